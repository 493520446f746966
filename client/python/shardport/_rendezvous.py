"""Bounded exchanges between a job's ranks over torch.distributed's store.

A collective (broadcast_object_list, all_gather_object) waits for every
rank of the group as long as the process group's own timeout, 30 minutes by
default on gloo: a rank that died before export_state_dict would leave the
others hanging there whatever timeout= says.  The group's key-value store
(the one init_process_group made, TCP or file) waits with a timeout of
its own, so the ticket and the ranks' rows go through it instead: each
sender sets one key, the others wait for it, and a rank that never comes is
named in an errors.Timeout.
"""

import datetime
import itertools
import pickle

from . import errors

# How long a rank waits for the others when the caller gives no timeout:
# as long as a new job waits for its first rank (job_timeout's default).
DEFAULT_TIMEOUT_S = 300.0

# Every rank makes the same calls in the same order, so the n-th call has
# the same keys on every rank.
_calls = itertools.count()


def _store(dist):
    return dist.distributed_c10d._get_default_store()


def _set(store, key):
    """Whether key is set now (PyTorch 1.13's PrefixStore has no check)."""
    try:
        store.wait([key], datetime.timedelta(milliseconds=1))
        return True
    except RuntimeError:
        return False


def _missing(store, keys):
    """The indices of keys not set yet."""
    return [i for i, key in enumerate(keys) if not _set(store, key)]


def exchange(dist, what, value, senders, timeout=None):
    """Posts value when this rank is one of senders, then waits at most
    timeout seconds (None: DEFAULT_TIMEOUT_S) for every sender's; returns
    the values in the order of senders.  what names the exchange in the
    Timeout ("hand out the job's ticket")."""
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    store = _store(dist)
    prefix = "shardport/%d/" % next(_calls)
    keys = [prefix + str(rank) for rank in senders]
    rank = dist.get_rank()
    if rank in senders:
        store.set(keys[senders.index(rank)], pickle.dumps(value))
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except RuntimeError:
        missing = [senders[i] for i in _missing(store, keys)]
        if not missing:
            raise
        raise errors.Timeout(
            "rank(s) %s did not %s within %g s (did they exit, or not reach "
            "this call?)" % (", ".join(map(str, missing)), what,
                             timeout)) from None
    return [pickle.loads(store.get(key)) for key in keys]
