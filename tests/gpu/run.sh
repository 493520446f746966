#!/bin/sh
# tests/gpu/run.sh - the CUDA backend on real GPUs, in one go.
#
#   tests/gpu/run.sh [--fakes] BUILD_DIR [RESULTS_DIR]
#
# BUILD_DIR is a meson build of this checkout made with the CUDA backend
# (the toolkit's headers found; `meson setup BUILD_DIR` on the GPU machine,
# or a build made elsewhere for the same system).  Nothing here loads the
# fakes: SHARDPORT_CUDART_LIB and SHARDPORT_NCCL_LIB are unset, so the
# daemon and the trainers use the machine's CUDA runtime and NCCL.
#
# What runs, each step printing PASS or FAIL (or SKIP and why):
#   1. shardportd -n --backend cuda: the backend loads and finds the GPUs;
#   2. export: trainer processes on the GPUs (one GPU is enough) register
#      cudaMalloc'ed shards (device pointers, PyTorch-format and raw IPC
#      handles, cuMem descriptors), export, read every owned tensor back and
#      compare it byte for byte; a rank killed mid-round fails the others
#      (the "export" and "faults" cases of the fakes' suite, run on the
#      hardware);
#   3. nccl-self: a one-rank NCCL communicator created and warmed by the
#      backend, a round of sends to itself checked byte for byte, and an
#      export's rounds through it;
#   4. nccl-2gpu (two or more GPUs): two processes, one GPU each, as two
#      "nodes" of two jobs at once (each job on communicators of its own,
#      its exports on a thread of its own): every round's moves between
#      them go through NCCL, each owner's tensors checked byte for byte,
#      two exports of one job and four of the other;
#   5. bench: an export's throughput against cudaMemcpy device-to-device
#      bandwidth measured in the same run;
#   6. save: two trainer processes save device tensors as a checkpoint
#      through the library's pinned staging (docs/checkpoints.md), read
#      back by the tests' own reader and, where it is installed, by the
#      safetensors library (tests/python/test_cuda_fake.py, on the GPUs);
#   7. torch, torch-expandable: two PyTorch ranks (torch 2.x) hold DTensor
#      shards in memory from the CUDA caching allocator, without and with
#      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, register them with
#      the placements inferred, export twice, and check every owned tensor
#      (tests/gpu/torch_export.py), against a daemon of the script's own;
#   8. two-jobs: two such PyTorch jobs at once on the same GPU(s) and
#      daemon.
# One line per step ("== STEP: PASS|FAIL|SKIP (detail)"); the last line is
# the summary to record in docs/gpu-runs.md.  With RESULTS_DIR, every
# step's log and summary.txt (the step lines and the summary) are written
# there.  Exit status 0 when every step that ran passed, 1 otherwise, 77
# without a GPU.  It fits in 8 minutes on one H200 (each step has its own
# bound well under that).
#
# --fakes runs the same steps on the build's fake CUDA runtime and fake NCCL
# with two fake GPUs (a small benchmark, whose figures mean nothing): how
# `meson test` keeps this script working on machines without a GPU
# (gpu-script-fakes).  The PyTorch steps say SKIP there, loudly, with why:
# PyTorch's caching allocator drives the real driver, which the fakes do
# not replace.
set -u

fakes=0
if [ "${1:-}" = --fakes ]; then
  fakes=1
  shift
fi
build=${1:?usage: tests/gpu/run.sh [--fakes] BUILD_DIR [RESULTS_DIR]}
build=$(cd "$build" && pwd) || exit 2
results=${2:-}
if [ -n "$results" ]; then
  mkdir -p "$results" && results=$(cd "$results" && pwd) || exit 2
fi
daemon=$build/daemon/shardportd
export_test=$build/tests/integration/gpu_fake/test-gpu-fake-export
gpunode=$build/tests/unit/gpu/gpunode
bench=$build/tests/gpu/gpu-bench
# The NCCL ids' bootstrap roots run in this helper (docs/gpu.md, "The NCCL
# bootstrap"): gpunode is not beside it, as the daemon is.
export SHARDPORT_NCCL_ROOT_HELPER=$build/daemon/shardport-nccl-root
for f in "$daemon" "$export_test" "$gpunode" "$bench" \
    "$SHARDPORT_NCCL_ROOT_HELPER"; do
  if [ ! -x "$f" ]; then
    echo "run.sh: $f is missing: is $build a build with the CUDA backend?" >&2
    exit 2
  fi
