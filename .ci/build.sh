#!/usr/bin/env bash
# Configures (once) and builds one build directory quietly.
#   .ci/build.sh DIR [meson setup options...]
# Output is kept in DIR.log and shown only when a step fails.
set -euo pipefail
dir=$1
shift
log="$dir.log"
: >"$log"
if [ ! -f "$dir/build.ninja" ]; then
  if ! meson setup "$dir" "$@" >>"$log" 2>&1; then
    cat "$log" >&2
    exit 1
  fi
fi
if ! meson compile -C "$dir" >>"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
