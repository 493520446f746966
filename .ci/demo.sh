#!/usr/bin/env bash
# The main job: start shardportd on a private socket with its built-in
# defaults, show `shardport status`, and stop the daemon cleanly.
#   .ci/demo.sh BUILD_DIR
set -euo pipefail
build=$1
run=$(mktemp -d /tmp/shardport-demo.XXXXXX)
chmod 0700 "$run"
sock="$run/shardport.sock"
daemon_log="$run/shardportd.log"

"$build/daemon/shardportd" --socket "$sock" --config /dev/null >"$daemon_log" 2>&1 &
daemon=$!
stop_daemon() {
  if kill -0 "$daemon" 2>/dev/null; then
    kill -TERM "$daemon"
    wait "$daemon" || { echo "shardportd exited with an error:" >&2; cat "$daemon_log" >&2; exit 1; }
  fi
  rm -rf "$run"
}
trap stop_daemon EXIT

for _ in $(seq 100); do
  [ -S "$sock" ] && break
  kill -0 "$daemon" 2>/dev/null || { cat "$daemon_log" >&2; exit 1; }
  sleep 0.05
done

"$build/client/cli/shardport" --socket "$sock" status
