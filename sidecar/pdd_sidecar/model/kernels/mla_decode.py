"""Paged MLA decode attention for a batch of sequences: absorbed queries over the paged latent
cache, returning the latent output and its log-sum-exp (what DCP ranks merge).

Contract: ``q [B, H, L]`` with ``L = kv_lora_rank + rope``; ``kv_cache`` the whole per-rank cache
``[num_blocks, num_layers, block_size, L]`` (kv/cache.py's layout); ``block_tables [B, max_blocks]``
(padded); ``seq_lens [B]`` the tokens this rank holds per sequence, filling the table's blocks in
order (token ``j`` at ``block_tables[b, j // block_size]``, offset ``j % block_size``). A length of
0 (a DCP rank holding no chunk) gives output 0 and LSE ``-inf``. Scores are ``q . k`` over all
``L`` dims times ``scale``; values are the first ``kv_lora_rank`` dims of each latent.

The torch reference runs on the CPU (and is what the Triton kernel is tested against); on CUDA
the Triton kernel reads each sequence's blocks in place (no gather copy), splits long contexts
over several programs and merges the splits by LSE. Its launch shapes depend only on tensor
shapes, never on ``seq_lens`` values, so it needs no host sync and can be captured in a graph.

A ``uint8`` cache holds FP8 latents (kv/fp8_layout.py, ``[..., block_size, token_bytes]``): the
reference dequantises what it gathers, the Triton kernel dequantises in registers (e4m3 values
of each 128-value group against its one scale, RoPE in bf16), so it reads 656 bytes a token
instead of 1,152. The cache's dtype alone picks the path.
"""

from __future__ import annotations

from typing import Any

import torch

from pdd_sidecar.kv import fp8_layout
from pdd_sidecar.model.kernels import decode_backend, pdl
from pdd_sidecar.model.kernels.flashmla_decode import flashmla_decode
from pdd_sidecar.model.kernels.pow2 import next_pow2
from pdd_sidecar.model.mla import decode_attention

try:
    import triton
    import triton.language as tl
except ImportError:  # machines without a GPU may have no Triton: the reference serves them
    HAS_TRITON = False
else:
    HAS_TRITON = True

LOG2E = 1.4426950408889634


