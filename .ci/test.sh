#!/usr/bin/env bash
# Runs one build directory's suite; prints failures and the suite's totals.
#   .ci/test.sh DIR [meson test options...]
set -uo pipefail
dir=$1
shift
log="$dir.test.log"
meson test -C "$dir" --print-errorlogs "$@" >"$log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  # The failing tests' own output (--print-errorlogs) and meson's summary.
  tail -n 400 "$log" >&2
  echo "shardport: tests failed in $dir (full log: $log)" >&2
fi
# A skipped suite says why in its log; name it here so nobody misses it.
grep -E '^ *[0-9]+/[0-9]+ .* SKIP ' "$log" | sed 's/^/shardport: SKIPPED: /' >&2
grep -E '^(Ok|Fail|Skipped|Timeout):' "$log" | tr '\n' ' ' | sed 's/  */ /g; s/ $/\n/' | sed "s|^|$dir: |"
exit $rc
