"""KV memory as a user gets it: the pool's defaults against explicit settings, the host tier
under the prefix cache, and a burst that shares one uncached prefix — in one run, on one device.

Every stack is `pdd serve` as a library, configured through `pdd serve`'s own parser, so
"defaults" are exactly what a user typing `pdd serve --device cuda --model DIR` gets.

(a) **defaults against explicit pools**: 64 and 256 at once of (1k prompt, 128 out), and a
    closed loop of 256 requests, 64 in flight, prompts lognormal around 1k (64 to 8k), outputs
    uniform 16 to 512; each with the defaults and with each ``--explicit`` pool. The defaults
    also take one ``--long`` prompt each (32k, 128k on a GPU): accepted or refused.
(b) **host tier**: documents of ``--doc-tokens`` (8k-32k), a working set ``--working-set``
    times the device prefix capacity (the device pool set small with ``--b-num-blocks``),
    revisited at random with a short question each; TTFT p50 with the host tier and without,
    and the host->device load rate against the same run's pinned copy rate.
(c) **no reuse**: the closed loop of (a) on fresh prompts in (b)'s small pool, where every
    eviction is an offload: the host tier on against off.
(d) **a burst sharing one uncached prefix**: 64 x 2,048 tokens sharing their first 1,536;
    prompt tokens computed (prompt - cached) over the distinct tokens, and the TTFT p50 over
    that of the same burst without the shared part (64 x 512 fresh, plus one 1,536 prompt).

    python bench/kv_tiers.py --quick                      # CPU, built-in model, a few minutes
    python bench/kv_tiers.py --device cuda --model DIR --json kv_tiers.json

Targets (issue 38): (a) defaults within 10 % of the best explicit pool in throughput and TTFT
p50, 32k and 128k accepted; (b) TTFT p50 with the tier >= 4x lower, load rate >= 80 % of the
pinned copy rate; (c) throughput with the tier within 3 % of off; (d) computed <= 1.05 x
distinct, TTFT p50 <= 1.2 x the burst without the shared part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sidecar"))
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT / "bench"))

import aiohttp  # noqa: E402
from stream_client import parse_metrics, stream_completion  # noqa: E402

from pdd_sidecar.model.config import load_config  # noqa: E402
from pdd_sidecar.serve.local_stack import (  # noqa: E402
    LocalStack,
    StackConfig,
    check_config,
    config_from_args,
    parser,
)


@dataclass
class Load:
    """One load on one stack."""
    stack: str
    load: str
    requests: int
    errors: int
    wall_s: float
    out_tokens: int
    prompt_tokens: int
    cached_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    first_error: str = ""

    @property
    def tok_s(self) -> float:
        return self.out_tokens / self.wall_s if self.wall_s else float("nan")

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass
class Run:
    loads: list[Load] = field(default_factory=list)
    stacks: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> flags, pool, ...
    summary: dict[str, Any] = field(default_factory=dict)


def pct(xs: Sequence[float], q: int) -> float:
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


class Prompts:
    """Token ids in the checkpoint's range; each salt its own sequence, so prompts of different
    salts share no block."""

    def __init__(self, span: int, base: int) -> None:
        self.span, self.base = span, base

    def make(self, n: int, salt: int) -> list[int]:
        rng = random.Random(salt * 7919 + 17)
        return [rng.randrange(self.span) + self.base for _ in range(n)]


async def send(session: aiohttp.ClientSession, url: str, prompt: list[int],
               max_tokens: int) -> tuple[float, int, int] | str:
    """(TTFT s, output tokens, cached tokens), or why it failed."""
    got = await stream_completion(session, url, prompt, max_tokens, include_usage=True)
    if isinstance(got, str):
        return got
    assert got.usage is not None
    cached = int((got.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return got.times[0] - got.start, len(got.tokens), cached


async def run_load(session: aiohttp.ClientSession, url: str, stack: str, name: str,
                   work: Sequence[tuple[list[int], int]], in_flight: int) -> Load:
    """``work`` (prompt, max tokens) with at most ``in_flight`` outstanding (a closed loop;
    len(work) in flight is a burst)."""
    gate = asyncio.Semaphore(in_flight)

    async def one(prompt: list[int], out: int) -> tuple[float, int, int] | str:
        async with gate:
            return await send(session, url, prompt, out)

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(p, o) for p, o in work))
    wall = time.perf_counter() - t0
    ok = [(p, g) for (p, _), g in zip(work, got, strict=True) if not isinstance(g, str)]
    errors = [g for g in got if isinstance(g, str)]
    ttft = [g[0] for _, g in ok]  # type: ignore[index]
    return Load(stack, name, len(work), len(errors), wall,
                sum(g[1] for _, g in ok), sum(len(p) for p, _ in ok),  # type: ignore[index]
                sum(g[2] for _, g in ok), pct(ttft, 50) * 1e3, pct(ttft, 99) * 1e3,  # type: ignore[index]
                errors[0] if errors else "")


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as resp:
        return parse_metrics(await resp.text())


def summed(m: dict[str, float], *parts: str) -> float:
    """The sum of every sample whose name holds all of ``parts`` as words (``load`` is not a
    word of ``pdd_host_kv_offload_bytes_total``), counters' ``_created`` stamps left out."""
    words = {k: k.split("{")[0].split("_") for k in m}
    return sum(v for k, v in m.items()
               if words[k][-1] != "created" and all(p in words[k] for p in parts))


