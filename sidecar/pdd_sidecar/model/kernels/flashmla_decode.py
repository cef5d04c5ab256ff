"""pdd's paged decode contract on FlashMLA's dense bf16 decode kernel (the optional
``sgl-flash-mla`` wheel, SM90; ``pip install 'pdd[flashmla]'``).

FlashMLA reads the same paged layout pdd keeps, so nothing is copied: one layer's slice of the
cache ``[num_blocks, block_size, L]`` (blocks strided by the other layers) is its
``k_cache [num_blocks, page_block_size, 1, L]``, the block table and lengths go as int32. What
differs is adapted here: FlashMLA wants 64-token blocks, bf16, ``L = 576`` with 512 values; it
plans its splits from the lengths on the device at every call (its tile-scheduler metadata,
recomputed per step, so a captured graph replays the planning kernel too); it returns the
output in bf16 and the LSE ``[B, H, 1]`` in natural log, and gives a sequence of length 0 no
finite answer, where pdd's contract (and DCP's LSE merge) wants output 0 and LSE ``-inf``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

HEAD_DIM = 576
V_DIM = 512
PAGE = 64
FP8_TOKEN_BYTES = 656  # kv/fp8_layout.token_bytes(512, 64)


def supports(kv_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """Whether FlashMLA's dense kernel takes this cache: bf16, 64-token blocks, latents of
    512 + 64 (the DeepSeek shapes)."""
    return (
        kv_cache.dtype == torch.bfloat16
        and kv_cache.dim() == 4
        and kv_cache.shape[2] == PAGE
        and kv_cache.shape[3] == HEAD_DIM
        and kv_lora_rank == V_DIM
        and kv_cache.stride(-1) == 1
    )


def flashmla_decode(
    module: ModuleType,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_mla_decode``'s ``(out [B, H, kv_lora_rank] fp32, lse [B, H] fp32)`` through
    ``module`` (the imported ``flash_mla``)."""
    if not supports(kv_cache, kv_lora_rank):
        raise ValueError(
            f"FlashMLA takes bf16 caches of {PAGE}-token blocks of {HEAD_DIM} values "
            f"(kv_lora_rank {V_DIM}); got {kv_cache.dtype} {tuple(kv_cache.shape)}, "
            f"kv_lora_rank {kv_lora_rank}"
        )
    b, h, _ = q.shape
    k_cache = kv_cache[:, layer].unsqueeze(2)
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    table = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    meta, _ = module.get_mla_metadata()
    fn: Any = module.flash_mla_with_kvcache
    out, lse = fn(
        q.to(torch.bfloat16).reshape(b, 1, h, HEAD_DIM),
        k_cache,
        table,
        lens,
        V_DIM,
        meta,
        softmax_scale=scale,
        causal=False,
        use_legacy=True,
    )
    empty = (lens == 0).view(b, 1)
    out = torch.where(empty.unsqueeze(-1), 0.0, out.view(b, h, V_DIM).float())
    lse = torch.where(empty, float("-inf"), lse.view(b, h).float())
    return out, lse


def supports_fp8(kv_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """Whether FlashMLA's sparse FP8 kernel (DeepSeek V3.2's 656-byte token, pdd's FP8 layout)
    takes this cache: uint8, 64-token blocks, 512 + 64 latents."""
    return (
        kv_cache.dtype == torch.uint8
        and kv_cache.dim() == 4
        and kv_cache.shape[2] == PAGE
        and kv_cache.shape[3] == FP8_TOKEN_BYTES
        and kv_lora_rank == V_DIM
    )


def flashmla_decode_fp8(
    module: ModuleType,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same contract over an FP8 cache through FlashMLA's sparse decode with every token
    selected (its dense FP8 kernel wants another token layout): the indices of all the table's
    slots, -1 past each length, heads padded to its 64 / 128. Experimental: the bench times it;
    not yet checked on a GPU against the reference, and no backend uses it."""
    if not supports_fp8(kv_cache, kv_lora_rank):
        raise ValueError(
            f"FlashMLA's FP8 kernel takes uint8 caches of {PAGE}-token blocks of "
            f"{FP8_TOKEN_BYTES} bytes; got {kv_cache.dtype} {tuple(kv_cache.shape)}"
        )
    b, h, _ = q.shape
    hp = 64 if h <= 64 else 128
    if h > 128:
        raise ValueError(f"FlashMLA's FP8 kernel takes up to 128 heads, got {h}")
    qp = q.to(torch.bfloat16)
    if hp != h:
        qp = torch.nn.functional.pad(qp, (0, 0, 0, hp - h))
    width = block_tables.shape[1]
    slots = torch.arange(PAGE, device=q.device, dtype=torch.int32)
    idx = (block_tables.to(torch.int32).unsqueeze(-1) * PAGE + slots).view(b, width * PAGE)
    lens = seq_lens.to(torch.int32).clamp(max=width * PAGE)
    # V3.2's kernel takes no per-sequence top-k length: slots past a length are -1 (skipped)
    past = torch.arange(width * PAGE, device=q.device, dtype=torch.int32) >= lens[:, None]
    idx = idx.masked_fill(past, -1).view(b, 1, width * PAGE)
    meta, _ = module.get_mla_metadata()
    fn: Any = module.flash_mla_with_kvcache
    out, lse = fn(
        qp.view(b, 1, hp, HEAD_DIM),
        kv_cache[:, layer].unsqueeze(2),
        None,
        None,
        V_DIM,
        meta,
        softmax_scale=scale,
        is_fp8_kvcache=True,
        indices=idx,
        use_legacy=True,
    )
    empty = (lens == 0).view(b, 1)
    out = torch.where(empty.unsqueeze(-1), 0.0, out.view(b, hp, V_DIM)[:, :h].float())
    lse = torch.where(empty, float("-inf"), lse.reshape(b, hp)[:, :h].float())
    return out, lse


__all__ = [
    "FP8_TOKEN_BYTES",
    "HEAD_DIM",
    "PAGE",
    "V_DIM",
    "flashmla_decode",
    "flashmla_decode_fp8",
    "supports",
    "supports_fp8",
]
