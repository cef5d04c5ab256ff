"""Prompt-lookup drafts' index of a long prompt: the time and memory of its first feed (the
decode's driver thread does it at the sequence's first drafting step, every running sequence
waiting), in bulk (hashed numpy arrays, the default from ``ngram.BULK_TOKENS`` tokens) against
the per-token dict (the baseline, the same run), and a later token's append and proposal.

    python bench/ngram_index.py --tokens 131072 --max-n 4,16
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))

from pdd_sidecar.engine.speculative import ngram  # noqa: E402


def measure(tokens: list[int], max_n: int, bulk: bool, later: int) -> dict[str, float]:
    saved = ngram.BULK_TOKENS
    ngram.BULK_TOKENS = saved if bulk else len(tokens) + 1
    try:
        index = ngram.NgramIndex(ngram.NgramConfig(k=3, max_n=max_n))
        tracemalloc.start()
        t0 = time.perf_counter()
        index.extend(tokens)
        first = time.perf_counter() - t0
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert bool(index._bulk) == bulk
        t0 = time.perf_counter()
        for i in range(later):
            index.extend([tokens[i * 7919 % len(tokens)]])
            index.propose()
        step = (time.perf_counter() - t0) / later
    finally:
        ngram.BULK_TOKENS = saved
    return {"first_feed_ms": first * 1e3, "held_mib": held / 2**20, "later_token_us": step * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-n", default="4,16", help="ngram maxN values, comma-separated")
    p.add_argument("--later", type=int, default=1000, help="tokens appended after the prompt")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    rng = random.Random(0)
    tokens = [rng.randrange(args.vocab) for _ in range(args.tokens)]
    rows: list[dict[str, Any]] = []
    print(f"{'maxN':>5} {'index':>6} {'first feed ms':>14} {'held MiB':>9} {'later µs':>9}")
    for max_n in (int(x) for x in args.max_n.split(",")):
        for bulk in (False, True):
            r = {"max_n": max_n, "index": "bulk" if bulk else "dict",
                 **measure(tokens, max_n, bulk, args.later)}
            rows.append(r)
            print(f"{max_n:>5} {r['index']:>6} {r['first_feed_ms']:>14.1f} "
                  f"{r['held_mib']:>9.1f} {r['later_token_us']:>9.1f}", flush=True)
        base, new = rows[-2], rows[-1]
        print(f"      bulk/dict: first feed {new['first_feed_ms'] / base['first_feed_ms']:.3f}x, "
              f"memory {new['held_mib'] / base['held_mib']:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": args.tokens, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
