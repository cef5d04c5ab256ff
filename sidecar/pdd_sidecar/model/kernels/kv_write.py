"""Masked store of new latents into the paged cache, for batches padded to a fixed size.

A padded decode batch (one captured CUDA graph per batch size) has rows that belong to no
sequence, and under DCP rows whose chunk another rank holds. Their writes must go nowhere: any
real slot they pointed at could belong to another sequence, or to blocks a KV pull is filling at
that moment. A data-dependent selection (``values[mask]``) would need the mask on the host, which
a graph cannot have, so on CUDA a Triton kernel stores only the rows whose mask is set; the CPU
(and CUDA without Triton, outside graphs) selects the rows in torch.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # machines without a GPU may have no Triton: torch serves them
    HAS_TRITON = False
else:
    HAS_TRITON = True


def write_latents(
    kv_cache: torch.Tensor,
    layer: int,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
    mask: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """``kv_cache[block_ids[i], layer, offsets[i]] = values[i]`` for every ``i`` with
    ``mask[i]``; rows without it touch nothing (their block id and offset are not read)."""
    if values.dim() != 2 or values.shape[1] != kv_cache.shape[-1]:
        raise ValueError(
            f"values must be [N, {kv_cache.shape[-1]}], got {tuple(values.shape)}"
        )
    n = values.shape[0]
    for name, t in (("block_ids", block_ids), ("offsets", offsets), ("mask", mask)):
        if t.shape != (n,):
            raise ValueError(f"{name} must be [{n}], got {tuple(t.shape)}")
    if n == 0:
        return
    if kv_cache.is_cuda and HAS_TRITON:
        layer_view = kv_cache[:, layer]
        vals = values.to(kv_cache.dtype).contiguous()
        latent = kv_cache.shape[-1]
        kernel: Any = _write_rows
        kernel[(n,)](
            layer_view, block_ids, offsets, mask, vals,
            layer_view.stride(0), layer_view.stride(1), vals.stride(0),
            L=latent, L_P2=max(16, 1 << (latent - 1).bit_length()),
        )  # fmt: skip
        return
    keep = mask.to(torch.bool)
    kv_cache[block_ids[keep].long(), layer, offsets[keep].long()] = values[keep].to(kv_cache.dtype)


if HAS_TRITON:

    @triton.jit
    def _write_rows(
        KV, BLK, OFF, MASK, V, stride_kvb, stride_kvt, stride_v,
        L: tl.constexpr, L_P2: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0)
        keep = tl.load(MASK + i) != 0
        blk = tl.load(BLK + i).to(tl.int64)
        off = tl.load(OFF + i).to(tl.int64)
        offs = tl.arange(0, L_P2)
        m = (offs < L) & keep
        row = tl.load(V + i.to(tl.int64) * stride_v + offs, mask=m, other=0.0)
        tl.store(KV + blk * stride_kvb + off * stride_kvt + offs, row, mask=m)


__all__ = ["HAS_TRITON", "write_latents"]