def stack_config(args: argparse.Namespace, flags: Sequence[str]) -> StackConfig:
    """What `pdd serve` would run with these flags (and the bench's device and model)."""
    argv = ["--device", args.device, "--model", args.model, "--port", "0", "--log-level",
            "WARNING", "--router-workers", "auto", *flags]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    return config_from_args(parser().parse_args(argv))


async def pool_info(session: aiohttp.ClientSession, stack: LocalStack) -> dict[str, Any]:
    """The served max_model_len and each instance's pool, as a user would read them."""
    info: dict[str, Any] = {}
    async with session.get(f"{stack.url}/v1/models") as resp:
        models = await resp.json()
    info["max_model_len"] = (models.get("data") or [{}])[0].get("max_model_len")
    for role, url in (("prefill", stack.prefill_url), ("decode", stack.decode_url)):
        m = await metrics(session, url)
        info[role] = {k.split("{")[0]: v for k, v in m.items()
                      if k.startswith(("pdd_kv_cache_", "pdd_kv_pool_", "pdd_kv_blocks"))}
    return info


def closed_loop_work(prompts: Prompts, n: int, seed: int,
                     quick: bool) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    lo, hi, mu = (32, 1024, math.log(256)) if quick else (64, 8192, math.log(1024))
    out_lo, out_hi = (4, 32) if quick else (16, 512)
    work = []
    for i in range(n):
        length = int(min(hi, max(lo, rng.lognormvariate(mu, 0.8))))
        work.append((prompts.make(length, seed * 100_000 + i), rng.randint(out_lo, out_hi)))
    return work


async def part_a_loads(session: aiohttp.ClientSession, stack: LocalStack, name: str,
                       args: argparse.Namespace, prompts: Prompts, salt: int) -> list[Load]:
    p, out = args.prompt_tokens, args.out_tokens
    loads = []
    for n in args.bursts:
        work = [(prompts.make(p, salt + n * 1000 + i), out) for i in range(n)]
        loads.append(await run_load(session, stack.url, name, f"burst {n}x({p},{out})", work, n))
    work = closed_loop_work(prompts, args.loop_requests, salt + 7, args.quick)
    label = f"closed loop {args.loop_requests}, {args.loop_in_flight} in flight"
    loads.append(await run_load(session, stack.url, name, label, work, args.loop_in_flight))
    return loads


async def part_b_loads(session: aiohttp.ClientSession, stack: LocalStack, name: str,
                       args: argparse.Namespace, prompts: Prompts, docs: int) -> list[Load]:
    """Visit each document once, then revisit them at random, a question each."""
    rng = random.Random(11)
    lengths = [rng.randint(*args.doc_tokens) for _ in range(docs)]
    texts = [prompts.make(n, 900_000 + d) for d, n in enumerate(lengths)]
    first = [(t + prompts.make(args.question_tokens, 950_000 + d), 8)
             for d, t in enumerate(texts)]
    loads = [await run_load(session, stack.url, name, f"first visits of {docs} documents",
                            first, args.b_in_flight)]
    order = [rng.randrange(docs) for _ in range(args.revisits)]
    again = [(texts[d] + prompts.make(args.question_tokens, 960_000 + i), 8)
             for i, d in enumerate(order)]
    loads.append(await run_load(session, stack.url, name, f"{args.revisits} revisits", again,
                                args.b_in_flight))
    return loads


