"""Masked store of new latents into the paged cache, for batches padded to a fixed size.

A padded decode batch (one captured CUDA graph per batch size) has rows that belong to no
sequence, and under DCP rows whose chunk another rank holds. Their writes must go nowhere: any
real slot they pointed at could belong to another sequence, or to blocks a KV pull is filling at
that moment. A data-dependent selection (``values[mask]``) would need the mask on the host, which
a graph cannot have, so on CUDA a Triton kernel stores only the rows whose mask is set; the CPU
(and CUDA without Triton, outside graphs) selects the rows in torch.

A ``uint8`` cache keeps FP8 latents (kv/fp8_layout.py): the store quantises each row on the way
in (per-128 e4m3 scales for the ``kv_lora_rank`` no-RoPE values, RoPE kept in bf16), in the same
kernel on CUDA, with ``quantize_latents`` in torch elsewhere; the cache's dtype alone decides.
"""

from __future__ import annotations

from typing import Any

import torch

from pdd_sidecar.kv import fp8_layout
from pdd_sidecar.model.kernels import pdl
from pdd_sidecar.model.kernels.pow2 import next_pow2

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
    mask: torch.Tensor | None,
    values: torch.Tensor,
    *,
    kv_lora_rank: int | None = None,
) -> None:
    """``kv_cache[block_ids[i], layer, offsets[i]] = values[i]`` for every ``i`` with
    ``mask[i]``; rows without it touch nothing (their block id and offset are not read).
    ``mask=None`` stores every row. A ``uint8`` (FP8) cache needs ``kv_lora_rank`` (where the
    no-RoPE values end) and stores each row quantised."""
    if kv_cache.dtype == torch.uint8:
        _check_fp8(kv_cache, values, kv_lora_rank)
    elif values.dim() != 2 or values.shape[1] != kv_cache.shape[-1]:
        raise ValueError(
            f"values must be [N, {kv_cache.shape[-1]}], got {tuple(values.shape)}"
        )
    n = values.shape[0]
    if mask is None:
        mask = torch.ones(n, dtype=torch.int32, device=values.device)
    for name, t in (("block_ids", block_ids), ("offsets", offsets), ("mask", mask)):
        if t.shape != (n,):
            raise ValueError(f"{name} must be [{n}], got {tuple(t.shape)}")
    if n == 0:
        return
    if kv_cache.dtype == torch.uint8:
        assert kv_lora_rank is not None
        _write_fp8(kv_cache, layer, block_ids, offsets, mask, values, kv_lora_rank)
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
            **pdl.launch(vals.device, n),
        )  # fmt: skip
        return
    keep = mask.to(torch.bool)
    kv_cache[block_ids[keep].long(), layer, offsets[keep].long()] = values[keep].to(kv_cache.dtype)


def _check_fp8(kv_cache: torch.Tensor, values: torch.Tensor, kv_lora_rank: int | None) -> None:
    if kv_lora_rank is None:
        raise ValueError("kv_lora_rank is required to write into an FP8 (uint8) cache")
    if values.dim() != 2 or not 0 < kv_lora_rank < values.shape[1]:
        raise ValueError(
            f"values must be [N, {kv_lora_rank} + rope] (kv_lora_rank {kv_lora_rank}), "
            f"got {tuple(values.shape)}"
        )
    want = fp8_layout.token_bytes(kv_lora_rank, values.shape[1] - kv_lora_rank)
    if kv_cache.shape[-1] != want:
        raise ValueError(
            f"FP8 cache's last dimension is {kv_cache.shape[-1]} bytes, an FP8 latent of "
            f"{values.shape[1]} values with kv_lora_rank {kv_lora_rank} takes {want}"
        )


def _write_fp8(
    kv_cache: torch.Tensor,
    layer: int,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
    mask: torch.Tensor,
    values: torch.Tensor,
    nope: int,
) -> None:
    if kv_cache.is_cuda and HAS_TRITON:
        _write_fp8_triton(kv_cache, layer, block_ids, offsets, mask, values, nope)
        return
    keep = mask.to(torch.bool)
    packed = fp8_layout.quantize_latents(values[keep], nope)
    kv_cache[block_ids[keep].long(), layer, offsets[keep].long()] = packed


