#!/usr/bin/env bash
# system-socket.sh - the service's own paths, as an installed daemon and
# its users meet them, in a private mount namespace (a tmpfs on /run, an
# overlay on /etc), so that the machine's real /run/shardport and
# /etc/shardport are never touched:
#   - shardportd run as root without --config or --socket reads
#     /etc/shardport/shardportd.conf and listens on
#     /run/shardport/shardport.sock (docs/operations.md);
#   - a user without XDG_RUNTIME_DIR (a batch job), or whose runtime
#     directory has no socket, reaches it with the CLI and the Python
#     package by default;
#   - a user the file system keeps out, a user the daemon refuses, and no
#     daemon at all each get an error naming the path, where it came from,
#     and what to do.
#   system-socket.sh SHARDPORTD SHARDPORT_CLI PYTHON3 PYTHONPATH_DIR LIBSHARDPORT
# Needs root and unshare(1), and a build that the user nobody can reach;
# where any is missing it says so and exits 77 (skipped).
set -euo pipefail

if [ -z "${SP_IN_NAMESPACE:-}" ]; then
  if [ "$(id -u)" != 0 ] || ! unshare -m --propagation private true 2>/dev/null; then
    echo "SKIPPED: system-socket needs root and unshare(1) for a private mount namespace" >&2
    echo "SKIPPED: system-socket needs root and unshare(1) for a private mount namespace"
    exit 77
  fi
  # The test runs the build's programs as nobody; a build under a private
  # directory (mktemp -d makes mode 0700) keeps nobody out of them.
  for built in "$2" "$5" "$4/shardport/__init__.py"; do
    if ! setpriv --reuid=nobody --regid=nogroup --clear-groups test -r "$built"; then
      echo "SKIPPED: system-socket runs the build as nobody, who cannot reach $built (a directory above it keeps others out)" >&2
      echo "SKIPPED: system-socket runs the build as nobody, who cannot reach $built (a directory above it keeps others out)"
      exit 77
    fi
  done
  exec unshare -m --propagation private env SP_IN_NAMESPACE=1 "$0" "$@"
fi

daemon=$1 cli=$2 python=$3 pypath=$4 lib=$5
work=$(mktemp -d /tmp/sp-system-socket.XXXXXX)
pid=
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

mount -t tmpfs -o mode=0755 tmpfs /run
mkdir "$work/upper" "$work/scratch"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$work/upper,workdir=$work/scratch" /etc
mkdir -p /etc/shardport

fail() {
  echo "FAIL: $*" >&2
  [ -f "$work/log" ] && { echo "--- shardportd's log:" >&2; cat "$work/log" >&2; }
  exit 1
}

# Starts the daemon as a fresh install runs it: no flags but --detach.
start_daemon() {
  pid=$("$daemon" --detach 2>>"$work/log") || fail "shardportd did not start"
}
stop_daemon() {
  kill "$pid"
  for _ in $(seq 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  pid=
}

# Runs a command as user:group with no supplementary groups, without
# XDG_RUNTIME_DIR or SHARDPORT_SOCKET (a batch job); its stdout and stderr
# go to $work/out and $work/err, its status to $status.
as_user() {
  local who=$1
  shift
  status=0
  setpriv --reuid="${who%:*}" --regid="${who#*:}" --clear-groups \
    env -u XDG_RUNTIME_DIR -u SHARDPORT_SOCKET PYTHONPATH="$pypath" \
    SHARDPORT_LIB="$lib" "$@" >"$work/out" 2>"$work/err" || status=$?
}

expect_err() {
  grep -qF -- "$1" "$work/err" || fail "expected '$1' in: $(cat "$work/err")"
}

py_ping='import shardport
try:
    shardport.Client().ping()
    print("pong")
except shardport.ShardportError as exc:
    print(type(exc).__name__, exc.message)'

# 1. The documented configuration file is the one read.
cat >/etc/shardport/shardportd.conf <<'EOF'
socket_group = nogroup
allowed_gid = nogroup
EOF
start_daemon
grep -qF "configuration /etc/shardport/shardportd.conf" "$work/log" ||
  fail "the start log does not name /etc/shardport/shardportd.conf"
[ "$(stat -c '%G %a' /run/shardport)" = "nogroup 750" ] ||
  fail "/run/shardport is $(stat -c '%G %a' /run/shardport), not nogroup 750"
[ "$(stat -c %G /run/shardport/shardport.sock)" = nogroup ] ||
  fail "the socket's group is not nogroup: the configuration was not read"

# 2. A user in the socket's group, without XDG_RUNTIME_DIR, finds it.
as_user nobody:nogroup "$cli" ping
[ "$status" = 0 ] || fail "nobody's ping failed ($status): $(cat "$work/err")"
grep -qF "pong from /run/shardport/shardport.sock" "$work/out" ||
  fail "unexpected ping output: $(cat "$work/out")"
as_user nobody:nogroup "$python" -c "$py_ping"
[ "$(cat "$work/out")" = pong ] || fail "Python: $(cat "$work/out" "$work/err")"
# With a runtime directory that has no socket of its own, too.
mkdir -m 0700 "$work/xdg" && chown nobody "$work/xdg"
chmod 0711 "$work"
status=0
setpriv --reuid=nobody --regid=nogroup --clear-groups \
  env -u SHARDPORT_SOCKET XDG_RUNTIME_DIR="$work/xdg" "$cli" ping \
  >"$work/out" 2>"$work/err" || status=$?
[ "$status" = 0 ] || fail "nobody's ping with XDG_RUNTIME_DIR failed: $(cat "$work/err")"

# 3. A user the file system keeps out hears which group to join.
as_user daemon:daemon "$cli" ping
[ "$status" = 1 ] || fail "daemon's ping exited $status"
expect_err "the file system denies daemon (uid 1) access (its directory is mode 0750, group nogroup)"
expect_err "usermod -aG nogroup USER"
as_user daemon:daemon "$python" -c "$py_ping"
grep -qF "PermissionDenied cannot reach /run/shardport/shardport.sock" "$work/out" ||
  fail "Python: $(cat "$work/out" "$work/err")"

# 4. A user the daemon itself refuses hears about allowed_uids.
stop_daemon
cat >/etc/shardport/shardportd.conf <<'EOF'
socket_group = nogroup
allowed_gid = none
EOF
start_daemon
as_user nobody:nogroup "$cli" ping
[ "$status" = 1 ] || fail "refused ping exited $status"
expect_err "shardportd at /run/shardport/shardport.sock (the system socket: XDG_RUNTIME_DIR is not set) refused nobody (uid 65534)"
expect_err "add the user to allowed_uids in shardportd's configuration, or set allowed_gid to a group of its users (such as shardport, never root)"

# 5. No daemon: the path, where it came from, and what to do.
stop_daemon
as_user nobody:nogroup "$cli" ping
[ "$status" = 3 ] || fail "ping without a daemon exited $status"
expect_err "no shardportd listens at /run/shardport/shardport.sock (the system socket, since XDG_RUNTIME_DIR is not set)"
as_user nobody:nogroup "$python" -c "$py_ping"
grep -qF "NoDaemon no shardportd listens at /run/shardport/shardport.sock" "$work/out" ||
  fail "Python: $(cat "$work/out" "$work/err")"
echo "ok: the system socket and configuration file, as a user finds them"
