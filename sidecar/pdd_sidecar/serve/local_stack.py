"""`pdd serve`: prefill instances, decode instances and the router as local processes.

The processes are the ones pods run (`python -m pdd_sidecar serve` and `python -m pdd_sidecar
router`, configured by environment), so a completion goes through a real NIXL hand-off; only the
routing plan, the ports and the GPUs come from here instead of the operator. There are
``--prefill-replicas`` prefills and ``--decode-replicas`` decodes (xPyD, one of each by
default), each with its own ports and log, all behind the one router; every decode reads from
every prefill, as in a cluster. Each child runs in its own session, so stopping one with its
rank processes is one `killpg`, and a Ctrl-C typed at the terminal reaches `pdd serve` alone,
which then stops the children in order.

Nothing here imports torch or aiohttp: `pdd --help` and argument errors stay fast, and the
benchmark can drive stacks from a light process. The pure helpers (argument checks, plan, env,
GPU assignment) are separate from the process handling so they can be tested without starting
anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd_api import keys
from pdd_api.models import (
    DEFAULT_KV_CACHE_DTYPE,
    DEFAULT_LOCAL_PREFILL_TOKENS,
    DEFAULT_NO_PREFILL,
    KV_CACHE_DTYPES,
    NO_PREFILL_MODES,
    SpeculativeSpec,
)
from pdd_api.routing import plan_for_spec
from pdd_api.speculative import speculative_env
from pdd_api.validation import parse_spec, validate_spec
from pdd_sidecar import env as E
from pdd_sidecar.processes import die_with_parent, usable_cpus

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")
ROLE_FLAGS = {
    "spec.prefill.tensorParallelSize": "--prefill-tp",
    "spec.prefill.decodeContextParallelSize": "--prefill-dcp",
    "spec.decode.tensorParallelSize": "--decode-tp",
    "spec.decode.decodeContextParallelSize": "--decode-dcp",
    "spec.blockSize": "--block-size",
    "spec.model.dtype": "--dtype",
    "spec.router.localPrefillTokens": "--local-prefill-tokens",
}
# Flags that stand for a whole part of the spec: every problem under it names the flag.
PART_FLAGS = {"spec.decode.speculative": "--speculative"}
# Tokens per KV block when --block-size is not given: on a GPU the PDDeployment's default, the
# size the MLA decode kernels are tuned for; on a CPU smaller, so short test prompts span blocks.
DEFAULT_BLOCK_SIZES = {"cuda": 64, "cpu": 16}
# Where a prefill and a decode share a GPU, the prefill's part of --gpu-memory-utilization.
DEFAULT_PREFILL_MEMORY_SHARE = 0.5
# Below Linux's ephemeral range, where gloo, UCX and client sockets take ports between our check
# and the child's bind.
PORT_RANGE = (10000, 32000)


class StackError(RuntimeError):
    """A process of the stack failed to start or died; the message says which and why."""


@dataclass(frozen=True)
class StackConfig:
    prefill_tp: int = 1
    prefill_dcp: int = 1
    decode_tp: int = 1
    decode_dcp: int = 1
    prefill_replicas: int = 1
    decode_replicas: int = 1
    model: str = "builtin"
    device: str = "cpu"
    port: int = 8000  # the router's; 0 picks a free one
    host: str = "127.0.0.1"
    block_size: int | None = None  # None: the device's (DEFAULT_BLOCK_SIZES)
    num_blocks: int | None = None  # KV blocks per rank, both roles; None: the instance default
    prefill_num_blocks: int | None = None
    decode_num_blocks: int | None = None
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on GPUs
    drain_s: float = 5.0
    max_num_seqs: int | None = None  # engine admission bound; None: the instance default
    max_waiting: int | None = None  # queue bound (429 beyond); None: the instance default
    max_step_tokens: int | None = None  # prefill tokens per step; None: by device
    chunk_tokens: int | None = None  # longest prompt chunk; None: by device
    long_chunk_tokens: int | None = None  # a longer prompt's piece beside others; None: by device
    prefix_cache: bool = True  # prefill and decode reuse the KV of prefixes they hold
    host_kv_cache_gib: float = 0.0  # host memory per rank under the prefix cache; 0: off
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE  # both roles' (they must agree)
    # spec.decode.speculative as given (JSON): judged by the spec's rules; None: no drafter
    speculative: Mapping[str, Any] | None = None
    router_workers: int = 1  # router processes sharing its port
    # Prompts whose uncached part is at most this many tokens are prefilled on their decode
    # (0: always through a prefill); with no prefill ready, fallback or refuse (503).
    local_prefill_tokens: int = DEFAULT_LOCAL_PREFILL_TOKENS
    no_prefill: str = DEFAULT_NO_PREFILL
    log_level: str = "INFO"
    # Share of each GPU's memory the stack's instances fill, and the prefill's part of it where
    # a prefill and a decode share a GPU (memory_utilizations)
    gpu_memory_utilization: float = keys.DEFAULT_GPU_MEMORY_UTILIZATION
    prefill_memory_share: float = DEFAULT_PREFILL_MEMORY_SHARE
    extra_env: Mapping[str, str] = field(default_factory=dict)
    # Per component (prefill, decode, router), after extra_env: what the operator renders for
    # one role only (a PDDeployment's OTEL_SERVICE_NAME, say).
    role_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    api_keys: tuple[str, ...] = ()  # the router's (serve/openai/api_keys.py); none: open
    api_key_file: str = ""

    @property
    def resolved_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.device == "cuda" else "float32")

    @property
    def resolved_block_size(self) -> int:
        return self.block_size or DEFAULT_BLOCK_SIZES.get(self.device, DEFAULT_BLOCK_SIZES["cpu"])

    def layout(self) -> str:
        def times(n: int) -> str:
            return f"{n} x " if n != 1 else ""

        if not self.prefill_replicas:
            return (f"aggregated: {times(self.decode_replicas)}decode tp{self.decode_tp}/"
                    f"dcp{self.decode_dcp} prefilling its own requests")

        return (f"{times(self.prefill_replicas)}prefill tp{self.prefill_tp}/dcp{self.prefill_dcp}"
                f", {times(self.decode_replicas)}decode tp{self.decode_tp}/dcp{self.decode_dcp}")

    def replicas(self, role: str) -> int:
        return self.prefill_replicas if role == "prefill" else self.decode_replicas

    def names(self, role: str) -> list[str]:
        """The instances' names (and log files): ``prefill``, or ``prefill-0``, ``prefill-1``
        ... when there are several."""
        n = self.replicas(role)
        return [role] if n == 1 else [f"{role}-{i}" for i in range(n)]

    def blocks(self, role: str) -> int | None:
        own = self.prefill_num_blocks if role == "prefill" else self.decode_num_blocks
        return own if own is not None else self.num_blocks


# `pdd serve --router-workers auto`: one router process per this many usable CPUs, at most
# AUTO_ROUTER_WORKERS_MAX. A lone router's Python is what a burst waits for: on a 16-CPU host
# with one H200, 64 prompts of 32 tokens had a TTFT 1.37-1.80x their engine bound through one
# router and 0.99-1.27x through four, the client's share 5.6-11.6 ms against 1.0-1.1
# (docs/serving.md, runs 39-40). The rest of the host is the
# instances': the decode keeps a core busy under load, the prefill up to one, each with its
# HTTP thread. Past four, no level gained (run 14: throughput is the engine's there).
CPUS_PER_ROUTER_WORKER = 4
AUTO_ROUTER_WORKERS_MAX = 4


def auto_router_workers(cpus: int) -> int:
    return max(1, min(AUTO_ROUTER_WORKERS_MAX, cpus // CPUS_PER_ROUTER_WORKER))


def speculative_arg(text: str) -> Any:
    """--speculative's JSON; its fields are judged with the spec's (problems())."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"must be JSON such as '{{\"method\": \"ngram\", \"tokens\": 2}}', got "
            f"{text!r}") from None


