#!/usr/bin/env bash
# Runs a libFuzzer target for a bounded time from the committed seeds, with
# its growing corpus and any crash input kept in a scratch directory so the
# source tree stays untouched.  A crash input is printed in hex.
#   run-fuzzer.sh TARGET SECONDS SEED_DIR
set -uo pipefail
target=$1
seconds=$2
seeds=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/corpus"
"$target" -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=1024 -timeout=10 \
  -artifact_prefix="$work/" "$work/corpus" "$seeds"
rc=$?
for crash in "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-*; do
  [ -e "$crash" ] || continue
  echo "failing input $(basename "$crash"):"
  od -An -tx1 -v "$crash"
done
exit $rc
