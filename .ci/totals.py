#!/usr/bin/env python3
"""Prints the totals of every meson test log named on the command line as
one line: `N passed, N failed, N skipped`."""
import json
import sys

passed = failed = skipped = 0
for path in sys.argv[1:]:
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError:
        failed += 1
        print(f"{path}: no test log (the build failed?)", file=sys.stderr)
        continue
    for line in lines:
        result = json.loads(line).get("result")
        if result in ("OK", "EXPECTEDFAIL"):
            passed += 1
        elif result == "SKIP":
            skipped += 1
        else:
            failed += 1
print(f"{passed} passed, {failed} failed, {skipped} skipped")