done
if [ $fakes -eq 1 ]; then
  export SHARDPORT_CUDART_LIB=$build/tests/fakes/libfakecudart.so
  export SHARDPORT_NCCL_LIB=$build/tests/fakes/libfakenccl.so
  export SHARDPORT_FAKE_GPUS=2
  : "${SP_BENCH_MIB:=64}"
  ngpus=2
  gpu_name="fake GPU (tests/fakes)"
  driver=fake
elif command -v nvidia-smi >/dev/null 2>&1; then
  unset SHARDPORT_CUDART_LIB SHARDPORT_NCCL_LIB
  ngpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
else
  unset SHARDPORT_CUDART_LIB SHARDPORT_NCCL_LIB
  ngpus=0
fi
if [ "$ngpus" -lt 1 ]; then
  echo "run.sh: no GPU visible (nvidia-smi -L lists none): nothing to test"
  exit 77
fi
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  ngpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/sp-gpu-run.XXXXXX") || exit 2
keep_results() {
  if [ -n "$results" ]; then
    cp "$work"/*.log "$results"/ 2>/dev/null
    cp "$work/summary.txt" "$results"/ 2>/dev/null
  fi
  rm -rf "$work"
}
trap keep_results EXIT
failed=0
summary=""

step() { # name status detail
  echo "== $1: $2${3:+ ($3)}" | tee -a "$work/summary.txt"
  summary="$summary $1:$2"
  [ "$2" = FAIL ] && failed=1
  return 0
}

# 1. the backend loads
if "$daemon" -n --config /dev/null --socket "$work/check.sock" --backend cuda \
    >"$work/check.log" 2>&1; then
  step backend PASS "$(tail -n 1 "$work/check.log" | sed 's/.*(backend /backend /')"
else
  cat "$work/check.log"
  step backend FAIL "shardportd --backend cuda refused to start"
fi

# 2. exports on the GPUs, byte for byte, and a rank killed mid-round
for case in export faults; do
  if SHARDPORTD=$daemon SP_TEST_GPUS=$ngpus timeout 600 "$export_test" "$case" \
      >"$work/$case.log" 2>&1; then
    step "$case" PASS "$(grep -o '[0-9]*%: Checks.*' "$work/$case.log")"
  else
    grep -v ' shardportd: info: ' "$work/$case.log" | tail -n 20
    step "$case" FAIL "see above"
  fi
done

# 3. a one-rank communicator, warmed, a self round, an export's rounds
if GPUNODE_GPUS=1 GPUNODE_SELF=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} \
    timeout 300 "$gpunode" - 1 0 2 >"$work/self.log" 2>&1 &&
    grep -q '^self ok' "$work/self.log" && grep -q '^ok 2 ' "$work/self.log"; then
  step nccl-self PASS
else
  cat "$work/self.log"
  step nccl-self FAIL "see above"
fi

# 4. two GPUs as two nodes: rounds through NCCL
if [ "$ngpus" -ge 2 ]; then
  first=$(echo "${CUDA_VISIBLE_DEVICES:-0,1}" | cut -d, -f1)
  second=$(echo "${CUDA_VISIBLE_DEVICES:-0,1}" | cut -d, -f2)
  GPUNODE_GPUS=1 GPUNODE_ID2=- CUDA_VISIBLE_DEVICES=$first timeout 300 \
    "$gpunode" - 2 0 2 >"$work/node0.log" 2>&1 &
  node0=$!
  id=""
  id2=""
  # Node 0 prints "id2" after "id": once the second is there, so is the
  # first.
  for _ in $(seq 1 300); do
    id2=$(sed -n 's/^id2 //p' "$work/node0.log")
    [ -n "$id2" ] && break
    sleep 0.1
  done
  id=$(sed -n 's/^id //p' "$work/node0.log")
  GPUNODE_GPUS=1 GPUNODE_ID2=$id2 CUDA_VISIBLE_DEVICES=$second timeout 300 \
    "$gpunode" "$id" 2 1 2 >"$work/node1.log" 2>&1
  rc1=$?
  wait "$node0"
  rc0=$?
  # Two jobs: the first exports 4 times, the second twice.
  if [ -n "$id2" ] && [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] &&
      [ "$(grep -c '^ok ' "$work/node0.log")" -eq 6 ] &&
      [ "$(grep -c '^ok ' "$work/node1.log")" -eq 6 ]; then
    step nccl-2gpu PASS
  else
    cat "$work/node0.log" "$work/node1.log"
    step nccl-2gpu FAIL "see above"
  fi
else
  step nccl-2gpu SKIP "one GPU"
fi

# 5. the benchmark, against a daemon of its own
"$daemon" --config /dev/null --socket "$work/bench.sock" --backend cuda \
  >"$work/bench-daemon.log" 2>&1 &
bench_daemon=$!
for _ in $(seq 1 100); do
  [ -S "$work/bench.sock" ] && break
  sleep 0.1
done
if timeout 600 "$bench" "$work/bench.sock" "${SP_BENCH_MIB:-1024}" 5 \
    >"$work/bench.log" 2>&1; then
  bench_line=$(cat "$work/bench.log")
  step bench PASS "$bench_line"
else
  cat "$work/bench.log"
  bench_line="bench failed"
  step bench FAIL "see above"
fi
kill "$bench_daemon" 2>/dev/null
wait "$bench_daemon" 2>/dev/null

# 6. a save of device tensors, read back
src=$(cd "$(dirname "$0")/../.." && pwd)
# SHARDPORT_TEST_PYTHON_ENV: settings for python3 alone (the sanitizer
# build's preload, from tests/gpu/meson.build), unquoted to split them.
# shellcheck disable=SC2086
if env ${SHARDPORT_TEST_PYTHON_ENV:-} \
    SHARDPORTD=$daemon SHARDPORT_LIB=$build/client/libshardport.so.0 \
    PYTHONPATH=$src/client/python:$src/tests/python timeout 300 \
    python3 "$src/tests/python/test_cuda_fake.py" \
    CudaFakeTest.test_save_device_memory >"$work/save.log" 2>&1; then
  step save PASS
else
  cat "$work/save.log"
  step save FAIL "see above"
fi

# 7, 8. PyTorch's own CUDA tensors, against a daemon of the script's own
torch_ok=""
if [ $fakes -eq 1 ]; then
  torch_ok="fakes: PyTorch's CUDA caching allocator drives the real driver, which the fakes do not replace; run on a GPU"
elif ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() and int(torch.__version__.split(".")[0]) >= 2 else 1)' \
    >/dev/null 2>&1; then
  torch_ok="python3 has no torch 2.x with CUDA"
fi
torch_job() { # log port [PYTORCH_CUDA_ALLOC_CONF]: two ranks, one job
  pids=""
  for r in 0 1; do
    env ${3:+PYTORCH_CUDA_ALLOC_CONF=$3} SHARDPORT_SOCKET="$work/torch.sock" \
      SHARDPORT_LIB=$build/client/libshardport.so.0 \
      PYTHONPATH=$src/client/python timeout 240 \
      python3 "$src/tests/gpu/torch_export.py" $r 2 "$2" >"$work/$1.$r.log" 2>&1 &
    pids="$pids $!"
  done
  for p in $pids; do
    wait "$p"
  done
  grep -q '^ok 0 ' "$work/$1.0.log" && grep -q '^ok 1 ' "$work/$1.1.log"
}
if [ -n "$torch_ok" ]; then
  for s in torch torch-expandable two-jobs; do
    step "$s" SKIP "$torch_ok"
  done
else
  "$daemon" --config /dev/null --socket "$work/torch.sock" --backend cuda \
    >"$work/torch-daemon.log" 2>&1 &
  torch_daemon=$!
  for _ in $(seq 1 100); do
    [ -S "$work/torch.sock" ] && break
    sleep 0.1
  done
  for s in torch torch-expandable; do
    conf=""
    [ "$s" = torch-expandable ] && conf=expandable_segments:True
    if torch_job "$s" 29511 "$conf"; then
      step "$s" PASS
    else
      tail -n 20 "$work/$s.0.log" "$work/$s.1.log"
      step "$s" FAIL "see above"
    fi
  done
  ( torch_job two-jobs-a 29521 ) & a=$!
  ( torch_job two-jobs-b 29531 expandable_segments:True ) & b=$!
  if wait "$a" && wait "$b"; then
    step two-jobs PASS
  else
    tail -n 20 "$work"/two-jobs-*.log
    step two-jobs FAIL "see above"
  fi
  kill "$torch_daemon" 2>/dev/null
  wait "$torch_daemon" 2>/dev/null
fi

line="shardport GPU run $(date -u +%Y-%m-%d): ${ngpus} x ${gpu_name:-unknown GPU} (driver ${driver:-?}):$summary; $bench_line"
echo "$line" | tee -a "$work/summary.txt"
exit $failed
