"""The latent's norm and RoPE, the query's RoPE and the store into the paged cache, one kernel.

Unfused, a decode layer runs for this an RMSNorm of the compressed KV, a rotation of its RoPE
part, a concatenation, the cache store and a rotation of the query's RoPE part: five launches
that each move a few kilobytes. Here one program per token reads its row of the fused
projection's output (``ckv``, a strided view is fine), writes the normalised and rotated latent
into its cache slot (rows whose ``mask`` is 0 store nothing, as ``write_latents``), optionally
into a ``latent`` tensor too (prefill attends over it), and returns the rotated query part.

A cache in another dtype than the activations (an FP8 cache's ``uint8`` bytes) is not written
here: the latent is computed by the kernel and the store left to ``write_latents``, which owns
every cache layout's quantisation.
"""

from __future__ import annotations

from typing import Any

import torch

from pdd_sidecar.model.kernels import pdl
from pdd_sidecar.model.kernels.kv_write import write_latents
from pdd_sidecar.model.kernels.norm_rope import apply_rope, apply_rope_ref, rms_norm, rms_norm_ref
from pdd_sidecar.model.kernels.pow2 import next_pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # machines without a GPU may have no Triton: the references serve them
    HAS_TRITON = False
else:
    HAS_TRITON = True


def latent_ref(
    ckv: torch.Tensor, norm_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """``[T, kv_lora + rope]``: ``[rms_norm(c), rope(k_pe)]`` of the kv_a output rows."""
    kvl = norm_w.shape[0]
    return torch.cat([rms_norm_ref(ckv[:, :kvl], norm_w, eps),
                      apply_rope_ref(ckv[:, kvl:], cos, sin)], -1)


def _store(kv_cache: torch.Tensor, layer: int, blk: torch.Tensor, off: torch.Tensor,
           mask: torch.Tensor, latent: torch.Tensor, kv_lora_rank: int) -> None:
    write_latents(kv_cache, layer, blk, off, mask, latent, kv_lora_rank=kv_lora_rank)


def rope_kv_write_ref(
    ckv: torch.Tensor, q_pe: torch.Tensor, norm_w: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, eps: float, kv_cache: torch.Tensor, layer: int, blk: torch.Tensor,
    off: torch.Tensor, mask: torch.Tensor, want_latent: bool = False,
    q_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rope(q_pe), latent or None)``, the latent stored at the masked-in slots; the rotated
    query written into ``q_out`` (any strides) when given, and that returned."""
    latent = latent_ref(ckv, norm_w, cos, sin, eps)
    _store(kv_cache, layer, blk, off, mask, latent, norm_w.shape[0])
    return _into(apply_rope_ref(q_pe, cos, sin), q_out), latent if want_latent else None


def _into(q: torch.Tensor, q_out: torch.Tensor | None) -> torch.Tensor:
    if q_out is None:
        return q
    q_out.copy_(q)
    return q_out


def rope_kv_write(
    ckv: torch.Tensor, q_pe: torch.Tensor, norm_w: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, eps: float, kv_cache: torch.Tensor, layer: int, blk: torch.Tensor,
    off: torch.Tensor, mask: torch.Tensor, want_latent: bool = False,
    q_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rope_kv_write_ref``'s result, one kernel on CUDA. ``ckv [T, kv_lora + rope]`` and
    ``q_pe [T, H, rope]`` may be strided views (last dimension contiguous)."""
    t = ckv.shape[0]
    kvl, rope = norm_w.shape[0], ckv.shape[1] - norm_w.shape[0]
    ok = (ckv.is_cuda and HAS_TRITON and t > 0 and q_pe.dim() == 3 and ckv.stride(-1) == 1
          and q_pe.stride(-1) == 1 and ckv.dtype == norm_w.dtype == q_pe.dtype
          and rope % 2 == 0 and cos.shape == (t, rope // 2) and q_pe.shape[2] == rope
          and (q_out is None or (q_out.shape == q_pe.shape and q_out.stride(-1) == 1)))
    if not ok:
        if ckv.is_cuda:  # the per-op kernels still serve (one each)
            kvl_part = rms_norm(ckv[:, :kvl], norm_w, eps)
            whole = torch.cat([kvl_part, apply_rope(ckv[:, kvl:], cos, sin)], -1)
            _store(kv_cache, layer, blk, off, mask, whole, kvl)
            return _into(apply_rope(q_pe, cos, sin), q_out), whole if want_latent else None
        return rope_kv_write_ref(ckv, q_pe, norm_w, cos, sin, eps, kv_cache, layer, blk, off,
                                 mask, want_latent, q_out)
    return rope_kv_write_triton(ckv, q_pe, norm_w, cos, sin, eps, kv_cache, layer, blk, off,
                                mask, want_latent, q_out)


def rope_kv_write_triton(
    ckv: torch.Tensor, q_pe: torch.Tensor, norm_w: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, eps: float, kv_cache: torch.Tensor, layer: int, blk: torch.Tensor,
    off: torch.Tensor, mask: torch.Tensor, want_latent: bool = False,
    q_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    t = ckv.shape[0]
    kvl, rope = norm_w.shape[0], ckv.shape[1] - norm_w.shape[0]
    direct = kv_cache.dtype == ckv.dtype
    latent = (torch.empty(t, kvl + rope, dtype=ckv.dtype, device=ckv.device)
              if want_latent or not direct else None)
    if q_out is None:
        q_out = torch.empty(q_pe.shape, dtype=q_pe.dtype, device=q_pe.device)
    layer_view = kv_cache[:, layer]
    c, s = cos.float().contiguous(), sin.float().contiguous()
    lat = latent if latent is not None else q_out  # any tensor: not written without STORE_LATENT
    heads = q_pe.shape[1]
    kernel: Any = _rope_kv_rows
    kernel[(t,)](
        ckv, q_pe, norm_w, c, s, layer_view, blk, off, mask, lat, q_out,
        ckv.stride(0), q_pe.stride(0), q_pe.stride(1), q_out.stride(0), q_out.stride(1),
        layer_view.stride(0), layer_view.stride(1), heads, eps,
        KVL=kvl, KVL_P2=next_pow2(kvl), HALF=rope // 2, HALF_P2=next_pow2(rope // 2),
        H_P2=next_pow2(heads, 1), WRITE_CACHE=direct, STORE_LATENT=latent is not None,
        **pdl.launch(ckv.device, t),
    )  # fmt: skip
    if not direct:
        assert latent is not None
        _store(kv_cache, layer, blk, off, mask, latent, kvl)
    return q_out, latent if want_latent else None


if HAS_TRITON:

    @triton.jit
    def _rope_kv_rows(
        CKV, QPE, NW, COS, SIN, KV, BLK, OFF, MASK, LAT, QOUT,
        stride_c, stride_qt, stride_qh, stride_ot, stride_oh, stride_kvb, stride_kvt, heads, eps,
        KVL: tl.constexpr, KVL_P2: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
        H_P2: tl.constexpr, WRITE_CACHE: tl.constexpr, STORE_LATENT: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        ty = QOUT.dtype.element_ty
        row = CKV + t * stride_c
        cols = tl.arange(0, KVL_P2)
        live = cols < KVL
        w = tl.load(NW + cols, mask=live, other=0.0).to(tl.float32)
        pdl.pdl_wait(PDL)
        x = tl.load(row + cols, mask=live, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / KVL + eps)
        c_norm = (w * (x * inv).to(ty).to(tl.float32)).to(ty)
        i = tl.arange(0, HALF_P2)
        li = i < HALF
        cs = tl.load(COS + t * HALF + i, mask=li, other=0.0)
        sn = tl.load(SIN + t * HALF + i, mask=li, other=0.0)
        ev = tl.load(row + KVL + 2 * i, mask=li, other=0.0).to(tl.float32)
        od = tl.load(row + KVL + 2 * i + 1, mask=li, other=0.0).to(tl.float32)
        k_ev = (ev * cs - od * sn).to(ty)
        k_od = (ev * sn + od * cs).to(ty)
        if WRITE_CACHE:
            keep = tl.load(MASK + t) != 0
            blk = tl.load(BLK + t).to(tl.int64)
            off = tl.load(OFF + t).to(tl.int64)
            dst = KV + blk * stride_kvb + off * stride_kvt
            tl.store(dst + cols, c_norm, mask=live & keep)
            tl.store(dst + KVL + 2 * i, k_ev, mask=li & keep)
            tl.store(dst + KVL + 2 * i + 1, k_od, mask=li & keep)
        if STORE_LATENT:
            lrow = LAT + t * (KVL + 2 * HALF)
            tl.store(lrow + cols, c_norm, mask=live)
            tl.store(lrow + KVL + 2 * i, k_ev, mask=li)
            tl.store(lrow + KVL + 2 * i + 1, k_od, mask=li)
        h = tl.arange(0, H_P2)
        lh = h < heads
        m2 = lh[:, None] & li[None, :]
        q = QPE + t * stride_qt + h[:, None] * stride_qh + 2 * i[None, :]
        qe = tl.load(q, mask=m2, other=0.0).to(tl.float32)
        qo = tl.load(q + 1, mask=m2, other=0.0).to(tl.float32)
        o = QOUT + t * stride_ot + h[:, None] * stride_oh + 2 * i[None, :]
        tl.store(o, (qe * cs[None, :] - qo * sn[None, :]).to(ty), mask=m2)
        tl.store(o + 1, (qe * sn[None, :] + qo * cs[None, :]).to(ty), mask=m2)


__all__ = ["HAS_TRITON", "latent_ref", "rope_kv_write", "rope_kv_write_ref", "rope_kv_write_triton"]
