#!/usr/bin/env bash
# One GPU run: the GPU tests (kernels, CUDA-graph decode, oracle), then the engine benchmark
# (extra arguments go to bench/engine.py). Logs and the bench's JSON land in $RESULTS.
set -o pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/sidecar PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RESULTS=${RESULTS:-/tmp/gpu-results}
mkdir -p "$RESULTS"
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  $PY -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$RESULTS/tests.log" || rc=1
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  $PY bench/engine.py --device cuda --json "$RESULTS/engine.json" "$@" 2>&1 \
    | tee "$RESULTS/bench.log" || rc=1
fi
exit $rc