def router_workers_arg(text: str) -> int:
    """``--router-workers``: a number, or ``auto`` (by the CPUs this process may use)."""
    if text == "auto":
        return auto_router_workers(usable_cpus())
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be auto or a number of processes, got {text!r}") from None


# Replicas per role `pdd serve` starts at most: each is a process (and tp rank processes) on
# this host.
MAX_REPLICAS = 16


@dataclass(frozen=True)
class InstancePorts:
    http: int
    side: int  # rank r listens on side + r
    dist: int


@dataclass(frozen=True)
class Ports:
    router: int
    prefill: tuple[InstancePorts, ...]  # one per replica
    decode: tuple[InstancePorts, ...]

    def of(self, role: str) -> tuple[InstancePorts, ...]:
        return self.prefill if role == "prefill" else self.decode


# ------------------------------------------------------------------ pure helpers


def deployment_spec(cfg: StackConfig) -> dict[str, Any]:
    """The PDDeployment spec this stack stands for, so `pdd validate` rules judge the layout."""
    model: dict[str, Any] = {"name": model_name(cfg.model), "dtype": cfg.resolved_dtype}
    if cfg.model != "builtin":
        model["source"] = cfg.model
    spec: dict[str, Any] = {
        "model": model,
        "image": "local",
        "blockSize": cfg.resolved_block_size,
        "prefill": {"tensorParallelSize": cfg.prefill_tp,
                    "decodeContextParallelSize": cfg.prefill_dcp},
        "decode": {"tensorParallelSize": cfg.decode_tp,
                   "decodeContextParallelSize": cfg.decode_dcp,
                   **({"speculative": cfg.speculative} if cfg.speculative is not None else {})},
        "router": {"localPrefillTokens": cfg.local_prefill_tokens, "noPrefill": cfg.no_prefill},
    }
    if cfg.kv_cache_dtype != DEFAULT_KV_CACHE_DTYPE:
        for role in ("prefill", "decode"):
            spec[role]["kvCacheDtype"] = cfg.kv_cache_dtype
    return spec


def model_name(model: str) -> str:
    return "builtin" if model == "builtin" else Path(model).name or model


def _flag_for(problem: str) -> str:
    """`spec.decode.decodeContextParallelSize: must ...` -> `--decode-dcp: spec.decode...`."""
    path = problem.split(":", 1)[0]
    flag = ROLE_FLAGS.get(path) or next(
        (f for part, f in PART_FLAGS.items() if path == part or path.startswith(f"{part}.")),
        None)
    return f"{flag}: {problem}" if flag else problem


