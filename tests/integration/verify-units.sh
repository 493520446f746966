#!/bin/sh
# Runs systemd-analyze verify on the generated units, and applies the
# sysusers.d and tmpfiles.d snippets to an empty root directory.
#
# usage: verify-units.sh SERVICE SOCKET SYSUSERS TMPFILES SHARDPORTD
#
# systemd-analyze verify exits 0 even when it ignores a line it cannot parse
# (an unknown key, a bad value), so any diagnostic at all fails this test.
# The one change made to the units: ExecStart names the installed path
# (sbindir), which does not exist before `meson install`, so the copy that is
# verified points at the freshly built binary instead.  Nothing else in this
# container differs from a real node for the purpose of verify: the
# shardport user and group are only looked up when the unit starts.
set -eu

service=$1
socket=$2
sysusers=$3
tmpfiles=$4
daemon=$5

if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "verify-units: SKIPPED: systemd-analyze is not installed"
  exit 77
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for unit in "$service" "$socket"; do
  if grep -n '@[A-Za-z_]*@' "$unit"; then
    echo "verify-units: $unit has an unsubstituted @variable@" >&2
    exit 1
  fi
done
grep -q '^ExecStart=/.*/shardportd$' "$service" || {
  echo "verify-units: ExecStart is not an absolute path to shardportd" >&2
  exit 1
}
# systemctl reload sends SIGHUP, which reloads the configuration; a stop
# leaves the drain its time (docs/operations.md).
grep -q '^ExecReload=/bin/kill -HUP \$MAINPID$' "$service" || {
  echo "verify-units: no ExecReload that sends SIGHUP to the daemon" >&2
  exit 1
}
stop=$(sed -n 's/^TimeoutStopSec=\([0-9]*\)s$/\1/p' "$service")
if [ -z "$stop" ] || [ "$stop" -lt 75 ]; then
  echo "verify-units: TimeoutStopSec must leave the default drain_timeout" \
    "(60 s) and the last replies (15 s) their time" >&2
  exit 1
fi

sed "s|^ExecStart=.*|ExecStart=$daemon|" "$service" >"$work/shardportd.service"
cp "$socket" "$work/shardportd.socket"

cd "$work"
status=0
out=$(systemd-analyze verify ./shardportd.service ./shardportd.socket 2>&1) ||
  status=$?
if [ "$status" -ne 0 ] || [ -n "$out" ]; then
  echo "verify-units: systemd-analyze verify (exit $status):" >&2
  echo "$out" >&2
  exit 1
fi

# The snippets, applied to a scratch root: the group and the system user
# exist afterwards, and the directories have their modes.
root="$work/root"
mkdir -p "$root/etc"
if ! out=$(systemd-sysusers --root="$root" "$sysusers" 2>&1); then
  echo "verify-units: systemd-sysusers failed: $out" >&2
  exit 1
fi
grep -q '^shardport:' "$root/etc/group" &&
  grep -q '^shardport:.*:/usr/sbin/nologin$' "$root/etc/passwd" || {
  echo "verify-units: sysusers did not create the shardport group and user" >&2
  exit 1
}
if ! out=$(systemd-tmpfiles --root="$root" --create "$tmpfiles" 2>&1) ||
  [ -n "$out" ]; then
  echo "verify-units: systemd-tmpfiles: $out" >&2
  exit 1
fi
[ "$(stat -c %a "$root/run/shardport")" = 750 ] &&
  [ "$(stat -c %a "$root/etc/shardport")" = 755 ] || {
  echo "verify-units: tmpfiles made the wrong directory modes" >&2
  exit 1
}
echo "verify-units: units verified, sysusers and tmpfiles snippets applied"
