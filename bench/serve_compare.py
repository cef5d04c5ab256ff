"""Served figures of several `pdd serve` settings side by side, each against one engine bound
measured in the same run, so a choice of default rests on figures from one card and one run.

Every mode is a whole P TP1 -> D TP1 stack (`bench/serve_path.py`'s, with pdd serve's defaults
unless the mode names a setting) driven with the same levels (`concurrency:prompt:max_tokens`,
streaming greedy completions of random token ids, ignore_eos). Modes, joined with `+`:

  default     pdd serve's defaults: the per-request P/D decision at its default threshold
  remote      --local-prefill-tokens 0: every prompt through the prefill (the decision off)
  local       every prompt of the levels prefilled on its decode
  aggregated  --prefill-replicas 0: one instance prefilling and decoding, all memory its KV
  bf16 / fp8  --kv-cache-dtype

Per level and mode: TTFT p50 and p99, TPOT p50, output tokens/s, the router's requests by path
(pdd_router_request_paths_total) and the ratio to the engine's bound (serve_path's
`level_bounds`). One burst of 64 requests varies by tens of % between two stacks of one run;
`--rounds R` starts every mode's stack R times, the order rotated each round, and takes each
figure's median over the rounds. Then, where the modes were run:
- remote and local: for each prompt length of the levels with max_tokens <= 2, which path's
  TTFT is lower, and the crossing point (the longest prompt where the decode's own prefill is
  not slower), the figure pdd serve's default threshold is set from;
- default and remote: the decision's targets (64:32:2 TTFT <= 1.1x the engine's bound with the
  decision on; 64:1024:128 unchanged within 3 %);
- fp8 and bf16 (or default, whose KV is the model's bf16): each level's TPOT and tokens/s
  of FP8 KV against bf16 KV, and the pools' tokens.

    python bench/serve_compare.py --quick                        # CPU, built-in model
    python bench/serve_compare.py --device cuda --model /dev/shm/pdd-random-v2lite-4 \
        --modes remote,local,default --levels 64:32:2,64:256:2,64:1024:2,64:1024:128
    python bench/serve_compare.py --device cuda --model CKPT --modes bf16,fp8 \
        --levels 1:256:128,64:256:128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import serve_path as sp  # noqa: E402
from stream_client import instance_pool, parse_metrics, rotated_rounds  # noqa: E402

from pdd_sidecar.model.config import load_config  # noqa: E402
from pdd_sidecar.serve.local_stack import LocalStack, StackConfig, check_config  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "remote": {"local_prefill_tokens": 0},
    "local": {"local_prefill_tokens": None},  # None: the levels' longest prompt
    "aggregated": {"prefill_replicas": 0},
    "bf16": {"kv_cache_dtype": "bfloat16"},
    "fp8": {"kv_cache_dtype": "fp8"},
}
QUICK_LEVELS = "4:16:2,4:64:2,4:64:8"  # also the CPU's default
DEFAULT_LEVELS = "64:32:2,64:128:2,64:256:2,64:512:2,64:1024:2,64:1024:128"
PATHS = ("remote_prefill", "local_prefill", "fallback")
DECISION_SHORT, DECISION_LONG = "64:32:2", "64:1024:128"
DECISION_SHORT_TARGET, DECISION_LONG_TOLERANCE = 1.1, 0.03


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for mode in modes:
        for part in mode.split("+"):
            if part not in MODES:
                raise argparse.ArgumentTypeError(
                    f"--modes: {part!r} in {mode!r} is not one of {', '.join(MODES)}")
    if not modes:
        raise argparse.ArgumentTypeError("--modes: name at least one mode")
    return modes


def mode_config(base: StackConfig, mode: str, longest_prompt: int) -> StackConfig:
    """The stack of one mode: the base (pdd serve's defaults) with the mode's settings."""
    settings: dict[str, Any] = {}
    for part in mode.split("+"):
        for key, value in MODES[part].items():
            settings[key] = longest_prompt if value is None else value
    return replace(base, **settings)


def router_paths(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        metrics = parse_metrics(resp.read().decode())
    return {p: sum(v for k, v in metrics.items()
                   if k.startswith("pdd_router_request_paths_total") and f'path="{p}"' in k)
            for p in PATHS}


def run_mode(cfg: StackConfig, levels: list[sp.LevelSpec], min_requests: int, vocab: int,
             bounds: dict[str, Any], log_dir: str | None) -> dict[str, Any]:
    stack = LocalStack(cfg, log_dir)
    out: dict[str, Any] = {"layout": cfg.layout(), "levels": [], "paths": {}, "pools": {}}
    try:
        t0 = time.perf_counter()
        stack.start()
        out["start_s"] = time.perf_counter() - t0
        roles = (("prefill", stack.prefill_url), ("decode", stack.decode_url)) \
            if cfg.prefill_replicas else (("decode", stack.decode_url),)
        out["pools"] = {role: instance_pool(url) for role, url in roles}
        capacity = min(p["tokens"] for p in out["pools"].values())
        kept, skipped = sp.plan_levels(levels, sys.maxsize, capacity)
        out["skipped"] = skipped
        for why in skipped:
            print(f"  skipped {why}", flush=True)
        # The first request after ready, as a user's first one meets it (a path warm-up
        # left cold shows here), then each level's shape once at up to 8 streams, untimed.
        first = kept[0]
        r = asyncio.run(sp.run_level(stack, sp.LevelSpec(1, first.prompt, 2), 1, vocab, 900))
        out["first_ttft_ms"] = r.ttft_p50_ms
        print(f"  first request after ready (1:{first.prompt}:2): TTFT {r.ttft_p50_ms:.1f} ms",
              flush=True)
        for i, lv in enumerate(kept):
            c = min(lv.concurrency, 8)
            asyncio.run(sp.run_level(stack, sp.LevelSpec(c, lv.prompt, lv.max_tokens), c,
                                     vocab, 500 + i))
        for i, lv in enumerate(kept):
            before = router_paths(stack.url)
            r = asyncio.run(sp.run_level(stack, lv, max(lv.concurrency, min_requests), vocab,
                                         i + 1))
            stack.raise_if_dead()
            after = router_paths(stack.url)
            r.bounds = sp.level_bounds(r, lv, bounds)
            r.timings = []
            out["levels"].append(r)
            out["paths"][lv.label] = {p: after[p] - before[p] for p in PATHS}
            print(f"  {sp.row(r)}  paths "
                  + ", ".join(f"{p} {n:.0f}" for p, n in out["paths"][lv.label].items() if n),
                  flush=True)
            print("    stages p50 ms: " + ", ".join(f"{k} {v:.1f}"
                                                 for k, v in r.timing_p50_ms.items()), flush=True)
    finally:
        stack.stop()
        if not log_dir:
            stack.cleanup()
    return out


MEDIAN_FIELDS = ("ttft_p50_ms", "ttft_p99_ms", "second_p50_ms", "tpot_p50_ms", "tokens_per_s")


def median_of_rounds(runs: list[dict[str, Any]], bounds: dict[str, Any]) -> dict[str, Any]:
    """One mode's result from its rounds: each level's latencies and tokens/s the median over
    the rounds (its ratios to the engine's ``bounds`` taken again), the rest the first
    round's; the rounds themselves kept under ``rounds``."""
    out = {**runs[0], "rounds": [[asdict(lv) for lv in r["levels"]] for r in runs]}
    levels = []
    for i, lv in enumerate(runs[0]["levels"]):
        same = [r["levels"][i] for r in runs]
        med = replace(lv, **{f: statistics.median(getattr(x, f) for x in same)
                             for f in MEDIAN_FIELDS})
        med.bounds = sp.level_bounds(med, sp.parse_levels(lv.level)[0], bounds)
        levels.append(med)
    out["levels"] = levels
    return out


def by_level(result: dict[str, Any]) -> dict[str, sp.LevelResult]:
    return {r.level: r for r in result["levels"]}


def crossing(remote: dict[str, Any], local: dict[str, Any]) -> tuple[list[str], int | None]:
    """Lines comparing the two paths' TTFT per prompt length (levels of at most 2 tokens out),
    and the longest prompt at which the decode's own prefill is not slower (every ratio is
    printed: a reader sees where the two cross and how noisy that is)."""
    rem, loc = by_level(remote), by_level(local)
    shared = sorted((r for k, r in rem.items() if k in loc and r.max_tokens <= 2),
                    key=lambda r: (r.concurrency, r.prompt))
    lines, best = [], None
    for r in shared:
        other = loc[r.level]
        ratio = other.ttft_p50_ms / r.ttft_p50_ms if r.ttft_p50_ms else float("nan")
        lines.append(f"{r.level:>14}: TTFT p50 remote {r.ttft_p50_ms:8.1f} ms, local "
                     f"{other.ttft_p50_ms:8.1f} ms, local/remote {ratio:5.2f}")
        if ratio <= 1.0:
            best = r.prompt if best is None else max(best, r.prompt)
    return lines, best


def decision_targets(default: dict[str, Any], remote: dict[str, Any]) -> list[str]:
    out = []
    d, r = by_level(default), by_level(remote)
    if DECISION_SHORT in d:
        lv = d[DECISION_SHORT]
        bound = lv.bounds.get("ttft_bound_ms", float("nan"))
        ratio = lv.ttft_p50_ms / bound
        off = r[DECISION_SHORT].ttft_p50_ms if DECISION_SHORT in r else float("nan")
        out.append(f"{DECISION_SHORT}: TTFT p50 with the decision on {lv.ttft_p50_ms:.1f} ms / "
                   f"engine bound {bound:.1f} ms = {ratio:.2f} (target <= "
                   f"{DECISION_SHORT_TARGET}) "
                   f"{'holds' if ratio <= DECISION_SHORT_TARGET else 'MISSED'}; off {off:.1f} ms")
    if DECISION_LONG in d and DECISION_LONG in r:
        on, off = d[DECISION_LONG].ttft_p50_ms, r[DECISION_LONG].ttft_p50_ms
        tps_on, tps_off = d[DECISION_LONG].tokens_per_s, r[DECISION_LONG].tokens_per_s
        change = on / off - 1
        out.append(f"{DECISION_LONG}: TTFT p50 on {on:.1f} ms, off {off:.1f} ms: "
                   f"{change * 100:+.1f} % (target within {DECISION_LONG_TOLERANCE * 100:.0f} %) "
                   f"{'holds' if abs(change) <= DECISION_LONG_TOLERANCE else 'MISSED'}; tok/s "
                   f"on {tps_on:.0f}, off {tps_off:.0f}")
    return out


def kv_dtype_lines(bf16: dict[str, Any], fp8: dict[str, Any]) -> list[str]:
    b, f = by_level(bf16), by_level(fp8)
    lines = [f"KV pool tokens (decode): bf16 {bf16['pools']['decode']['tokens']}, fp8 "
             f"{fp8['pools']['decode']['tokens']} "
             f"({fp8['pools']['decode']['tokens'] / bf16['pools']['decode']['tokens']:.2f}x)"]
    for level in (k for k in b if k in f):
        x, y = b[level], f[level]
        lines.append(f"{level:>14}: TPOT p50 bf16 {x.tpot_p50_ms:7.2f} ms, fp8 "
                     f"{y.tpot_p50_ms:7.2f} ms ({y.tpot_p50_ms / x.tpot_p50_ms:.2f}x); tok/s "
                     f"bf16 {x.tokens_per_s:8.1f}, fp8 {y.tokens_per_s:8.1f} "
                     f"({y.tokens_per_s / x.tokens_per_s:.2f}x); TTFT p50 bf16 "
                     f"{x.ttft_p50_ms:.1f}, fp8 {y.ttft_p50_ms:.1f} ms")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"CPU, builtin model, levels {QUICK_LEVELS}, modes remote,local,default")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default="builtin", help="builtin or a checkpoint folder")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--levels", default=None, help="comma-separated concurrency:prompt:max_tokens "
                   f"(default {DEFAULT_LEVELS}; on cpu {QUICK_LEVELS})")
    p.add_argument("--modes", type=parse_modes, default=None,
                   help=f"comma-separated, each of {', '.join(MODES)} or several joined with + "
                   "(default remote,local,default)")
    p.add_argument("--min-requests", type=int, default=None,
                   help="requests per level: max(concurrency, this) (default 8; --quick 4)")
    p.add_argument("--reps", type=int, default=10, help="timed decode steps per bound")
    p.add_argument("--rounds", type=int, default=1,
                   help="every mode's stack this many times, the order rotated each round; "
                   "each figure the median over rounds (default 1)")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="keep each stack's logs under DIR/<mode> (default: removed)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds: at least 1, got {args.rounds}")
    if args.quick:
        args.device, args.model = "cpu", "builtin"
    modes = args.modes or ["remote", "local", "default"]
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    try:
        levels = sp.parse_levels(args.levels or (QUICK_LEVELS if args.device == "cpu" else
                                                 DEFAULT_LEVELS))
    except ValueError as exc:
        p.error(str(exc))
    min_requests = args.min_requests or (4 if args.quick else 8)
    cfg = load_config(args.model)
    bs = sp.DEFAULT_BLOCK_SIZES[args.device]
    step, chunk, long_chunk = sp.step_budget(args.device, None, None, None)
    req, levels, skipped = sp.bounds_request(args.model, args.device, dtype, bs, levels,
                                             step, chunk, long_chunk, args.reps)
    for why in skipped:
        print(f"skipped {why}", flush=True)
    if not levels:
        p.error("--levels: every level was skipped")
    env = sp.budget_env(req)
    print(f"serve_compare: model {args.model}, {args.device} {dtype}, block {bs}, modes "
          f"{', '.join(modes)}, levels {', '.join(lv.label for lv in levels)}", flush=True)
    t0 = time.perf_counter()
    bounds = sp.run_bounds(req, {**os.environ, **env})
    print(f"engine bounds ({bounds['decode_mode']} decode, {time.perf_counter() - t0:.0f}s):",
          flush=True)
    for key, ms in {**bounds["prefill_ms"], **bounds["decode_step_ms"]}.items():
        print(f"  {'prefill' if 'x' in key else 'decode step'} {key}: {ms:.2f} ms", flush=True)
    top = max(lv.concurrency for lv in levels)
    base = StackConfig(model=args.model, device=args.device, port=0, dtype=dtype,
                       max_num_seqs=max(256, top), max_waiting=max(256, 2 * top),
                       log_level="WARNING", drain_s=1.0)
    longest = max(lv.prompt for lv in levels)
    configs = {mode: mode_config(base, mode, longest) for mode in modes}
    for mode, mcfg in configs.items():
        found = check_config(mcfg)
        if found:
            p.error(f"--modes {mode}: " + "; ".join(found))
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for rnd, mode in rotated_rounds(modes, args.rounds):
        mcfg = configs[mode]
        print(f"\nmode {mode}" + (f", round {rnd + 1}" if args.rounds > 1 else "")
              + f": {mcfg.layout()}, local prefill up to {mcfg.local_prefill_tokens} tokens, "
              f"KV {mcfg.kv_cache_dtype}", flush=True)
        print(f"  {sp.HEADER}", flush=True)
        name = mode if args.rounds == 1 else f"{mode}-{rnd + 1}"
        log_dir = str(Path(args.log_dir) / name) if args.log_dir else None
        run = run_mode(mcfg, levels, min_requests, cfg.vocab_size, bounds, log_dir)
        runs[mode].append(run)
        print("  KV pools: " + "; ".join(f"{role} {pool['tokens']} tokens ({pool['sized_by']})"
                                         for role, pool in run["pools"].items()), flush=True)
    results = {mode: median_of_rounds(r, bounds) for mode, r in runs.items()}
    if args.rounds > 1:
        print(f"\nmedians over {args.rounds} rounds:", flush=True)
        for mode, r in results.items():
            print(f"  mode {mode}\n  {sp.HEADER}", flush=True)
            for lv in r["levels"]:
                print(f"  {sp.row(lv)}", flush=True)
    summary: list[str] = []
    if "remote" in results and "local" in results:
        lines, best = crossing(results["remote"], results["local"])
        summary += ["the two paths' TTFT (the crossing point sets pdd serve's default "
                    "--local-prefill-tokens):", *lines,
                    f"the decode's own prefill is not slower at {best} prompt tokens, the longest"
                    if best is not None else "the decode's own prefill is slower at every length"]
    if "default" in results and "remote" in results:
        summary += ["the decision's targets (default against remote, same run):",
                    *decision_targets(results["default"], results["remote"])]
    ref = "bf16" if "bf16" in results else "default"  # the default KV is the model's dtype
    if ref in results and "fp8" in results:
        summary += [f"FP8 KV against {ref} (bf16) KV (same run):",
                    *kv_dtype_lines(results[ref], results["fp8"])]
    print("\n" + "\n".join(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": {"model": args.model, "device": args.device, "dtype": dtype,
                       "block_size": bs, "modes": modes, "skipped": skipped},
            "bounds": bounds, "summary": summary,
            "rounds": args.rounds,
            "modes": {m: {**r, "levels": [asdict(lv) for lv in r["levels"]]}
                      for m, r in results.items()},
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