async def part_d_loads(session: aiohttp.ClientSession, stack: LocalStack, name: str,
                       args: argparse.Namespace, prompts: Prompts) -> list[Load]:
    shared_n, own_n, n = args.d_shared, args.d_own, args.d_burst
    shared = prompts.make(shared_n, 777_001)
    work = [(shared + prompts.make(own_n, 777_100 + i), 2) for i in range(n)]
    with_shared = await run_load(session, stack.url, name,
                                 f"burst {n}x{shared_n + own_n}, {shared_n} shared", work, n)
    # The same work without a shared part: n fresh own parts plus one shared-length prompt.
    alone = [(prompts.make(own_n, 778_100 + i), 2) for i in range(n)]
    alone.append((prompts.make(shared_n, 778_001), 2))
    without = await run_load(session, stack.url, name,
                             f"burst {n}x{own_n} fresh + 1x{shared_n}", alone, n + 1)
    return [with_shared, without]


def pinned_copy_rate(device: str) -> float:
    """Host->device bytes/s from pinned memory, the same run's bound for the tier's loads,
    timed as the tier times its loads (kv/host_pool.py): a wall clock around a copy and a
    synchronize would count the launch and the host wait too, against the tier's events."""
    if device != "cuda":
        return float("nan")
    import torch

    from pdd_sidecar.kv.host_pool import pinned_copy_rate as rate

    out = rate(1 << 30, torch.device("cuda"))
    torch.cuda.empty_cache()
    return out


async def on_stack(args: argparse.Namespace, run: Run, name: str, flags: Sequence[str],
                   body: Any) -> None:
    cfg = stack_config(args, flags)
    found = check_config(cfg)
    if found:
        raise SystemExit(f"kv_tiers: stack {name} ({' '.join(flags) or 'defaults'}): "
                         + "; ".join(found))
    log_dir = Path(args.log_dir) / name if args.log_dir else None
    stack = LocalStack(cfg, log_dir)
    try:
        t0 = time.perf_counter()
        await asyncio.to_thread(stack.start)
        ready_s = time.perf_counter() - t0
        timeout = aiohttp.ClientTimeout(total=3600)
        conn = aiohttp.TCPConnector(limit=512)
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
            info = await pool_info(session, stack)
            run.stacks[name] = {"flags": list(flags), "ready_s": ready_s, **info}
            print(f"[{name}] ready in {ready_s:.0f}s; flags {' '.join(flags) or '(defaults)'}; "
                  f"max_model_len {info['max_model_len']}; prefill {info['prefill']}; "
                  f"decode {info['decode']}", flush=True)
            await body(session, stack)
        stack.raise_if_dead()
    finally:
        stack.stop()
        stack.cleanup()


