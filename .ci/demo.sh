#!/usr/bin/env bash
# The main job: start shardportd on a private socket with its built-in
# defaults, run the demo trainer program (4 ranks exporting a synthetic
# sharded model, every owned tensor verified), show `shardport status` once
# while the export moves data, and stop the daemon cleanly.  Prints the
# status table and the demo's summary line, nothing else unless something
# fails.
#   .ci/demo.sh BUILD_DIR [shardport-demo options...]
set -euo pipefail
build=$1
shift
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

# Rounds of at most 32 MiB, so that the status taken at the first round
# shows the export moving.
status_cmd=$(printf '%q ' "$build/client/cli/shardport" --socket "$sock" status)
if ! "$build/client/demo/shardport-demo" --socket "$sock" --ranks 4 \
    --max-bytes $((32 << 20)) --status-cmd "$status_cmd" "$@"; then
  echo "shardport-demo failed; the daemon's log:" >&2
  cat "$daemon_log" >&2
  exit 1
fi
