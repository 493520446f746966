#!/bin/sh
# The across-nodes wing has one face (docs/internals.md): checks that no
# file outside daemon/mesh/ (the wing's own unit tests and fuzz targets
# aside) includes one of its internal headers, and that no file of the
# wing calls a job_* or export_* function (it calls back through struct
# mesh_ops).  Prints each breach and fails when there is one.
set -u
root=${1:?usage: check_boundary.sh SOURCE_ROOT}
cd "$root" || exit 1
status=0
inside=$(grep -rlE '#include "daemon/mesh/(internal|nodelink|nodemsg|peerauth|peerhost)\.h"' \
  daemon client proto include | grep -v '^daemon/mesh/')
if [ -n "$inside" ]; then
  echo "outside daemon/mesh/, only daemon/mesh/mesh.h may be included:"
  echo "$inside"
  status=1
fi
calls=$(grep -nE '\b(job|export)_[a-z_]+\(' daemon/mesh/*.c daemon/mesh/*.h |
  grep -vE '\b(quota_job_admit|mesh_export_free)\(' |
  grep -vE '^[^:]+:[0-9]+:\s*(/?\*|//)')
if [ -n "$calls" ]; then
  echo "the wing calls jobs or exports directly (use struct mesh_ops):"
  echo "$calls"
  status=1
fi
exit $status