def _check(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, L], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 4:
        raise ValueError(
            f"kv_cache must be [num_blocks, num_layers, block_size, L], got {tuple(kv_cache.shape)}"
        )
    b, _, latent = q.shape
    if not 0 < kv_lora_rank < latent:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} must be in (0, {latent})")
    if kv_cache.dtype == torch.uint8:
        want = fp8_layout.token_bytes(kv_lora_rank, latent - kv_lora_rank)
        if kv_cache.shape[-1] != want:
            raise ValueError(
                f"FP8 kv_cache's last dimension ({kv_cache.shape[-1]}) is not the "
                f"{want} bytes of a latent of L {latent} with kv_lora_rank {kv_lora_rank}"
            )
    elif kv_cache.shape[-1] != latent:
        raise ValueError(f"q's L ({latent}) differs from kv_cache's L ({kv_cache.shape[-1]})")
    if not 0 <= layer < kv_cache.shape[1]:
        raise ValueError(f"layer {layer} out of range [0, {kv_cache.shape[1]})")
    if block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be [{b}, max_blocks], got {tuple(block_tables.shape)}")
    if seq_lens.shape != (b,):
        raise ValueError(f"seq_lens must be [{b}], got {tuple(seq_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


def gather_latents(
    kv_cache: torch.Tensor, layer: int, block_ids: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """The first ``num_tokens`` latents of ``layer`` held in ``block_ids`` (filled in order)."""
    bs, latent = kv_cache.shape[2], kv_cache.shape[3]
    nb = -(-num_tokens // bs)
    blocks = kv_cache[block_ids[:nb].long(), layer]
    return blocks.reshape(nb * bs, latent)[:num_tokens]


def paged_mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: gather its latents and run ``decode_attention`` (the single-sequence path
    the transformers oracle checks), so the batched contract cannot drift from it."""
    _check(q, kv_cache, layer, block_tables, seq_lens, kv_lora_rank)
    b, h, _ = q.shape
    lens = seq_lens.tolist()
    cap = block_tables.shape[1] * kv_cache.shape[2]
    bad = [(i, n) for i, n in enumerate(lens) if not 0 <= n <= cap]
    if bad:
        raise ValueError(f"seq_lens out of range [0, {cap}] (table capacity): {bad[:5]}")
    out = torch.zeros(b, h, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h), float("-inf"), dtype=torch.float32, device=q.device)
    for i, n in enumerate(lens):
        if n:
            kv = gather_latents(kv_cache, layer, block_tables[i], n)
            if kv.dtype == torch.uint8:
                kv = fp8_layout.dequantize_latents(kv, kv_lora_rank, q.dtype)
            out[i], lse[i] = decode_attention(q[i], kv, kv_lora_rank, scale)
    return out, lse


def paged_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H, kv_lora_rank] fp32, lse [B, H] fp32, natural log)``: on CUDA the kernel
    decode_backend picks (FlashMLA or Triton), the torch reference elsewhere. ``num_splits``
    (Triton only) fixes the split count, which otherwise follows the table's width: callers
    whose runs must round alike whatever their tables' widths (graphs of instances with
    different cache sizes) pass one."""
    if q.is_cuda:
        backend = decode_backend.current()
        if backend.use_flashmla(q, kv_cache, kv_lora_rank):
            assert backend.module is not None
            _check(q, kv_cache, layer, block_tables, seq_lens, kv_lora_rank)
            return flashmla_decode(
                backend.module, q, kv_cache, layer, block_tables, seq_lens, kv_lora_rank, scale
            )
    if q.is_cuda and HAS_TRITON:
        return paged_mla_decode_triton(
            q, kv_cache, layer, block_tables, seq_lens, kv_lora_rank, scale, num_splits
        )
    return paged_mla_decode_ref(q, kv_cache, layer, block_tables, seq_lens, kv_lora_rank, scale)


# --- Triton -----------------------------------------------------------------------------------

_SM_COUNT: dict[int, int] = {}
LAST_LAUNCH: dict[str, Any] = {}  # the last compiled split kernel (registers, spills: bench)

# Tunables; the bench sweeps them on the device (bench/engine.py --tune).
BLOCK_N = 32
NUM_WARPS = 4
NUM_STAGES = 2
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 256
FP8_BLOCK_N = 64
FP8_NUM_WARPS = 4
FP8_NUM_STAGES = 2
FP8_KERNEL = "groups"  # or "tile" (bench/decode_attention.py times both)


def sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def num_splits_for(batch: int, head_groups: int, capacity: int, sms: int) -> int:
    """Splits per sequence from shapes alone (never from ``seq_lens``' values): about two
    programs per SM, each split at least ``MIN_SPLIT_TOKENS`` of the table's capacity, less for
    short tables, where a few long splits would leave the step waiting on a handful of programs
    walking their tokens one tile at a time."""
    want = -(-2 * sms // max(1, batch * head_groups))
    least = min(MIN_SPLIT_TOKENS, max(64, capacity // 16))
    most = max(1, -(-capacity // least))
    return max(1, min(want, most, MAX_SPLITS))


def paged_mla_decode_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lengths past the table's capacity are clipped to it in the kernel (no host check: that
    would be a sync); the reference raises for them. ``fp8_kernel`` (FP8 caches) picks the
    variant, default ``FP8_KERNEL``: ``groups`` scales each 128-value group's scores and
    probabilities (no K-tile multiply), ``tile`` dequantises the K tile and runs the bf16
    kernel's two dots."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not importable")
    _check(q, kv_cache, layer, block_tables, seq_lens, kv_lora_rank)
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache's last dimension must be contiguous")
    b, h, latent = q.shape
    c, r = kv_lora_rank, latent - kv_lora_rank
    fp8 = kv_cache.dtype == torch.uint8
    if fp8:
        if c > 4 * fp8_layout.GROUP:
            raise ValueError(f"the FP8 kernel takes kv_lora_rank up to 512, got {c}")
        # the latents come out of the cache in the query's dtype (bf16 in serving)
        q = (q if q.dtype == torch.float32 else q.to(torch.bfloat16)).contiguous()
    else:
        q = q.to(kv_cache.dtype).contiguous()
    block_h = 16 if h <= 16 else 32
    hg = -(-h // block_h)
    bs = kv_cache.shape[2]
    max_blocks = block_tables.shape[1]
    bn = block_n or (FP8_BLOCK_N if fp8 else BLOCK_N)
    if num_splits is None:
        num_splits = num_splits_for(b, hg, max_blocks * bs, sm_count(q.device))
    out = torch.empty(b, h, c, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, dtype=torch.float32, device=q.device)
    if num_splits > 1:
        o_part = torch.empty(b, h, num_splits, c, dtype=torch.float32, device=q.device)
        l_part = torch.empty(b, h, num_splits, dtype=torch.float32, device=q.device)
        so = o_part.stride()
        sl = l_part.stride()
    else:
        o_part, l_part = out, lse
        so = (out.stride(0), out.stride(1), 0)
        sl = (lse.stride(0), lse.stride(1), 0)
    kernel: Any = _mla_decode_split
    extra: dict[str, Any] = {}
    if fp8:
        ng = fp8_layout.num_groups(c)
        extra = {"NG": ng, "G_P2": next_pow2(min(c, fp8_layout.GROUP))}
        variant = fp8_kernel or FP8_KERNEL
        if variant == "groups":
            kernel = _mla_decode_split_fp8
        elif variant == "tile":
            extra.update(FP8=True, NG_P2=next_pow2(ng, 1))
        else:
            raise ValueError(f"fp8_kernel {variant!r} is not one of groups, tile")
        num_warps = num_warps or FP8_NUM_WARPS
        num_stages = num_stages or FP8_NUM_STAGES
    LAST_LAUNCH["split"] = kernel[(b, num_splits, hg)](
        q,
        kv_cache[:, layer],  # the layer's base address: no layer index inside the kernel
        block_tables,
        seq_lens,
        o_part,
        l_part,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        block_tables.stride(0),
        so[0],
        so[1],
        so[2],
        sl[0],
        sl[1],
        sl[2],
        max_blocks,
        h,
        num_splits,
        BS=bs,
        C=c,
        R=r,
        C_P2=next_pow2(c),
        R_P2=next_pow2(r),
        BLOCK_H=block_h,
        BLOCK_N=bn,
        TILE_IN_BLOCK=bs % bn == 0,
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps or NUM_WARPS,
        num_stages=num_stages or NUM_STAGES,
        **extra,
        **pdl.launch(q.device, b),
    )
    if num_splits > 1:
        reduce: Any = _mla_decode_reduce
        reduce[(b, h)](
            o_part,
            l_part,
            out,
            lse,
            so[0],
            so[1],
            so[2],
            sl[0],
            sl[1],
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            seq_lens,
            max_blocks,
            num_splits,
            BS=bs,
            BLOCK_N=bn,
            C=c,
            C_P2=next_pow2(c),
            S_P2=next_pow2(num_splits, 2),
            num_warps=4,
            **pdl.launch(q.device, b),
        )
    return out, lse


if HAS_TRITON:

    @triton.jit
    def _mla_decode_split(
        Q,
        KV,
        BT,
        SL,
        O_PART,
        LSE,
        scale_log2,
        stride_qb,
        stride_qh,
        stride_kvb,
        stride_kvt,
        stride_btb,
        stride_ob,
        stride_oh,
        stride_os,
        stride_lb,
        stride_lh,
        stride_ls,
        max_blocks,
        num_heads,
        num_splits,
        BS: tl.constexpr,
        C: tl.constexpr,
        R: tl.constexpr,
        C_P2: tl.constexpr,
        R_P2: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        TILE_IN_BLOCK: tl.constexpr,
        IEEE: tl.constexpr,
        FP8: tl.constexpr = False,
        NG: tl.constexpr = 1,
        NG_P2: tl.constexpr = 1,
        G_P2: tl.constexpr = 16,
        PDL: tl.constexpr = False,
    ):
        b = tl.program_id(0)
        s = tl.program_id(1)
        hg = tl.program_id(2)
        pdl.pdl_wait(PDL)
        offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < num_heads
        offs_c = tl.arange(0, C_P2)
        offs_r = tl.arange(0, R_P2)
        mask_c = offs_c < C
        mask_r = offs_r < R

        seq_len = tl.minimum(tl.load(SL + b).to(tl.int32), max_blocks * BS)
        per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = s * per_split
        end = tl.minimum(start + per_split, seq_len)

        q_row = Q + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
        q_c = tl.load(q_row + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
        q_r = tl.load(
            q_row + C + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0
        )

        m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, C_P2], dtype=tl.float32)
        bt_row = BT + b.to(tl.int64) * stride_btb
        # A tile inside one block needs one block id, fetched an iteration ahead so the KV
        # loads do not wait on the table load.
        blk_next = tl.load(bt_row + start // BS, mask=start < end, other=0).to(tl.int64)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            if TILE_IN_BLOCK:
                blk = blk_next
                nxt = n0 + BLOCK_N
                blk_next = tl.load(bt_row + nxt // BS, mask=nxt < end, other=0).to(tl.int64)
                row = KV + blk * stride_kvb + (offs_n % BS) * stride_kvt
            else:
                blk_t = tl.load(bt_row + offs_n // BS, mask=mask_n, other=0).to(tl.int64)
                row = KV + blk_t * stride_kvb + (offs_n % BS) * stride_kvt
            if FP8:  # the "tile" FP8 variant: the tile dequantised, then as bf16
                k_c, k_r = _fp8_tile(row, mask_n, offs_r, mask_r, C, NG, NG_P2, G_P2,
                                     Q.dtype.element_ty)  # fmt: skip
            else:
                k_c = tl.load(
                    row[:, None] + offs_c[None, :],
                    mask=mask_n[:, None] & mask_c[None, :],
                    other=0.0,
                )
                k_r = tl.load(
                    row[:, None] + C + offs_r[None, :],
                    mask=mask_n[:, None] & mask_r[None, :],
                    other=0.0,
                )
            if IEEE:
                qk = tl.dot(q_c, tl.trans(k_c), input_precision="ieee")
                qk += tl.dot(q_r, tl.trans(k_r), input_precision="ieee")
            else:
                qk = tl.dot(q_c, tl.trans(k_c))
                qk += tl.dot(q_r, tl.trans(k_r))
            qk = tl.where(mask_n[None, :], qk * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p.to(k_c.dtype), k_c, input_precision="ieee")
            else:
                pv = tl.dot(p.to(k_c.dtype), k_c)
            acc = acc * alpha[:, None] + pv
            m = m_new

        has = l_sum > 0
        l_safe = tl.where(has, l_sum, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(has, (m + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        o_ptr = O_PART + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + s * stride_os
        # A split past the sequence's end stores nothing (the reduce skips it): with the split
        # count fixed by a graph's bucket, most splits of a short sequence are empty. Split 0
        # always stores, so a length of 0 still yields output 0 and LSE -inf.
        live_h = mask_h & ((offs_h * 0 + start < end) | (s == 0))
        tl.store(o_ptr + offs_c[None, :], out, mask=live_h[:, None] & mask_c[None, :])
        tl.store(
            LSE + b.to(tl.int64) * stride_lb + offs_h * stride_lh + s * stride_ls,
            lse,
            mask=live_h,
        )

    @triton.jit
    def _fp8_tile(row, mask_n, offs_r, mask_r, C: tl.constexpr, NG: tl.constexpr,
                  NG_P2: tl.constexpr, G_P2: tl.constexpr, DT: tl.constexpr):  # fmt: skip
        """A tile of FP8 latents as ``DT``: ``([BLOCK_N, NG_P2 * G_P2], [BLOCK_N, R_P2])``, each
        group of 128 values times its scale (column ``g * 128 + j`` is value ``g * 128 + j``:
        ``G_P2`` is 128 unless there is one group)."""
        offs_g = tl.arange(0, NG_P2)
        offs_j = tl.arange(0, G_P2)
        col = offs_g[:, None] * 128 + offs_j[None, :]
        m = mask_n[:, None, None] & ((col < C) & (offs_j[None, :] < 128))[None, :, :]
        kq = tl.load(row[:, None, None] + col[None, :, :], mask=m, other=0)
        sc = tl.load(
            (row + C).to(tl.pointer_type(tl.float32))[:, None] + offs_g[None, :],
            mask=mask_n[:, None] & (offs_g < NG)[None, :],
            other=0.0,
        )
        k = kq.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, :, None]
        k_c = tl.reshape(k, [k.shape[0], NG_P2 * G_P2]).to(DT)
        k_r = tl.load(
            (row + C + 4 * NG).to(tl.pointer_type(tl.bfloat16))[:, None] + offs_r[None, :],
            mask=mask_n[:, None] & mask_r[None, :],
            other=0.0,
        ).to(DT)
        return k_c, k_r

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _fp8_group(row, mask_n, offs_j, g: tl.constexpr, C: tl.constexpr, DT: tl.constexpr):
        """Group ``g`` of a tile's latents: its e4m3 values ``[BLOCK_N, G_P2]`` as ``DT``
        (unscaled: exact) and its scales ``[BLOCK_N]`` (fp32, 1 where masked)."""
        col = g * 128 + offs_j
        m = mask_n[:, None] & (col < C)[None, :]
        kq = tl.load(row[:, None] + col[None, :], mask=m, other=0)
        k = kq.to(tl.float8e4nv, bitcast=True).to(DT)
        sc = tl.load((row + C + 4 * g).to(tl.pointer_type(tl.float32)), mask=mask_n, other=1.0)
        return k, sc

    @triton.jit
    def _mla_decode_split_fp8(
        Q,
        KV,
        BT,
        SL,
        O_PART,
        LSE,
        scale_log2,
        stride_qb,
        stride_qh,
        stride_kvb,
        stride_kvt,
        stride_btb,
        stride_ob,
        stride_oh,
        stride_os,
        stride_lb,
        stride_lh,
        stride_ls,
        max_blocks,
        num_heads,
        num_splits,
        BS: tl.constexpr,
        C: tl.constexpr,
        R: tl.constexpr,
        C_P2: tl.constexpr,
        R_P2: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        TILE_IN_BLOCK: tl.constexpr,
        IEEE: tl.constexpr,
        NG: tl.constexpr,
        G_P2: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """The bf16 split kernel's walk over an FP8 cache (``KV`` bytes, strides in bytes).
        The scales never touch the K tile: scores are ``sum_g s_g (q_g . k_g)`` and the output
        of group ``g`` is ``(p * s_g) @ k_g``, so each of the (at most 4) groups of 128 values
        is one unscaled e4m3 -> ``DT`` conversion and two dots, and a scale costs a multiply of
        ``BLOCK_N`` scores instead of 128 values per token."""
        DT: tl.constexpr = tl.float32 if IEEE else tl.bfloat16
        b = tl.program_id(0)
        s = tl.program_id(1)
        hg = tl.program_id(2)
        pdl.pdl_wait(PDL)
        offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < num_heads
        offs_j = tl.arange(0, G_P2)
        offs_r = tl.arange(0, R_P2)
        mask_r = offs_r < R

        seq_len = tl.minimum(tl.load(SL + b).to(tl.int32), max_blocks * BS)
        per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = s * per_split
        end = tl.minimum(start + per_split, seq_len)

        q_row = Q + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
        mh = mask_h[:, None]
        q0 = tl.load(q_row + offs_j[None, :], mask=mh & (offs_j < C)[None, :], other=0.0)
        q1 = tl.load(q_row + 128 + offs_j[None, :], mask=mh & (offs_j + 128 < C)[None, :],
                     other=0.0)  # fmt: skip
        q2 = tl.load(q_row + 256 + offs_j[None, :], mask=mh & (offs_j + 256 < C)[None, :],
                     other=0.0)  # fmt: skip
        q3 = tl.load(q_row + 384 + offs_j[None, :], mask=mh & (offs_j + 384 < C)[None, :],
                     other=0.0)  # fmt: skip
        q_r = tl.load(q_row + C + offs_r[None, :], mask=mh & mask_r[None, :], other=0.0)
        rope_at: tl.constexpr = C + 4 * NG

        m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc0 = tl.zeros([BLOCK_H, G_P2], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_H, G_P2], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_H, G_P2], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_H, G_P2], dtype=tl.float32)
        bt_row = BT + b.to(tl.int64) * stride_btb
        blk_next = tl.load(bt_row + start // BS, mask=start < end, other=0).to(tl.int64)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            if TILE_IN_BLOCK:
                blk = blk_next
                nxt = n0 + BLOCK_N
                blk_next = tl.load(bt_row + nxt // BS, mask=nxt < end, other=0).to(tl.int64)
                row = KV + blk * stride_kvb + (offs_n % BS) * stride_kvt
            else:
                blk_t = tl.load(bt_row + offs_n // BS, mask=mask_n, other=0).to(tl.int64)
                row = KV + blk_t * stride_kvb + (offs_n % BS) * stride_kvt
            k_r = tl.load(
                (row + rope_at).to(tl.pointer_type(tl.bfloat16))[:, None] + offs_r[None, :],
                mask=mask_n[:, None] & mask_r[None, :],
                other=0.0,
            ).to(DT)
            k0, s0 = _fp8_group(row, mask_n, offs_j, 0, C, DT)
            qk = _dot(q_r, tl.trans(k_r), IEEE)
            qk += _dot(q0, tl.trans(k0), IEEE) * s0[None, :]
            if NG > 1:
                k1, s1 = _fp8_group(row, mask_n, offs_j, 1, C, DT)
                qk += _dot(q1, tl.trans(k1), IEEE) * s1[None, :]
            if NG > 2:
                k2, s2 = _fp8_group(row, mask_n, offs_j, 2, C, DT)
                qk += _dot(q2, tl.trans(k2), IEEE) * s2[None, :]
            if NG > 3:
                k3, s3 = _fp8_group(row, mask_n, offs_j, 3, C, DT)
                qk += _dot(q3, tl.trans(k3), IEEE) * s3[None, :]
            qk = tl.where(mask_n[None, :], qk * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            acc0 = acc0 * alpha[:, None] + _dot(
                (p * s0[None, :]).to(DT), k0, IEEE
            )
            if NG > 1:
                acc1 = acc1 * alpha[:, None] + _dot(
                    (p * s1[None, :]).to(DT), k1, IEEE
                )
            if NG > 2:
                acc2 = acc2 * alpha[:, None] + _dot(
                    (p * s2[None, :]).to(DT), k2, IEEE
                )
            if NG > 3:
                acc3 = acc3 * alpha[:, None] + _dot(
                    (p * s3[None, :]).to(DT), k3, IEEE
                )
            m = m_new

        has = l_sum > 0
        l_safe = tl.where(has, l_sum, 1.0)
        lse = tl.where(has, (m + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        o_ptr = O_PART + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + s * stride_os
        live_h = mask_h & ((offs_h * 0 + start < end) | (s == 0))
        lh = live_h[:, None]
        tl.store(o_ptr + offs_j[None, :], acc0 / l_safe[:, None], mask=lh & (offs_j < C)[None, :])
        if NG > 1:
            tl.store(o_ptr + 128 + offs_j[None, :], acc1 / l_safe[:, None],
                     mask=lh & (offs_j + 128 < C)[None, :])
        if NG > 2:
            tl.store(o_ptr + 256 + offs_j[None, :], acc2 / l_safe[:, None],
                     mask=lh & (offs_j + 256 < C)[None, :])
        if NG > 3:
            tl.store(o_ptr + 384 + offs_j[None, :], acc3 / l_safe[:, None],
                     mask=lh & (offs_j + 384 < C)[None, :])
        tl.store(
            LSE + b.to(tl.int64) * stride_lb + offs_h * stride_lh + s * stride_ls,
            lse,
            mask=live_h,
        )

    @triton.jit
    def _mla_decode_reduce(
        O_PART,
        L_PART,
        OUT,
        LSE,
        stride_pb,
        stride_ph,
        stride_ps,
        stride_lb,
        stride_lh,
        stride_ob,
        stride_oh,
        stride_sb,
        SL,
        max_blocks,
        num_splits,
        BS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        C: tl.constexpr,
        C_P2: tl.constexpr,
        S_P2: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        pdl.pdl_wait(PDL)
        # the splits that stored: as the split kernel cuts the sequence
        seq_len = tl.minimum(tl.load(SL + b).to(tl.int32), max_blocks * BS)
        per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        n_live = tl.maximum(tl.cdiv(seq_len, tl.maximum(per_split, 1)), 1)
        offs_s = tl.arange(0, S_P2)
        mask_s = offs_s < n_live
        offs_c = tl.arange(0, C_P2)
        mask_c = offs_c < C
        base_l = L_PART + b.to(tl.int64) * stride_lb + h * stride_lh
        lses = tl.load(base_l + offs_s, mask=mask_s, other=float("-inf"))
        m = tl.max(lses, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.exp(lses - m_safe), 0)
        base_o = O_PART + b.to(tl.int64) * stride_pb + h * stride_ph
        acc = tl.zeros([C_P2], dtype=tl.float32)
        for s in range(n_live):
            w = tl.exp(tl.load(base_l + s) - m_safe)
            acc += w * tl.load(base_o + s * stride_ps + offs_c, mask=mask_c, other=0.0)
        t_safe = tl.where(total > 0, total, 1.0)
        tl.store(
            OUT + b.to(tl.int64) * stride_ob + h * stride_oh + offs_c, acc / t_safe, mask=mask_c
        )
        lse = tl.where(total > 0, m_safe + tl.log(t_safe), float("-inf"))
        tl.store(LSE + b.to(tl.int64) * stride_sb + h, lse)


__all__ = [
    "HAS_TRITON",
    "gather_latents",
    "num_splits_for",
    "sm_count",
    "paged_mla_decode",
    "paged_mla_decode_ref",
    "paged_mla_decode_triton",
]
