#!/usr/bin/env bash
# The scale simulation's sizes that today's daemons hold on one machine of
# 24 GiB (docs/benchmarks.md, "Scale"): the root's bytes against the node
# count at 100 keys (8 to 128 nodes), at 1,000 keys (8 and 32 nodes), and
# 8 nodes at the full 10,000 keys; 8 ranks per node, a first and a
# repeated export each.  Every point runs even when one fails (its own
# failure printed); the status says whether all were correct.
#   ladder.sh SCALE_SIM
set -u
sim=$1
status=0
for point in "8 100" "32 100" "64 100" "128 100" "8 1000" "32 1000" \
             "8 10000"; do
  set -- $point
  nice "$sim" --nodes "$1" --per-node 8 --keys "$2" || status=1
  echo
done
exit $status
