#!/usr/bin/env bash
# Every GPU check and benchmark of the engine in one bounded command, for machines with GPUs and
# no package registry: installs wheels brought along in .whl/ and .whl_tf/ (only what the
# machine's Python lacks), then runs the stages named in STAGES, each under its own time limit,
# and leaves the logs and JSON in $OUT (at most eight files, flat; the rest in extra.tar.gz).
# The wheels fit a call's 64 MiB once bench/slim_wheel.py has taken nixl-cu13's unused parts out.
#
#   OUT=/tmp/out STAGES=tests,engine bash bench/gpu_all.sh        # one GPU is enough
#   OUT=/tmp/out STAGES=sweep,serving bash bench/gpu_all.sh       # two GPUs, NIXL
#
# Stages:
#   tests    tests/gpu: kernels against their references, CUDA-graph decode against eager,
#            the transformers oracle in fp32 (skipped where transformers is not importable)
#   engine   bench/engine.py: decode per step (loop and RankEngine, eager and graphs) against
#            the same-run roofline, attention alone, prefill, routed experts
#   sweep    tests/gpu/sweep.py on the two-GPU configurations (DTYPES, default bfloat16)
#   serving  bench/gpu_serving.sh: decode dcp 1 against dcp 2 (CONCURRENCY, default 16,64,256)
#   serve_path  bench/serve_path.py on a random V2-Lite-width checkpoint of LAYERS layers
#            (default 4) in /dev/shm: TTFT stages and the served path against same-run engine
#            bounds (SERVE_PATH_ARGS adds flags, e.g. --levels); one GPU is enough
#   serve_path_workers  the same with the router as ROUTER_WORKERS processes (default 1) on
#            WORKERS_LEVELS (default 64:32:2,64:1024:128,256:1024:128), to set beside
#            serve_path's router of pdd serve's default processes (auto: 4 on 16 CPUs) from the
#            same call
#   serve_path_asyncio  the same on asyncio's own event loop (PDD_EVENT_LOOP=asyncio) on
#            ASYNCIO_LEVELS (default 64:32:2,64:1024:128): the baseline for uvloop, same call
#   serve_path_in_order  the same with every prefill step in the host's order
#            (PDD_OVERTAKING=0) on IN_ORDER_LEVELS (default 1:1024:2) and its long-then-short
#            run: the baseline for overtaking prefill steps, same call
#   prefix_cache  bench/prefix_cache.py on the same kind of checkpoint: shared system prompt and
#            multi-turn chats, prefix cache off against on (PREFIX_CACHE_ARGS adds flags);
#            P TP1 -> D TP1 unless PREFIX_CACHE_ARGS says otherwise; one GPU is enough
# Time limits (s): TESTS_S 240, ENGINE_S 300, SWEEP_S 300, SERVING_S 280, SERVE_PATH_S 300,
# SERVE_PATH_WORKERS_S 200, SERVE_PATH_ASYNCIO_S 150, SERVE_PATH_IN_ORDER_S 150,
# PREFIX_CACHE_S 300, KV_TIERS_S 420, PROFILE_S 120, HANDOFF_S 120, LAUNCH_QUEUE_S 90,
# STRUCTURED_S 300, SERVE_COMPARE_S 420, TRACING_S 300, SPECULATIVE_S 400.
#   kv_tiers bench/kv_tiers.py on the same kind of checkpoint: the KV pool's defaults against
#            explicit pools, the host tier, no reuse, a burst sharing one prefix
#            (KV_TIERS_ARGS adds flags, e.g. --parts a,d); one GPU is enough
#   profile  bench/prefill_profile.py on that checkpoint: where a short prefill step's time goes
#            (PROFILE_ARGS adds flags, e.g. "--trend 8 --nixl-agent": wall against CPU time a step)
#   handoff  bench/kv_transfer.py --same-device: the CUDA IPC READ of pdd serve on one GPU (two
#            processes), idle and in the conditions of a served read; one GPU is enough
#   launch_queue  bench/launch_queue.py: how many launches a stream holds before the host
#            stalls, and how many one eager prefill step makes (LAYERS layers); one GPU
#   structured  bench/structured_tpot.py on that checkpoint (a synthetic tokenizer of its
#            vocabulary beside it): decode TPOT at 64 streams with 0, 25 and 100 % of requests
#            under a JSON schema, and with top_logprobs 5 on all (STRUCTURED_ARGS adds flags);
#            needs llguidance (its wheel in .whl/); one GPU is enough
#   serve_compare  bench/serve_compare.py on that checkpoint: several pdd serve settings side by
#            side against one engine bound (COMPARE_MODES, default remote,local,default: the
#            per-request P/D decision off, always local, as shipped; COMPARE_LEVELS adds
#            --levels; COMPARE_ARGS other flags); one GPU is enough
#   tracing  bench/serving.py --tracing off,1%,100% on that checkpoint, one decode rank: TPOT
#            and tokens/s with OpenTelemetry off and at two sampling ratios, each stack in two
#            rotated rounds, 1 and 64 streams of 128 tokens (TRACING_ARGS replaces those
#            flags); one GPU is enough
#   speculative  bench/speculative.py on a random 27-layer V2-Lite-width model: ceiling, floor
#            (self-disabled over 512 tokens), the modelled curve and the MTP module's cost at
#            batch 1, 16, 64 and k 1, 2, 3 (SPECULATIVE_ARGS replaces those flags; "--model
#            v3 --layers 1" for DeepSeek-V3's widths, which fit an H100 with the module); one GPU
# Each stage leaves one or two files in $OUT; all five at once would pass eight.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
STAGES=${STAGES:-tests,engine}
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/env.txt"; }
has() { $PY -c "import $1" 2>/dev/null; }

