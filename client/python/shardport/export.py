"""Jobs, exports and pushes of PyTorch state dicts.

A Job is this process's rank in a shardport job: one connection to the
node's daemon.  It lives as long as the training run, so that its daemons'
communicators stay warm: register the state dict once (the daemon maps the
tensors' shared memory, so later updates made in place are seen), then
export, or push into the job's consumers (consumer.py), as often as
needed.  export_state_dict does an export in one call.
"""

from collections.abc import Mapping

from . import _rendezvous, errors
from ._progress import TerminalProgress
from .client import Client


def _torch_distributed():
    """torch.distributed, initialized; else a clear error."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise errors.InvalidArgument(
            "torch.distributed is not initialized: call "
            "torch.distributed.init_process_group() first, or make the job "
            "with Job.create and Job.join and hand the ticket over yourself")
    return dist


def join_device(client, device):
    """The device a rank or consumer joins with: "cpu", "cuda:<GPU UUID>"
    as given, or a CUDA device (a torch.device or an ordinal) named by its
    GPU's UUID."""
    if device is None or isinstance(device, str) and (
            device == "cpu" or device.startswith("cuda:GPU-")):
        return device or "cpu"
    import torch
    device = torch.device("cuda", device) if isinstance(device, int) \
        else torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise errors.InvalidArgument("a rank or consumer is on the CPU or a "
                                     "CUDA device, not on %s" % device)
    index = device.index if device.index is not None \
        else torch.cuda.current_device()
    return client.cuda_device_name(index)


def synchronize(devices):
    """Waits for the work of this process's streams on the CUDA devices:
    the daemon reads (a rank's storages) or writes (a consumer's buffers)
    that memory as soon as it is asked to (docs/protocol.md, storage_add)."""
    if devices:
        import torch
        for index in devices:
            torch.cuda.synchronize(index)


def _terminal_progress(rank):
    """The progress line an export shows when the caller chose none: on
    rank 0 only (the ranks of a job often share one terminal, and rank 0's
    line shows the job's progress), and only where stderr is a terminal."""
    return TerminalProgress() if rank == 0 and TerminalProgress.wanted() \
        else None