def problems(cfg: StackConfig, attention_heads: int | None = None,
             gpus: Sequence[str] | None = None) -> list[str]:
    """Every reason the stack cannot run, each naming its flag; empty when it can.

    The P/D fit goes through pdd_api's rules so the messages are the ones `pdd validate` prints.
    """
    out: list[str] = []
    if cfg.device not in DEVICES:
        out.append(f"--device: must be one of {', '.join(DEVICES)}, got {cfg.device!r}")
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        out.append(f"--dtype: must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    if not 0 <= cfg.port <= 65535:
        out.append(f"--port: must be between 0 and 65535, got {cfg.port}")
    for flag, value in (("--num-blocks", cfg.num_blocks),
                        ("--prefill-num-blocks", cfg.prefill_num_blocks),
                        ("--decode-num-blocks", cfg.decode_num_blocks)):
        if value is not None and value < 1:
            out.append(f"{flag}: must be >= 1, got {value}")
    for flag, value in (("--max-num-seqs", cfg.max_num_seqs),
                        ("--max-waiting", cfg.max_waiting),
                        ("--max-step-tokens", cfg.max_step_tokens),
                        ("--chunk-tokens", cfg.chunk_tokens),
                        ("--long-chunk-tokens", cfg.long_chunk_tokens)):
        least = 0 if flag == "--max-waiting" else 1
        if value is not None and value < least:
            out.append(f"{flag}: must be >= {least}, got {value}")
    if cfg.drain_s < 0:
        out.append(f"--drain-s: must be >= 0, got {cfg.drain_s}")
    if not 0 < cfg.gpu_memory_utilization <= 1:  # nan fails too
        out.append(f"--gpu-memory-utilization: must be in (0, 1], got "
                   f"{cfg.gpu_memory_utilization}")
    if not 0 < cfg.prefill_memory_share < 1:
        out.append(f"--prefill-memory-share: must be in (0, 1) (each role keeps some of a "
                   f"shared GPU), got {cfg.prefill_memory_share}")
    if not 0 <= cfg.host_kv_cache_gib < float("inf"):
        out.append(f"--host-kv-cache-gib: must be a number >= 0, got {cfg.host_kv_cache_gib}")
    if cfg.kv_cache_dtype not in KV_CACHE_DTYPES:
        out.append(f"--kv-cache-dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                   f"{cfg.kv_cache_dtype!r}")
    # 0 prefills: aggregated, each decode prefills its requests itself.
    for flag, value, least in (("--prefill-replicas", cfg.prefill_replicas, 0),
                               ("--decode-replicas", cfg.decode_replicas, 1)):
        if not least <= value <= MAX_REPLICAS:
            out.append(f"{flag}: must be between {least} and {MAX_REPLICAS}, got {value}")
    if not 1 <= cfg.router_workers <= E.MAX_ROUTER_WORKERS:
        out.append(f"--router-workers: must be between 1 and {E.MAX_ROUTER_WORKERS}, got "
                   f"{cfg.router_workers}")
    for key in cfg.api_keys:
        if not key or key != key.strip() or "," in key or any(c.isspace() for c in key):
            out.append("--api-key: must be non-empty, without spaces or commas, got "
                       f"{len(key)} characters")
    if out:
        return out
    out += [_flag_for(p) for p in validate_spec(deployment_spec(cfg))]
    if out:
        return out
    if attention_heads is not None:
        for flag, tp in (("--prefill-tp", cfg.prefill_tp), ("--decode-tp", cfg.decode_tp)):
            if attention_heads % tp:
                out.append(f"{flag}: must divide the model's num_attention_heads "
                           f"({attention_heads}), got {tp}")
    if gpus is not None and cfg.device == "cuda":
        if not gpus:
            out.append("--device cuda: no GPU visible (CUDA_VISIBLE_DEVICES is empty, or "
                       "nvidia-smi lists none)")
        for flag, tp in (("--prefill-tp", cfg.prefill_tp), ("--decode-tp", cfg.decode_tp)):
            if gpus and tp > len(gpus):
                out.append(f"{flag}: {tp} ranks need {tp} distinct GPUs, {len(gpus)} visible")
    return out


def routing_plan_json(cfg: StackConfig) -> str:
    """What the operator would put in the routing ConfigMap for this layout."""
    return plan_for_spec(parse_spec(deployment_spec(cfg))).to_json()


def instance_gpus(tps: Sequence[int], gpus: Sequence[str]) -> list[list[str]]:
    """CUDA_VISIBLE_DEVICES entries of instances of these tps, in order: each takes the next
    GPUs, wrapping around.

    Ranks of one instance always get distinct GPUs (so tp <= len(gpus)); instances may share
    some, which lets 2 GPUs host P TP1 + D TP2, and one GPU any number of TP1 instances.
    """
    n = len(gpus)
    if n == 0:
        raise ValueError("no GPUs to assign")
    if max(tps, default=1) > n:
        raise ValueError(f"an instance of tp {max(tps)} needs that many distinct GPUs, "
                         f"{n} visible")
    out, first = [], 0
    for tp in tps:
        out.append([gpus[(first + i) % n] for i in range(tp)])
        first += tp
    return out


def gpu_lists(prefill_tp: int, decode_tp: int,
              gpus: Sequence[str]) -> tuple[list[str], list[str]]:
    """CUDA_VISIBLE_DEVICES entries of one prefill and one decode: prefill ranks first."""
    prefill, decode = instance_gpus([prefill_tp, decode_tp], gpus)
    return prefill, decode


def memory_utilizations(utilization: float, prefill_share: float,
                        instances: Sequence[tuple[str, Sequence[str]]]) -> list[float]:
    """Each instance's PDD_GPU_MEMORY_UTILIZATION, from ``(role, its GPUs)`` per instance.

    On a GPU that prefill and decode instances share, the prefills split ``utilization x
    prefill_share`` evenly and the decodes ``utilization x (1 - prefill_share)``; on a GPU of
    one role, its instances split ``utilization`` (one alone gets all of it). An instance on
    several GPUs (TP ranks) takes its smallest part: one setting holds for all its ranks.
    """
    count: dict[str, dict[str, int]] = {}
    for role, gpus in instances:
        for g in set(gpus):
            count.setdefault(g, {"prefill": 0, "decode": 0})[role] += 1
    out = []
    for role, gpus in instances:
        parts = []
        for g in gpus:
            on = count[g]
            part = 1.0
            if on["prefill"] and on["decode"]:
                part = prefill_share if role == "prefill" else 1.0 - prefill_share
            parts.append(utilization * part / on[role])
        out.append(min(parts) if parts else utilization)
    return out


def stack_gpus(cfg: StackConfig, gpus: Sequence[str]) -> tuple[list[list[str]], list[list[str]]]:
    """Per replica of each role: the prefills' ranks first, then the decodes', wrapping around."""
    tps = [cfg.prefill_tp] * cfg.prefill_replicas + [cfg.decode_tp] * cfg.decode_replicas
    lists = instance_gpus(tps, gpus)
    return lists[:cfg.prefill_replicas], lists[cfg.prefill_replicas:]


def connect_host(host: str) -> str:
    """The address clients (and the decode's side-channel reads) use for a bind address."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def stack_memory(cfg: StackConfig, prefill_gpus: Sequence[Sequence[str]],
                 decode_gpus: Sequence[Sequence[str]]) -> tuple[list[float], list[float]]:
    """Each replica's GPU memory utilization, per role: instances sharing a GPU split it
    (memory_utilizations)."""
    shares = memory_utilizations(
        cfg.gpu_memory_utilization, cfg.prefill_memory_share,
        [("prefill", g) for g in prefill_gpus] + [("decode", g) for g in decode_gpus])
    return shares[:len(prefill_gpus)], shares[len(prefill_gpus):]


def urls(cfg: StackConfig, ports: Ports, role: str) -> list[str]:
    """Where each replica of a role answers HTTP."""
    host = connect_host(cfg.host)
    return [f"http://{host}:{p.http}" for p in ports.of(role)]


def instance_env(cfg: StackConfig, role: str, ports: Ports, routing_file: str,
                 gpus: Sequence[str] | None = None, grant_key_file: str = "",
                 utilization: float | None = None, replica: int = 0) -> dict[str, str]:
    """The PDD_* environment of one instance (replica ``replica`` of its role): what the
    operator writes into a pod. ``utilization``: its share of its GPUs (memory_utilizations);
    cuda only."""
    tp, dcp = ((cfg.prefill_tp, cfg.prefill_dcp) if role == "prefill"
               else (cfg.decode_tp, cfg.decode_dcp))
    own = ports.of(role)[replica]
    http, side, dist = own.http, own.side, own.dist
    env = {
        E.PDD_ROLE: role,
        E.PDD_REPLICA: str(replica),
        E.PDD_TP_SIZE: str(tp),
        E.PDD_DCP_SIZE: str(dcp),
        E.PDD_BLOCK_SIZE: str(cfg.resolved_block_size),
        E.PDD_ROUTING_FILE: routing_file,
        E.PDD_SIDE_CHANNEL_PORT: str(side),
        E.POD_IP: connect_host(cfg.host),
        E.PDD_HTTP_PORT: str(http),
        E.PDD_BIND_HOST: cfg.host,
        E.PDD_DIST_PORT: str(dist),
        E.PDD_MODEL_NAME: model_name(cfg.model),
        E.PDD_MODEL_SOURCE: cfg.model,
        E.PDD_DTYPE: cfg.resolved_dtype,
        E.PDD_DEVICE: cfg.device,
        E.PDD_DRAIN_S: str(cfg.drain_s),
        E.PDD_LOG_LEVEL: cfg.log_level,
        keys.ENV_GRANT_KEY_FILE: grant_key_file,
    }
    for key, value in ((E.PDD_NUM_BLOCKS, cfg.blocks(role)),
                       (E.PDD_MAX_NUM_SEQS, cfg.max_num_seqs),
                       (E.PDD_MAX_WAITING, cfg.max_waiting),
                       (E.PDD_MAX_STEP_TOKENS, cfg.max_step_tokens),
                       (E.PDD_CHUNK_TOKENS, cfg.chunk_tokens),
                       (E.PDD_LONG_CHUNK_TOKENS, cfg.long_chunk_tokens)):
        if value is not None:
            env[key] = str(value)
    if not cfg.prefix_cache:
        env[E.PDD_PREFIX_CACHE] = "0"
    if cfg.host_kv_cache_gib:
        env[E.PDD_HOST_KV_CACHE_GIB] = str(cfg.host_kv_cache_gib)
    if cfg.kv_cache_dtype != DEFAULT_KV_CACHE_DTYPE:
        env[E.PDD_KV_CACHE_DTYPE] = cfg.kv_cache_dtype
    if role == "decode":
        env[E.PDD_PREFILL_URLS] = ",".join(urls(cfg, ports, "prefill"))
    if cfg.speculative is not None:  # problems() has judged it by the spec's rules
        env.update(speculative_env(SpeculativeSpec.model_validate(cfg.speculative), role))
    if cfg.device == "cuda" and gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    if cfg.device == "cuda":
        env[E.PDD_GPU_MEMORY_UTILIZATION] = str(
            cfg.gpu_memory_utilization if utilization is None else utilization)
    env.update(cfg.extra_env)
    env.update(cfg.role_env.get(role, {}))
    return env


def router_env(cfg: StackConfig, ports: Ports, grant_key_file: str = "") -> dict[str, str]:
    """What the operator gives the router Deployment, with local URLs."""
    env = {
        E.PDD_HTTP_PORT: str(ports.router),
        E.PDD_BIND_HOST: cfg.host,
        E.PDD_PREFILL_URLS: ",".join(urls(cfg, ports, "prefill")),
        E.PDD_DECODE_URLS: ",".join(urls(cfg, ports, "decode")),
        E.PDD_ROUTER_HEALTH_INTERVAL_S: "0.5",
        E.PDD_MODEL_NAME: model_name(cfg.model),
        E.PDD_MODEL_SOURCE: cfg.model,
        E.PDD_BLOCK_SIZE: str(cfg.resolved_block_size),
        E.PDD_LOG_LEVEL: cfg.log_level,
        E.PDD_ROUTER_WORKERS: str(cfg.router_workers),
        E.PDD_ROUTER_LOCAL_PREFILL_TOKENS: str(cfg.local_prefill_tokens),
        E.PDD_ROUTER_NO_PREFILL: cfg.no_prefill,
        keys.ENV_GRANT_KEY_FILE: grant_key_file,
    }
    if cfg.api_keys:
        env[keys.ENV_API_KEY] = ",".join(cfg.api_keys)
    if cfg.api_key_file:
        env[keys.ENV_API_KEY_FILE] = cfg.api_key_file
    env.update(cfg.extra_env)
    env.update(cfg.role_env.get(keys.COMPONENT_ROUTER, {}))
    return env


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_ports(cfg: StackConfig, is_free: Callable[[int], bool] = port_free,
               rng: random.Random | None = None) -> Ports:
    """Free ports for everything but an explicit router port: side channels need tp
    consecutive ones each."""
    rng = rng or random.Random()
    taken: set[int] = set()
    if cfg.port:
        taken.add(cfg.port)

    def run(n: int) -> int:
        for _ in range(10000):
            base = rng.randint(PORT_RANGE[0], PORT_RANGE[1] - n)
            span = range(base, base + n)
            if not taken.intersection(span) and all(is_free(p) for p in span):
                taken.update(span)
                return base
        raise StackError(f"no {n} consecutive free ports in {PORT_RANGE[0]}..{PORT_RANGE[1]}")

    router = cfg.port or run(1)

    def instances(n: int, tp: int) -> tuple[InstancePorts, ...]:
        return tuple(InstancePorts(http=run(1), side=run(tp), dist=run(1)) for _ in range(n))

    return Ports(router=router, prefill=instances(cfg.prefill_replicas, cfg.prefill_tp),
                 decode=instances(cfg.decode_replicas, cfg.decode_tp))


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """GPU ids to hand out: CUDA_VISIBLE_DEVICES when set, else what nvidia-smi lists."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def attention_heads(model: str) -> int:
    """The model's head count (tp must divide it); ValueError naming the model when unreadable."""
    from pdd_sidecar.model.config import load_config

    try:
        return load_config(model).num_attention_heads
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"cannot read the model's config.json: {exc}") from None


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc.strerror})"
    return "\n".join(text.splitlines()[-lines:])


