"""FP8 block-scaled matmuls against the bf16 matmuls of dequantized weights, for DeepSeek-V3's
linear layers as one tensor-parallel rank holds them.

The loader dequantizes DeepSeek's e4m3 weights (128x128 block scales) to the serving dtype. The
alternative is to keep them in FP8 and multiply with ``torch._scaled_mm`` (activations quantized
on the fly in 1x128 groups, weights in 128x128 blocks, as DeepSeek's own inference does). Per
layer shape and token count this times, in the same run:

- ``bf16``: ``F.linear`` on bf16 weights (what serving does now; the baseline);
- ``fp8``: activation quantization plus the scaled matmul (what serving would do);
- ``fp8 mm``: the scaled matmul alone, on already quantized activations;

and prints each FP8 time as a fraction of the bf16 time, the error of each result against fp32
arithmetic on the same (dequantized) weights, and weight bytes. Needs a GPU with FP8 tensor cores
(Hopper or later); elsewhere it says so and exits.

    python bench/fp8_linear.py --tp 8
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
BLOCK = 128


def v3_shapes(tp: int) -> list[tuple[str, int, int]]:
    """``(layer, out N, in K)`` of one TP rank's share of DeepSeek-V3 (hidden 7168, 128 heads,
    q LoRA 1536, kv LoRA 512, dense intermediate 18432, expert intermediate 2048)."""
    h, heads = 7168, 128 // tp
    return [
        ("q_a_proj", 1536, h),
        ("q_b_proj", heads * 192, 1536),
        ("kv_a_proj", 576, h),
        ("kv_b_proj", heads * 256, 512),
        ("o_proj", h, heads * 128),
        ("dense gate+up", 2 * 18432 // tp, h),
        ("dense down", h, 18432 // tp),
        ("expert gate+up", 2 * 2048 // tp, h),
        ("expert down", h, 2048 // tp),
    ]


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    blocks = F.pad(w.float(), (0, -k % BLOCK, 0, -n % BLOCK))
    blocks = blocks.unflatten(1, (-1, BLOCK)).unflatten(0, (-1, BLOCK))
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).flatten(2).flatten(0, 1)
    return q[:n, :k].contiguous(), scale  # scale [N/128, K/128]


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and 128 input features: DeepSeek's dynamic activation scheme."""
    m, k = x.shape
    g = x.float().unflatten(1, (-1, BLOCK))
    scale = (g.abs().amax(dim=-1) / E4M3_MAX).clamp(min=1e-12)
    q = (g / scale[..., None]).to(torch.float8_e4m3fn).flatten(1)
    return q, scale  # scale [M, K/128]


def dequant(q: torch.Tensor, scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    s = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return q.float() * s[: q.shape[0], : q.shape[1]]


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


# scale_a ``[M, K/128]`` and scale_b ``[K/128, N/128]`` in the memory orders a kernel may want;
# the first one whose product is right is used.
Layout = Callable[[torch.Tensor], torch.Tensor]
LAYOUTS: list[tuple[str, Layout, Layout]] = [
    ("a col-major, b row-major", _col_major, lambda sb: sb.t().contiguous()),
    ("a row-major, b row-major", torch.Tensor.contiguous, lambda sb: sb.t().contiguous()),
    ("a col-major, b col-major", _col_major, torch.Tensor.t),
    ("a row-major, b col-major", torch.Tensor.contiguous, torch.Tensor.t),
]


def time_cuda(fn: Callable[[], object], iters: int = 50) -> float:
    """Mean seconds per call over ``iters`` calls after warming up, timed with CUDA events."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1000 / iters)
    return best


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--tokens", default="1,8,64,256,2048,8192")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("fp8_linear: needs a CUDA GPU with FP8 tensor cores (sm_89 or later)")
        return 0
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  DeepSeek-V3 at tp {a.tp}")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    chosen: str | None = None
    header = f"{'layer':15} {'N':>6} {'K':>6} {'tokens':>6} {'bf16 us':>9} {'fp8/bf16':>9} " \
             f"{'mm/bf16':>8} {'err bf16':>9} {'err fp8':>8}"
    print(header)
    for layer, n, k in v3_shapes(a.tp):
        w = torch.randn(n, k, device=dev, generator=g) / k**0.5
        wq, ws = quantize_weight(w)
        w_deq = dequant(wq, ws, BLOCK, BLOCK)
        w_bf16 = w_deq.to(torch.bfloat16)
        for m in (int(t) for t in a.tokens.split(",")):
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            ref = x.float() @ w_deq.t()
            xq, xs = quantize_act(x)
            picked, last_err = None, ""
            for name, fa, fb in LAYOUTS:
                if chosen is not None and name != chosen:
                    continue
                try:
                    y = torch._scaled_mm(xq, wq.t(), fa(xs), fb(ws), out_dtype=torch.bfloat16)
                except (RuntimeError, ValueError) as exc:
                    last_err = str(exc).splitlines()[0][:100]
                    if chosen is None:
                        print(f"  ({name}: {last_err})")
                    continue
                if rel_err(y, ref) < 0.05:
                    picked = (name, fa, fb)
                    break
                if chosen is None:
                    print(f"  ({name}: wrong result, rel err {rel_err(y, ref):.3f})")
            if picked is None:
                print(f"{layer:15} {n:6} {k:6} {m:6}  no block-scaled _scaled_mm: {last_err}")
                continue
            chosen, fa, fb = picked
            wq_t, sa, sb = wq.t(), fa(xs), fb(ws)

            def fp8_mm(xq=xq, sa=sa, sb=sb, wq_t=wq_t) -> torch.Tensor:
                return torch._scaled_mm(xq, wq_t, sa, sb, out_dtype=torch.bfloat16)

            def fp8_full(x=x, wq_t=wq_t, sb=sb, fa=fa) -> torch.Tensor:
                q, s = quantize_act(x)
                return torch._scaled_mm(q, wq_t, fa(s), sb, out_dtype=torch.bfloat16)

            t_bf16 = time_cuda(lambda x=x, w_bf16=w_bf16: F.linear(x, w_bf16))
            t_full = time_cuda(fp8_full)
            t_mm = time_cuda(fp8_mm)
            e_bf16 = rel_err(F.linear(x, w_bf16), ref)
            e_fp8 = rel_err(fp8_full(), ref)
            row = dict(layer=layer, n=n, k=k, tokens=m, bf16_s=t_bf16, fp8_s=t_full, mm_s=t_mm,
                       err_bf16=e_bf16, err_fp8=e_fp8)
            rows.append(row)
            print(f"{layer:15} {n:6} {k:6} {m:6} {t_bf16 * 1e6:9.1f} {t_full / t_bf16:9.2f} "
                  f"{t_mm / t_bf16:8.2f} {e_bf16:9.1e} {e_fp8:8.1e}")
    if chosen:
        print(f"scale layout: {chosen}")
    tot_bf16 = sum(2 * n * k for _, n, k in v3_shapes(a.tp))
    tot_fp8 = sum(n * k + 4 * -(-n // BLOCK) * -(-k // BLOCK) for _, n, k in v3_shapes(a.tp))
    print(f"weight bytes of these shapes: bf16 {tot_bf16:,}  fp8+scales {tot_fp8:,} "
          f"({tot_fp8 / tot_bf16:.2f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