class Job:
    """One rank of a job.  Make it with Job.create (rank 0), Job.join (the
    other ranks, with rank 0's ticket) or Job.from_torch_distributed (every
    rank at once); their socket and timeout are Client's.  Closing it leaves
    the job and releases its exports."""

    def __init__(self, client, ticket, rank, world, timeout=None,
                 consumers=0):
        self.client = client
        self.ticket = ticket
        self.rank = rank
        self.world = world
        self.consumers = consumers
        self.timeout = timeout
        self._registration = None

    @classmethod
    def create(cls, world, *, consumers=0, socket=None, timeout=None,
               device=None):
        """Creates a job of world ranks and consumers consumers (0: none;
        at most 4096) and joins it as rank 0; hand job.ticket to the other
        ranks and to the consumers.  device is where this rank's tensors
        are: None or "cpu", or a CUDA device (torch.device, ordinal, or
        "cuda:<GPU UUID>")."""
        client = Client(socket, timeout)
        try:
            ticket = client.create_job(world, consumers)
            client.join(ticket, 0, world, join_device(client, device))
        except BaseException:
            client.close()
            raise
        return cls(client, ticket, 0, world, timeout, consumers)

    @classmethod
    def join(cls, ticket, rank, world, *, consumers=0, socket=None,
             timeout=None, device=None):
        """Joins the job of ticket as rank of world; consumers is the
        job's count of consumers (only recorded here, as job.consumers)."""
        client = Client(socket, timeout)
        try:
            client.join(ticket, rank, world, join_device(client, device))
        except BaseException:
            client.close()
            raise
        return cls(client, ticket, rank, world, timeout, consumers)

    @classmethod
    def from_torch_distributed(cls, *, consumers=0, socket=None,
                               timeout=None, device=None):
        """Collective over torch.distributed's default group: rank 0
        creates the job (with consumers consumers, as Job.create) and
        hands its ticket to the other ranks through the group's store,
        every rank joins as its own rank (on device, as Job.create).  If
        rank 0 cannot create the job, every rank raises its error; a rank
        that waits longer than timeout seconds (default 5 minutes) for the
        ticket raises errors.Timeout naming rank 0."""
        dist = _torch_distributed()
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank != 0:
            (outcome,) = _rendezvous.exchange(
                dist, "hand out the job's ticket", None, [0], timeout)
            if isinstance(outcome, tuple):
                raise errors.error_for(*outcome)
            return cls.join(outcome, rank, world, consumers=consumers,
                            socket=socket, timeout=timeout, device=device)
        try:
            job = cls.create(world, consumers=consumers, socket=socket,
                             timeout=timeout, device=device)
        except Exception as exc:
            # The other ranks wait for the ticket: they get the error too.
            if isinstance(exc, errors.ShardportError):
                outcome = (exc.code, exc.message)
            else:
                outcome = (errors.Internal.code,
                           "rank 0 could not create the job: %s" % exc)
            _rendezvous.exchange(dist, "hand out the job's ticket", outcome,
                                 [0], timeout)
            raise
        _rendezvous.exchange(dist, "hand out the job's ticket", job.ticket,
                             [0], timeout)
        return job

    def register(self, state_dict, placements=None, *,
                 default_placement=None):
        """Registers this rank's tensors: once per job.

        placements maps keys to "shard0", "replicated", "plain", "expert" or
        a shardport.Placement (an "affine" one carries its Pieces); keys it
        leaves out are inferred: a DTensor with Shard(0) on a 1-D mesh is
        shard0, with Replicate() replicated.  A plain tensor left out takes
        default_placement; without one it is plain in a job of one rank and
        refused in a bigger one (whole on every rank, or each rank's own
        part?  Only the caller knows).  CPU tensors not yet in shared memory
        are moved there, as Tensor.share_memory_() does.
        """
        from .tensors import Registration
        if self._registration is not None:
            raise errors.BadState("this rank already registered its state "
                                  "dict; register once, export many times")
        self._register(Registration(state_dict, placements, self.world,
                                    default_placement, timeout=self.timeout))

    def _register(self, registration):
        self.client.register_storages(registration.storage_descs)
        self.client.register_tensors(registration.tensor_descs)
        self._registration = registration

    def export(self, *, groups=(), progress=None, timeout=None, max_keys=0,
               max_bytes=0):
        """Runs one export; returns the Export of this rank's whole tensors.

        groups: lists of keys that must end on one owner.  progress: None
        shows a progress line on rank 0 when its stderr is a terminal (one
        line for the job, not one per rank), False shows nothing, a
        callable receives every shardport.Progress.  timeout:
        seconds the daemon waits for the other ranks and for progress.
        max_keys, max_bytes: the bounds of one round (0: the defaults).
        """
        return self._export(groups, progress, timeout, max_keys, max_bytes,
                            close_job=False)

    def _export(self, groups, progress, timeout, max_keys, max_bytes,
                close_job):
        if self._registration is None:
            raise errors.BadState("register the state dict before exporting")
        synchronize(self._registration.cuda_devices)
        shown = None
        if progress is None:
            progress = shown = _terminal_progress(self.rank)
        try:
            owned = self.client.export(groups=groups, max_keys=max_keys,
                                       max_bytes=max_bytes, timeout=timeout,
                                       progress=progress or None)
        finally:
            if shown is not None:
                shown.close()
        return Export(self, owned, close_job)

    def push(self, *, timeout=None, max_keys=0, max_bytes=0):
        """Pushes the registered tensors' current values into every
        consumer of the job, each consumer's keys laid out as it
        registered them (shardport.Consumer): a collective over the job's
        ranks, which pass the same max_keys and max_bytes.  Returns this
        rank's shardport.PushResult once every consumer's bytes are in
        place, or raises the push's one error on every rank and consumer
        (errors.ConsumerLost naming a consumer that left, errors.RankLost,
        errors.Timeout, a planner's refusal).  timeout: seconds the daemon
        waits for the ranks and consumers and for progress; max_keys,
        max_bytes: the bounds of one round (0: the defaults).  Push as
        often as the weights change: the plan is reused while no rank or
        consumer registered anew."""
        if self._registration is None:
            raise errors.BadState("register the state dict before pushing")
        synchronize(self._registration.cuda_devices)
        return self.client.push(max_keys=max_keys, max_bytes=max_bytes,
                                timeout=timeout)

    def save(self, path, *, max_shard_bytes=5 * 2**30, metadata=None,
             overwrite=False, groups=(), progress=None, timeout=None,
             max_keys=0, max_bytes=0):
        """Saves the registered state dict as a Hugging Face checkpoint in
        path: safetensors files written by each owner and rank 0's
        model.safetensors.index.json (docs/checkpoints.md).  A collective:
        every rank calls it with the same path and options.  Returns the
        shardport.SaveResult of this rank.  progress as for export (the
        terminal line also shows the bytes written)."""
        if self._registration is None:
            raise errors.BadState("register the state dict before saving")
        synchronize(self._registration.cuda_devices)
        shown = None
        if progress is None:
            progress = shown = _terminal_progress(self.rank)
        try:
            return self.client.save(
                path, max_shard_bytes=max_shard_bytes, metadata=metadata,
                overwrite=overwrite, groups=groups, max_keys=max_keys,
                max_bytes=max_bytes, timeout=timeout,
                progress=progress or None)
        finally:
            if shown is not None:
                shown.close()

    def close(self):
        self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        self.close()