wheels=()
if compgen -G ".whl/*.whl" >/dev/null && ! { has nixl && has pydantic && has llguidance; }; then
    wheels+=(.whl/*.whl)
fi
if compgen -G ".whl_tf/*.whl" >/dev/null && ! has transformers; then
    wheels+=(.whl_tf/*.whl)
fi
if [ ${#wheels[@]} -gt 0 ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${wheels[@]}" 2>&1 | tail -5 | tee -a "$OUT/env.txt"
    export PYTHONPATH=/tmp/site:$PWD/operator:$PWD/sidecar${PYTHONPATH:+:$PYTHONPATH}
else  # what the caller's PYTHONPATH held (an earlier run's /tmp/site) stays on it
    export PYTHONPATH=$PWD/operator:$PWD/sidecar${PYTHONPATH:+:$PYTHONPATH}
fi
say "installed ${#wheels[@]} wheels: ${wheels[*]:-none}"
{
    nvidia-smi --query-gpu=index,name,memory.used,memory.total,clocks.sm,clocks.mem \
        --format=csv 2>&1 || true
    $PY - <<'EOF' 2>&1
import importlib
import os
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      "cpus", os.cpu_count())
for m in ("triton", "transformers", "huggingface_hub", "tokenizers", "safetensors", "regex",
          "tqdm", "filelock", "packaging", "requests", "yaml", "numpy", "nixl", "pydantic",
          "aiohttp", "prometheus_client", "jinja2", "llguidance"):
    try:
        mod = importlib.import_module(m)
        print(f"{m} {getattr(mod, '__version__', '?')} ({os.path.dirname(mod.__file__ or '')})")
    except Exception as exc:  # noqa: BLE001
        print(f"{m} MISSING: {type(exc).__name__}: {exc}")
EOF
} | tee -a "$OUT/env.txt"

rc=0
# One random V2-Lite-width checkpoint of LAYERS layers for the stages that serve a model: written
# once (the first stage that needs it), removed at the end.
CKPT=/dev/shm/pdd-random-v2lite-${LAYERS:-4}
[ -d /dev/shm ] && [ -w /dev/shm ] || CKPT=/tmp/pdd-random-v2lite-${LAYERS:-4}
checkpoint() {
    [ -f "$CKPT/config.json" ] && return 0
    MODEL_SIZE=v2lite LAYERS=${LAYERS:-4} CKPT=$CKPT DEVICE=cuda $PY bench/random_checkpoint.py \
        2>&1 | tee -a "$OUT/env.txt"
}
want() { [[ ",$STAGES," == *",$1,"* ]]; }

if want tests; then
    say "stage tests"
    # TESTS_ARGS: other pytest arguments (a file, -k EXPR) instead of the whole of tests/gpu
    eval "set -- ${TESTS_ARGS:-tests/gpu}"
    timeout -k 10 "${TESTS_S:-240}" $PY -m pytest "$@" -q -s -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" || rc=1
    say "tests done"
fi
if want engine; then
    say "stage engine"
    timeout -k 10 "${ENGINE_S:-300}" $PY bench/engine.py --device cuda --json "$OUT/engine.json" \
        ${ENGINE_ARGS:-} 2>&1 | tee "$OUT/engine.log" || rc=1
    say "engine done"
fi
if want sweep; then
    say "stage sweep"
    timeout -k 10 "${SWEEP_S:-300}" $PY tests/gpu/sweep.py --device cuda --configs x2 \
        --dtype "${DTYPES:-bfloat16}" --jobs 2 --budget-s $(( ${SWEEP_S:-300} - 90 )) \
        --out /tmp/sweep-out 2>&1 | tee "$OUT/sweep.log" || rc=1
    mkdir -p /tmp/gpu-all-extra && cp /tmp/sweep-out/sweep.* /tmp/gpu-all-extra/ 2>/dev/null
    say "sweep done"
fi
if want serving; then
    say "stage serving"
    mkdir -p /tmp/serving-out
    OUT=/tmp/serving-out CONCURRENCY=${CONCURRENCY:-16,64,256} \
        BENCH_TIMEOUT=${SERVING_S:-280} bash bench/gpu_serving.sh >/dev/null 2>&1 || rc=1
    cp /tmp/serving-out/serving.log /tmp/serving-out/serving.json "$OUT/" 2>/dev/null
    mkdir -p /tmp/gpu-all-extra && cp -r /tmp/serving-out /tmp/gpu-all-extra/serving
    say "serving done"
fi
if want serve_path; then
    say "stage serve_path"
    checkpoint
    PDD_ROUTER_REQUEST_TIMEOUT_S=600 timeout -k 10 "${SERVE_PATH_S:-300}" $PY bench/serve_path.py \
        --device cuda --dtype bfloat16 --model "$CKPT" --json "$OUT/serve_path.json" \
        --log-dir /tmp/serve-path-logs ${SERVE_PATH_ARGS:-} 2>&1 | tee "$OUT/serve_path.log" || rc=1
    mkdir -p /tmp/gpu-all-extra && cp -r /tmp/serve-path-logs /tmp/gpu-all-extra/ 2>/dev/null
    say "serve_path done"
fi
# A variant of serve_path set beside it from the same call: NAME LIMIT LEVELS, then VAR=VALUE
# settings of its stack and, after --, more flags of the bench.
serve_path_variant() {
    local name=$1 limit=$2 levels=$3 vars=()
    shift 3
    while [ $# -gt 0 ] && [ "$1" != -- ]; do vars+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    say "stage $name"
    checkpoint
    env "${vars[@]}" PDD_ROUTER_REQUEST_TIMEOUT_S=600 timeout -k 10 "$limit" $PY \
        bench/serve_path.py --device cuda --dtype bfloat16 --model "$CKPT" --levels "$levels" \
        "$@" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" || rc=1
    say "$name done"
}
want serve_path_workers && serve_path_variant serve_path_workers "${SERVE_PATH_WORKERS_S:-200}" \
    "${WORKERS_LEVELS:-64:32:2,64:1024:128,256:1024:128}" -- --router-workers "${ROUTER_WORKERS:-1}"
want serve_path_asyncio && serve_path_variant serve_path_asyncio "${SERVE_PATH_ASYNCIO_S:-150}" \
    "${ASYNCIO_LEVELS:-64:32:2,64:1024:128}" PDD_EVENT_LOOP=asyncio
want serve_path_in_order && serve_path_variant serve_path_in_order \
    "${SERVE_PATH_IN_ORDER_S:-150}" "${IN_ORDER_LEVELS:-1:1024:2}" PDD_OVERTAKING=0
if want prefix_cache; then
    say "stage prefix_cache"
    checkpoint
    PDD_ROUTER_REQUEST_TIMEOUT_S=600 timeout -k 10 "${PREFIX_CACHE_S:-300}" $PY \
        bench/prefix_cache.py --device cuda --dtype bfloat16 --model "$CKPT" \
        --json "$OUT/prefix_cache.json" ${PREFIX_CACHE_ARGS:-} 2>&1 \
        | tee "$OUT/prefix_cache.log" || rc=1
    say "prefix_cache done"
fi
if want kv_tiers; then
    say "stage kv_tiers"
    checkpoint
    PDD_ROUTER_REQUEST_TIMEOUT_S=900 timeout -k 10 "${KV_TIERS_S:-420}" $PY bench/kv_tiers.py \
        --device cuda --dtype bfloat16 --model "$CKPT" --json "$OUT/kv_tiers.json" \
        --log-dir /tmp/kv-tiers-logs ${KV_TIERS_ARGS:-} 2>&1 | tee "$OUT/kv_tiers.log" || rc=1
    mkdir -p /tmp/gpu-all-extra && cp -r /tmp/kv-tiers-logs /tmp/gpu-all-extra/ 2>/dev/null
    say "kv_tiers done"
fi
if want profile; then
    say "stage profile"
    checkpoint
    timeout -k 10 "${PROFILE_S:-120}" $PY bench/prefill_profile.py --model "$CKPT" \
        --tokens "${PROFILE_TOKENS:-1024}" ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.log" || rc=1
    say "profile done"
fi
if want handoff; then
    say "stage handoff"
    timeout -k 10 "${HANDOFF_S:-120}" $PY bench/kv_transfer.py --device cuda --same-device \
        --repeat 20 --json "$OUT/handoff.json" 2>&1 | tee "$OUT/handoff.log" || rc=1
    say "handoff done"
fi
if want launch_queue; then
    say "stage launch_queue"
    timeout -k 10 "${LAUNCH_QUEUE_S:-90}" $PY bench/launch_queue.py --layers "${LAYERS:-4}" \
        2>&1 | tee "$OUT/launch_queue.log" || rc=1
    say "launch_queue done"
fi
if want structured; then
    say "stage structured"
    checkpoint
    PDD_ROUTER_REQUEST_TIMEOUT_S=600 timeout -k 10 "${STRUCTURED_S:-300}" $PY \
        bench/structured_tpot.py --device cuda --dtype bfloat16 --model "$CKPT" \
        --json "$OUT/structured_tpot.json" --log-dir /tmp/structured-logs ${STRUCTURED_ARGS:-} \
        2>&1 | tee "$OUT/structured_tpot.log" || rc=1
    mkdir -p /tmp/gpu-all-extra && cp -r /tmp/structured-logs /tmp/gpu-all-extra/ 2>/dev/null
    say "structured done"
fi
if want serve_compare; then
    say "stage serve_compare"
    checkpoint
    PDD_ROUTER_REQUEST_TIMEOUT_S=600 timeout -k 10 "${SERVE_COMPARE_S:-420}" $PY \
        bench/serve_compare.py --device cuda --dtype bfloat16 --model "$CKPT" \
        --modes "${COMPARE_MODES:-remote,local,default}" \
        ${COMPARE_LEVELS:+--levels "$COMPARE_LEVELS"} --json "$OUT/serve_compare.json" \
        ${COMPARE_ARGS:-} 2>&1 | tee "$OUT/serve_compare.log" || rc=1
    say "serve_compare done"
fi
if want tracing; then
    say "stage tracing"
    checkpoint
    PDD_ROUTER_REQUEST_TIMEOUT_S=600 timeout -k 10 "${TRACING_S:-300}" $PY bench/serving.py \
        --device cuda --dtype bfloat16 --model "$CKPT" --decode-tp 1 --tracing off,1%,100% \
        --json "$OUT/tracing.json" ${TRACING_ARGS:---concurrency 1,64 --seqs-at-dcp1 64 \
        --requests-per-level 2 --max-tokens 128 --rounds 2} 2>&1 | tee "$OUT/tracing.log" || rc=1
    say "tracing done"
fi
if want speculative; then
    say "stage speculative"
    eval "set -- ${SPECULATIVE_ARGS:---batches 1,16,64 --ks 1,2,3 --tokens 64 --floor-tokens 512}"
    timeout -k 10 "${SPECULATIVE_S:-400}" $PY bench/speculative.py --device cuda \
        --json "$OUT/speculative.json" "$@" 2>&1 | tee "$OUT/speculative.log" || rc=1
    say "speculative done"
fi
rm -rf "$CKPT"
if [ -d /tmp/gpu-all-extra ]; then  # the rest in one archive: $OUT keeps to eight files
    tar -czf "$OUT/extra.tar.gz" -C /tmp/gpu-all-extra . 2>/dev/null
fi
say "all done, exit $rc"
exit $rc
