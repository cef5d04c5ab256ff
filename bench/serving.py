"""Serving throughput against concurrency: decode dcp = 1 against dcp = N at the same KV memory.

Each layout runs as a whole local stack (`pdd serve` used as a library: a prefill instance, a
decode instance, the router, real NIXL hand-offs). Both decode layouts get the same KV blocks per
rank, sized so dcp = 1 holds only ``--seqs-at-dcp1`` sequences of prompt + max_tokens; with the
KV sharded over N ranks each sequence needs 1/N of the blocks per rank, so the decode should
admit N times as many. The yardstick is the dcp = 1 stack of the same run.

At every concurrency level, ``--requests-per-level`` x concurrency streaming completions go
through the router (ignore_eos, so every one is exactly ``--max-tokens`` long) from that many
concurrent clients. Reported per level: output tokens/s (all completion tokens over the level's
wall time), time to first token and time per output token (TPOT, per request: (last token - first
token) / (tokens - 1), median over requests), and from the decode's /metrics, sampled every
50 ms: the most sequences it admitted at once (pdd_running_sequences), the longest queue
(pdd_waiting_sequences), the fewest free blocks (pdd_kv_blocks_free) and the mean decode batch
(pdd_batch_size). The summary gives admitted(dcp=N) / admitted(dcp=1) at the top level (target:
exactly N) and the tokens/s ratio there.

With ``--tracing off,1%,100%`` the cost of traces instead: the decode dcp = N stack runs once
per sampling ratio and round (``--rounds``, the order rotated each round; OpenTelemetry on,
parent-based ratio sampler, spans exported over OTLP/HTTP to a receiver in this process that
counts them; docs/tracing.md), each level against the same run's untraced stacks: the medians
over rounds of TPOT p50 and output tokens/s as ratios to ``off`` (target: <= 2 % at 100 %),
and the spans the receiver got.

    python bench/serving.py --quick                       # CPU, built-in model, a few minutes
    python bench/serving.py --device cuda --decode-tp 4 --model /models/DeepSeek-V2-Lite-Chat
    python bench/serving.py --device cuda --decode-tp 1 --tracing off,1%,100%
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sidecar"))
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT / "bench"))

import aiohttp  # noqa: E402
from stream_client import parse_metrics, rotated_rounds, stream_completion  # noqa: E402
from trace_sink import TraceSink  # noqa: E402

from pdd_sidecar.model.config import load_config  # noqa: E402
from pdd_sidecar.serve.local_stack import LocalStack, StackConfig, check_config  # noqa: E402


@dataclass
class Level:
    decode_dcp: int
    concurrency: int
    requests: int
    errors: int
    seconds: float
    output_tokens: int
    tokens_per_s: float
    ttft_p50_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    max_running: int
    max_waiting: int
    min_blocks_free: int
    mean_batch: float
    tracing: str = "off"  # the sampling ratio the stack traced at (--tracing)
    spans: int = 0  # spans the receiver got during the level


class MetricsWatch:
    """Samples the decode's /metrics while a level runs; keeps the extremes."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url
        self.max_running = self.max_waiting = 0.0
        self.min_free = float("inf")
        self.batch: tuple[float, float] | None = None  # (sum, count) at the start

    async def scrape(self) -> dict[str, float]:
        async with self.session.get(f"{self.url}/metrics") as resp:
            return parse_metrics(await resp.text())

    async def run(self, stop: asyncio.Event) -> tuple[float, float]:
        first = await self.scrape()
        self.batch = (first.get("pdd_batch_size_sum", 0.0), first.get("pdd_batch_size_count", 0.0))
        last = first
        while True:
            s = last
            self.max_running = max(self.max_running, s.get("pdd_running_sequences", 0.0))
            self.max_waiting = max(self.max_waiting, s.get("pdd_waiting_sequences", 0.0))
            free = [v for k, v in s.items() if k.startswith("pdd_kv_blocks_free")]
            if free:
                self.min_free = min(self.min_free, min(free))
            if stop.is_set():
                break
            try:
                await asyncio.wait_for(stop.wait(), 0.05)
            except TimeoutError:
                pass
            last = await self.scrape()
        end = await self.scrape()
        return (end.get("pdd_batch_size_sum", 0.0) - self.batch[0],
                end.get("pdd_batch_size_count", 0.0) - self.batch[1])


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int],
                      max_tokens: int) -> tuple[float, list[float]] | str:
    got = await stream_completion(session, url, prompt, max_tokens)
    return got if isinstance(got, str) else (got.start, got.times)