class Export(Mapping):
    """The whole tensors this rank owns after one export, by key.

    A mapping of key to torch.Tensor.  The tensors lie in memory the daemon
    published (no copy), valid until release(): leaving a `with` block
    releases, and so does closing the job.  Use of a tensor after its
    export is released reads unmapped memory; copy what must outlive it.
    Identity tensors, which this rank already held whole, are the caller's
    own objects and stay valid.
    """

    def __init__(self, job, owned, close_job=False):
        from .tensors import OwnedTensors
        self._job = job
        self._owned = owned
        self._close_job = close_job
        self.export_id = owned.export_id
        maker = OwnedTensors(job._registration, keepalive=self)
        try:
            self._tensors = {o.key: maker.tensor(o) for o in owned.tensors}
        except BaseException:
            job.client.release(owned)
            raise

    def _live(self):
        if self._tensors is None:
            raise errors.NoSuchExport("export %d was released; its tensors "
                                      "are gone" % self.export_id)
        return self._tensors

    def __getitem__(self, key):
        return self._live()[key]

    def __iter__(self):
        return iter(self._live())

    def __len__(self):
        return len(self._live())

    @property
    def released(self):
        return self._tensors is None

    def release(self):
        """Releases the export (a second call does nothing)."""
        if self._tensors is None:
            return
        self._tensors = None
        try:
            self._job.client.release(self._owned)
        finally:
            if self._close_job:
                self._job.close()

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        self.release()


def export_state_dict(state_dict, placements=None, *, groups=(),
                      progress=None, timeout=None, socket=None,
                      default_placement=None):
    """Exports a sharded state dict in one call; collective over
    torch.distributed's default group.

    Creates a job of every rank, registers state_dict (see Job.register for
    placements and default_placement), runs one export (see Job.export for
    groups and progress) and returns the Export of this rank's whole
    tensors.  Release it, or use it as a context manager: the release also
    leaves the job.  For repeated exports keep a Job.

    timeout, in seconds, bounds each request to the daemon, how long the
    daemon waits for the other ranks, and how long a rank waits for rank 0's
    ticket and the others' rows (None: the daemon's export_timeout, the
    library's 30 s per request, 5 minutes for the ticket); socket is the
    daemon's socket path (None: $SHARDPORT_SOCKET, then the default path).
    """
    from .tensors import Registration
    device = next((v.device for v in state_dict.values()
                   if getattr(v, "is_cuda", False)), None)
    # Placements are decided, and refused, before the job exists: every
    # rank refuses alike, and none is left joining a job its peers left.
    registration = Registration(state_dict, placements,
                                _torch_distributed().get_world_size(),
                                default_placement, timeout=timeout)
    job = Job.from_torch_distributed(socket=socket, timeout=timeout,
                                     device=device)
    try:
        job._register(registration)
        return job._export(groups, progress, timeout, 0, 0, close_job=True)
    except BaseException:
        job.close()
        raise


def save_state_dict(state_dict, path, placements=None, max_shard_bytes=5 * 2**30,
                    metadata=None, *, overwrite=False, groups=(),
                    progress=None, timeout=None, socket=None,
                    default_placement=None):
    """Saves a sharded state dict as a Hugging Face checkpoint in one call;
    collective over torch.distributed's default group, like
    export_state_dict.

    Every owner writes the whole tensors it owns into safetensors files of
    its own in path (in parallel, never gathered on one rank), and rank 0
    writes model.safetensors.index.json once every file of every rank is
    durable (docs/checkpoints.md).  max_shard_bytes bounds one file's
    tensor bytes (a larger tensor gets a file of its own); metadata maps
    strings to strings for every file's __metadata__; overwrite replaces a
    checkpoint already in path (else errors.CheckpointExists on every
    rank).  Placements, groups, progress, timeout and socket as for
    export_state_dict.  Returns this rank's shardport.SaveResult; the job
    is left afterwards.
    """
    from .tensors import Registration
    device = next((v.device for v in state_dict.values()
                   if getattr(v, "is_cuda", False)), None)
    registration = Registration(state_dict, placements,
                                _torch_distributed().get_world_size(),
                                default_placement, timeout=timeout)
    job = Job.from_torch_distributed(socket=socket, timeout=timeout,
                                     device=device)
    with job:
        job._register(registration)
        return job.save(path, max_shard_bytes=max_shard_bytes,
                        metadata=metadata, overwrite=overwrite, groups=groups,
                        progress=progress, timeout=timeout)
