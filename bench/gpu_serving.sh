#!/usr/bin/env bash
# The serving benchmark (bench/serving.py) on GPUs, in one bounded command, on a machine with no
# package registry: installs the wheels carried in .whl/ (if any), writes a random-weights
# checkpoint of DeepSeek-V2-Lite width (a few layers, vocab 102400) to local memory, runs decode
# TP2/DCP1 against TP2/DCP2 at the same per-rank KV blocks, and leaves the JSON, the log and each
# stack's logs in $OUT.
#
#   OUT=/tmp/out bash bench/gpu_serving.sh                          # 2 GPUs
#   OUT=/tmp/out DEVICE=cpu MODEL_SIZE=small CONCURRENCY=1,4 bash bench/gpu_serving.sh  # smoke
#
# Knobs (environment): DEVICE (cuda), MODEL_SIZE (v2lite | small), LAYERS (4), CONCURRENCY
# (1,4,16,64,256), REQS (requests per level as a multiple of concurrency, 1), MAX_TOKENS (64),
# SEQS_AT_DCP1 (16), DTYPE (bfloat16), BENCH_TIMEOUT (seconds, 330), PYTHON (python3).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
MODEL_SIZE=${MODEL_SIZE:-v2lite}
LAYERS=${LAYERS:-4}
CONCURRENCY=${CONCURRENCY:-1,4,16,64,256}
REQS=${REQS:-1}
MAX_TOKENS=${MAX_TOKENS:-64}
SEQS_AT_DCP1=${SEQS_AT_DCP1:-16}
DTYPE=${DTYPE:-bfloat16}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-330}
PY=${PYTHON:-python3}

# NVLink multicast stays off everywhere (children inherit the environment).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PDD_ROUTER_REQUEST_TIMEOUT_S=600
WORK=$(mktemp -d /tmp/pdd-gpu-serving.XXXXXX)
export TMPDIR=$WORK

if compgen -G ".whl/*.whl" >/dev/null && ! $PY -c "import nixl, pydantic" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tail -5
    export PYTHONPATH=/tmp/site:$PWD/operator:$PWD/sidecar${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD/operator:$PWD/sidecar${PYTHONPATH:+:$PYTHONPATH}
fi

{
    date -u
    nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv 2>&1 || true
    nvidia-smi topo -m 2>&1 || true
    $PY - <<'EOF' 2>&1
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
for m in ("nixl", "pydantic", "aiohttp", "yaml", "safetensors", "prometheus_client",
          "tokenizers", "jinja2", "triton", "numpy"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as exc:  # noqa: BLE001
        print(m, "MISSING", type(exc).__name__, exc)
EOF
} | tee "$OUT/env.txt"

CKPT=/dev/shm/pdd-random-$MODEL_SIZE-$LAYERS
[ -d /dev/shm ] && [ -w /dev/shm ] || CKPT=$WORK/ckpt
t0=$(date +%s)
MODEL_SIZE=$MODEL_SIZE LAYERS=$LAYERS CKPT=$CKPT DEVICE=$DEVICE $PY bench/random_checkpoint.py \
    2>&1 | tee -a "$OUT/env.txt"
echo "checkpoint step: $(( $(date +%s) - t0 ))s"

rc=0
timeout -k 10 "$BENCH_TIMEOUT" $PY bench/serving.py --device "$DEVICE" --dtype "$DTYPE" \
    --model "$CKPT" --concurrency "$CONCURRENCY" --requests-per-level "$REQS" \
    --max-tokens "$MAX_TOKENS" --seqs-at-dcp1 "$SEQS_AT_DCP1" --json "$OUT/serving.json" \
    --log-dir "$WORK/logs" 2>&1 | tee "$OUT/serving.log" || rc=$?
echo "serving.py exit code $rc after $(( $(date +%s) - t0 ))s"
nvidia-smi --query-gpu=index,memory.used --format=csv 2>/dev/null || true
if [ -d "$WORK/logs" ]; then
    tar -czf "$OUT/stack-logs.tar.gz" -C "$WORK" logs
    for f in "$WORK"/logs/*/*.log; do
        echo "== $f (last 15 lines)"
        tail -n 15 "$f"
    done
fi
rm -rf "$CKPT" "$WORK"
exit "$rc"