async def run_level(stack: LocalStack, dcp: int, concurrency: int, n_requests: int,
                    prompts: list[list[int]], max_tokens: int) -> Level:
    timeout = aiohttp.ClientTimeout(total=600)
    conn = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        watch = MetricsWatch(session, stack.decode_url)
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch.run(stop))
        queue = list(range(n_requests))
        results: list[tuple[float, list[float]] | str] = []

        async def client() -> None:
            while queue:
                i = queue.pop()
                results.append(await one_request(session, stack.url, prompts[i % len(prompts)],
                                                 max_tokens))

        await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        seconds = time.perf_counter() - t0
        stop.set()
        batch_sum, batch_count = await watcher
    ok = [r for r in results if not isinstance(r, str)]
    failures = [r for r in results if isinstance(r, str)]
    if failures:
        kinds = {f.split(":")[0] for f in failures}
        print(f"  {len(failures)} failed ({', '.join(sorted(kinds))}), e.g. {failures[0]}",
              file=sys.stderr, flush=True)
    tokens = sum(len(t) for _, t in ok)
    ttft = [t[0] - s for s, t in ok]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for _, t in ok if len(t) > 1]

    def pct(xs: list[float], q: int) -> float:
        if len(xs) < 2:
            return xs[0] if xs else float("nan")
        return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]

    return Level(
        decode_dcp=dcp, concurrency=concurrency, requests=len(results),
        errors=len(results) - len(ok), seconds=seconds, output_tokens=tokens,
        tokens_per_s=tokens / seconds, ttft_p50_ms=pct(ttft, 50) * 1e3,
        tpot_p50_ms=pct(tpot, 50) * 1e3, tpot_p90_ms=pct(tpot, 90) * 1e3,
        max_running=int(watch.max_running), max_waiting=int(watch.max_waiting),
        min_blocks_free=int(watch.min_free) if watch.min_free != float("inf") else -1,
        mean_batch=batch_sum / batch_count if batch_count else float("nan"),
    )


def sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    """(prompt tokens, decode blocks per rank, blocks a sequence needs per rank at dcp = 1).

    The decode reserves prompt + max_tokens - 1 tokens of KV per sequence; the prompt is sized so
    that is a whole number of chunks divisible by N, so dcp = N needs exactly 1/N of the blocks.
    """
    n = args.decode_tp
    want = args.prompt_tokens + args.max_tokens - 1
    chunks = -(-want // args.block_size)
    chunks = -(-chunks // n) * n
    prompt = chunks * args.block_size - args.max_tokens + 1
    if prompt < 1:
        raise SystemExit("--max-tokens: too long for the chosen block size")
    return prompt, chunks * args.seqs_at_dcp1, chunks


def tracing_modes(text: str) -> list[str]:
    """``off,1%,100%`` (or ratios: ``0.01``) -> ["off", "0.01", "1"]; off always first."""
    out = ["off"]
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part == "off":
            continue
        try:
            ratio = float(part[:-1]) / 100 if part.endswith("%") else float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--tracing: off or a sampling ratio (1%, 0.01), got {part!r}") from None
        if not 0 < ratio <= 1:
            raise argparse.ArgumentTypeError(
                f"--tracing: a ratio in (0, 1] or a percentage in (0, 100]%, got {part!r}")
        out.append(f"{ratio:g}")
    return list(dict.fromkeys(out))


EXPORT_DELAY_MS = 1000


def tracing_env(mode: str, sink_url: str) -> dict[str, str]:
    """The standard OTEL_* variables the operator renders for spec.tracing at ``mode``."""
    if mode == "off":
        return {}
    # Batches every second instead of every 5 s (the SDK's default): each level's spans reach
    # the receiver before the next level starts, at a little more export work than by default.
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": sink_url, "OTEL_EXPORTER_OTLP_PROTOCOL":
            "http/protobuf", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": mode, "OTEL_BSP_SCHEDULE_DELAY": str(EXPORT_DELAY_MS)}


def row(r: Level, traced: bool = False) -> str:
    """A level's line; with ``traced`` (--tracing) led by the sampling ratio, ended by spans."""
    head = f"{r.tracing if r.tracing == 'off' else f'{float(r.tracing):.0%}':>5} " if traced \
        else ""
    return (f"{head}{r.decode_dcp:>4} {r.concurrency:>5} {r.requests:>5} {r.errors:>4} "
            f"{r.tokens_per_s:>9.1f} {r.ttft_p50_ms:>9.1f} {r.tpot_p50_ms:>9.2f} "
            f"{r.tpot_p90_ms:>9.2f} {r.max_running:>8} {r.max_waiting:>7} "
            f"{r.min_blocks_free:>6} {r.mean_batch:>6.2f}" + (f" {r.spans:>6}" if traced else ""))


HEADER = (f"{'dcp':>4} {'conc':>5} {'reqs':>5} {'err':>4} {'out tok/s':>9} "
          f"{'TTFT p50':>9} {'TPOT p50':>9} {'TPOT p90':>9} {'admitted':>8} {'waiting':>7} "
          f"{'free':>6} {'batch':>6}")
TRACED_HEADER = f"{'trace':>5} {HEADER} {'spans':>6}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small levels and few requests (a few minutes on 2 CPU cores)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default="builtin")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--decode-tp", type=int, default=2, help="N: decode ranks (dcp 1 against N)")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--prefill-dcp", type=int, default=1)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated levels (default 1,4,16,64,256; --quick 1,4,16,32)")
    p.add_argument("--requests-per-level", type=float, default=None,
                   help="requests per level as a multiple of its concurrency (default 4; "
                   "--quick 2), at least 8")
    p.add_argument("--prompt-tokens", type=int, default=48,
                   help="prompt length, rounded up so the KV fills whole chunks")
    p.add_argument("--max-tokens", type=int, default=None, help="default 32; --quick 16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seqs-at-dcp1", type=int, default=8,
                   help="sequences the decode's per-rank KV holds at dcp = 1 (default 8)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    p.add_argument("--tracing", type=tracing_modes, default=None, metavar="MODES",
                   help="measure traces' cost: decode dcp = N once per sampling ratio, e.g. "
                   "off,1%%,100%% (off is always run)")
    p.add_argument("--rounds", type=int, default=2,
                   help="with --tracing: every mode's stack this many times, the order rotated "
                   "each round; each figure is the median over rounds (default 2)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="keep each stack's logs in DIR/dcpN (default: a temporary folder, "
                   "removed)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds: at least 1, got {args.rounds}")
    levels = args.concurrency or ([1, 4, 16, 32] if args.quick else [1, 4, 16, 64, 256])
    per_level = args.requests_per_level or (2.0 if args.quick else 4.0)
    args.max_tokens = args.max_tokens or (16 if args.quick else 32)
    n = args.decode_tp
    prompt_len, decode_blocks, blocks_per_seq = sizes(args)
    top = max(levels)
    # The prefill holds each prompt's KV until the decode has read it: never its limit here.
    prefill_blocks = 2 * top * -(-(prompt_len) // args.block_size) + 64
    prompts = [[(17 * i + 31 * j + 7) % 256 for j in range(prompt_len)] for i in range(64)]
    if args.model != "builtin":
        vocab = load_config(args.model).vocab_size
        span = min(1000, vocab // 2)
        prompts = [[(17 * i + 31 * j + 7) % span + min(100, vocab - span)
                    for j in range(prompt_len)] for i in range(64)]
    print(f"serving: P tp{args.prefill_tp}/dcp{args.prefill_dcp} -> D tp{n}/dcp{{1,{n}}}, "
          f"model {args.model}, {args.device}, prompt {prompt_len} + {args.max_tokens} tokens, "
          f"block {args.block_size}, decode KV {decode_blocks} blocks per rank "
          f"({blocks_per_seq} per sequence at dcp 1 -> {decode_blocks // blocks_per_seq} "
          f"sequences; at dcp {n}: {decode_blocks // (blocks_per_seq // n)}), "
          f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}", flush=True)
    results: list[Level] = []
    runs = ([(n, mode) for _, mode in rotated_rounds(args.tracing, args.rounds)]
            if args.tracing else [(1, "off"), (n, "off")])
    sink = TraceSink() if args.tracing else None
    for i, (dcp, mode) in enumerate(runs):
        cfg = StackConfig(prefill_tp=args.prefill_tp, prefill_dcp=args.prefill_dcp,
                          decode_tp=n, decode_dcp=dcp, model=args.model, device=args.device,
                          port=0, block_size=args.block_size, prefill_num_blocks=prefill_blocks,
                          decode_num_blocks=decode_blocks, dtype=args.dtype,
                          max_num_seqs=max(256, top), max_waiting=max(256, 2 * top),
                          log_level="WARNING", drain_s=1.0, local_prefill_tokens=0,
                          extra_env=tracing_env(mode, sink.url if sink else ""))
        found = check_config(cfg)
        if found:
            p.error("; ".join(found))
        name = f"dcp{dcp}" + (f"-trace{mode}-{i}" if args.tracing else "")
        log_dir = Path(args.log_dir) / name if args.log_dir else None
        stack = LocalStack(cfg, log_dir)
        try:
            t0 = time.perf_counter()
            stack.start()
            print(f"decode dcp {dcp}: stack ready in {time.perf_counter() - t0:.0f}s "
                  f"(logs {stack.log_dir})", flush=True)
            # Warm-up; with --tracing at the top level too, so that no mode's first level meets
            # the first burst of concurrent prompts alone.
            asyncio.run(run_level(stack, dcp, 2, 4, prompts, args.max_tokens))
            if args.tracing:
                asyncio.run(run_level(stack, dcp, top, top, prompts, args.max_tokens))
            if sink is not None and mode != "off":
                time.sleep(2 * EXPORT_DELAY_MS / 1e3)  # its spans, before the first level's
            print(TRACED_HEADER if args.tracing else HEADER, flush=True)
            for c in levels:
                spans = sink.spans if sink else 0
                r = asyncio.run(run_level(stack, dcp, c, max(8, int(per_level * c)), prompts,
                                          args.max_tokens))
                stack.raise_if_dead()
                r.tracing = mode
                if sink is not None and mode != "off":
                    time.sleep(2 * EXPORT_DELAY_MS / 1e3)  # the level's last batches
                r.spans = (sink.spans - spans) if sink else 0
                results.append(r)
                print(row(r, bool(args.tracing)), flush=True)
        finally:
            stack.stop()
            stack.cleanup()
    if sink is not None:
        sink.close()
        return tracing_summary(args, levels, results)
    base = {r.concurrency: r for r in results if r.decode_dcp == 1}
    shard = {r.concurrency: r for r in results if r.decode_dcp == n}
    admitted = shard[top].max_running / max(1, base[top].max_running)
    speed = shard[top].tokens_per_s / base[top].tokens_per_s if base[top].tokens_per_s else 0.0
    print(f"\nat concurrency {top}: admitted dcp{n}/dcp1 = {shard[top].max_running}/"
          f"{base[top].max_running} = {admitted:.2f} (target {n}); output tokens/s "
          f"dcp{n}/dcp1 = {speed:.2f}; TPOT p50 {shard[top].tpot_p50_ms:.2f} vs "
          f"{base[top].tpot_p50_ms:.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": {k: v for k, v in vars(args).items() if k != "concurrency"}
            | {"concurrency": levels, "prompt_tokens": prompt_len,
               "decode_blocks_per_rank": decode_blocks, "blocks_per_seq_dcp1": blocks_per_seq},
            "levels": [asdict(r) for r in results],
            "summary": {"admitted_ratio": admitted, "tokens_per_s_ratio": speed,
                        "target_ratio": n},
        }, indent=2) + "\n")
    return 0


