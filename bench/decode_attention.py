"""Paged MLA decode attention: pdd's Triton kernel (bf16 and FP8 caches) against FlashMLA (the
optional ``sgl-flash-mla`` wheel: dense bf16, and its sparse FP8 kernel with every token
selected) and against the same run's HBM roofline, at the shapes serving sees.

DeepSeek-V2-Lite attention: latent 512 + 64, 64-token blocks, a cache of two layers (a block's
slice of one layer is strided, as in the engine), shuffled block tables, one query token per
sequence. Each kernel is timed as the engine runs it, inside a CUDA graph (``--reps`` calls per
replay, best of ``--samples`` replays), so launch overhead counts as it does in a captured
step. The roofline is the KV bytes a step must read (``batch x context x token bytes``: 1,152
bf16, 656 FP8) at the same run's HBM read rate (a reduction over 2 GiB). A cache smaller than
the L2 (50 MB on an H100: 1 x 1k, 1 x 32k) stays there across the graph's calls, so those
shapes can pass the HBM roofline. Every kernel's output is compared with the Triton bf16
kernel's (max error relative to the output's largest value: FP8 shows its quantisation there).

    python bench/decode_attention.py --device cuda                       # the default shapes
    python bench/decode_attention.py --device cuda --shapes 1x32k --heads 16 --tune
    python bench/decode_attention.py --device cpu --shapes 1x256 --reps 1   # reference only

``--tune`` sweeps the FP8 kernel's tile (``BLOCK_N``), warps and stages per shape and prints the
best next to the default (mla_decode.FP8_BLOCK_N / FP8_NUM_WARPS / FP8_NUM_STAGES). Both FP8
variants run (``triton_fp8``: scales applied to each group's scores and probabilities;
``triton_fp8_tile``: the K tile dequantised, then the bf16 kernel's dots), each with the split
kernel's registers and spills.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))

from pdd_sidecar.kv import fp8_layout  # noqa: E402
from pdd_sidecar.model.kernels import flashmla_decode as fm  # noqa: E402
from pdd_sidecar.model.kernels import mla_decode as md  # noqa: E402
from pdd_sidecar.model.kernels.decode_backend import flashmla_wins  # noqa: E402
from pdd_sidecar.model.kernels.kv_write import write_latents  # noqa: E402

C, R, BS, LAYERS = 512, 64, 64, 2
DEFAULT_SHAPES = "1x1k,1x32k,1x128k,16x32k,64x4k,128x4k"
TUNE = [(32, 4, 2), (64, 4, 2), (64, 8, 2), (32, 4, 3), (64, 4, 3), (128, 8, 2), (16, 4, 2)]

Fn = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def parse_shape(s: str) -> tuple[int, int]:
    b, ctx = s.lower().split("x")
    mult = 1024 if ctx.endswith("k") else 1
    return int(b), int(ctx.rstrip("k")) * mult


def time_graph(fn: Fn, reps: int, samples: int, device: torch.device) -> float:
    """Seconds per call: ``reps`` calls captured in one CUDA graph, best replay of
    ``samples`` (eager on the CPU)."""
    fn()
    if device.type != "cuda":
        best = float("inf")
        for _ in range(samples):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best = min(best, (time.perf_counter() - t0) / reps)
        return best
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except Exception as e:  # not capturable: timed eagerly, and said so
        print(f"    (not capturable: {type(e).__name__}: {str(e)[:100]}; timed eagerly)")
        torch.cuda.synchronize()

        def run() -> object:
            return [fn() for _ in range(reps)]
    else:
        run = graph.replay  # type: ignore[assignment]
    run()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return best


def hbm_read_rate(device: torch.device) -> float:
    """Bytes read per second by a reduction over 2 GiB (read-only traffic: the roofline's
    rate; a copy's read rate would be half the bus, the other half writing)."""
    if device.type != "cuda":
        return float("nan")
    x = torch.ones(2**30, dtype=torch.bfloat16, device=device)
    t = time_graph(lambda: (x.sum(dtype=torch.float32), x), 5, 10, device)
    return x.numel() * x.element_size() / t


def build(
    batch: int, ctx: int, heads: int, device: torch.device, g: torch.Generator
) -> dict[str, Any]:
    per_seq = -(-ctx // BS)
    nb = batch * per_seq + 1
    kv = torch.empty(nb, LAYERS, BS, C + R, dtype=torch.bfloat16, device=device)
    fp8 = torch.empty(nb, LAYERS, BS, fp8_layout.token_bytes(C, R), dtype=torch.uint8,
                      device=device)
    layer = LAYERS - 1
    step = 4096 // BS  # blocks filled per write
    for b0 in range(0, nb, step):
        n = min(step, nb - b0) * BS
        vals = torch.randn(n, C + R, generator=g, device=device).to(torch.bfloat16)
        ids = torch.arange(n, device=device)
        kv[b0:b0 + n // BS, layer] = vals.view(-1, BS, C + R)
        write_latents(fp8, layer, b0 + ids // BS, ids % BS, None, vals, kv_lora_rank=C)
    perm = torch.randperm(nb - 1, generator=g, device=device) + 1
    tables = perm[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, C + R, generator=g, device=device).to(torch.bfloat16)
    return {"kv": kv, "fp8": fp8, "tables": tables, "lens": lens, "q": q, "layer": layer}


def variants(case: dict[str, Any], flash: Any, scale: float) -> dict[str, Fn]:
    q, tables, lens, layer = case["q"], case["tables"], case["lens"], case["layer"]
    out: dict[str, Fn] = {
        "triton_bf16": lambda: md.paged_mla_decode_triton(
            q, case["kv"], layer, tables, lens, C, scale),
        "triton_fp8": lambda: md.paged_mla_decode_triton(
            q, case["fp8"], layer, tables, lens, C, scale, fp8_kernel="groups"),
        "triton_fp8_tile": lambda: md.paged_mla_decode_triton(
            q, case["fp8"], layer, tables, lens, C, scale, fp8_kernel="tile"),
    }
    if flash is not None:
        out["flashmla_bf16"] = lambda: fm.flashmla_decode(
            flash, q, case["kv"], layer, tables, lens, C, scale)
        out["flashmla_fp8 (experimental)"] = lambda: fm.flashmla_decode_fp8(
            flash, q, case["fp8"], layer, tables, lens, C, scale)
    return out


def run_shape(
    shape: str, heads: int, args: argparse.Namespace, flash: Any, rate: float,
    device: torch.device, g: torch.Generator, name: str,
) -> dict[str, Any]:
    """One shape's row: every variant's time, roofline share and error, printed."""
    scale = 192**-0.5
    batch, ctx = parse_shape(shape)
    case = build(batch, ctx, heads, device, g)
    if device.type != "cuda":
        t = time_graph(lambda: md.paged_mla_decode_ref(
            case["q"], case["kv"], case["layer"], case["tables"], case["lens"], C,
            scale), args.reps, args.samples, device)
        print(f"{heads:>3}h {shape:>7} reference {t * 1e3:.3f} ms")
        return {}
    row: dict[str, Any] = {"shape": shape, "heads": heads, "device": name}
    base_o, _ = md.paged_mla_decode_triton(
        case["q"], case["kv"], case["layer"], case["tables"], case["lens"], C, scale)
    scale_o = float(base_o.abs().max())
    line = [f"{heads:>3}h {shape:>7}"]
    for vname, fn in variants(case, flash, scale).items():
        tok = 656 if "fp8" in vname else 1152
        roof = batch * ctx * tok / rate
        try:
            o, _ = fn()
            err = float((o - base_o).abs().max()) / scale_o
            t = time_graph(fn, args.reps, args.samples, device)
        except Exception as e:  # a FlashMLA kernel that refuses the shape
            row[vname] = {"error": f"{type(e).__name__}: {e}"[:200]}
            line.append(f"{vname} n/a ({type(e).__name__}: {str(e)[:80]})")
            continue
        row[vname] = {"us": t * 1e6, "roofline": roof / t, "err": err}
        regs = ""
        if vname.startswith("triton"):
            fn()  # the split kernel just launched is this variant's
            k = md.LAST_LAUNCH.get("split")
            row[vname]["regs"] = getattr(k, "n_regs", None)
            row[vname]["spills"] = getattr(k, "n_spills", None)
            regs = f" regs {row[vname]['regs']} spills {row[vname]['spills']}"
        line.append(f"{vname} {t * 1e6:8.1f} us {roof / t:5.0%} roof err {err:.1e}{regs}")
    if "us" not in row["triton_fp8"]:
        print("\n    ".join(line), flush=True)
        return row
    tb, t8 = row["triton_bf16"]["us"], row["triton_fp8"]["us"]
    for fname in ("flashmla_bf16", "flashmla_fp8 (experimental)"):
        if "us" in row.get(fname, {}):
            fl = row[fname]["us"]
            line.append(f"Triton bf16 / {fname} time {tb / fl:.2f}, "
                        f"Triton FP8 / {fname} time {t8 / fl:.2f}")
    line.append(f"Triton FP8 speed-up over Triton bf16 {tb / t8:.2f}x")
    if "us" in row.get("flashmla_bf16", {}):  # what a user gets: PDD_ATTENTION_BACKEND=auto
        pick = "flashmla_bf16" if flashmla_wins(batch, heads) else "triton_bf16"
        row["auto"] = pick
        line.append(f"default (auto) runs {pick}: time / flashmla_bf16 "
                    f"{row[pick]['us'] / row['flashmla_bf16']['us']:.2f}")
    print("\n    ".join(line), flush=True)
    if args.tune:
        for variant in ("groups", "tile"):
            best = None
            for bn, w, st in TUNE:
                def fn8(bn: int = bn, w: int = w, st: int = st, v: str = variant) -> Any:
                    return md.paged_mla_decode_triton(
                        case["q"], case["fp8"], case["layer"], case["tables"], case["lens"],
                        C, scale, block_n=bn, num_warps=w, num_stages=st, fp8_kernel=v)
                try:
                    t = time_graph(fn8, args.reps, args.samples, device)
                except Exception as e:
                    print(f"    tune {variant} {bn}/{w}/{st}: {type(e).__name__}: "
                          f"{str(e)[:80]}", flush=True)
                    continue
                if best is None or t < best[0]:
                    best = (t, bn, w, st)
                print(f"    tune fp8 {variant} BLOCK_N {bn} warps {w} stages {st}: "
                      f"{t * 1e6:.1f} us", flush=True)
            row[f"fp8_{variant}_tuned"] = best
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="batch x context, comma-separated")
    p.add_argument("--heads", default="16,128", help="query heads, comma-separated")
    p.add_argument("--heads-128-shapes", default="1x32k,64x4k",
                   help="shapes also run at heads above 16 (all when empty)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--tune", action="store_true", help="sweep the FP8 kernel's launch settings")
    p.add_argument("--json", default="", help="write the rows here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible")
    try:
        import flash_mla  # type: ignore[import-not-found]

        flash: Any = flash_mla if device.type == "cuda" else None
        flash_note = f"flash_mla {getattr(flash_mla, '__version__', '?')}"
    except ImportError as e:
        flash, flash_note = None, f"no FlashMLA ({e})"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rate = hbm_read_rate(device)
    print(f"decode attention on {name}, torch {torch.__version__}, {flash_note}; "
          f"HBM read rate {rate / 1e9:.0f} GB/s; graph of {args.reps} calls, best of "
          f"{args.samples}", flush=True)
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    extra = {s.strip() for s in args.heads_128_shapes.split(",") if s.strip()}
    for heads in [int(h) for h in args.heads.split(",")]:
        for shape in args.shapes.split(","):
            if heads > 16 and extra and shape not in extra:
                continue
            row = run_shape(shape, heads, args, flash, rate, device, g, name)
            if row:
                rows.append(row)
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
