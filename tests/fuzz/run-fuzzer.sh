#!/usr/bin/env bash
# Runs a libFuzzer target for a bounded time from the committed seeds, with
# its growing corpus and any crash input kept in a scratch directory so the
# source tree stays untouched.  A crash input is printed in hex.  The last
# line says what the run did: inputs executed, and the coverage reached
# (edges of the target's instrumented code, and libFuzzer's features).
#   run-fuzzer.sh TARGET SECONDS SEED_DIR
# SP_FUZZ_SECONDS, when set, replaces SECONDS: a long run
# (docs/benchmarks.md, "Fuzzing").
set -uo pipefail
target=$1
seconds=${SP_FUZZ_SECONDS:-$2}
seeds=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/corpus"
"$target" -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=1024 -timeout=10 \
  -print_final_stats=1 -artifact_prefix="$work/" "$work/corpus" "$seeds" \
  >"$work/log" 2>&1
rc=$?
cat "$work/log"
for crash in "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-*; do
  [ -e "$crash" ] || continue
  echo "failing input $(basename "$crash"):"
  od -An -tx1 -v "$crash"
done
edges=$(sed -n 's/^INFO: Loaded [0-9]* modules *(\([0-9]*\) inline 8-bit counters).*/\1/p' \
  "$work/log" | head -n 1)
runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/log")
last=$(grep -E '^#[0-9]+' "$work/log" | tail -n 1)
cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
corpus=$(ls "$work/corpus" | wc -l)
echo "$(basename "$target"): ${runs:-?} executions in $seconds s," \
  "${cov:-?} of ${edges:-?} edges covered, ${ft:-?} features," \
  "$corpus inputs found beyond the seeds"
exit $rc