def tracing_summary(args: argparse.Namespace, levels: list[int], results: list[Level]) -> int:
    """Each traced level against the untraced runs of the same level (same stack layout, same
    run): the medians over rounds of TPOT p50 and output tokens/s, as ratios."""
    def median(mode: str, c: int, key: str) -> float:
        return statistics.median(getattr(r, key) for r in results
                                 if r.tracing == mode and r.concurrency == c)

    print(f"\ntraces' cost (decode dcp {args.decode_tp}; ratio to tracing off, same run, medians "
          f"over {args.rounds} rounds):")
    summary = []
    for mode in dict.fromkeys(r.tracing for r in results):
        for c in levels:
            each = [r for r in results if r.tracing == mode and r.concurrency == c]
            label = mode if mode == "off" else f"{float(mode):.0%}"
            print(f"  {label:>5} at concurrency {c:>4}: TPOT p50 per round "
                  f"{', '.join(f'{r.tpot_p50_ms:.2f}' for r in each)} ms, output tok/s "
                  f"{', '.join(f'{r.tokens_per_s:.0f}' for r in each)}")
    for mode in dict.fromkeys(r.tracing for r in results if r.tracing != "off"):
        for c in levels:
            tpot_off, speed_off = median("off", c, "tpot_p50_ms"), median("off", c, "tokens_per_s")
            tpot_on, speed_on = median(mode, c, "tpot_p50_ms"), median(mode, c, "tokens_per_s")
            tpot = tpot_on / tpot_off if tpot_off else float("nan")
            speed = speed_on / speed_off if speed_off else float("nan")
            spans = sum(r.spans for r in results if r.tracing == mode and r.concurrency == c)
            reqs = sum(r.requests for r in results if r.tracing == mode and r.concurrency == c)
            summary.append({"tracing": mode, "concurrency": c, "tpot_p50_ms": tpot_on,
                            "tpot_p50_ms_off": tpot_off, "tpot_p50_ratio": tpot,
                            "tokens_per_s_ratio": speed, "spans": spans, "requests": reqs})
            print(f"  {float(mode):>5.0%} at concurrency {c:>4}: TPOT p50 {tpot_on:.2f} vs "
                  f"{tpot_off:.2f} ms = {tpot:.3f}x, output tok/s {speed:.3f}x, {spans} spans "
                  f"for {reqs} requests")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": {k: v for k, v in vars(args).items() if k != "concurrency"}
            | {"concurrency": levels}, "levels": [asdict(r) for r in results],
            "tracing_summary": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