def _write_fp8_triton(
    kv_cache: torch.Tensor,
    layer: int,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
    mask: torch.Tensor,
    values: torch.Tensor,
    nope: int,
) -> None:
    """The Triton store (CUDA; tests run it in Triton's interpreter)."""
    layer_view = kv_cache[:, layer]
    vals = values.contiguous()
    rope = vals.shape[1] - nope
    groups = fp8_layout.num_groups(nope)
    kernel: Any = _write_rows_fp8
    kernel[(vals.shape[0],)](
        layer_view, block_ids, offsets, mask, vals,
        layer_view.stride(0), layer_view.stride(1), vals.stride(0),
        C=nope, R=rope, NG_P2=next_pow2(groups, 1), G_P2=next_pow2(min(nope, fp8_layout.GROUP)),
        R_P2=next_pow2(rope), E4M3_MAX=fp8_layout.E4M3_MAX, MIN_SCALE=fp8_layout._MIN_SCALE,
        **pdl.launch(vals.device, vals.shape[0]),
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _write_rows(
        KV, BLK, OFF, MASK, V, stride_kvb, stride_kvt, stride_v,
        L: tl.constexpr, L_P2: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        i = tl.program_id(0)
        pdl.pdl_wait(PDL)
        keep = tl.load(MASK + i) != 0
        blk = tl.load(BLK + i).to(tl.int64)
        off = tl.load(OFF + i).to(tl.int64)
        offs = tl.arange(0, L_P2)
        m = (offs < L) & keep
        row = tl.load(V + i.to(tl.int64) * stride_v + offs, mask=m, other=0.0)
        tl.store(KV + blk * stride_kvb + off * stride_kvt + offs, row, mask=m)

    @triton.jit
    def _write_rows_fp8(
        KV, BLK, OFF, MASK, V, stride_kvb, stride_kvt, stride_v,
        C: tl.constexpr, R: tl.constexpr, NG_P2: tl.constexpr, G_P2: tl.constexpr,
        R_P2: tl.constexpr, E4M3_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        """One row: the no-RoPE values as [groups, 128], a scale per group (amax / 448, as
        fp8_layout computes it), the e4m3 bytes, the scales' bytes, then the RoPE in bf16."""
        i = tl.program_id(0)
        pdl.pdl_wait(PDL)
        keep = tl.load(MASK + i) != 0
        blk = tl.load(BLK + i).to(tl.int64)
        off = tl.load(OFF + i).to(tl.int64)
        src = V + i.to(tl.int64) * stride_v
        dst = KV + blk * stride_kvb + off * stride_kvt
        offs_g = tl.arange(0, NG_P2)
        offs_j = tl.arange(0, G_P2)
        col = offs_g[:, None] * 128 + offs_j[None, :]
        m = (col < C) & (offs_j[None, :] < 128) & keep
        x = tl.load(src + col, mask=m, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 1) / E4M3_MAX, MIN_SCALE)
        qv = tl.minimum(tl.maximum(x / scale[:, None], -E4M3_MAX), E4M3_MAX)
        tl.store(dst + col, qv.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=m)
        ng = (C + 127) // 128
        s_ptr = (dst + C).to(tl.pointer_type(tl.float32))
        tl.store(s_ptr + offs_g, scale, mask=(offs_g < ng) & keep)
        offs_r = tl.arange(0, R_P2)
        mr = (offs_r < R) & keep
        rope = tl.load(src + C + offs_r, mask=mr, other=0.0).to(tl.bfloat16)
        r_ptr = (dst + C + 4 * ng).to(tl.pointer_type(tl.bfloat16))
        tl.store(r_ptr + offs_r, rope, mask=mr)


__all__ = ["HAS_TRITON", "write_latents"]
