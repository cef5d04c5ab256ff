"""The served path against the engine's own bound, with each request's TTFT taken apart.

Starts `pdd serve` (a P TP1 -> D TP1 local stack: prefill instance, decode instance, router,
real NIXL hand-offs) and drives streaming `/v1/completions` of random token ids (greedy,
ignore_eos, so every completion is exactly max_tokens long) at levels `concurrency:prompt:
max_tokens`. Per level: TTFT p50/p99, TPOT p50, output tokens/s over the level's wall time, and
the median of every stage of the router's per-request breakdown (`pdd.timing`, docs/serving.md).

Every figure stands beside the engine's bound, measured in the same run on the same device and
model, in a separate process before the stack starts, loading the model as the sidecar does
(`load_rank_model`, `new_cache`, `RankEngine`, CUDA graphs as the engine defaults): the prompt's
prefill in one pass and chunked as the scheduler chunks it (the stack's chunk and step budgets,
the scheduler itself packing the steps), and a decode step at each batch size the levels use.
The stack runs with pdd serve's defaults, as a user gets them (block size, KV pools sized from
memory on a GPU), unless --block-size or --num-blocks say otherwise.

- concurrency 1: TTFT p50 / (chunked prefill of the prompt + decode step at batch 1);
- N > 1, a few tokens: TTFT p50 / (N prompts through the scheduler's steps + decode step at N);
- one token: wall / (N prompts through the scheduler's steps, per round of N);
- many tokens (>= 16): tokens/s / (N / decode step at batch N, mid-completion context).

The decode's `/metrics` give the KV READ's bytes and seconds (`pdd_kv_transfer_*`), so the READ
rate in GB/s; on CUDA a same-run copy of a 256 MB tensor between the devices the prefill and
the decode use is the hand-off's yardstick.

    python bench/serve_path.py --quick --json /tmp/serve_path.json     # CPU, builtin, < 1 min
    python bench/serve_path.py --device cuda --dtype bfloat16 --model /dev/shm/pdd-random-v2lite-4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sidecar"))
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT / "bench"))

import aiohttp  # noqa: E402
from stream_client import (  # noqa: E402
    instance_pool,
    parse_metrics,
    sample_probes,
    stage_medians,
    stream_completion,
)

from pdd_sidecar import env as E  # noqa: E402
from pdd_sidecar.engine.scheduler import step_budget  # noqa: E402
from pdd_sidecar.gc_pauses import PauseTimer, freeze_heap  # noqa: E402
from pdd_sidecar.model.config import load_config  # noqa: E402
from pdd_sidecar.processes import cpu_seconds, tree_cpu_seconds  # noqa: E402
from pdd_sidecar.serve.event_loop import loop_kind, uvloop_installed  # noqa: E402
from pdd_sidecar.serve.local_stack import (  # noqa: E402
    DEFAULT_BLOCK_SIZES,
    LocalStack,
    StackConfig,
    check_config,
    router_workers_arg,
)

LONG_PROMPT_TOKENS = 32768  # the long-then-short run's long prompt, where it fits
QUICK_LONG_PROMPT_TOKENS = 256  # --quick's, so that a CPU run stays short
# KV memory of the engine-bound process's own cache at most (the stack's pools are the
# product's: sized from memory on a GPU, unless --num-blocks)
BOUNDS_KV_GIB = {"cuda": 24.0, "cpu": 1.0}
DEFAULT_LEVELS = "1:1024:2,1:8192:2,1:32768:2,64:32:2,64:1024:1,64:1024:128,256:1024:128"
QUICK_LEVELS = "1:64:2,4:32:2,4:64:8"
LONG_HEAD_START_S = 0.15  # the long prompt's prefill is under way when the short one comes
MAX_SHORTS = 16  # short prompts sent one after another into the long prompt's prefill
SHORT_PAUSE_S = 0.03  # at most this long between one's answer and the next (a random phase)
MANY_TOKENS = 16  # a level with at least this many output tokens is judged by tokens/s
COPY_BYTES = 256 << 20
@dataclass(frozen=True)
class LevelSpec:
    concurrency: int
    prompt: int
    max_tokens: int

    @property
    def label(self) -> str:
        return f"{self.concurrency}:{self.prompt}:{self.max_tokens}"

    @property
    def decode_context(self) -> int:
        """The context a decode step of this level sees halfway through its completion."""
        return self.prompt + self.max_tokens // 2


def parse_levels(text: str) -> list[LevelSpec]:
    levels = []
    for item in text.split(","):
        parts = item.strip().split(":")
        try:
            c, p, t = (int(x) for x in parts)
        except ValueError:
            raise ValueError(f"--levels: {item!r} is not concurrency:prompt:max_tokens "
                             "(three integers)") from None
        if min(c, p, t) < 1:
            raise ValueError(f"--levels: {item!r}: every number must be >= 1")
        levels.append(LevelSpec(c, p, t))
    return levels


@dataclass
class LevelResult:
    level: str
    concurrency: int
    prompt: int
    max_tokens: int
    requests: int
    errors: int
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    second_p50_ms: float  # the decode's first token: the hand-off done (NaN at max_tokens 1)
    tpot_p50_ms: float
    timing_p50_ms: dict[str, float]
    read_bytes: float
    read_seconds: float
    read_GBps: float
    read_device_GBps: float = float("nan")  # cuda_ipc: bytes over the copies' device time
    bounds: dict[str, float] = field(default_factory=dict)
    timings: list[dict[str, float]] = field(default_factory=list)  # each request's pdd.timing
    # /readyz of router, prefill and decode and the decode's /metrics, polled during the level
    probe_p99_ms: float = float("nan")
    probe_max_ms: float = float("nan")
    probe_failures: int = 0
    probe_worst_ms: dict[str, float] = field(default_factory=dict)  # per probed URL
    probe_worst_at_s: dict[str, float] = field(default_factory=dict)  # when, into the level
    # The client's TTFT less the router's (`pdd.timing` ttft), per request: the client sending
    # the request, the router reading it before its clock starts, the token's way back.
    outside_p50_ms: float = float("nan")
    # CPU seconds each process (with the processes it started) ran during the level: which
    # core's Python a burst waited for, beside the stages above.
    cpu_s: dict[str, float] = field(default_factory=dict)
    # Garbage-collector pauses per process during the level: [collections, seconds, collections
    # over 5 ms] (instances' and router's /metrics, the client's own gc.callbacks).
    gc_pauses: dict[str, list[float]] = field(default_factory=dict)
    # The same since each process installed its timer (an instance before its warm-up, the
    # router and the client once ready), at the level's end.
    gc_since_start: dict[str, list[float]] = field(default_factory=dict)


# ------------------------------------------------------------------------- host CPU
CPU_OF = ("router", "prefill", "decode")


GC_LONG_S = 0.005  # a bucket bound of gc_pauses.BUCKETS


def gc_totals(metrics: dict[str, float]) -> tuple[float, float, float]:
    """(collections, seconds, collections over GC_LONG_S) in a process's /metrics so far."""
    n = secs = short = 0.0
    for key, v in metrics.items():
        name = key.split("{")[0]
        if name.endswith("gc_pause_seconds_count"):
            n += v
        elif name.endswith("gc_pause_seconds_sum"):
            secs += v
        elif name.endswith("gc_pause_seconds_bucket") and f'le="{GC_LONG_S}"' in key:
            short += v
    return n, secs, n - short


