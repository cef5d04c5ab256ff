"""Cached latents read back as values, whichever dtype the paged cache keeps.

The prefill of a continuing prompt (chunked prefill, a prefix-cache hit) attends over latents
already in the cache. A bf16/fp32 cache hands them out as stored; a ``uint8`` cache holds FP8
latents (kv/fp8_layout.py) and they come out dequantised to the dtype asked for. On CUDA one
Triton kernel gathers the blocks and dequantises in one pass (no uint8 copy of the blocks, no
float32 intermediate); elsewhere torch gathers whole block rows and ``dequantize_latents``
converts them. Movers of cache bytes (the hand-off, the host tier, block copies) need none of
this: FP8 blocks move as their bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from pdd_sidecar.kv import fp8_layout
from pdd_sidecar.model.kernels.pow2 import next_pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # machines without a GPU may have no Triton: torch serves them
    HAS_TRITON = False
else:
    HAS_TRITON = True


def latent_dim(kv_cache: torch.Tensor, kv_lora_rank: int) -> int:
    """Values a token's latent has (``kv_lora_rank + rope``) in a cache of either kind."""
    width = kv_cache.shape[-1]
    if kv_cache.dtype != torch.uint8:
        return width
    rope_bytes = width - kv_lora_rank - fp8_layout.SCALE_BYTES * fp8_layout.num_groups(
        kv_lora_rank
    )
    if kv_lora_rank <= 0 or rope_bytes <= 0 or rope_bytes % fp8_layout.ROPE_BYTES:
        raise ValueError(
            f"an FP8 cache of {width} bytes a token holds no latent with kv_lora_rank "
            f"{kv_lora_rank}"
        )
    return kv_lora_rank + rope_bytes // fp8_layout.ROPE_BYTES


def read_latent_blocks(
    kv_cache: torch.Tensor,
    layer: int,
    block_ids: torch.Tensor,
    *,
    kv_lora_rank: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Every token of ``block_ids``' blocks of ``layer``, in order: ``[len(block_ids) *
    block_size, kv_lora_rank + rope]`` of ``dtype`` (default: the cache's dtype, bf16 for an
    FP8 cache). ``kv_cache`` is ``[num_blocks, num_layers, block_size, width]``."""
    if kv_cache.dim() != 4:
        raise ValueError(
            f"kv_cache must be [num_blocks, num_layers, block_size, width], "
            f"got {tuple(kv_cache.shape)}"
        )
    if not 0 <= layer < kv_cache.shape[1]:
        raise ValueError(f"layer {layer} out of range [0, {kv_cache.shape[1]})")
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got {tuple(block_ids.shape)}")
    nb, layers, bs, width = kv_cache.shape
    latent = latent_dim(kv_cache, kv_lora_rank)
    fp8 = kv_cache.dtype == torch.uint8
    out_dtype = dtype or (torch.bfloat16 if fp8 else kv_cache.dtype)
    n = block_ids.shape[0] * bs
    if fp8 and kv_cache.is_cuda and HAS_TRITON and n:
        return _read_fp8_triton(kv_cache, layer, block_ids, kv_lora_rank, latent, out_dtype)
    # One block of one layer is a contiguous row: gathering whole rows runs at copy speed.
    rows = kv_cache.reshape(nb * layers, bs * width)
    blocks = rows.index_select(0, block_ids.long() * layers + layer).view(n, width)
    if fp8:
        return fp8_layout.dequantize_latents(blocks, kv_lora_rank, out_dtype)
    return blocks.to(out_dtype)


def read_latents(
    kv_cache: torch.Tensor,
    layer: int,
    block_ids: torch.Tensor,
    num_tokens: int,
    *,
    kv_lora_rank: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The first ``num_tokens`` latents held in ``block_ids`` (filled in order), as
    :func:`read_latent_blocks` reads them."""
    bs = kv_cache.shape[2]
    nb = -(-num_tokens // bs)
    if nb > block_ids.shape[0]:
        raise ValueError(f"num_tokens {num_tokens} exceeds {block_ids.shape[0]} blocks of {bs}")
    blocks = read_latent_blocks(
        kv_cache, layer, block_ids[:nb], kv_lora_rank=kv_lora_rank, dtype=dtype
    )
    return blocks[:num_tokens]


def _read_fp8_triton(
    kv_cache: torch.Tensor,
    layer: int,
    block_ids: torch.Tensor,
    kv_lora_rank: int,
    latent: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The Triton gather-and-dequantise (CUDA; tests run it in Triton's interpreter)."""
    bs = kv_cache.shape[2]
    n = block_ids.shape[0] * bs
    out = torch.empty(n, latent, dtype=dtype, device=kv_cache.device)
    layer_view = kv_cache[:, layer]
    kernel: Any = _dequant_rows
    kernel[(n,)](
        layer_view, block_ids, out, layer_view.stride(0), layer_view.stride(1),
        out.stride(0), BS=bs, C=kv_lora_rank, R=latent - kv_lora_rank,
        NG_P2=next_pow2(fp8_layout.num_groups(kv_lora_rank), 1),
        G_P2=next_pow2(min(kv_lora_rank, fp8_layout.GROUP)), R_P2=next_pow2(latent - kv_lora_rank),
    )  # fmt: skip
    return out


if HAS_TRITON:

    @triton.jit
    def _dequant_rows(
        KV, BLK, OUT, stride_kvb, stride_kvt, stride_o,
        BS: tl.constexpr, C: tl.constexpr, R: tl.constexpr, NG_P2: tl.constexpr,
        G_P2: tl.constexpr, R_P2: tl.constexpr,
    ):  # fmt: skip
        """Token ``t`` of the gathered blocks: its group's values times the group's scale,
        then the RoPE part, into row ``t`` of ``OUT``."""
        t = tl.program_id(0)
        blk = tl.load(BLK + t // BS).to(tl.int64)
        src = KV + blk * stride_kvb + (t % BS).to(tl.int64) * stride_kvt
        dst = OUT + t.to(tl.int64) * stride_o
        ng: tl.constexpr = (C + 127) // 128
        offs_g = tl.arange(0, NG_P2)
        offs_j = tl.arange(0, G_P2)
        col = offs_g[:, None] * 128 + offs_j[None, :]
        m = (col < C) & (offs_j[None, :] < 128)
        q = tl.load(src + col, mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        sc = tl.load((src + C).to(tl.pointer_type(tl.float32)) + offs_g, mask=offs_g < ng, other=0)
        tl.store(dst + col, (q * sc[:, None]).to(OUT.dtype.element_ty), mask=m)
        offs_r = tl.arange(0, R_P2)
        mr = offs_r < R
        rope = tl.load((src + C + 4 * ng).to(tl.pointer_type(tl.bfloat16)) + offs_r, mask=mr)
        tl.store(dst + C + offs_r, rope.to(OUT.dtype.element_ty), mask=mr)


__all__ = ["HAS_TRITON", "latent_dim", "read_latent_blocks", "read_latents"]
