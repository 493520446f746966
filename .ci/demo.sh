#!/usr/bin/env bash
# The main job: start shardportd on a private socket with its built-in
# defaults, run the demo trainer program (4 ranks exporting a synthetic
# sharded model, every owned tensor verified), show `shardport status` once
# while the export moves data, and stop the daemon cleanly.  Prints the
# status table and the demo's summary line, nothing else unless something
# fails.
#
# With NODES=N (N > 1) it starts N daemons instead, each listening for the
# others on a loopback port of its own (--peer-listen 127.0.0.1:0), and
# spreads the ranks over them: one job across N nodes, moved between the
# daemons over TCP (the status shown is the first daemon's, with the job's
# nodes).
#   [NODES=N] .ci/demo.sh BUILD_DIR [shardport-demo options...]
set -euo pipefail
build=$1
shift
nodes=${NODES:-1}
case $nodes in
  [1-8]) ;;
  *) echo "demo.sh: NODES=$nodes is not a number from 1 to 8" >&2; exit 2 ;;
esac
run=$(mktemp -d /tmp/shardport-demo.XXXXXX)
chmod 0700 "$run"

daemons=()
sockets=()
stop_daemons() {
  local failed=0 i
  for i in "${!daemons[@]}"; do
    if kill -0 "${daemons[$i]}" 2>/dev/null; then
      kill -TERM "${daemons[$i]}"
      if ! wait "${daemons[$i]}"; then
        echo "shardportd $i exited with an error:" >&2
        cat "$run/shardportd-$i.log" >&2
        failed=1
      fi
    fi
  done
  rm -rf "$run"
  [ "$failed" = 0 ] || exit 1
}
trap stop_daemons EXIT

peer=()
[ "$nodes" -gt 1 ] && peer=(--peer-listen 127.0.0.1:0)
for i in $(seq 0 $((nodes - 1))); do
  sock="$run/shardport-$i.sock"
  "$build/daemon/shardportd" --socket "$sock" --config /dev/null "${peer[@]}" \
    >"$run/shardportd-$i.log" 2>&1 &
  daemons+=($!)
  sockets+=(--socket "$sock")
done
for i in "${!daemons[@]}"; do
  for _ in $(seq 100); do
    [ -S "$run/shardport-$i.sock" ] && break
    kill -0 "${daemons[$i]}" 2>/dev/null || { cat "$run/shardportd-$i.log" >&2; exit 1; }
    sleep 0.05
  done
done

# Rounds of at most 32 MiB, so that the status taken at the first round
# shows the export moving.
status_cmd=$(printf '%q ' "$build/client/cli/shardport" --socket "$run/shardport-0.sock" status)
if ! "$build/client/demo/shardport-demo" "${sockets[@]}" --ranks 4 \
    --max-bytes $((32 << 20)) --status-cmd "$status_cmd" "$@"; then
  echo "shardport-demo failed; the daemons' logs:" >&2
  cat "$run"/shardportd-*.log >&2
  exit 1
fi