def show(load: Load) -> None:
    err = f" ({load.errors} failed: {load.first_error[:120]})" if load.errors else ""
    print(f"  [{load.stack}] {load.load}: {load.tok_s:,.0f} out tok/s, TTFT p50 "
          f"{load.ttft_p50_ms:,.1f} ms p99 {load.ttft_p99_ms:,.1f} ms, prompt "
          f"{load.prompt_tokens}, cached {load.cached_tokens}{err}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes for the CPU")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default="builtin")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--parts", default="a,b,c,d", help="which parts to run (default a,b,c,d)")
    p.add_argument("--explicit", default=None,
                   help="explicit pools to compare with the defaults, ';'-separated flag sets "
                   "(default on cuda '--block-size 64 --num-blocks 3000'; quick "
                   "'--num-blocks 4096')")
    p.add_argument("--long", default=None, help="long prompts the defaults must accept "
                   "(default 32768,131072; quick 2048,6144)")
    p.add_argument("--host-gib", type=float, default=None,
                   help="--host-kv-cache-gib of the tier runs (default 32; quick 0.25)")
    p.add_argument("--b-num-blocks", type=int, default=None,
                   help="device pool of parts (b) and (c), per rank (default 1024 of 64; quick 256 "
                   "of 16)")
    p.add_argument("--working-set", type=float, default=3.0,
                   help="(b) documents' tokens over the device prefix capacity (default 3)")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--log-dir", default=None, metavar="DIR")
    args = p.parse_args(argv)
    q = args.quick
    args.bursts = (8, 16) if q else (64, 256)
    args.prompt_tokens, args.out_tokens = (128, 8) if q else (1024, 128)
    args.loop_requests, args.loop_in_flight = (32, 8) if q else (256, 64)
    args.doc_tokens = (256, 512) if q else (8192, 32768)
    args.question_tokens = 16 if q else 64
    args.revisits = 16 if q else 32
    args.b_in_flight = 4 if q else 8
    args.d_shared, args.d_own, args.d_burst = (192, 64, 8) if q else (1536, 512, 64)
    explicit = args.explicit or ("--num-blocks 4096" if q else "--block-size 64 --num-blocks 3000")
    explicit_sets = [s.split() for s in explicit.split(";") if s.strip()]
    longs = [int(x) for x in (args.long or ("2048,6144" if q else "32768,131072")).split(",")]
    host_gib = args.host_gib if args.host_gib is not None else (0.25 if q else 32.0)
    b_blocks = args.b_num_blocks or (256 if q else 1024)
    b_block = 16 if q and args.device == "cpu" else 64
    parts = set(args.parts.split(","))
    span, base = 256, 0
    if args.model != "builtin":
        vocab = load_config(args.model).vocab_size
        span, base = min(20000, vocab // 2), min(100, vocab // 4)
    prompts = Prompts(span, base)
    run = Run()
    print(f"kv_tiers: {args.device}, model {args.model}, parts {','.join(sorted(parts))}; cpus "
          f"{os.cpu_count()}, load average {os.getloadavg()[0]:.1f}", flush=True)
    copy_rate = pinned_copy_rate(args.device)

    async def main_async() -> None:
        if "a" in parts or "d" in parts:
            async def defaults(session: aiohttp.ClientSession, stack: LocalStack) -> None:
                if "a" in parts:
                    for load in await part_a_loads(session, stack, "defaults", args, prompts, 1):
                        run.loads.append(load)
                        show(load)
                    for n in longs:
                        load = await run_load(session, stack.url, "defaults", f"long {n}",
                                              [(prompts.make(n, 31 + n), 2)], 1)
                        run.loads.append(load)
                        show(load)
                if "d" in parts:
                    for load in await part_d_loads(session, stack, "defaults", args, prompts):
                        run.loads.append(load)
                        show(load)
            await on_stack(args, run, "defaults", [], defaults)
        if "a" in parts:
            for i, flags in enumerate(explicit_sets):
                name = f"explicit{i + 1}"

                async def explicit_body(session: aiohttp.ClientSession, stack: LocalStack,
                                        name: str = name) -> None:
                    for load in await part_a_loads(session, stack, name, args, prompts, 1):
                        run.loads.append(load)
                        show(load)
                await on_stack(args, run, name, flags, explicit_body)
        if "b" in parts or "c" in parts:
            # (b) and (c) share two stacks: a device pool small enough that the documents fill
            # --working-set times it, without and with the host tier. No reuse (c) in a small
            # pool evicts all the time: every eviction is an offload, the tier's worst case.
            bflags = ["--block-size", str(b_block), "--num-blocks", str(b_blocks)]
            mean_doc = sum(args.doc_tokens) / 2 + args.question_tokens
            docs = max(2, math.ceil(args.working_set * b_blocks * b_block / mean_doc))
            for name, flags in (("small pool", bflags),
                                ("small pool + host tier",
                                 [*bflags, "--host-kv-cache-gib", str(host_gib)])):
                async def bc_body(session: aiohttp.ClientSession, stack: LocalStack,
                                  name: str = name) -> None:
                    if "c" in parts:
                        work = closed_loop_work(prompts, args.loop_requests, 501, q)
                        load = await run_load(session, stack.url, name, "no reuse", work,
                                              args.loop_in_flight)
                        run.loads.append(load)
                        show(load)
                    if "b" not in parts:
                        return
                    before = await metrics(session, stack.prefill_url)
                    for load in await part_b_loads(session, stack, name, args, prompts, docs):
                        run.loads.append(load)
                        show(load)
                    after = await metrics(session, stack.prefill_url)
                    moved = {k: summed(after, "host", *k.split()) - summed(before, "host",
                                                                            *k.split())
                             for k in ("load bytes", "load seconds", "load copies",
                                       "offload bytes", "offload seconds", "offload copies")}
                    run.stacks[name]["host_tier_delta"] = moved
                    run.stacks[name]["documents"] = docs
                    print(f"  [{name}] host tier over (b): {moved}", flush=True)
                await on_stack(args, run, name, flags, bc_body)

    asyncio.run(main_async())
    run.summary = summarize(run, copy_rate)
    for k, v in run.summary.items():
        print(f"{k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"config": {k: v for k, v in vars(args).items() if not callable(v)},
             "pinned_copy_bytes_s": copy_rate, "stacks": run.stacks,
             "loads": [asdict(x) | {"tok_s": x.tok_s} for x in run.loads],
             "summary": run.summary}, indent=2, default=str) + "\n")
    failed = sum(x.errors for x in run.loads if not x.load.startswith("long"))
    return 1 if failed else 0