# ------------------------------------------------------------------ processes


def _http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def _http_json(url: str, timeout: float = 2.0) -> Any:
    """The JSON body of a 200 answer; None for anything else."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read()) if resp.status == 200 else None
    except (OSError, ValueError):
        return None


def router_sees(body: Any, prefills: Sequence[str], decodes: Sequence[str]) -> bool:
    """A router's /readyz body says ready with every one of these instances ready."""
    if not isinstance(body, dict) or body.get("ready") is not True:
        return False
    return all(isinstance(body.get(role), dict) and body[role].get(u) is True
               for role, want in (("prefill", prefills), ("decode", decodes)) for u in want)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    url: str
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def describe_exit(self) -> str:
        code = self.exit_code()
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        return (f"{self.name} {how}; last lines of {self.log_path}:\n"
                f"{log_tail(self.log_path)}")


class LocalStack:
    """Prefill instances, decode instances and a router; `with` stops them all."""

    def __init__(self, cfg: StackConfig, log_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        self.own_log_dir = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pdd-serve-"))
        self.run_dir: Path | None = None  # routing plan and grant key, removed on stop
        self.children: list[Child] = []
        self.ports: Ports | None = None
        self._stopped = False

    # public ---------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self.ports is not None
        return f"http://{connect_host(self.cfg.host)}:{self.ports.router}"

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def role_children(self, role: str) -> list[Child]:
        names = self.cfg.names(role)
        return [c for c in self.children if c.name in names]

    @property
    def prefill_urls(self) -> list[str]:
        return [c.url for c in self.role_children("prefill")]

    @property
    def decode_urls(self) -> list[str]:
        return [c.url for c in self.role_children("decode")]

    @property
    def prefill_url(self) -> str:
        """The first prefill's."""
        return self.prefill_urls[0]

    @property
    def decode_url(self) -> str:
        return self.decode_urls[0]

    def start(self, timeout_s: float = 600.0,
              should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Start every process and wait until all answer /readyz 200.

        False when `should_stop` turned true first (the caller then stops); StackError when a
        child died or the timeout passed (after stopping the rest).
        """
        cfg = self.cfg
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = Path(tempfile.mkdtemp(prefix="pdd-serve-run-"))
        routing_file = self.run_dir / "routing.json"
        routing_file.write_text(routing_plan_json(cfg))
        # The deployment's transfer-grant key (a Secret in a cluster), shared by the stack.
        key_file = self.run_dir / "grant.key"
        key_file.touch(mode=0o600)
        key_file.write_text(secrets.token_hex(32))
        self.ports = ports = pick_ports(cfg)
        gpus: dict[str, list[list[str]] | list[None]] = {
            "prefill": [None] * cfg.prefill_replicas, "decode": [None] * cfg.decode_replicas}
        utils: dict[str, list[float | None]] = {role: [None] * len(gpus[role]) for role in gpus}
        if cfg.device == "cuda":
            try:
                p_gpus, d_gpus = stack_gpus(cfg, visible_gpus(os.environ))
            except ValueError as exc:
                raise StackError(f"--device cuda: {exc}") from None
            gpus["prefill"], gpus["decode"] = p_gpus, d_gpus
            p_util, d_util = stack_memory(cfg, p_gpus, d_gpus)
            utils["prefill"], utils["decode"] = list(p_util), list(d_util)
        serve_argv = [sys.executable, "-m", "pdd_sidecar", "serve"]
        self.children = [
            Child(name, serve_argv,
                  instance_env(cfg, role, ports, str(routing_file), gpus[role][i],
                               str(key_file), utils[role][i], replica=i),
                  urls(cfg, ports, role)[i], self.log_dir / f"{name}.log")
            for role in ("prefill", "decode") for i, name in enumerate(cfg.names(role))
        ]
        self.children.append(
            Child("router", [sys.executable, "-m", "pdd_sidecar", "router"],
                  router_env(cfg, ports, str(key_file)), self.url, self.log_dir / "router.log"))
        for c in self.children:
            self._spawn(c)
        deadline = time.monotonic() + timeout_s
        pending = list(self.children)
        while pending:
            if should_stop():
                return False
            self.raise_if_dead()
            pending = [c for c in pending if not self._ready(c)]
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                self.stop()
                raise StackError(f"not ready after {timeout_s:.0f}s: {names} (logs in "
                                 f"{self.log_dir})")
            if pending:
                time.sleep(0.3)
        return True

    def _ready(self, c: Child) -> bool:
        """An instance answers /readyz 200; the router too, having seen every instance ready
        (its probes run on their own clock), so the first requests are routed over all."""
        if c.name != "router":
            return _http_status(f"{c.url}/readyz") == 200
        return router_sees(_http_json(f"{c.url}/readyz"), self.prefill_urls, self.decode_urls)

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.exit_code() is not None]

    def raise_if_dead(self) -> None:
        dead = self.dead()
        if dead:
            message = "\n".join(c.describe_exit() for c in dead)
            self.stop()
            raise StackError(message)

    def stop(self, grace_s: float | None = None) -> None:
        """Router first, then decode, then prefill: SIGTERM to each leader (instances drain
        and their rank processes follow), SIGKILL to whole groups after the grace period."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.cfg.drain_s + 5.0 if grace_s is None else grace_s
        started = [c for c in self.children if c.process is not None]
        for c in reversed(started):
            if c.exit_code() is None:
                try:
                    os.kill(c.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for c in started:
            assert c.process is not None
            try:
                c.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in started:
            try:
                os.killpg(c.pid, signal.SIGKILL)  # rank processes left behind, if any
            except ProcessLookupError:
                pass
            assert c.process is not None
            c.process.wait()
        deadline = time.monotonic() + 10.0
        while any(group_alive(c.pid) for c in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def cleanup(self) -> None:
        """Remove the log folder too when it was a temporary one of ours (benchmark runs)."""
        if self.own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # private --------------------------------------------------------------

    def _spawn(self, c: Child) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **c.env}
        with c.log_path.open("ab") as log:
            c.process = subprocess.Popen(
                c.argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent,
            )


# ------------------------------------------------------------------ CLI


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdd serve",
        description="Run prefill instances, decode instances (one of each by default) and the "
        "router as local processes (no cluster) until Ctrl-C or SIGTERM. Any other PDD_* "
        "setting of the instances can be given in the environment.",
    )
    p.add_argument("--prefill-tp", type=int, default=1, help="prefill TP ranks (default 1)")
    p.add_argument("--prefill-dcp", type=int, default=1, help="1 or --prefill-tp (default 1)")
    p.add_argument("--decode-tp", type=int, default=1, help="decode TP ranks (default 1)")
    p.add_argument("--decode-dcp", type=int, default=1, help="1 or --decode-tp (default 1)")
    p.add_argument("--prefill-replicas", type=int, default=1,
                   help="prefill instances behind the router, each with its own ports, log and "
                   "(on cuda) the next GPUs in turn; 0: aggregated, each decode prefills its "
                   "requests itself and has its GPUs' memory to itself (default 1)")
    p.add_argument("--decode-replicas", type=int, default=1,
                   help="decode instances behind the router, each reading from every prefill "
                   "(default 1)")
    p.add_argument("--model", default="builtin",
                   help="Hugging Face DeepSeek-V2/V3 checkpoint directory, or 'builtin'")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="default cpu")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="default float32 on cpu, bfloat16 on cuda")
    p.add_argument("--port", type=int, default=8000, help="router port, 0 for any (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="address every process listens on")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default 64 on cuda, the PDDeployment's default and "
                   "what the MLA decode kernels want; 16 on cpu)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per rank on both roles (default: on cuda as many as "
                   "--gpu-memory-utilization leaves room for after the weights and the warm-up, "
                   "1024 on cpu); overrides the sizing from memory")
    p.add_argument("--prefill-num-blocks", type=int, default=None,
                   help="KV blocks per prefill rank (overrides --num-blocks)")
    p.add_argument("--decode-num-blocks", type=int, default=None,
                   help="KV blocks per decode rank (overrides --num-blocks)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=keys.DEFAULT_GPU_MEMORY_UTILIZATION, metavar="F",
                   help="share of each GPU's memory the instances fill: weights, activations, "
                   "CUDA graphs and the KV pool, which gets what is left (default "
                   f"{keys.DEFAULT_GPU_MEMORY_UTILIZATION}; in (0, 1]; no effect on cpu). An "
                   "instance alone on its GPUs gets F; where prefill and decode instances share "
                   "a GPU, see --prefill-memory-share (docs/kv-memory.md)")
    p.add_argument("--prefill-memory-share", type=float, default=DEFAULT_PREFILL_MEMORY_SHARE,
                   metavar="S",
                   help="on a GPU that prefill and decode instances share, the prefills split "
                   "F x S and the decodes F x (1 - S) (default "
                   f"{DEFAULT_PREFILL_MEMORY_SHARE}; in (0, 1))")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences an instance admits at once (default: the instance's)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="requests an instance queues beyond that; more get 429 "
                   "(default: the instance's)")
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="prompt tokens a prefill step runs at most (default 8192 on cuda, 2048 "
                   "on cpu; larger steps run long prompts faster and hold other prompts longer)")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="longest piece of one prompt in a step, whole blocks (default 8192 on "
                   "cuda, 512 on cpu)")
    p.add_argument("--long-chunk-tokens", type=int, default=None,
                   help="while a prompt that fits one chunk shares its steps, a prompt longer "
                   "than a chunk runs in pieces of this many, so that one's stay short (default "
                   "1024 on cuda, 512 on cpu)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="compute every prompt from scratch (default: the prefill reuses the KV "
                   "of prompt prefixes it computed before)")
    p.add_argument("--host-kv-cache-gib", type=float, default=0.0,
                   help="GiB of host memory per rank, on both roles, that keep the KV the "
                   "prefix cache evicts, loaded back instead of computed again (pinned on "
                   "cuda; default 0: off; docs/host-kv-tier.md)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=DEFAULT_KV_CACHE_DTYPE,
                   help="what both roles' KV cache keeps a token's latent in: auto, the "
                   "model's dtype, or fp8, FlashMLA's layout (656 bytes a token of a layer "
                   "against 1,152 in bf16; docs/fp8-kv.md)")
    p.add_argument("--speculative", type=speculative_arg, default=None, metavar="JSON",
                   help="the decode's drafter, as spec.decode.speculative: "
                   "'{\"method\": \"ngram\", \"tokens\": 2}' or '{\"method\": \"mtp\"}' "
                   "(method mtp | ngram, tokens 1..8, default 1; ngram: {\"maxN\": 4, "
                   "\"minN\": 1}; docs/operator.md, Speculative decoding). Default: none")
    p.add_argument("--router-workers", type=router_workers_arg, default="auto",
                   help="router processes sharing its port, each a whole router; more spread "
                   "its per-request and per-token work over more cores (default auto: one per "
                   f"{CPUS_PER_ROUTER_WORKER} CPUs this process may use, 1 to "
                   f"{AUTO_ROUTER_WORKERS_MAX})")
    p.add_argument("--local-prefill-tokens", type=int,
                   default=DEFAULT_LOCAL_PREFILL_TOKENS, metavar="N",
                   help="prefill a prompt on its decode, in the running batch, when the part "
                   "of it that decode does not cache is at most N tokens; 0: always through a "
                   "prefill (default %(default)s, a conservative guess: measure the crossing "
                   "point on your GPU, docs/serving.md)")
    p.add_argument("--no-prefill", choices=NO_PREFILL_MODES,
                   default=DEFAULT_NO_PREFILL,
                   help="with no prefill ready: serve requests on a decode (fallback, counted "
                   "as such) or answer 503 (refuse) (default %(default)s)")
    p.add_argument("--api-key", dest="api_keys", action="append", default=[], metavar="KEY",
                   help="a key clients must send as `Authorization: Bearer KEY` (repeat for "
                   "several; default: none, the router is open)")
    p.add_argument("--api-key-file", default="", metavar="PATH",
                   help="a file (or folder of files) of keys, one per line, read again when "
                   "it changes")
    p.add_argument("--log-dir", default=None,
                   help="folder for the logs (default: a new temp folder)")
    p.add_argument("--log-level", default="INFO", help="log level of the processes")
    p.add_argument("--drain-s", type=float, default=5.0,
                   help="on stop, how long instances may finish running requests (default 5)")
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds to wait for every process to be ready (default 600)")
    return p


def config_from_args(a: argparse.Namespace) -> StackConfig:
    return StackConfig(
        prefill_tp=a.prefill_tp, prefill_dcp=a.prefill_dcp, decode_tp=a.decode_tp,
        decode_dcp=a.decode_dcp, prefill_replicas=a.prefill_replicas,
        decode_replicas=a.decode_replicas, model=a.model, device=a.device, port=a.port, host=a.host,
        block_size=a.block_size, num_blocks=a.num_blocks,
        prefill_num_blocks=a.prefill_num_blocks, decode_num_blocks=a.decode_num_blocks,
        dtype=a.dtype, drain_s=a.drain_s, max_num_seqs=a.max_num_seqs,
        max_waiting=a.max_waiting, max_step_tokens=a.max_step_tokens,
        chunk_tokens=a.chunk_tokens, long_chunk_tokens=a.long_chunk_tokens,
        prefix_cache=a.prefix_cache, router_workers=a.router_workers,
        local_prefill_tokens=a.local_prefill_tokens, no_prefill=a.no_prefill,
        host_kv_cache_gib=a.host_kv_cache_gib,
        kv_cache_dtype=a.kv_cache_dtype, speculative=a.speculative,
        log_level=a.log_level.upper(),
        api_keys=tuple(a.api_keys), api_key_file=a.api_key_file,
        gpu_memory_utilization=a.gpu_memory_utilization,
        prefill_memory_share=a.prefill_memory_share,
    )


def check_config(cfg: StackConfig, env: Mapping[str, str] | None = None) -> list[str]:
    """Everything `pdd serve` refuses before starting a process (model, GPUs and port too)."""
    found = problems(cfg)
    if found:
        return found
    if cfg.model != "builtin" and not Path(cfg.model).is_dir():
        return [f"--model: {cfg.model!r} is neither 'builtin' nor a directory"]
    if cfg.api_key_file:
        from pdd_sidecar.serve.openai.api_keys import KeyFileError, read_key_file

        try:
            read_key_file(cfg.api_key_file)
        except KeyFileError as exc:
            return [f"--api-key-file: {str(exc).partition(': ')[2]}"]
    try:
        heads = attention_heads(cfg.model)
    except ValueError as exc:
        return [f"--model {cfg.model}: {exc}"]
    gpus = visible_gpus(os.environ if env is None else env) if cfg.device == "cuda" else None
    found = problems(cfg, heads, gpus)
    if not found and cfg.port and not port_free(cfg.port, connect_host(cfg.host)):
        found.append(f"--port: {cfg.port} is already in use on {connect_host(cfg.host)}")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 after a requested stop, 1 when a process failed, 2 on bad arguments."""
    ap = parser()
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = config_from_args(a)
    found = check_config(cfg)
    if found:
        ap.print_usage(sys.stderr)
        for f in found:
            print(f"pdd serve: {f}", file=sys.stderr)
        return 2
    if cfg.model != "builtin":
        cfg = dataclasses.replace(cfg, model=str(Path(cfg.model).resolve()))

    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, frame: object) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    stack = LocalStack(cfg, a.log_dir)
    memory = (f", GPU memory {cfg.gpu_memory_utilization:g} (prefill share "
              f"{cfg.prefill_memory_share:g} of a shared GPU)" if cfg.device == "cuda" else "")
    print(f"pdd serve: starting {cfg.layout()} on {cfg.device}, KV blocks of "
          f"{cfg.resolved_block_size} tokens{memory}, router of "
          f"{cfg.router_workers} process{'es' if cfg.router_workers > 1 else ''}; logs in "
          f"{stack.log_dir}", flush=True)
    try:
        try:
            if stack.start(a.start_timeout, stop.is_set):
                assert stack.ports is not None
                print(f"pdd serve: ready at {stack.url} ({cfg.layout()})", flush=True)
                while not stop.wait(0.5):
                    stack.raise_if_dead()
        except StackError as exc:
            print(f"pdd serve: {exc}\npdd serve: stopped everything", file=sys.stderr,
                  flush=True)
            return 1
        print(f"pdd serve: {received[0] if received else 'stop'} received, stopping",
              flush=True)
        stack.stop()
        print("pdd serve: stopped", flush=True)
        return 0
    finally:
        stack.stop()
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    raise SystemExit(main())
