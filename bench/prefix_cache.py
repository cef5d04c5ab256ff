"""The prefix cache (prefill and decode) on against off, in one run, on the two workloads it is
for.

(a) **Shared system prompt**: ``--shared`` tokens every request starts with, then ``--unique``
tokens of its own; ``--concurrency`` requests at once, ``--rounds`` times.
(b) **Multi-turn chats**: ``--chats`` conversations at once, ``--turns`` turns each; a turn's
prompt is the previous turn's prompt, its answer and ``--turn-tokens`` new user tokens.

Each workload runs on a whole local stack (`pdd serve` as a library: prefill, decode, router,
real NIXL hand-offs), once with the cache on and once started with ``--no-prefix-cache``'s
setting. Completions stream with ``stream_options.include_usage``; per phase (a round, a turn)
the table gives TTFT p50/p99, the prompt tokens the prefill computed (its own
``pdd_prefill_computed_tokens`` counter; the answers' ``usage.prompt_tokens_details.cached_tokens``
give those it took from its cache) and the KV bytes the decode READ
(``pdd_kv_transfer_bytes`` on its /metrics), also over the KV of the phase's new tokens (those
the decode has not held yet: a turn's new user tokens, a round's own tokens; all of the first
phase's prompt), at the bytes per token the cache-off run moved. The prefill's cache saves
prefill compute; the decode's keeps each finished conversation's KV, so a follow-up turn (routed
back to it) READs only the tokens after what it holds (its whole units and the partial last one).

    python bench/prefix_cache.py --quick        # CPU, built-in model, about a minute
    python bench/prefix_cache.py --device cuda --prefill-tp 2 --prefill-dcp 2 --decode-tp 2 \\
        --decode-dcp 2 --model /models/DeepSeek-V2-Lite-Chat
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
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
    TIMING_NAMES,
    instance_pool,
    parse_metrics,
    stage_medians,
    stream_completion,
)

from pdd_sidecar.model.config import load_config  # noqa: E402
from pdd_sidecar.serve.local_stack import (  # noqa: E402
    DEFAULT_BLOCK_SIZES,
    LocalStack,
    StackConfig,
    check_config,
)


@dataclass
class Phase:
    workload: str  # "shared" | "chat"
    cache: bool
    phase: int  # round or turn, from 1
    requests: int
    errors: int
    prompt_tokens: int
    computed_tokens: int  # prompt tokens the prefill ran (not taken from its cache)
    cached_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    kv_bytes_read: float  # by the decode, over NIXL
    new_tokens: int  # prompt tokens the decode has not held before this phase
    kv_over_new: float = float("nan")  # kv_bytes_read / the new tokens' KV (set at the end)
    timing_p50_ms: dict[str, float] = field(default_factory=dict)  # pdd.timing stage medians
    tokens: list[list[int]] = field(default_factory=list)  # each answer's, [] for a failed one


@dataclass
class Answer:
    ttft: float
    tokens: list[int]
    cached: int
    timing: dict[str, float] = field(default_factory=dict)


def pct(xs: list[float], q: int) -> float:
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int],
                   max_tokens: int) -> Answer | str:
    """One streamed completion: time to its first token, its tokens and cached tokens."""
    got = await stream_completion(session, url, prompt, max_tokens, include_usage=True)
    if isinstance(got, str):
        return got
    assert got.usage is not None
    return Answer(got.times[0] - got.start, got.tokens,
                  got.usage["prompt_tokens_details"]["cached_tokens"],
                  dict(got.pdd.get("timing") or {}))


async def counter(session: aiohttp.ClientSession, url: str, name: str) -> float:
    """The sum of a counter's samples on an instance's /metrics."""
    async with session.get(f"{url}/metrics") as resp:
        metrics = parse_metrics(await resp.text())
    return sum(v for k, v in metrics.items() if k.split("{")[0] == name)


async def kv_bytes(session: aiohttp.ClientSession, decode_url: str) -> float:
    return await counter(session, decode_url, "pdd_kv_transfer_bytes_total")


async def computed(session: aiohttp.ClientSession, prefill_url: str) -> float:
    return await counter(session, prefill_url, "pdd_prefill_computed_tokens_total")


async def phase(stack: LocalStack, session: aiohttp.ClientSession, workload: str, cache: bool,
                number: int, prompts: list[list[int]], max_tokens: int,
                new: list[int]) -> tuple[Phase, list[Answer | str]]:
    before = await kv_bytes(session, stack.decode_url)
    ran_before = await computed(session, stack.prefill_url)
    answers = await asyncio.gather(*(complete(session, stack.url, p, max_tokens)
                                     for p in prompts))
    moved = await kv_bytes(session, stack.decode_url) - before
    ran = await computed(session, stack.prefill_url) - ran_before
    ok = [(p, a) for p, a in zip(prompts, answers, strict=True) if isinstance(a, Answer)]
    failed = [a for a in answers if isinstance(a, str)]
    if failed:
        print(f"  {len(failed)} failed, e.g. {failed[0]}", file=sys.stderr, flush=True)
    ttft = [a.ttft for _, a in ok]
    prompt_tokens = sum(len(p) for p, _ in ok)
    cached = sum(a.cached for _, a in ok)
    new_tokens = sum(n for n, a in zip(new, answers, strict=True) if isinstance(a, Answer))
    stages = stage_medians(a.timing for _, a in ok)
    return Phase(workload, cache, number, len(prompts), len(failed), prompt_tokens,
                 int(ran), cached, pct(ttft, 50) * 1e3, pct(ttft, 99) * 1e3,
                 moved, new_tokens, timing_p50_ms=stages,
                 tokens=[a.tokens if isinstance(a, Answer) else [] for a in answers]
                 ), list(answers)


def tokens(n: int, salt: int, span: int, base: int) -> list[int]:
    return [(17 * salt + 31 * j + 7 * (j // 5) * salt) % span + base for j in range(n)]


async def run_stack(stack: LocalStack, args: argparse.Namespace, cache: bool,
                    span: int, base: int) -> list[Phase]:
    timeout = aiohttp.ClientTimeout(total=1800)
    conn = aiohttp.TCPConnector(limit=max(args.concurrency, args.chats) + 4)
    out: list[Phase] = []
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        await complete(session, stack.url, tokens(8, 9999, span, base), 2)  # warm-up
        system = tokens(args.shared, 1, span, base)
        for r in range(args.rounds):
            prompts = [system + tokens(args.unique, 1000 + r * args.concurrency + i, span, base)
                       for i in range(args.concurrency)]
            new = [len(q) if r == 0 else args.unique for q in prompts]
            ph, _ = await phase(stack, session, "shared", cache, r + 1, prompts, args.max_tokens,
                                new)
            out.append(ph)
        chats = [tokens(args.turn_tokens, 5000 + c, span, base) for c in range(args.chats)]
        for t in range(args.turns):
            new = [len(q) if t == 0 else args.turn_tokens for q in chats]
            ph, answers = await phase(stack, session, "chat", cache, t + 1, chats,
                                      args.max_tokens, new)
            out.append(ph)
            chats = [chat + (a.tokens if isinstance(a, Answer) else [])
                     + tokens(args.turn_tokens, 7000 + 97 * c + t, span, base)
                     for c, (chat, a) in enumerate(zip(chats, answers, strict=True))]
    return out


HEADER = (f"{'workload':>8} {'phase':>5} {'reqs':>5} {'err':>4} {'prompt':>8} "
          f"{'computed off':>12} {'computed on':>11} {'TTFT p50 off/on ms':>19} "
          f"{'TTFT p99 off/on ms':>19} {'KV MB/req off/on':>17} {'KV/new KV off/on':>17}")


def row(off: Phase, on: Phase) -> str:
    def mb(p: Phase) -> float:
        return p.kv_bytes_read / max(1, p.requests - p.errors) / 1e6

    return (f"{on.workload:>8} {on.phase:>5} {on.requests:>5} {off.errors + on.errors:>4} "
            f"{on.prompt_tokens:>8} {off.computed_tokens:>12} {on.computed_tokens:>11} "
            f"{off.ttft_p50_ms:>9.1f}/{on.ttft_p50_ms:<9.1f} "
            f"{off.ttft_p99_ms:>9.1f}/{on.ttft_p99_ms:<9.1f} {mb(off):>8.2f}/{mb(on):<8.2f} "
            f"{off.kv_over_new:>8.2f}/{on.kv_over_new:<8.2f}")


def per_token_bytes(off: list[Phase]) -> float:
    """KV bytes READ per prompt token with nothing cached (decode ranks that each read a
    chunk count once per rank, as the counter does)."""
    tokens = sum(p.prompt_tokens for p in off)
    return sum(p.kv_bytes_read for p in off) / tokens if tokens else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small sizes for CPU: 256 shared + 32 unique tokens, 8 at once, "
                   "3 turns of 4 chats")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default="builtin")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--prefill-dcp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--decode-dcp", type=int, default=1)
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: pdd serve's, 64 on cuda, 16 on cpu)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per rank of each instance (default: pdd serve's, sized from "
                   "GPU memory on cuda, 1024 on cpu)")
    p.add_argument("--shared", type=int, default=None, help="system prompt tokens (2048)")
    p.add_argument("--unique", type=int, default=None, help="tokens of each request (128)")
    p.add_argument("--concurrency", type=int, default=None, help="requests at once (64)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the shared workload")
    p.add_argument("--chats", type=int, default=None, help="conversations at once (16)")
    p.add_argument("--turns", type=int, default=None, help="turns per conversation (8)")
    p.add_argument("--turn-tokens", type=int, default=None, help="new user tokens a turn (128)")
    p.add_argument("--max-tokens", type=int, default=None, help="answer tokens (32; quick 4)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="keep each stack's logs in DIR/on, DIR/off")
    args = p.parse_args(argv)
    q = args.quick
    for name, full, quick in (("shared", 2048, 256), ("unique", 128, 32),
                              ("concurrency", 64, 8), ("chats", 16, 4), ("turns", 8, 3),
                              ("turn_tokens", 128, 48), ("max_tokens", 32, 4)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    span, base = 256, 0
    if args.model != "builtin":
        vocab = load_config(args.model).vocab_size
        span, base = min(1000, vocab // 2), min(100, vocab // 4)
    args.block_size = args.block_size or DEFAULT_BLOCK_SIZES[args.device]
    blocks = (f"{args.num_blocks} blocks per rank" if args.num_blocks
              else "pdd serve's KV pools")
    print(f"prefix cache: P tp{args.prefill_tp}/dcp{args.prefill_dcp} -> D tp{args.decode_tp}/"
          f"dcp{args.decode_dcp}, model {args.model}, {args.device}, block {args.block_size}, "
          f"{blocks}; shared {args.shared} + {args.unique} x {args.concurrency} "
          f"x {args.rounds} rounds; {args.chats} chats x {args.turns} turns of "
          f"{args.turn_tokens} + {args.max_tokens}; cpus {os.cpu_count()}, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    results: list[Phase] = []
    pools: dict[bool, dict[str, Any]] = {}
    for cache in (False, True):
        cfg = StackConfig(prefill_tp=args.prefill_tp, prefill_dcp=args.prefill_dcp,
                          decode_tp=args.decode_tp, decode_dcp=args.decode_dcp,
                          model=args.model, device=args.device, port=0,
                          block_size=args.block_size, num_blocks=args.num_blocks,
                          dtype=args.dtype,
                          max_num_seqs=256, max_waiting=512, log_level="WARNING", drain_s=1.0,
                          prefix_cache=cache, local_prefill_tokens=0)  # the prefill's cache
        found = check_config(cfg)
        if found:
            p.error("; ".join(found))
        log_dir = Path(args.log_dir) / ("on" if cache else "off") if args.log_dir else None
        stack = LocalStack(cfg, log_dir)
        try:
            t0 = time.perf_counter()
            stack.start()
            pool = pools[cache] = {role: instance_pool(url) for role, url in (
                ("prefill", stack.prefill_url), ("decode", stack.decode_url))}
            print(f"cache {'on' if cache else 'off'}: stack ready in "
                  f"{time.perf_counter() - t0:.0f}s; KV pools: " + "; ".join(
                      f"{role} {kv['blocks']} blocks ({kv['tokens']} tokens, {kv['sized_by']})"
                      for role, kv in pool.items()), flush=True)
            results += asyncio.run(run_stack(stack, args, cache, span, base))
            stack.raise_if_dead()
        finally:
            stack.stop()
            stack.cleanup()
    off = [r for r in results if not r.cache]
    on = [r for r in results if r.cache]
    token_kv = per_token_bytes(off)
    for r in results:
        if r.new_tokens:
            r.kv_over_new = r.kv_bytes_read / (r.new_tokens * token_kv)
    print(HEADER)
    for a, b in zip(off, on, strict=True):
        print(row(a, b))
    print("\nmedian of each TTFT stage per request, ms (pdd.timing, docs/serving.md), off / on:")
    print(f"{'workload':>8} {'phase':>5} " + " ".join(f"{k[:13]:>13}" for k in TIMING_NAMES))
    nan = float("nan")
    for a, b in zip(off, on, strict=True):
        print(f"{a.workload:>8} {a.phase:>5} " + " ".join(
            f"{a.timing_p50_ms.get(k, nan):>6.1f}/{b.timing_p50_ms.get(k, nan):<6.1f}"
            for k in TIMING_NAMES))
    summary = {}
    for w in ("shared", "chat"):
        c_off = sum(r.computed_tokens for r in off if r.workload == w)
        c_on = sum(r.computed_tokens for r in on if r.workload == w)
        later = [r.kv_over_new for r in on if r.workload == w and r.phase > 1]
        # TTFT after the first phase (a warm cache: the steady state), off over on
        ttft_off = [r.ttft_p50_ms for r in off if r.workload == w and r.phase > 1]
        ttft_on = [r.ttft_p50_ms for r in on if r.workload == w and r.phase > 1]
        summary[w] = {"ttft_p50_off_over_on_after_first":
                      (statistics.median(ttft_off) / statistics.median(ttft_on)
                       if ttft_off and ttft_on else float("nan")),
                      "computed_off": c_off, "computed_on": c_on,
                      "computed_ratio": c_on / c_off if c_off else float("nan"),
                      "kv_bytes_off": sum(r.kv_bytes_read for r in off if r.workload == w),
                      "kv_bytes_on": sum(r.kv_bytes_read for r in on if r.workload == w),
                      "kv_over_new_max_after_first": max(later, default=float("nan"))}
        print(f"{w}: prompt tokens computed, on/off = {c_on}/{c_off} "
              f"= {summary[w]['computed_ratio']:.2f}; KV bytes per phase after the first over "
              f"its new tokens' KV, at most {summary[w]['kv_over_new_max_after_first']:.2f}; "
              f"TTFT p50 after the first phase, off/on = "
              f"{summary[w]['ttft_p50_off_over_on_after_first']:.2f}x")
    if summary["shared"]["computed_off"]:
        print(f"targets: shared TTFT p50 off/on "
              f"{summary['shared']['ttft_p50_off_over_on_after_first']:.2f}x (>= 3x on a GPU); "
              f"chat KV per turn over its new tokens' KV "
              f"{summary['chat']['kv_over_new_max_after_first']:.2f} (<= 1.1)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": vars(args) | {"pools": pools[True], "pools_cache_off": pools[False]},
            "kv_bytes_per_token": token_kv,
            "phases": [asdict(r) for r in results], "summary": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