def summarize(run: Run, copy_rate: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    by = {(x.stack, x.load): x for x in run.loads}
    names = sorted({x.load for x in run.loads if x.stack.startswith("explicit")})
    for load in names:
        d = by.get(("defaults", load))
        best = [x for (s, lo), x in by.items() if lo == load and s.startswith("explicit")]
        if d is None or not best:
            continue
        tok = max(x.tok_s for x in best)
        ttft = min(x.ttft_p50_ms for x in best)
        out[f"(a) {load}"] = (f"defaults {d.tok_s:,.0f} tok/s = {d.tok_s / tok:.2f} of the best "
                              f"explicit; TTFT p50 {d.ttft_p50_ms:,.1f} ms = "
                              f"{d.ttft_p50_ms / ttft:.2f}x the best (target >= 0.90 and <= 1.10)")
    for x in run.loads:
        if x.load.startswith("long"):
            out[f"(a) {x.load} with defaults"] = ("accepted" if not x.errors else
                                                  f"REFUSED: {x.first_error[:160]}")
    off, on = by.get(("small pool", f"{_revisits(run)} revisits")), None
    on = by.get(("small pool + host tier", f"{_revisits(run)} revisits"))
    if off and on:
        delta = run.stacks.get("small pool + host tier", {}).get("host_tier_delta", {})
        rate = (delta.get("load bytes", 0.0) / delta["load seconds"]
                if delta.get("load seconds") else float("nan"))
        per_copy = (delta.get("load bytes", 0.0) / delta["load copies"]
                    if delta.get("load copies") else float("nan"))
        out["(b) host tier"] = (f"revisit TTFT p50 {off.ttft_p50_ms:,.1f} ms without, "
                                f"{on.ttft_p50_ms:,.1f} ms with = "
                                f"{off.ttft_p50_ms / on.ttft_p50_ms:.2f}x lower (target >= 4); "
                                f"cached {off.cached_tokens} / "
                                f"{on.cached_tokens} of {on.prompt_tokens}; load rate "
                                f"{rate / 1e9:.1f} GB/s = {rate / copy_rate:.2f} of pinned copy "
                                f"{copy_rate / 1e9:.1f} GB/s (target >= 0.80), "
                                f"{per_copy / 2**20:.1f} MiB a copy")
    c_off = by.get(("small pool", "no reuse"))
    c_on = by.get(("small pool + host tier", "no reuse"))
    if c_off and c_on:
        out["(c) no reuse"] = (f"tier on {c_on.tok_s:,.0f} / off {c_off.tok_s:,.0f} tok/s = "
                               f"{c_on.tok_s / c_off.tok_s:.3f} (target >= 0.97)")
    d = [x for x in run.loads if x.stack == "defaults" and x.load.startswith("burst")
         and ("shared" in x.load or "fresh" in x.load)]
    if len(d) == 2:
        shared, fresh = d
        distinct = _distinct(shared)
        out["(d) shared burst"] = (f"computed {shared.computed_tokens} of {shared.prompt_tokens} "
                                   f"prompt tokens = {shared.computed_tokens / distinct:.3f} x the "
                                   f"{distinct} distinct (target <= 1.05); TTFT p50 "
                                   f"{shared.ttft_p50_ms:,.1f} ms = "
                                   f"{shared.ttft_p50_ms / fresh.ttft_p50_ms:.2f}x the burst "
                                   f"without a shared part (target <= 1.2)")
    return out


def _revisits(run: Run) -> int:
    return next((int(x.load.split()[0]) for x in run.loads if x.load.endswith("revisits")), 0)


def _distinct(load: Load) -> int:
    """Distinct prompt tokens of a shared burst: the shared part once, every own part."""
    words = load.load.replace(",", "").split()  # "burst NxT S shared"
    n, total = (int(v) for v in words[1].split("x"))
    shared = int(words[2])
    return shared + n * (total - shared)


if __name__ == "__main__":
    raise SystemExit(main())
