"""Decode-step MLA attention over the paged latent cache against context length.

Shape of DeepSeek-V2-Lite attention: 16 heads, latent 512 + rope 64, bf16, one layer, one query
token. Per context length it times the engine's decode path (gather the request's blocks from the
paged cache, absorbed attention returning output and LSE) and the attention alone on an already
contiguous latent array, and reports KV bytes read per second. As the yardstick it measures, in the
same run, a plain ``torch`` device copy of the same number of bytes and prints each rate as a
fraction of that copy bandwidth (bytes copied per second).

    python bench/decode_attention.py                  # CPU
    python bench/decode_attention.py --device cuda    # e.g. H200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))

from pdd_sidecar.kv.cache import PagedKVCache  # noqa: E402
from pdd_sidecar.model.mla import decode_attention  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(
    fn: Callable[[], object], device: torch.device, min_time: float, min_iters: int
) -> float:
    """Best (as timeit: the least disturbed) seconds per call over batches; batch size adapts
    so slow CPU points stay short."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    one = max(time.perf_counter() - t0, 1e-7)
    per_batch = max(1, int(min_time / 5 / one))
    samples = []
    for _ in range(max(5, min_iters // per_batch)):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) / per_batch)
    return min(samples)


def measure(ctx: int, args: argparse.Namespace, g: torch.Generator) -> dict[str, float]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    latent = args.kv_lora_rank + args.rope_dim
    scale = (128 + args.rope_dim) ** -0.5
    blocks = -(-ctx // args.block_size)
    # More than one layer so a block's slice of one layer is strided, as in the engine's cache.
    cache = PagedKVCache(blocks + 1, args.layers, args.block_size, latent, dtype, device)
    cache.allocate(1)  # the request does not start at block 0
    table = torch.tensor(cache.allocate(blocks), device=device)
    for b in range(0, cache.num_blocks, 256):
        chunk = cache.kv[b : b + 256]
        chunk.copy_(torch.randn(chunk.shape, generator=g).to(dtype))
    q = torch.randn(args.heads, latent, generator=g).to(device=device, dtype=dtype)
    layer = args.layers - 1
    kv_flat = cache.read(layer, table, ctx).contiguous()
    nbytes = ctx * latent * kv_flat.element_size()
    src = kv_flat.flatten()
    dst = torch.empty_like(src)

    def paged() -> object:
        return decode_attention(q, cache.read(layer, table, ctx), args.kv_lora_rank, scale)

    def contiguous() -> object:
        return decode_attention(q, kv_flat, args.kv_lora_rank, scale)

    t_copy = time_op(lambda: dst.copy_(src), device, args.min_time, args.min_iters)
    t_paged = time_op(paged, device, args.min_time, args.min_iters)
    t_contig = time_op(contiguous, device, args.min_time, args.min_iters)
    copy_bw = nbytes / t_copy
    return {
        "context": ctx,
        "kv_bytes": nbytes,
        "paged_ms": t_paged * 1e3,
        "paged_GBps": nbytes / t_paged / 1e9,
        "paged_vs_copy": nbytes / t_paged / copy_bw,
        "contig_ms": t_contig * 1e3,
        "contig_GBps": nbytes / t_contig / 1e9,
        "contig_vs_copy": nbytes / t_contig / copy_bw,
        "copy_GBps": copy_bw / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2, help="layers in the paged cache")
    p.add_argument(
        "--contexts",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1024 * 2**i for i in range(7)],
        help="comma-separated context lengths (default 1k..64k)",
    )
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of timing per point")
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print rows as JSON lines too")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible")
    dev_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(
        f"decode attention, {args.heads} heads, latent {args.kv_lora_rank}+{args.rope_dim}, "
        f"{args.dtype}, block {args.block_size}, device {dev_name}, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'context':>8} {'KV MiB':>8} {'paged ms':>9} {'GB/s':>7} {'/copy':>6}"
        f" {'contig ms':>9} {'GB/s':>7} {'/copy':>6} {'copy GB/s':>9}"
    )
    g = torch.Generator().manual_seed(0)
    for ctx in args.contexts:
        r = measure(ctx, args, g)
        print(
            f"{r['context']:>8} {r['kv_bytes'] / 2**20:>8.1f} {r['paged_ms']:>9.3f}"
            f" {r['paged_GBps']:>7.2f} {r['paged_vs_copy']:>6.2f} {r['contig_ms']:>9.3f}"
            f" {r['contig_GBps']:>7.2f} {r['contig_vs_copy']:>6.2f} {r['copy_GBps']:>9.2f}"
        )
        if args.json:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
