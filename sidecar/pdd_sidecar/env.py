"""Every environment variable and label key the sidecar runtime reads, in one place.

Keys shared with the operator are defined once in pdd_api.keys and named here for the runtime.

The operator sets these on prefill/decode/router pods; tests set them on local processes. Names in
the first block are a contract (docs/architecture.md, "Sidecar env"); the rest are runtime knobs
with defaults that work in a pod (fixed ports) and can be overridden so several instances share
one machine.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdd_api import keys, rules
from pdd_api.models import (
    DEFAULT_KV_CACHE_DTYPE,
    DEFAULT_LOCAL_PREFILL_TOKENS,
    DEFAULT_NGRAM_MAX_N,
    DEFAULT_NGRAM_MIN_N,
    DEFAULT_ROUTER_POLICY,
    DEFAULT_SPECULATIVE_TOKENS,
    KV_CACHE_DTYPES,
    MAX_LOCAL_PREFILL_TOKENS,
    NO_PREFILL_MODES,
    ROUTER_POLICIES,
    SPECULATIVE_METHODS,
)
from pdd_sidecar.switch import switch

# --- contract (docs/architecture.md "Sidecar env") ---
PDD_ROLE = keys.ENV_ROLE
PDD_REPLICA = keys.ENV_REPLICA
PDD_TP_SIZE = keys.ENV_TP_SIZE
PDD_DCP_SIZE = keys.ENV_DCP_SIZE
PDD_BLOCK_SIZE = keys.ENV_BLOCK_SIZE
PDD_ROUTING_FILE = keys.ENV_ROUTING_FILE
PDD_SIDE_CHANNEL_PORT = keys.ENV_SIDE_CHANNEL_PORT
POD_IP = keys.ENV_POD_IP
PDD_GRANT_KEY_FILE = keys.ENV_GRANT_KEY_FILE  # the deployment's transfer-grant key (a Secret)

# --- runtime knobs of prefill/decode instances ---
PDD_HTTP_PORT = keys.ENV_HTTP_PORT  # instance API (/v1/prefill, /v1/decode, /healthz, ...)
PDD_BIND_HOST = "PDD_BIND_HOST"  # address the HTTP servers listen on
PDD_DIST_PORT = keys.ENV_DIST_PORT  # torch.distributed rendezvous of the instance's ranks
PDD_MODEL_NAME = keys.ENV_MODEL_NAME  # what is served; part of the compatibility record
PDD_MODEL_SOURCE = keys.ENV_MODEL_SOURCE  # Hugging Face DeepSeek-V2 directory; built-in when empty
PDD_MODEL_SEED = "PDD_MODEL_SEED"  # seed of the built-in tiny model
PDD_DTYPE = keys.ENV_DTYPE  # float32 | bfloat16
PDD_DEVICE = "PDD_DEVICE"  # auto | cpu | cuda (rank r uses cuda:r); auto: cuda if tp GPUs are seen
# KV cache blocks per rank; unset: sized from memory on a GPU (kv/pool_sizing.py), 1024 on a CPU
PDD_NUM_BLOCKS = keys.ENV_NUM_BLOCKS
# Share of the GPU's memory the instance may fill (weights, activations, graphs, KV): the pool
# gets what is left after warm-up (kv/pool_sizing.py); PDD_NUM_BLOCKS, when set, wins.
PDD_GPU_MEMORY_UTILIZATION = keys.ENV_GPU_MEMORY_UTILIZATION
# GiB of pinned host memory under the prefix cache, per rank (0: no host tier).
PDD_HOST_KV_CACHE_GIB = keys.ENV_HOST_KV_CACHE_GIB
# What the KV cache keeps a token's latent in: auto (the model's dtype) or fp8 (FlashMLA's
# layout, kv/fp8_layout.py). Prefill and decode must agree: the hand-off moves bytes as they are.
PDD_KV_CACHE_DTYPE = keys.ENV_KV_CACHE_DTYPE
# Speculative decoding, decode only (docs/operator.md, "Speculative decoding"): the drafter
# (mtp | ngram; unset: none), tokens drafted per step, the n-gram drafter's longest and shortest
# ending.
PDD_SPECULATIVE_METHOD = keys.ENV_SPECULATIVE_METHOD
PDD_SPECULATIVE_TOKENS = keys.ENV_SPECULATIVE_TOKENS
PDD_SPECULATIVE_NGRAM_MAX = keys.ENV_SPECULATIVE_NGRAM_MAX
PDD_SPECULATIVE_NGRAM_MIN = keys.ENV_SPECULATIVE_NGRAM_MIN
# When a speculating decode stops drafting (engine/speculative/config.py has the defaults and
# the bench that set them): above this many running sequences, and per sequence while its
# recent acceptance is below this fraction.
PDD_SPECULATIVE_MAX_BATCH = "PDD_SPECULATIVE_MAX_BATCH"
PDD_SPECULATIVE_MIN_ACCEPTANCE = "PDD_SPECULATIVE_MIN_ACCEPTANCE"
# Prefill frees unclaimed blocks after this; keep it well above the decode's transfer timeout,
# or a slow hand-off could read blocks the lease already gave to another request.
PDD_LEASE_SECONDS = "PDD_LEASE_SECONDS"
PDD_TRANSFER_TIMEOUT_S = "PDD_TRANSFER_TIMEOUT_S"  # bound on one hand-off (decode side)
PDD_HANDSHAKE_TIMEOUT_S = "PDD_HANDSHAKE_TIMEOUT_S"  # bound on one side-channel call
PDD_NOTIF_POLL_S = "PDD_NOTIF_POLL_S"  # how often prefill polls NIXL notifications
PDD_DRAIN_S = "PDD_DRAIN_S"  # on SIGTERM, wait at most this long for held KV and requests
# In a pod the deletion's grace period (the role's drainSeconds, set by the operator) is the
# bound: the instance leaves as soon as it is idle, and the kubelet stops it at the end.
DEFAULT_DRAIN_S = 3600.0
# Serving engine (see engine/scheduler.py for the policy)
PDD_MAX_NUM_SEQS = "PDD_MAX_NUM_SEQS"  # sequences admitted at once (running or pulling KV)
PDD_MAX_WAITING = "PDD_MAX_WAITING"  # queued beyond that are refused with 429
# prefill tokens in one forward pass; unset: by device (engine/scheduler.py DEVICE_BUDGETS)
PDD_MAX_STEP_TOKENS = "PDD_MAX_STEP_TOKENS"
PDD_CHUNK_TOKENS = "PDD_CHUNK_TOKENS"  # longest prompt chunk (whole blocks); unset: by device
# a step's piece of a prompt longer than PDD_CHUNK_TOKENS while shorter prompts share its steps
# (so theirs stay short); unset: by device
PDD_LONG_CHUNK_TOKENS = "PDD_LONG_CHUNK_TOKENS"
PDD_MAX_MODEL_LEN = "PDD_MAX_MODEL_LEN"  # prompt + max_tokens limit; 0: the model's own
# how long a thread waiting for the GIL waits before the holder is asked to let go (sys.
# setswitchinterval, in microseconds): every torch call of the engine and of a KV pull gives
# the GIL up and waits this long to get it back while an HTTP thread runs
PDD_GIL_SWITCH_INTERVAL_US = "PDD_GIL_SWITCH_INTERVAL_US"
# The HTTP servers' event loop (serve/event_loop.py): auto (default: uvloop when installed,
# else asyncio's own) | uvloop (refused at start when not installed) | asyncio.
PDD_EVENT_LOOP = "PDD_EVENT_LOOP"
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
# 1 (default): on CUDA, decode-only steps replay a CUDA graph captured per batch-size bucket;
# 0: every step eager. Read by the engine (engine/cuda_graphs.py); no effect on the CPU.
PDD_CUDA_GRAPHS = "PDD_CUDA_GRAPHS"
# 1 (default): a layer's fused kernels (residual add with RMSNorm, one projection GEMV for the
# query and the latent, RoPE with the KV write, the router in one kernel, the shared experts in
# the routed experts' GEMV at small batches); 0: the unfused kernels. Read by the model
# (model/fusion.py); for same-run comparisons.
PDD_FUSED_DECODE = "PDD_FUSED_DECODE"
# Up to this many tokens a step runs the shared experts as always-chosen experts inside the
# routed experts' GEMV (default 1); above it, apart. Read by model/fusion.py.
PDD_SHARED_IN_GEMV_TOKENS = "PDD_SHARED_IN_GEMV_TOKENS"
# 1 (default): the step's Triton kernels of up to 8 rows launch as programmatic dependents of
# the kernel before them (Hopper and later; model/kernels/pdl.py); 0: ordinary launches. Read by
# the model.
PDD_PDL = "PDD_PDL"
# 1 (default): on a single-rank CUDA prefill, graphed steps of fresh prompts run ahead of queued
# device work (a high-priority stream); 0: every step in the host's order. Read by the engine
# (engine/overtaking.py); checked everywhere, no effect on the CPU.
PDD_OVERTAKING = "PDD_OVERTAKING"
# How a decode reads KV: auto (default: a CUDA IPC device copy from a prefill on this host's
# CUDA devices, NIXL otherwise) | nixl | cuda_ipc (refused at the handshake when it cannot work).
PDD_KV_TRANSPORT = "PDD_KV_TRANSPORT"
# 1 (default): a prefill reuses the KV of whole prompt blocks it computed before
# (kv/prefix_cache.py); 0: every prompt computed from scratch.
PDD_PREFIX_CACHE = keys.ENV_PREFIX_CACHE
# Tests only: each KV pull sleeps before it claims its blocks: "S" seconds, or "A:B" (uniform).
PDD_FAULT_PULL_DELAY_S = "PDD_FAULT_PULL_DELAY_S"
PDD_PREFILL_URLS = keys.ENV_PREFILL_URLS  # comma list of http://host:port of prefill instances
PDD_DECODE_URLS = keys.ENV_DECODE_URLS  # comma list of http://host:port of decode instances
PDD_PREFILL_SERVICE = keys.ENV_PREFILL_SERVICE  # headless Service DNS name[:port] of prefill pods
PDD_DECODE_SERVICE = keys.ENV_DECODE_SERVICE
PDD_LOG_LEVEL = "PDD_LOG_LEVEL"
# --- an instance whose ranks span the pods of one LeaderWorkerSet group (docs/dataplane.md) ---
LWS_LEADER_ADDRESS = keys.ENV_LWS_LEADER_ADDRESS  # set by LWS: the leader pod (rendezvous)
LWS_GROUP_SIZE = keys.ENV_LWS_GROUP_SIZE  # set by LWS: pods in the group (absent or 1: one pod)
LWS_WORKER_INDEX = keys.ENV_LWS_WORKER_INDEX  # set by LWS: 0 on the leader, 1.. on the workers
# Optional cross-check: must equal PDD_TP_SIZE / LWS_GROUP_SIZE (the role's GPUs per pod).
PDD_RANKS_PER_POD = keys.ENV_RANKS_PER_POD
# Fault injection for tests only: after its first per-peer read, decode rank r creates
# <path>.reached.<r> and waits (within the transfer timeout) until <path> exists.
PDD_FAULT_READ_GATE = "PDD_FAULT_READ_GATE"
# Tests only: every forward step of the instance takes this many seconds more (a slow step).
PDD_FAULT_STEP_DELAY_S = "PDD_FAULT_STEP_DELAY_S"
# Tests only, CPU instances: each piece of work between two points the driver waits for (a step
# done, tokens sampled) takes this many seconds on a pretend device, one after another: the CPU
# twin of a device's queue.
PDD_FAULT_DEVICE_LAG_S = "PDD_FAULT_DEVICE_LAG_S"
# Tests only, CPU prefills: "1" launches every in-order step a layer at a time, serving between
# layers, as a CUDA prefill launches its long ones (engine/launch_pacing.py).
PDD_FAULT_PACED_LAUNCH = "PDD_FAULT_PACED_LAUNCH"

# --- router (listens on PDD_HTTP_PORT; replicas from PDD_*_URLS and/or PDD_*_SERVICE) ---
PDD_ROUTER_HEALTH_INTERVAL_S = "PDD_ROUTER_HEALTH_INTERVAL_S"
PDD_ROUTER_REQUEST_TIMEOUT_S = "PDD_ROUTER_REQUEST_TIMEOUT_S"
PDD_ROUTER_MAX_BODY_BYTES = "PDD_ROUTER_MAX_BODY_BYTES"  # larger request bodies get a 413
PDD_ROUTER_MAX_CONCURRENCY = "PDD_ROUTER_MAX_CONCURRENCY"  # requests in flight; beyond: 429
PDD_ROUTER_READY_WAIT_S = "PDD_ROUTER_READY_WAIT_S"  # how long a request waits for a ready replica
# Router processes sharing the port (serve/router/router_workers.py); each is a whole router.
PDD_ROUTER_WORKERS = keys.ENV_ROUTER_WORKERS
MAX_ROUTER_WORKERS = rules.MAX_ROUTER_WORKERS
PDD_ROUTER_WORKER = "PDD_ROUTER_WORKER"  # set by the router for its workers: this one's index
PDD_ROUTER_WORKERS_DIR = "PDD_ROUTER_WORKERS_DIR"  # likewise: the folder the workers share
# How the router picks replicas (serve/router/routing_policy.py): cache-aware (default),
# least-loaded or round-robin.
PDD_ROUTER_POLICY = keys.ENV_ROUTER_POLICY
# Where a request is prefilled (serve/router/prefill_path.py): on the decode when the prompt's
# part the decode does not cache is at most this many tokens (0: always through a prefill while
# one is ready); and, with no prefill ready, fallback (serve on a decode) or refuse (503).
PDD_ROUTER_LOCAL_PREFILL_TOKENS = keys.ENV_ROUTER_LOCAL_PREFILL_TOKENS
PDD_ROUTER_NO_PREFILL = keys.ENV_ROUTER_NO_PREFILL
# How the router talks to its upstreams: pdd (/v1/prefill, /v1/decode) or vllm (vLLM's P/D
# proxy flow on /v1/completions, which pdd instances and vLLM servers both speak)
PDD_ROUTER_UPSTREAM_PROTOCOL = "PDD_ROUTER_UPSTREAM_PROTOCOL"
UPSTREAM_PROTOCOLS = ("pdd", "vllm")
# API keys (serve/openai/api_keys.py): comma-separated keys, and/or a file or folder of files
# holding one key per line, read again when it changes (a mounted Secret rotates without a restart).
PDD_API_KEY = keys.ENV_API_KEY
PDD_API_KEY_FILE = keys.ENV_API_KEY_FILE
# Longest prompt + completion the router accepts; unset: the checkpoint's max_position_embeddings.
PDD_MAX_MODEL_LEN = "PDD_MAX_MODEL_LEN"

DEFAULT_HTTP_PORT = keys.HTTP_PORT
DEFAULT_SIDE_CHANNEL_PORT = 5600
DEFAULT_DIST_PORT = keys.DIST_PORT
DEFAULT_GIL_SWITCH_INTERVAL_US = 500.0
ROLES = ("prefill", "decode")
KV_TRANSPORTS = ("auto", "nixl", "cuda_ipc")  # kv/transport.py


class ConfigError(ValueError):
    """The environment cannot describe a working instance; the message names the variable."""


def _int(env: Mapping[str, str], key: str, default: int | None, minimum: int = 0) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"{key}: required, not set")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{key}: must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"{key}: must be >= {minimum}, got {value}")
    return value


def _optional_int(env: Mapping[str, str], key: str, minimum: int) -> int | None:
    return _int(env, key, None, minimum) if env.get(key, "").strip() else None


def _choice(env: Mapping[str, str], key: str, choices: tuple[str, ...]) -> str:
    value = env.get(key, "") or choices[0]
    if value not in choices:
        raise ConfigError(f"{key}: must be one of {', '.join(choices)}, got {value!r}")
    return value


def _switch(env: Mapping[str, str], key: str, default: bool) -> bool:
    try:
        return switch(env, key, default)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _range(env: Mapping[str, str], key: str) -> tuple[float, float]:
    raw = env.get(key, "") or "0"
    try:
        lo, _, hi = raw.partition(":")
        span = (float(lo), float(hi or lo))
    except ValueError:
        raise ConfigError(f"{key}: must be seconds or LOW:HIGH, got {raw!r}") from None
    if not 0 <= span[0] <= span[1]:
        raise ConfigError(f"{key}: must be 0 <= LOW <= HIGH, got {raw!r}")
    return span


def _required(env: Mapping[str, str], key: str, what: str) -> str:
    value = env.get(key, "")
    if not value:
        raise ConfigError(f"{key}: required, not set ({what})")
    return value


def _float(env: Mapping[str, str], key: str, default: float, positive: bool = False) -> float:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{key}: must be a number, got {raw!r}") from None
    if not math.isfinite(value):  # nan passes every comparison below; inf is no bound
        raise ConfigError(f"{key}: must be a finite number, got {raw!r}")
    if value < 0:
        raise ConfigError(f"{key}: must be >= 0, got {value}")
    if positive and value == 0:
        raise ConfigError(f"{key}: must be > 0, got {value}")
    return value


def _fraction(env: Mapping[str, str], key: str, default: float) -> float:
    """A share of something: in (0, 1]."""
    value = _float(env, key, default)
    if not 0 < value <= 1:
        raise ConfigError(f"{key}: must be in (0, 1], got {env.get(key)!r}")
    return value


def parse_urls(raw: str | None) -> list[str]:
    """`http://a:8000,b:8000` -> base URLs without trailing slash; a bare host:port gets http."""
    out = []
    for part in (raw or "").split(","):
        part = part.strip().rstrip("/")
        if part:
            out.append(part if "://" in part else f"http://{part}")
    return out


@dataclass(frozen=True)
class SpeculativeSettings:
    """A decode's drafter, as spec.decode.speculative says it (the engine builds its drafter
    from these: for ngram, engine/speculative/ngram.py NgramConfig(k=tokens, max_n, min_n))."""

    method: str  # one of pdd_api.models.SPECULATIVE_METHODS
    tokens: int = DEFAULT_SPECULATIVE_TOKENS
    ngram_max: int = DEFAULT_NGRAM_MAX_N
    ngram_min: int = DEFAULT_NGRAM_MIN_N
    max_batch: int | None = None  # None: the engine's default
    min_acceptance: float | None = None


def _bounded(env: Mapping[str, str], key: str, default: int, hi: int) -> int:
    value = _int(env, key, default, 1)
    if value > hi:
        raise ConfigError(f"{key}: must be between 1 and {hi}, got {value}")
    return value


def _speculative(env: Mapping[str, str], role: str) -> SpeculativeSettings | None:
    """None without PDD_SPECULATIVE_METHOD; a setting that cannot apply is refused, not
    ignored (a drafter's knob without a drafter, n-gram lengths for mtp, a prefill's drafter)."""
    method = env.get(PDD_SPECULATIVE_METHOD, "")
    ngram_keys = (PDD_SPECULATIVE_NGRAM_MAX, PDD_SPECULATIVE_NGRAM_MIN)
    tuning = (PDD_SPECULATIVE_MAX_BATCH, PDD_SPECULATIVE_MIN_ACCEPTANCE)
    if not method:
        stray = next((k for k in (PDD_SPECULATIVE_TOKENS, *ngram_keys, *tuning) if env.get(k)),
                     None)
        if stray is not None:
            raise ConfigError(f"{stray}: set without {PDD_SPECULATIVE_METHOD} "
                              f"({', '.join(SPECULATIVE_METHODS)}), got {env[stray]!r}")
        return None
    if method not in SPECULATIVE_METHODS:
        raise ConfigError(f"{PDD_SPECULATIVE_METHOD}: must be one of "
                          f"{', '.join(SPECULATIVE_METHODS)}, got {method!r}")
    if role != "decode":
        # A prefill of an mtp decode runs the module over the prompt and sends the draft
        # state (engine/speculative/mtp_served.py); it drafts nothing, so nothing else applies.
        stray = next((k for k in (PDD_SPECULATIVE_TOKENS, *ngram_keys, *tuning) if env.get(k)),
                     None)
        if method != "mtp" or stray is not None:
            raise ConfigError(f"{stray or PDD_SPECULATIVE_METHOD}: only a decode drafts, got "
                              f"{env.get(stray) if stray else method!r} on a {role} (a "
                              f"prefill takes {PDD_SPECULATIVE_METHOD}=mtp alone: it fills "
                              f"the MTP draft state)")
        return SpeculativeSettings(method=method)
    if method != "ngram":
        stray = next((k for k in ngram_keys if env.get(k)), None)
        if stray is not None:
            raise ConfigError(f"{stray}: only with {PDD_SPECULATIVE_METHOD}=ngram, got "
                              f"{method!r}")
    lo = _bounded(env, PDD_SPECULATIVE_NGRAM_MIN, DEFAULT_NGRAM_MIN_N, rules.MAX_NGRAM_N)
    hi = _bounded(env, PDD_SPECULATIVE_NGRAM_MAX, DEFAULT_NGRAM_MAX_N, rules.MAX_NGRAM_N)
    if lo > hi:
        raise ConfigError(f"{PDD_SPECULATIVE_NGRAM_MIN}: must not exceed "
                          f"{PDD_SPECULATIVE_NGRAM_MAX} ({hi}), got {lo}")
    return SpeculativeSettings(
        method=method,
        tokens=_bounded(env, PDD_SPECULATIVE_TOKENS, DEFAULT_SPECULATIVE_TOKENS,
                        rules.MAX_SPECULATIVE_TOKENS),
        ngram_max=hi, ngram_min=lo,
        max_batch=_optional_int(env, PDD_SPECULATIVE_MAX_BATCH, 0),
        min_acceptance=_acceptance(env))


def _acceptance(env: Mapping[str, str]) -> float | None:
    """PDD_SPECULATIVE_MIN_ACCEPTANCE in [0, 1] (0: never paused for low acceptance)."""
    if not env.get(PDD_SPECULATIVE_MIN_ACCEPTANCE, "").strip():
        return None
    value = _float(env, PDD_SPECULATIVE_MIN_ACCEPTANCE, 0.0)
    if not 0 <= value <= 1:
        raise ConfigError(f"{PDD_SPECULATIVE_MIN_ACCEPTANCE}: must be in [0, 1], got "
                          f"{env.get(PDD_SPECULATIVE_MIN_ACCEPTANCE)!r}")
    return value


@dataclass(frozen=True)
class InstanceSettings:
    role: str
    replica: int
    tp: int
    dcp: int
    block_size: int
    routing_file: str
    side_channel_port: int
    pod_ip: str
    http_port: int
    bind_host: str
    dist_port: int
    model_name: str
    model_source: str
    model_seed: int
    dtype: str
    device: str
    num_blocks: int | None  # None: from memory on a GPU, a fixed default on a CPU (kv/pool_sizing)
    lease_seconds: float
    transfer_timeout_s: float
    handshake_timeout_s: float
    notif_poll_s: float
    prefill_urls: list[str] = field(default_factory=list)
    prefill_service: str = ""
    fault_read_gate: str = ""
    drain_s: float = DEFAULT_DRAIN_S
    max_num_seqs: int = 256
    max_waiting: int = 256
    max_step_tokens: int | None = None  # None: the device's default
    chunk_tokens: int | None = None
    long_chunk_tokens: int | None = None
    max_model_len: int = 0
    gil_switch_interval_us: float = DEFAULT_GIL_SWITCH_INTERVAL_US
    prefix_cache: bool = True
    grant_key_file: str = ""
    fault_pull_delay_s: tuple[float, float] = (0.0, 0.0)
    fault_step_delay_s: float = 0.0
    fault_device_lag_s: float = 0.0
    fault_paced_launch: bool = False
    kv_transport: str = "auto"
    event_loop: str = "auto"
    group_size: int = 1  # pods holding this instance's ranks
    worker_index: int = 0  # this pod's place in the group; 0 holds rank 0 and serves HTTP
    leader_address: str = ""  # where rank 0's pod is reached (the rendezvous)
    gpu_memory_utilization: float = keys.DEFAULT_GPU_MEMORY_UTILIZATION
    host_kv_cache_gib: float = 0.0
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE  # one of pdd_api.models.KV_CACHE_DTYPES
    speculative: SpeculativeSettings | None = None  # decode's drafter; None: no speculation

    @property
    def cache_extra_layers(self) -> int:
        """Cache layers after the model's: the MTP module's latents (engine/speculative/
        mtp.py), on a decode drafting with it and on its prefill, which fills them."""
        return 1 if self.speculative is not None and self.speculative.method == "mtp" else 0

    @property
    def ranks_per_pod(self) -> int:
        return self.tp // self.group_size

    @property
    def local_ranks(self) -> range:
        """The global ranks this pod runs: pod k holds k*g .. k*g+g-1."""
        first = self.worker_index * self.ranks_per_pod
        return range(first, first + self.ranks_per_pod)

    @property
    def spans_pods(self) -> bool:
        return self.group_size > 1

    @property
    def is_leader(self) -> bool:
        return self.worker_index == 0

    @property
    def rendezvous_host(self) -> str:
        host = self.leader_address if self.spans_pods else "127.0.0.1"
        return f"[{host}]" if ":" in host else host

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> InstanceSettings:
        env = os.environ if env is None else env
        role = env.get(PDD_ROLE, "")
        if role not in ROLES:
            raise ConfigError(f"{PDD_ROLE}: must be one of {', '.join(ROLES)}, got {role!r}")
        tp = _int(env, PDD_TP_SIZE, None, 1)
        dcp = _int(env, PDD_DCP_SIZE, 1, 1)
        if dcp not in (1, tp):
            raise ConfigError(
                f"{PDD_DCP_SIZE}: must be 1 or equal to {PDD_TP_SIZE} ({tp}), got {dcp}"
            )
        routing_file = env.get(PDD_ROUTING_FILE, "")
        if not routing_file:
            raise ConfigError(f"{PDD_ROUTING_FILE}: required, not set")
        dtype = env.get(PDD_DTYPE, "") or "float32"
        if dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"{PDD_DTYPE}: must be float32 or bfloat16, got {dtype!r}")
        device = env.get(PDD_DEVICE, "") or "auto"
        if device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"{PDD_DEVICE}: must be auto, cpu or cuda, got {device!r}")
        side = _int(env, PDD_SIDE_CHANNEL_PORT, DEFAULT_SIDE_CHANNEL_PORT, 1)
        transport = env.get(PDD_KV_TRANSPORT, "") or "auto"
        if transport not in KV_TRANSPORTS:
            raise ConfigError(f"{PDD_KV_TRANSPORT}: must be one of {', '.join(KV_TRANSPORTS)}, "
                              f"got {transport!r}")
        group_size, worker_index, leader = _group(env, tp)
        return cls(
            role=role,
            replica=_int(env, PDD_REPLICA, 0),
            tp=tp,
            dcp=dcp,
            block_size=_int(env, PDD_BLOCK_SIZE, None, 1),
            routing_file=routing_file,
            side_channel_port=side,
            pod_ip=env.get(POD_IP, "") or "127.0.0.1",
            http_port=_int(env, PDD_HTTP_PORT, DEFAULT_HTTP_PORT, 1),
            bind_host=env.get(PDD_BIND_HOST, "") or "0.0.0.0",
            dist_port=_int(env, PDD_DIST_PORT, DEFAULT_DIST_PORT, 1),
            model_name=env.get(PDD_MODEL_NAME, "") or "builtin",
            model_source=env.get(PDD_MODEL_SOURCE, "") or "builtin",
            model_seed=_int(env, PDD_MODEL_SEED, 1234),
            dtype=dtype,
            device=device,
            num_blocks=_optional_int(env, PDD_NUM_BLOCKS, 1),
            lease_seconds=_float(env, PDD_LEASE_SECONDS, 60.0),
            transfer_timeout_s=_float(env, PDD_TRANSFER_TIMEOUT_S, 20.0),
            handshake_timeout_s=_float(env, PDD_HANDSHAKE_TIMEOUT_S, 5.0),
            notif_poll_s=_float(env, PDD_NOTIF_POLL_S, 0.02),
            prefill_urls=parse_urls(env.get(PDD_PREFILL_URLS)),
            prefill_service=env.get(PDD_PREFILL_SERVICE, ""),
            fault_read_gate=env.get(PDD_FAULT_READ_GATE, ""),
            drain_s=_float(env, PDD_DRAIN_S, DEFAULT_DRAIN_S),
            max_num_seqs=_int(env, PDD_MAX_NUM_SEQS, 256, 1),
            max_waiting=_int(env, PDD_MAX_WAITING, 256, 0),
            max_step_tokens=_optional_int(env, PDD_MAX_STEP_TOKENS, 1),
            chunk_tokens=_optional_int(env, PDD_CHUNK_TOKENS, 1),
            long_chunk_tokens=_optional_int(env, PDD_LONG_CHUNK_TOKENS, 1),
            max_model_len=_int(env, PDD_MAX_MODEL_LEN, 0, 0),
            gil_switch_interval_us=_float(env, PDD_GIL_SWITCH_INTERVAL_US,
                                          DEFAULT_GIL_SWITCH_INTERVAL_US, positive=True),
            prefix_cache=_switch(env, PDD_PREFIX_CACHE, True),
            grant_key_file=_required(env, PDD_GRANT_KEY_FILE, "the transfer-grant key file "
                                     "shared by the deployment's prefill and decode pods"),
            fault_pull_delay_s=_range(env, PDD_FAULT_PULL_DELAY_S),
            fault_step_delay_s=_float(env, PDD_FAULT_STEP_DELAY_S, 0.0),
            fault_device_lag_s=_float(env, PDD_FAULT_DEVICE_LAG_S, 0.0),
            fault_paced_launch=_switch(env, PDD_FAULT_PACED_LAUNCH, False),
            kv_transport=transport,
            event_loop=_choice(env, PDD_EVENT_LOOP, EVENT_LOOPS),
            group_size=group_size,
            worker_index=worker_index,
            leader_address=leader,
            gpu_memory_utilization=_fraction(env, PDD_GPU_MEMORY_UTILIZATION,
                                             keys.DEFAULT_GPU_MEMORY_UTILIZATION),
            host_kv_cache_gib=_float(env, PDD_HOST_KV_CACHE_GIB, 0.0),
            kv_cache_dtype=_choice(env, PDD_KV_CACHE_DTYPE, KV_CACHE_DTYPES),
            speculative=_speculative(env, role),
        )


def _group(env: Mapping[str, str], tp: int) -> tuple[int, int, str]:
    """(group size, worker index, leader address) from LeaderWorkerSet's env; one pod without."""
    size = _int(env, LWS_GROUP_SIZE, 1, 1)
    per_pod = env.get(PDD_RANKS_PER_POD, "")
    if size == 1:
        if per_pod and _int(env, PDD_RANKS_PER_POD, None, 1) != tp:
            raise ConfigError(f"{PDD_RANKS_PER_POD}: {per_pod} ranks per pod need "
                              f"{LWS_GROUP_SIZE} = {PDD_TP_SIZE} / {PDD_RANKS_PER_POD} pods, "
                              f"but the instance is one pod ({LWS_GROUP_SIZE} unset or 1)")
        return 1, 0, ""
    if tp % size:
        raise ConfigError(f"{LWS_GROUP_SIZE}: {PDD_TP_SIZE} ({tp}) must be a multiple of the "
                          f"group size, got {size}")
    if per_pod and _int(env, PDD_RANKS_PER_POD, None, 1) != tp // size:
        raise ConfigError(f"{PDD_RANKS_PER_POD}: must be {PDD_TP_SIZE} / {LWS_GROUP_SIZE} = "
                          f"{tp // size}, got {per_pod}")
    index = _int(env, LWS_WORKER_INDEX, None, 0)
    if index >= size:
        raise ConfigError(f"{LWS_WORKER_INDEX}: must be < {LWS_GROUP_SIZE} ({size}), got {index}")
    leader = _required(env, LWS_LEADER_ADDRESS, "the group's leader pod, where its ranks meet")
    return size, index, leader


