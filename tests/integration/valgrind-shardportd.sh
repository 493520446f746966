#!/bin/sh
# Runs the shardportd named by $SHARDPORTD_REAL under valgrind, so that the
# daemon suites can drive it unchanged: any memory error or leak makes the
# daemon exit 1, which the suites' clean-shutdown checks turn into a failure.
exec valgrind -q --leak-check=full \
  --show-leak-kinds=definite,indirect,possible \
  --errors-for-leak-kinds=definite,indirect,possible \
  --error-exitcode=1 "$SHARDPORTD_REAL" "$@"