class ClientPauses:
    """The client's own collections, timed as the servers' are (its timer observes into this
    list, as theirs into a histogram)."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self.timer = PauseTimer(self)

    def labels(self, *_: str) -> ClientPauses:
        return self

    def observe(self, amount: float) -> None:
        self.pauses.append(amount)

    def totals(self) -> tuple[float, float, float]:
        self.timer.flush()
        return (len(self.pauses), sum(self.pauses),
                sum(1 for p in self.pauses if p > GC_LONG_S))


CLIENT_GC = ClientPauses()


def stack_cpu_s(stack: LocalStack) -> dict[str, float]:
    """Each process of the stack, CPU seconds so far."""
    return {name: tree_cpu_seconds(stack.child(name).pid) for name in CPU_OF}


# ------------------------------------------------------------------------- engine bounds
def _sync(torch: Any, dev: Any) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _best_s(fn: Any, torch: Any, dev: Any, reps: int, warmup: int) -> float:
    """The fastest of ``reps`` calls: a bound is what the engine can do, not what a busy
    host let it do once."""
    for _ in range(warmup):
        fn()
    _sync(torch, dev)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(torch, dev)
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_bounds(req: dict[str, Any]) -> dict[str, Any]:
    """The engine's own times for what the levels ask (run in a process of its own)."""
    import torch

    from pdd_sidecar.engine.comm import SingleComm
    from pdd_sidecar.engine.rank_engine import RankEngine, new_cache
    from pdd_sidecar.engine.scheduler import Scheduler
    from pdd_sidecar.engine.seq_chunk import SeqChunk
    from pdd_sidecar.model.rank_model import load_rank_model

    device = "cuda:0" if req["device"] == "cuda" else "cpu"
    t0 = time.perf_counter()
    model = load_rank_model(req["model"], 0, 1, req["dtype"], device)
    cache = new_cache(model, req["num_blocks"], req["block_size"], device)
    eng = RankEngine(model, cache, SingleComm())
    dev, bs = cache.device, req["block_size"]
    vocab = model.config.vocab_size
    rng = random.Random(1)
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "decode_mode": eng.decode_mode,
                           "prefill_one_pass_ms": {}, "prefill_ms": {}, "decode_step_ms": {}}

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def blocks(tokens: int) -> list[int]:
        return cache.allocate(-(-tokens // bs))

    def scheduled(n: int, p: int) -> float:
        """n prompts of p tokens through the scheduler's steps, as the prefill instance runs
        them (its chunk and step budgets); seconds, wall."""
        sch = Scheduler("prefill", cache, bs, 1, 1, max_running=n, max_waiting=n,
                        step_tokens=req["step_tokens"], chunk_tokens=req["chunk_tokens"],
                        long_chunk_tokens=req["long_chunk_tokens"])
        from pdd_sidecar.engine.scheduler import Sequence

        for i in range(n):
            sch.submit(Sequence(f"s{i}", prompt(p), 1, p))
        start = time.perf_counter()
        while sch.busy:
            plan = sch.plan()
            eng.step([SeqChunk(c.tokens, c.start, c.seq.blocks) for c in plan.prefill])
            for c in plan.prefill:
                sch.on_chunk_done(c)
                if c.last:
                    sch.finish_prefill(c.seq, keep_blocks=False)
        _sync(torch, dev)
        return time.perf_counter() - start

    for n, p in req["prefills"]:
        key = f"{n}x{p}"
        big = n * p > 65536
        scheduled(min(n, 2), min(p, 512))  # shapes compiled, memory pools grown
        runs = [scheduled(n, p) for _ in range(1 if big else 3)]
        out["prefill_ms"][key] = min(runs) * 1e3
        if n == 1:
            ids, table = prompt(p), blocks(p)
            chunk = [SeqChunk(ids, 0, table)]
            out["prefill_one_pass_ms"][str(p)] = _best_s(
                lambda c=chunk: eng.step(c), torch, dev, 1 if big else 3, 1) * 1e3
            cache.free(table)
    for n, ctx in req["decodes"]:
        need = -(-(ctx + 1) // bs)
        # More than the cache holds at once: the sequences share one table (the same reads).
        own = n * need <= cache.num_free
        tables = [blocks(ctx + 1) for _ in range(n if own else 1)]
        chunks = [SeqChunk([rng.randrange(vocab)], ctx, tables[i if own else 0])
                  for i in range(n)]
        out["decode_step_ms"][f"{n}@{ctx}"] = _best_s(
            lambda c=chunks: eng.step(c), torch, dev, req["reps"], 3) * 1e3
        for t in tables:
            cache.free(t)
    if dev.type == "cuda":
        del eng, cache, model
        torch.cuda.empty_cache()
        dst = torch.device("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
        a = torch.empty(COPY_BYTES, dtype=torch.uint8, device=dev)
        b = torch.empty(COPY_BYTES, dtype=torch.uint8, device=dst)
        sec = _best_s(lambda: b.copy_(a), torch, dst, 10, 2)
        out["copy_GBps"] = COPY_BYTES / sec / 1e9
        out["copy_devices"] = f"{dev} -> {dst}"
    return out


def run_bounds(req: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pdd-bounds-") as tmp:
        rq, res = Path(tmp) / "req.json", Path(tmp) / "out.json"
        rq.write_text(json.dumps(req))
        subprocess.run([sys.executable, __file__, "--bounds-worker", str(rq), str(res)],
                       env=env, check=True)
        result: dict[str, Any] = json.loads(res.read_text())
        return result


# ------------------------------------------------------------------------- the load
def transfer_totals(metrics: dict[str, float]) -> tuple[float, float, float]:
    """(bytes, wall seconds, device seconds) of every rank's KV READs so far (device seconds:
    the cuda_ipc copies' own time, by CUDA events)."""
    nbytes = sum(v for k, v in metrics.items() if k.startswith("pdd_kv_transfer_bytes_total"))
    secs = sum(v for k, v in metrics.items() if k.startswith("pdd_kv_transfer_seconds_sum"))
    dev = sum(v for k, v in metrics.items()
              if k.startswith("pdd_kv_transfer_device_seconds_total"))
    return nbytes, secs, dev


@dataclass
class Reply:
    start: float
    times: list[float]
    timing: dict[str, float]
    cached_tokens: int | None = None  # with usage asked for: the prefill's prefix-cache hit

    @property
    def ttft_ms(self) -> float:
        return (self.times[0] - self.start) * 1e3


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int],
                      max_tokens: int, usage: bool = False) -> Reply | str:
    got = await stream_completion(session, url, prompt, max_tokens, include_usage=usage)
    if isinstance(got, str):
        return got
    cached = None
    if got.usage is not None:
        cached = int((got.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Reply(got.start, got.times, got.pdd.get("timing") or {}, cached)


class ProbeSampler:
    """Polls the probes a kubelet and the router poll, while a level runs: every answer should
    be prompt and 200 whatever the load (they are answered off the engine's path).

    It runs in a process of its own: the level's streaming clients keep the benchmark's event
    loop and its GIL busy, and a probe timed in the same process would count that delay as the
    server's."""

    INTERVAL_S = 0.05

    def __init__(self, stack: LocalStack) -> None:
        self.urls = {f"{u}/readyz": f"{name} /readyz" for name, u in
                     (("router", stack.url), ("prefill", stack.prefill_url),
                      ("decode", stack.decode_url))}
        self.urls[f"{stack.decode_url}/metrics"] = "decode /metrics"
        self.latencies_ms: list[float] = []
        self.worst_ms: dict[str, float] = {}
        self.worst_at_s: dict[str, float] = {}
        self.failures = 0
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._polling = ctx.Event()
        self._results: Any = ctx.Queue()
        self._proc = ctx.Process(target=sample_probes, name="probe-sampler", daemon=True,
                                 args=(self.urls, self.INTERVAL_S, self._stop, self._results,
                                       self._polling))

    def __enter__(self) -> ProbeSampler:
        self._proc.start()
        self._polling.wait(timeout=60)  # its first round is done: the level may start
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        try:
            got = self._results.get(timeout=60)
        finally:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
        self.latencies_ms = got["latencies_ms"]
        self.worst_ms = got["worst_ms"]
        self.worst_at_s = got["worst_at_s"]
        self.failures = got["failures"]


# Not a level's seed (1, 2, ...) nor the first requests' (1000 + i): the long prompt and the short
# ones are new to the prefix cache. Until run 37 it was 7, the seventh level's, so the first
# short prompt was that level's 33rd prompt, found cached: a 16-token eager step, not a fresh
# one (docs/serving.md, runs 35-37).
LONG_THEN_SHORT_SEED = 7_000
# A short prompt's time in the prefill during the long one, and the host's share of it.
SHORT_PREFILL_PARTS = ("prefill_queue", "prefill_inbox", "prefill_gather", "prefill_compute",
                       "prefill_launch", "prefill_to_host")


async def long_then_short(stack: LocalStack, long_tokens: int, short_tokens: int,
                          vocab: int, delay_s: float) -> dict[str, Any]:
    """Short prompts sent one after another while a long one is being prefilled, each a new
    prompt (nothing to share in a prefix cache), each a random pause after the last one's
    answer: their TTFTs, to hold against the idle TTFT (a long prompt must not starve short
    ones). One short prompt says little, as its wait depends on where in the long prompt's
    step it lands (runs 24-27, one each: 1.49-3.60x); the median and the worst of those sent
    before the long prompt's first token say how a stream of them fares."""
    rng = random.Random(LONG_THEN_SHORT_SEED)
    long_prompt = [rng.randrange(vocab) for _ in range(long_tokens)]
    timeout = aiohttp.ClientTimeout(total=900)
    shorts: list[Reply] = []
    error = None
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def prefill_counters() -> dict[str, float]:
            async with session.get(f"{stack.prefill_url}/metrics") as resp:
                got = parse_metrics(await resp.text())
            out = {w: got.get(f'pdd_overtaking_steps_total{{waited="{w}"}}', 0.0)
                   for w in ("false", "true")}
            for order in ("in_order", "overtaking"):
                for part in ("sum", "count"):
                    out[f"{order}_{part}"] = got.get(
                        f'pdd_step_enqueue_seconds_{part}{{order="{order}"}}', 0.0)
            return out

        before = await prefill_counters()
        long_start = time.perf_counter()
        long_task = asyncio.create_task(one_request(session, stack.url, long_prompt, 2,
                                                    usage=True))
        await asyncio.sleep(delay_s)
        while not shorts or (not long_task.done() and len(shorts) < MAX_SHORTS):
            got = await one_request(session, stack.url,
                                    [rng.randrange(vocab) for _ in range(short_tokens)], 2,
                                    usage=True)
            if isinstance(got, str):
                error = got
                break
            shorts.append(got)
            await asyncio.sleep(rng.uniform(0, SHORT_PAUSE_S))
        long = await long_task
        after = await prefill_counters()
    out: dict[str, Any] = {"long_tokens": long_tokens, "short_tokens": short_tokens,
                           "delay_ms": delay_s * 1e3,
                           "overtaking_steps": (after["false"] + after["true"]
                                                - before["false"] - before["true"]),
                           "overtaking_waited": after["true"] - before["true"]}
    for order in ("in_order", "overtaking"):  # the prefill host's time enqueuing each kind
        n = after[f"{order}_count"] - before[f"{order}_count"]
        out[f"{order}_enqueued"] = n
        out[f"{order}_enqueue_ms"] = ((after[f"{order}_sum"] - before[f"{order}_sum"]) * 1e3 / n
                                      if n else float("nan"))
    if error is not None:
        out["short_error"] = error
    if isinstance(long, str):
        out["long_error"] = long
    else:
        out["long_ttft_ms"] = long.ttft_ms
        out["long_timing"] = long.timing
        out["long_cached_tokens"] = long.cached_tokens
    during = [r for r in shorts if isinstance(long, str) or r.start < long.times[0]]
    judged = during or shorts[:1]
    if judged:
        ttfts = [r.ttft_ms for r in judged]
        out["shorts_sent"] = len(shorts)
        out["shorts_during"] = len(during)
        out["short_ttfts_ms"] = ttfts
        out["short_ttft_ms"] = statistics.median(ttfts)
        out["worst_short_ttft_ms"] = max(ttfts)
        out["short_timing"] = sorted(judged, key=lambda r: r.ttft_ms)[len(judged) // 2].timing
        out["worst_short_timing"] = max(judged, key=lambda r: r.ttft_ms).timing
        out["short_sent_ms"] = [(r.start - long_start) * 1000 for r in judged]
        out["short_cached_tokens"] = [r.cached_tokens for r in judged]
        out["short_prefill_ms"] = [{k: r.timing[k] for k in SHORT_PREFILL_PARTS if k in r.timing}
                                   for r in judged]
    return out


def triton_kernels() -> set[str]:
    """The Triton kernels in the on-disk cache (each compiled variant once): a kernel that
    appears while the stack serves was compiled on a request's time."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return {f"{p.parent.name[:8]}/{p.stem}" for p in root.glob("*/*.json")
            if not p.name.startswith("__grp__")}


def pct(xs: list[float], q: int) -> float:
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


async def open_connections(session: aiohttp.ClientSession, url: str, n: int) -> None:
    """The client's ``n`` connections to the router, opened before a level's clock starts, as
    a client with a keep-alive pool has them: a burst over fresh connections reaches the
    router as its TCP handshakes complete, the first request alone ms ahead of the rest, and
    an idle prefill then steps on it by itself (run 17, docs/serving.md)."""
    async def one() -> None:
        async with session.get(f"{url}/v1/models") as resp:
            await resp.read()

    await asyncio.gather(*(one() for _ in range(n)))


async def run_level(stack: LocalStack, spec: LevelSpec, n_requests: int, vocab: int,
                    seed: int) -> LevelResult:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(spec.prompt)] for _ in range(n_requests)]
    timeout = aiohttp.ClientTimeout(total=900)
    conn = aiohttp.TCPConnector(limit=spec.concurrency + 4)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        async def scrape() -> dict[str, dict[str, float]]:
            out = {}
            for name in CPU_OF:
                url = stack.url if name == "router" else stack.child(name).url
                async with session.get(f"{url}/metrics") as resp:
                    out[name] = parse_metrics(await resp.text())
            return out

        before = await scrape()
        await open_connections(session, stack.url, spec.concurrency)
        queue = list(range(n_requests))
        results: list[Reply | str] = []

        async def client() -> None:
            while queue:
                i = queue.pop()
                results.append(await one_request(session, stack.url, prompts[i],
                                                 spec.max_tokens))

        with ProbeSampler(stack) as probes:  # polling before the clock starts
            cpu0 = stack_cpu_s(stack)
            cpu0["client"] = cpu_seconds(os.getpid())
            client_gc0 = CLIENT_GC.totals()
            t0 = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(spec.concurrency)))
            wall = time.perf_counter() - t0
            client_gc1 = CLIENT_GC.totals()
            cpu1 = {"client": cpu_seconds(os.getpid()), **stack_cpu_s(stack)}
        after = await scrape()
    gc_pauses = {name: [a - b for a, b in zip(gc_totals(after[name]), gc_totals(before[name]),
                                              strict=True)] for name in CPU_OF}
    gc_pauses["client"] = [a - b for a, b in zip(client_gc1, client_gc0, strict=True)]
    gc_since_start = {name: list(gc_totals(after[name])) for name in CPU_OF}
    gc_since_start["client"] = list(client_gc1)
    transfer_after, transfer_before = (transfer_totals(after["decode"]),
                                       transfer_totals(before["decode"]))
    ok = [r for r in results if isinstance(r, Reply)]
    failures = [r for r in results if isinstance(r, str)]
    if failures:
        print(f"  {spec.label}: {len(failures)} failed, e.g. {failures[0]}", file=sys.stderr,
              flush=True)
    tokens = sum(len(r.times) for r in ok)
    ttft = [r.ttft_ms for r in ok]
    second = [(r.times[1] - r.start) * 1e3 for r in ok if len(r.times) > 1]
    tpot = [(r.times[-1] - r.times[0]) / (len(r.times) - 1) * 1e3 for r in ok
            if len(r.times) > 1]
    medians = stage_medians(r.timing for r in ok)
    outside = [r.ttft_ms - r.timing["ttft"] for r in ok if "ttft" in r.timing]
    rbytes, rsecs, rdev = (a - b for a, b in zip(transfer_after, transfer_before, strict=True))
    return LevelResult(
        level=spec.label, concurrency=spec.concurrency, prompt=spec.prompt,
        max_tokens=spec.max_tokens, requests=len(results), errors=len(failures), wall_s=wall,
        output_tokens=tokens, tokens_per_s=tokens / wall if wall else 0.0,
        ttft_p50_ms=pct(ttft, 50), ttft_p99_ms=pct(ttft, 99), second_p50_ms=pct(second, 50),
        tpot_p50_ms=pct(tpot, 50),
        timing_p50_ms=medians, read_bytes=rbytes, read_seconds=rsecs,
        read_GBps=rbytes / rsecs / 1e9 if rsecs > 0 else float("nan"),
        read_device_GBps=rbytes / rdev / 1e9 if rdev > 0 else float("nan"),
        timings=[r.timing for r in ok], probe_p99_ms=pct(probes.latencies_ms, 99),
        probe_max_ms=max(probes.latencies_ms, default=float("nan")),
        probe_failures=probes.failures, probe_worst_ms=probes.worst_ms,
        probe_worst_at_s=probes.worst_at_s, outside_p50_ms=pct(outside, 50),
        cpu_s={k: cpu1[k] - cpu0[k] for k in cpu0}, gc_pauses=gc_pauses,
        gc_since_start=gc_since_start)


# ------------------------------------------------------------------------- judging
def level_bounds(r: LevelResult, spec: LevelSpec, b: dict[str, Any]) -> dict[str, float]:
    """The level's figures against the engine's, as ratios (1.0 = the engine's own speed)."""
    n, p, t = spec.concurrency, spec.prompt, spec.max_tokens
    out: dict[str, float] = {}
    prefill = b["prefill_ms"][f"{n}x{p}"]
    decode = b["decode_step_ms"][f"{n}@{spec.decode_context}"]
    out["prefill_ms"] = prefill
    if n == 1:
        out["prefill_one_pass_ms"] = b["prefill_one_pass_ms"][str(p)]
    out["decode_step_ms"] = decode
    if t > 1:
        out["ttft_bound_ms"] = prefill + decode
        out["ttft_ratio"] = r.ttft_p50_ms / out["ttft_bound_ms"]
        out["second_ratio"] = r.second_p50_ms / out["ttft_bound_ms"]
    else:
        out["wall_bound_ms"] = -(-r.requests // n) * prefill
        out["wall_ratio"] = r.wall_s * 1e3 / out["wall_bound_ms"]
    if t >= MANY_TOKENS:
        # The engine prefills the level's prompts in its scheduled steps, then runs T decode
        # steps at batch N: what the same engine does with the same work, end to end.
        out["tokens_per_s_bound"] = n * t / (prefill / 1e3 + t * decode / 1e3)
        out["tokens_per_s_ratio"] = r.tokens_per_s / out["tokens_per_s_bound"]
    if "copy_GBps" in b and r.requests and r.read_bytes > 0:
        per_request = r.read_bytes / max(1, r.requests - r.errors)
        out["read_bound_ms"] = per_request / (b["copy_GBps"] * 1e9) * 1e3
    return out


# The one-H200 targets of the served path, each a ratio to the engine's bound of the same run:
# level -> (what is compared, bound key(s) summed, the target, True when higher is better).
TARGETS: dict[str, tuple[str, tuple[str, ...], float, bool]] = {
    "1:1024:2": ("TTFT p50 / prefill compute", ("prefill_ms",), 1.5, False),
    "1:8192:2": ("TTFT p50 / (prefill compute + bytes at the copy rate)",
                 ("prefill_ms", "read_bound_ms"), 1.3, False),
    "64:32:2": ("TTFT p50 / (that prefill step + one decode step)",
                ("prefill_ms", "decode_step_ms"), 1.5, False),
    "64:1024:1": ("wall / the engine's time for those prompts", ("wall_bound_ms",), 1.3, False),
    "64:1024:128": ("tok/s / the engine's (prefills, then T steps at batch N)",
                    ("tokens_per_s_bound",), 0.7, True),
}


def judge(r: LevelResult) -> dict[str, Any] | None:
    """The level's target, its ratio and whether it holds; None for a level with none."""
    if r.level not in TARGETS:
        return None
    what, keys, target, higher = TARGETS[r.level]
    if any(k not in r.bounds for k in keys):
        return None
    bound = sum(r.bounds[k] for k in keys)
    value = (r.tokens_per_s if higher else r.wall_s * 1e3 if r.max_tokens == 1
             else r.ttft_p50_ms)
    ratio = value / bound if bound else float("nan")
    out = {"what": what, "value": value, "bound": bound, "ratio": ratio, "target": target,
           "holds": ratio >= target if higher else ratio <= target}
    if what.startswith("TTFT") and bound:
        # The first token is the prefill's; the decode's first one shows the hand-off's cost
        # against the same bound (the figure these targets were first set on).
        out["second_token_ratio"] = r.second_p50_ms / bound
    return out


def kv_bytes_per_block(model: str, dtype: str, block_size: int) -> int:
    cfg = load_config(model)
    return cfg.num_hidden_layers * block_size * cfg.latent_dim * (2 if dtype == "bfloat16" else 4)


def plan_levels(levels: list[LevelSpec], max_len: int, capacity_tokens: int
                ) -> tuple[list[LevelSpec], list[str]]:
    kept, skipped = [], []
    for lv in levels:
        need = lv.prompt + lv.max_tokens
        if need > max_len:
            skipped.append(f"{lv.label}: prompt + max_tokens = {need} exceeds the model's "
                           f"maximum length {max_len}")
        elif need > capacity_tokens:
            skipped.append(f"{lv.label}: prompt + max_tokens = {need} exceeds the KV capacity "
                           f"of {capacity_tokens} tokens")
        else:
            kept.append(lv)
    return kept, skipped


def bounds_request(model: str, device: str, dtype: str, bs: int, levels: list[LevelSpec],
                   step_tokens: int, chunk_tokens: int, long_chunk_tokens: int, reps: int
                   ) -> tuple[dict[str, Any], list[LevelSpec], list[str]]:
    """What the engine-bound process measures for these levels (`measure_bounds`), its own
    cache holding every level within BOUNDS_KV_GIB; the levels it can hold and why not the
    others."""
    per_block = kv_bytes_per_block(model, dtype, bs)
    budget = int(BOUNDS_KV_GIB[device] * 2**30 // per_block)
    want = max(lv.concurrency * -(-(lv.prompt + lv.max_tokens) // bs) for lv in levels)
    blocks = max(1, min(want + 8, budget))
    levels, skipped = plan_levels(levels, load_config(model).max_position_embeddings,
                                  blocks * bs)
    req = {"model": model, "device": device, "dtype": dtype, "block_size": bs,
           "num_blocks": blocks, "chunk_tokens": chunk_tokens,
           "long_chunk_tokens": long_chunk_tokens, "step_tokens": step_tokens, "reps": reps,
           "prefills": sorted({(lv.concurrency, lv.prompt) for lv in levels}),
           "decodes": sorted({(lv.concurrency, lv.decode_context) for lv in levels})}
    return req, levels, skipped


def budget_env(req: dict[str, Any]) -> dict[str, str]:
    """The step budgets of a bounds request as the stack's environment, so the stack's
    scheduler and the bound's run the same steps."""
    return {E.PDD_CHUNK_TOKENS: str(req["chunk_tokens"]),
            E.PDD_LONG_CHUNK_TOKENS: str(req["long_chunk_tokens"]),
            E.PDD_MAX_STEP_TOKENS: str(req["step_tokens"])}


HEADER = (f"{'level':>14} {'reqs':>4} {'err':>3} {'wall s':>7} {'tok/s':>8} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'2nd p50':>8} {'TPOT p50':>8} {'READ GB/s':>9} | {'bound':>9} "
          f"{'ratio':>6} judged by: bound")


def row(r: LevelResult) -> str:
    b = r.bounds
    if "tokens_per_s_ratio" in b:
        bound, ratio, what = b["tokens_per_s_bound"], b["tokens_per_s_ratio"], \
            "tok/s: N x T / (prefills + T steps)"
    elif "wall_ratio" in b:
        bound, ratio, what = b["wall_bound_ms"], b["wall_ratio"], \
            "wall: scheduled prefills (ms)"
    else:
        bound, ratio, what = b["ttft_bound_ms"], b["ttft_ratio"], \
            "TTFT p50: prefill + step (ms)"
    return (f"{r.level:>14} {r.requests:>4} {r.errors:>3} {r.wall_s:>7.2f} "
            f"{r.tokens_per_s:>8.1f} {r.ttft_p50_ms:>9.1f} {r.ttft_p99_ms:>9.1f} "
            f"{r.second_p50_ms:>8.1f} {r.tpot_p50_ms:>8.2f} {r.read_GBps:>9.2f} | {bound:>9.2f} "
            f"{ratio:>6.2f} {what}")


SHORT = {"router_to_prefill": "r>P", "prefill_queue": "Pq", "prefill_compute": "Pc",
         "prefill_to_router": "P>r", "to_client": "r>cl", "ttft": "TTFT",
         "grant_to_decode": "r>D", "decode_queue": "Dq", "claim": "claim", "read": "read",
         "join": "join", "first_step": "step1", "decode_to_client": "D>cl",
         "second_token": "2nd", "router_to_decode": "r>Dl", "local_queue": "Lq",
         "local_gather": "Lg", "local_compute": "Lc"}


def timing_row(r: LevelResult) -> str:
    cells = [f"{r.timing_p50_ms[k]:>{max(7, len(SHORT[k]))}.2f}" if k in r.timing_p50_ms
             else f"{'-':>{max(7, len(SHORT[k]))}}" for k in SHORT]
    return f"{r.level:>14} " + " ".join(cells) + f" | {r.outside_p50_ms:>7.2f}"


def timing_header() -> str:
    return (f"{'level':>14} " + " ".join(f"{v:>{max(7, len(v))}}" for v in SHORT.values())
            + f" | {'cl-TTFT':>7}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"CPU, builtin model, levels {QUICK_LEVELS}, 4 requests a level")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default="builtin", help="builtin or a checkpoint folder")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--levels", default=None,
                   help=f"comma-separated concurrency:prompt:max_tokens (default "
                   f"{DEFAULT_LEVELS}; --quick {QUICK_LEVELS})")
    p.add_argument("--min-requests", type=int, default=None,
                   help="requests per level: max(concurrency, this) (default 8; --quick 4)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: pdd serve's, 64 on cuda, 16 on cpu)")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="the stack's PDD_CHUNK_TOKENS (default: the device's, as serving)")
    p.add_argument("--long-chunk-tokens", type=int, default=None,
                   help="the stack's PDD_LONG_CHUNK_TOKENS (default: the device's)")
    p.add_argument("--step-tokens", type=int, default=None,
                   help="the stack's PDD_MAX_STEP_TOKENS")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per rank of each instance (default: pdd serve's, sized from "
                   "GPU memory on cuda, 1024 on cpu); levels that do not fit are skipped")
    p.add_argument("--router-workers", type=router_workers_arg, default="auto",
                   help="router processes sharing its port (pdd serve --router-workers; "
                   "default auto, as pdd serve's)")
    p.add_argument("--local-prefill-tokens", type=int, default=0, metavar="N",
                   help="pdd serve --local-prefill-tokens: prompts with at most N uncached "
                   "tokens prefilled on the decode (default 0: every request through the "
                   "prefill, the path the breakdown describes); run with 0 and with the prompt "
                   "length to compare the two paths' TTFT on the same stack")
    p.add_argument("--reps", type=int, default=10, help="timed decode steps per bound")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="keep the stack's logs here (default: a temporary folder, removed)")
    p.add_argument("--bounds-worker", nargs=2, metavar=("REQ", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.bounds_worker:
        req = json.loads(Path(args.bounds_worker[0]).read_text())
        Path(args.bounds_worker[1]).write_text(json.dumps(measure_bounds(req)))
        return 0
    if args.quick:
        args.device, args.model = "cpu", "builtin"
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.step_tokens, args.chunk_tokens, args.long_chunk_tokens = step_budget(
        args.device, args.step_tokens, args.chunk_tokens, args.long_chunk_tokens)
    try:
        levels = parse_levels(args.levels or (QUICK_LEVELS if args.quick else DEFAULT_LEVELS))
    except ValueError as exc:
        p.error(str(exc))
    min_requests = args.min_requests or (4 if args.quick else 8)
    bs = args.block_size or DEFAULT_BLOCK_SIZES[args.device]
    cfg = load_config(args.model)
    req, levels, skipped = bounds_request(args.model, args.device, dtype, bs, levels,
                                          args.step_tokens, args.chunk_tokens,
                                          args.long_chunk_tokens, args.reps)
    bound_blocks = req["num_blocks"]
    loop = loop_kind(os.environ.get(E.PDD_EVENT_LOOP, "") or E.EVENT_LOOPS[0], uvloop_installed())
    print(f"serve_path: P tp1 -> D tp1, model {args.model}, {args.device} {dtype}, block {bs}, "
          f"chunk {args.chunk_tokens} (long prompts {args.long_chunk_tokens}), "
          f"step {args.step_tokens}, KV "
          + (f"{args.num_blocks} blocks per rank" if args.num_blocks else "pdd serve's pools")
          + f", router workers {args.router_workers}, "
          f"event loop {loop}, cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}",
          flush=True)
    for why in skipped:
        print(f"skipped {why}", flush=True)
    if not levels:
        p.error("--levels: every level was skipped")
    extra_env = budget_env(req)
    t0 = time.perf_counter()
    bounds = run_bounds(req, {**os.environ, **extra_env})
    print(f"engine bounds ({bounds['decode_mode']} decode, separate process, "
          f"{time.perf_counter() - t0:.0f}s):", flush=True)
    for key, ms in bounds["prefill_ms"].items():
        n, tokens = key.split("x")
        one = bounds["prefill_one_pass_ms"].get(tokens) if n == "1" else None
        print(f"  prefill {n} x {tokens} tokens, scheduled: {ms:.2f} ms"
              + (f"; one pass {one:.2f} ms" if one is not None else ""), flush=True)
    for key, ms in bounds["decode_step_ms"].items():
        n, ctx = key.split("@")
        print(f"  decode step at batch {n}, context {ctx}: {ms:.3f} ms", flush=True)
    if "copy_GBps" in bounds:
        print(f"  device copy of 256 MB ({bounds['copy_devices']}): {bounds['copy_GBps']:.1f} "
              "GB/s", flush=True)
    top = max(lv.concurrency for lv in levels)
    scfg = StackConfig(prefill_tp=1, prefill_dcp=1, decode_tp=1, decode_dcp=1, model=args.model,
                       device=args.device, port=0, block_size=bs, num_blocks=args.num_blocks,
                       dtype=dtype, max_num_seqs=max(256, top), max_waiting=max(256, 2 * top),
                       log_level="WARNING", drain_s=1.0, extra_env=extra_env,
                       router_workers=args.router_workers,
                       local_prefill_tokens=args.local_prefill_tokens)
    found = check_config(scfg)
    if found:
        p.error("; ".join(found))
    results: list[LevelResult] = []
    first_after_ready: dict[str, Any] = {}
    mixed: dict[str, Any] = {}
    compiled: dict[str, list[str]] = {}
    stack = LocalStack(scfg, args.log_dir)
    try:
        t0 = time.perf_counter()
        stack.start()
        print(f"stack ready in {time.perf_counter() - t0:.0f}s (logs {stack.log_dir})",
              flush=True)
        pools = {role: instance_pool(url) for role, url in (("prefill", stack.prefill_url),
                                                            ("decode", stack.decode_url))}
        capacity = min(pool["tokens"] for pool in pools.values())
        print("KV pools: " + "; ".join(
            f"{role} {pool['blocks']} blocks of {pool['block_size']} tokens ({pool['tokens']} "
            f"tokens, {pool['bytes_per_rank'] / 2**30:.2f} GiB a rank, {pool['sized_by']})"
            for role, pool in pools.items()), flush=True)
        levels, too_long = plan_levels(levels, cfg.max_position_embeddings, capacity)
        for why in too_long:
            print(f"skipped {why}", flush=True)
        skipped += too_long
        if not levels:
            raise SystemExit("serve_path: every level was skipped: the pools are too small")
        # The client's heap frozen as the servers' are: its own collections would count in
        # the TTFTs it measures. Its pauses are timed as theirs.
        freeze_heap()
        CLIENT_GC.timer.install()
        known = triton_kernels()

        def note_compiled(when: str) -> None:
            new = sorted(triton_kernels() - known)
            known.update(new)
            compiled[when] = new
            print(f"  Triton kernels compiled while serving ({when}): {len(new)}"
                  + (f": {', '.join(new)}" if new else ""), flush=True)

        # Ready means warm: the first request after ready against the same request's steady TTFT.
        first_prompt = min(1024, cfg.max_position_embeddings - 2, capacity - 2)
        first = [asyncio.run(run_level(stack, LevelSpec(1, first_prompt, 2), 1,
                                       cfg.vocab_size, 1000 + i)) for i in range(4)]
        steady = statistics.median(r.ttft_p50_ms for r in first[1:])
        first_after_ready = {"prompt": first_prompt, "first_ttft_ms": first[0].ttft_p50_ms,
                             "steady_ttft_ms": steady,
                             "first_timing": first[0].timings[0] if first[0].timings else {},
                             "second_timing": first[1].timings[0] if first[1].timings else {},
                             "ratio": first[0].ttft_p50_ms / steady if steady else float("nan")}
        print(f"first request after ready (1:{first_prompt}:2): TTFT "
              f"{first[0].ttft_p50_ms:.1f} ms, steady {steady:.1f} ms (median of the next 3): "
              f"{first_after_ready['ratio']:.2f}x (target <= 1.2x)", flush=True)
        for name in ("first_timing", "second_timing"):
            print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                             first_after_ready[name].items()), flush=True)
        note_compiled("first requests")
        print(HEADER, flush=True)
        for i, lv in enumerate(levels):
            r = asyncio.run(run_level(stack, lv, max(lv.concurrency, min_requests),
                                      cfg.vocab_size, i + 1))
            stack.raise_if_dead()
            r.bounds = level_bounds(r, lv, bounds)
            results.append(r)
            print(row(r), flush=True)
        note_compiled("levels")
        long_tokens = min(QUICK_LONG_PROMPT_TOKENS if args.quick else LONG_PROMPT_TOKENS,
                          cfg.max_position_embeddings - 2, capacity // 2 - 2)
        short_tokens = first_prompt
        idle = steady
        mixed = asyncio.run(long_then_short(stack, long_tokens, short_tokens, cfg.vocab_size,
                                            LONG_HEAD_START_S))
        mixed["idle_short_ttft_ms"] = idle
        note_compiled("long then short")
        if "short_ttft_ms" in mixed:
            mixed["ratio"] = mixed["short_ttft_ms"] / idle if idle else float("nan")
            mixed["worst_ratio"] = mixed["worst_short_ttft_ms"] / idle if idle else float("nan")
    finally:
        stack.stop()
        if not args.log_dir:
            stack.cleanup()
    print("\nmedian of each stage per request (ms; pdd.timing, docs/serving.md): to the first "
          "token (the prefill's), then the hand-off to the decode's first token (2nd); "
          "cl-TTFT: the client's TTFT less the router's (sending, the router reading the "
          "request, the token's way back)")
    print(timing_header())
    for r in results:
        print(timing_row(r))
    print("\nhost CPU during each level (CPU seconds of each process and those it started, "
          "as cores busy on average over the level's wall time):")
    for r in results:
        print(f"{r.level:>14}: " + ", ".join(
            f"{k} {v * 1e3:7.1f} ms ({v / r.wall_s:4.2f})" for k, v in r.cpu_s.items()))
    print("\ngarbage-collector pauses during each level (collections, their total, those over "
          f"{GC_LONG_S * 1e3:.0f} ms; the instances' and the router's pdd_*gc_pause_seconds, "
          "the client's own):")
    for r in results:
        print(f"{r.level:>14}: " + ", ".join(
            f"{k} {int(n)} / {secs * 1e3:.1f} ms / {int(long)}"
            for k, (n, secs, long) in r.gc_pauses.items()))
    copy = bounds.get("copy_GBps")
    print("\nKV hand-off (decode /metrics: pdd_kv_transfer_bytes, pdd_kv_transfer_seconds)"
          + (f" against the device copy rate {copy:.1f} GB/s:" if copy else ":"))
    for r in results:
        done = max(1, r.requests - r.errors)
        line = (f"{r.level:>14}: {r.read_bytes / done / 1e6:9.2f} MB per request, READ "
                f"{r.read_GBps:7.2f} GB/s (device time {r.read_device_GBps:7.1f} GB/s), "
                f"median read stage "
                f"{r.timing_p50_ms.get('read', float('nan')):8.2f} ms")
        if "read_bound_ms" in r.bounds:
            line += f", at the copy rate {r.bounds['read_bound_ms']:.3f} ms"
        print(line)
    if "ratio" in mixed:
        print(f"\n{mixed['shorts_sent']} prompts of {mixed['short_tokens']} tokens sent one "
              f"after another from {mixed['delay_ms']:.0f} ms into a {mixed['long_tokens']}-token "
              f"prefill, {mixed['shorts_during']} before its first token: TTFT median "
              f"{mixed['short_ttft_ms']:.1f} ms, worst {mixed['worst_short_ttft_ms']:.1f} ms, idle "
              f"{mixed['idle_short_ttft_ms']:.1f} ms: median {mixed['ratio']:.2f}x, worst "
              f"{mixed['worst_ratio']:.2f}x (target <= 2x); the long prompt's TTFT "
              f"{mixed.get('long_ttft_ms', float('nan')):.1f} ms")
        print("  each short prompt's TTFT (ms): "
              + ", ".join(f"{t:.1f}" for t in mixed["short_ttfts_ms"]))
        print(f"  prefill steps that overtook queued device work (pdd_overtaking_steps_total): "
              f"{mixed['overtaking_steps']:.0f}, of which waited {mixed['overtaking_waited']:.0f}")
        print(f"  the prefill host enqueuing a step (pdd_step_enqueue_seconds), mean: in order "
              f"{mixed['in_order_enqueue_ms']:.1f} ms ({mixed['in_order_enqueued']:.0f} steps), "
              f"overtaking {mixed['overtaking_enqueue_ms']:.1f} ms "
              f"({mixed['overtaking_enqueued']:.0f})")
        print("  short: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                      mixed.get("short_timing", {}).items()))
        print("  worst: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                      mixed.get("worst_short_timing", {}).items()))
        print("  each short prompt sent at (ms into the long prompt's prefill): "
              + ", ".join(f"{t:.0f}" for t in mixed.get("short_sent_ms", [])))
        print("  prompt tokens found in the prefix cache (usage.cached_tokens): long "
              f"{mixed.get('long_cached_tokens')}, short "
              + ", ".join(str(t) for t in mixed.get("short_cached_tokens", [])))
        print("  each short prompt in the prefill (ms): queue (of it the driver taking it in, "
              "then its first plan), compute (of it the host launching, then the device and "
              "the token's way back)")
        for t in mixed.get("short_prefill_ms", []):
            print("    " + ", ".join(f"{k.removeprefix('prefill_')} {t[k]:.1f}" for k in t))
    print("\ntargets (one H200, same-run engine bounds):")
    judged = {r.level: j for r in results if (j := judge(r)) is not None}
    for level, j in judged.items():
        sign = ">=" if TARGETS[level][3] else "<="
        second = (f"; the decode's first token {j['second_token_ratio']:.2f}x"
                  if "second_token_ratio" in j else "")
        print(f"{level:>14}: {j['what']}: {j['value']:.1f} / {j['bound']:.1f} = "
              f"{j['ratio']:.2f} (target {sign} {j['target']}) "
              f"{'holds' if j['holds'] else 'MISSED'}{second}")
    print("\nprobes during each level (/readyz of router, prefill, decode; decode /metrics; "
          "every 50 ms; target: each answer within 100 ms, all 200):")
    for r in results:
        print(f"{r.level:>14}: p99 {r.probe_p99_ms:7.1f} ms, max {r.probe_max_ms:7.1f} ms, "
              f"not 200: {r.probe_failures}; worst "
              + ", ".join(f"{u} {ms:.0f} (at {r.probe_worst_at_s.get(u, 0.0):.2f} s)"
                          for u, ms in r.probe_worst_ms.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": {"model": args.model, "device": args.device, "dtype": dtype,
                       "block_size": bs, "chunk_tokens": args.chunk_tokens,
                       "long_chunk_tokens": args.long_chunk_tokens,
                       "step_tokens": args.step_tokens, "num_blocks": args.num_blocks,
                       "bounds_num_blocks": bound_blocks, "pools": pools,
                       "min_requests": min_requests, "cpus": os.cpu_count(),
                       "router_workers": args.router_workers, "event_loop": loop},
            "skipped": skipped,
            "first_after_ready": first_after_ready,
            "targets": judged,
            "long_then_short": mixed,
            "compiled_while_serving": compiled,
            "bounds": bounds,
            "levels": [asdict(r) for r in results],
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