@dataclass(frozen=True)
class RouterSettings:
    port: int
    bind_host: str
    prefill: list[str]
    decode: list[str]
    prefill_service: str
    decode_service: str
    health_interval_s: float
    request_timeout_s: float
    model_name: str = "builtin"
    model_source: str = "builtin"
    max_model_len: int = 0  # 0: from the checkpoint
    max_body_bytes: int = 8 << 20
    max_concurrency: int = 1024
    upstream_protocol: str = "pdd"
    ready_wait_s: float = 5.0
    router_policy: str = DEFAULT_ROUTER_POLICY
    local_prefill_tokens: int = DEFAULT_LOCAL_PREFILL_TOKENS
    no_prefill: str = NO_PREFILL_MODES[0]
    block_size: int = 64  # the instances' (the prefix index keys whole blocks of prompts)
    workers: int = 1  # processes serving the port, each a whole router
    worker: int | None = None  # this process's index among them; None: not a worker
    workers_dir: str = ""  # a worker's: the folder its siblings share (metrics, warm marks)
    event_loop: str = "auto"
    api_keys: tuple[str, ...] = ()
    api_key_file: str = ""

    @property
    def aggregated(self) -> bool:
        """No prefill instance at all (`pdd serve --prefill-replicas 0`): every request is
        prefilled on its decode (serve/router/prefill_path.py)."""
        return not (self.prefill or self.prefill_service)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RouterSettings:
        env = os.environ if env is None else env
        settings = cls(
            port=_int(env, PDD_HTTP_PORT, DEFAULT_HTTP_PORT, 1),
            bind_host=env.get(PDD_BIND_HOST, "") or "0.0.0.0",
            prefill=parse_urls(env.get(PDD_PREFILL_URLS)),
            decode=parse_urls(env.get(PDD_DECODE_URLS)),
            prefill_service=env.get(PDD_PREFILL_SERVICE, ""),
            decode_service=env.get(PDD_DECODE_SERVICE, ""),
            health_interval_s=_float(env, PDD_ROUTER_HEALTH_INTERVAL_S, 2.0),
            request_timeout_s=_float(env, PDD_ROUTER_REQUEST_TIMEOUT_S, 120.0),
            model_name=env.get(PDD_MODEL_NAME, "") or "builtin",
            model_source=env.get(PDD_MODEL_SOURCE, "") or "builtin",
            max_model_len=_int(env, PDD_MAX_MODEL_LEN, 0, 0),
            max_body_bytes=_int(env, PDD_ROUTER_MAX_BODY_BYTES, 8 << 20, 1024),
            max_concurrency=_int(env, PDD_ROUTER_MAX_CONCURRENCY, 1024, 1),
            upstream_protocol=_choice(env, PDD_ROUTER_UPSTREAM_PROTOCOL, UPSTREAM_PROTOCOLS),
            ready_wait_s=_float(env, PDD_ROUTER_READY_WAIT_S, 5.0),
            router_policy=_choice(env, PDD_ROUTER_POLICY, ROUTER_POLICIES),
            local_prefill_tokens=_int(env, PDD_ROUTER_LOCAL_PREFILL_TOKENS,
                                      DEFAULT_LOCAL_PREFILL_TOKENS, 0),
            no_prefill=_choice(env, PDD_ROUTER_NO_PREFILL, NO_PREFILL_MODES),
            block_size=_int(env, PDD_BLOCK_SIZE, 64, 1),
            workers=_int(env, PDD_ROUTER_WORKERS, 1, 1),
            worker=_optional_int(env, PDD_ROUTER_WORKER, 0),
            workers_dir=env.get(PDD_ROUTER_WORKERS_DIR, ""),
            event_loop=_choice(env, PDD_EVENT_LOOP, EVENT_LOOPS),
            api_keys=tuple(k.strip() for k in env.get(PDD_API_KEY, "").split(",") if k.strip()),
            api_key_file=env.get(PDD_API_KEY_FILE, ""),
        )
        if settings.local_prefill_tokens > MAX_LOCAL_PREFILL_TOKENS:
            raise ConfigError(f"{PDD_ROUTER_LOCAL_PREFILL_TOKENS}: must be <= "
                              f"{MAX_LOCAL_PREFILL_TOKENS}, got {settings.local_prefill_tokens}")
        if settings.workers > MAX_ROUTER_WORKERS:
            raise ConfigError(f"{PDD_ROUTER_WORKERS}: must be <= {MAX_ROUTER_WORKERS}, got "
                              f"{settings.workers}")
        if not (settings.decode or settings.decode_service):
            raise ConfigError(f"{PDD_DECODE_URLS} or {PDD_DECODE_SERVICE}: one is required")
        return settings
