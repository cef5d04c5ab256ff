#!/usr/bin/env python3
"""Why a bf16 sweep row differs from the single-GPU reference: logit margins, no P/D hand-off.

For each prompt of the sweep, the single-rank reference (tp1/dcp1) is run keeping its logits;
then each single-instance TP/DCP layout (ranks as local processes over NCCL, no prefill/decode
split, no NIXL) is run twice: free-running (its own greedy tokens, compared with the reference's:
first divergence) and teacher-forced along the reference's tokens with in-process ranks (so the
logits of every step are comparable). A flip is a step where the layout's argmax differs from
the reference's; it is printed with the reference's top-1 minus top-2 logit gap at that step and
the largest logit difference between the two runs over all steps. Small gaps and differences of
bf16 size mean the divergence is rounding (reduction order across TP ranks), not the data path.

    python tests/gpu/bf16_margin.py --device cuda --dtype bfloat16 --layouts 2x1,2x2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "tests" / "dataplane", ROOT / "sidecar", ROOT / "operator"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from test_sweep import BLOCK, MAX_TOKENS, PROMPT_LENGTHS, _prompt  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layouts", default="2x1,2x2", help="comma list of TPxDCP")
    ap.add_argument("--prompts", default=",".join(map(str, PROMPT_LENGTHS)))
    a = ap.parse_args(argv)
    import torch

    from pdd_sidecar.engine.generate import generate_result

    layouts = [tuple(int(v) for v in s.split("x")) for s in a.layouts.split(",") if s]
    lengths = [int(n) for n in a.prompts.split(",") if n]

    def logits_of(res: object) -> list[torch.Tensor]:
        return [res.prompt_logits[-1], *res.step_logits]  # type: ignore[attr-defined]

    def gap(v: torch.Tensor) -> float:
        top = torch.topk(v.float(), 2).values
        return float(top[0] - top[1])

    print(f"{a.dtype} on {a.device}: reference tp1/dcp1 vs single-instance layouts "
          f"(blockSize {BLOCK}, {MAX_TOKENS} greedy tokens)")
    print(f"{'prompt':>6} {'layout':>8} {'free-run 1st diff':>17} {'min ref gap':>11} "
          f"{'max |dlogit|':>12}  flips (step: ref gap / layout gap)")
    for n in lengths:
        ref = generate_result("builtin", _prompt(n), MAX_TOKENS, block_size=BLOCK,
                              dtype=a.dtype, device=a.device, keep_logits=True)
        ref_logits = logits_of(ref)
        min_gap = min(gap(v) for v in ref_logits)
        for tp, dcp in layouts:
            kw = dict(block_size=BLOCK, dtype=a.dtype, device=a.device, tp=tp, dcp=dcp)
            free = generate_result("builtin", _prompt(n), MAX_TOKENS, launcher="procs",
                                   **kw).token_ids
            diff = next((i for i, (x, y) in enumerate(zip(free, ref.token_ids, strict=True))
                         if x != y), None)
            # Logits cannot come back from the process launcher (a tensor through its queue
            # outlives the rank that sent it), so the forced run uses in-process ranks.
            forced = generate_result("builtin", _prompt(n), MAX_TOKENS, keep_logits=True,
                                     forced_ids=ref.token_ids, launcher="inproc", **kw)
            lay = logits_of(forced)
            flips = []
            worst = 0.0
            for step, (r, l_) in enumerate(zip(ref_logits, lay, strict=True)):
                worst = max(worst, float((r.float() - l_.float()).abs().max()))
                if int(torch.argmax(r)) != int(torch.argmax(l_)):
                    flips.append(f"{step}: {gap(r):.4f} / {gap(l_):.4f}")
            print(f"{n:>6} {f'tp{tp}/dcp{dcp}':>8} {('-' if diff is None else diff):>17} "
                  f"{min_gap:>11.4f} {worst:>12.4f}  {'; '.join(flips) or '-'}", flush=True)
            if diff is not None:
                print(f"{'':>6} {'':>8} free-run tokens {free}\n{'':>6} {'':>8} reference       "
                      f"{ref.token_ids}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
