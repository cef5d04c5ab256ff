"""RMSNorm and rotary embedding, each one Triton kernel on CUDA beside its torch reference.

In eager torch each is a chain of small elementwise kernels (upcast, square, mean, rsqrt, scale,
downcast, weight; unflatten, four products, stack, downcast): about seven per norm and eight per
rotation, three norms and two rotations per layer, which at decode batch sizes cost more GPU time
than the bytes they move. The kernels compute the same fp32 arithmetic in one pass; the CPU keeps
the references, which stay the transformers-oracle-tested path.

``add_rms_norm`` is the residual add and the next norm in one pass (the sum written once, the
normalised sum beside it): a layer has two of them, after attention and after the MLP.
"""

from __future__ import annotations

from typing import Any

import torch

from pdd_sidecar.model.kernels import pdl
from pdd_sidecar.model.kernels.pow2 import next_pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # machines without a GPU may have no Triton: the references serve them
    HAS_TRITON = False
else:
    HAS_TRITON = True


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm_ref(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + y, rms_norm(x + y))``, the sum rounded to ``x``'s dtype first, as eager torch."""
    s = x + y
    return s, rms_norm_ref(s, weight, eps)


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[T, ..., dim]`` by per-token angles; ``cos``/``sin`` are ``[T, dim/2]``;
    interleaved pairs (DeepSeek's layout)."""
    xf = x.float().unflatten(-1, (-1, 2))
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    even, odd = xf[..., 0], xf[..., 1]
    out = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1)
    return out.flatten(-2).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` over the last dimension, normalized in fp32 and rounded to
    ``x``'s dtype before the weight, as transformers does."""
    n = x.shape[-1]
    if (not (x.is_cuda and HAS_TRITON) or x.dtype != weight.dtype or weight.shape != (n,)
            or x.stride(-1) != 1 or x.numel() == 0):
        return rms_norm_ref(x, weight, eps)
    return rms_norm_triton(x, weight, eps)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, n)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    kernel: Any = _rms_norm_rows
    block = next_pow2(n)
    kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), n, eps, BLOCK=block,
                             num_warps=4 if block <= 2048 else 8,
                             **pdl.launch(x.device, rows.shape[0]))
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum ``x + y`` and its RMSNorm, one kernel on CUDA (``add_rms_norm_ref``'s
    roundings)."""
    n = x.shape[-1]
    if (not (x.is_cuda and HAS_TRITON) or x.dtype != weight.dtype or y.dtype != x.dtype
            or y.shape != x.shape or weight.shape != (n,) or x.numel() == 0):
        return add_rms_norm_ref(x, y, weight, eps)
    return add_rms_norm_triton(x, y, weight, eps)


def add_rms_norm_triton(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    xr, yr = x.reshape(-1, n).contiguous(), y.reshape(-1, n).contiguous()
    total = torch.empty_like(xr)
    normed = torch.empty_like(xr)
    kernel: Any = _add_rms_norm_rows
    block = next_pow2(n)
    kernel[(xr.shape[0],)](xr, yr, weight, total, normed, n, eps, BLOCK=block,
                           num_warps=4 if block <= 2048 else 8,
                           **pdl.launch(x.device, xr.shape[0]))
    return total.view(x.shape), normed.view(x.shape)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope_ref``'s rotation; ``x`` may be a strided view (the rope part of q)."""
    dim = x.shape[-1]
    t = x.shape[0]
    if (not (x.is_cuda and HAS_TRITON) or x.dim() < 2 or x.stride(-1) != 1 or dim % 2
            or cos.shape != (t, dim // 2) or sin.shape != cos.shape or x.numel() == 0):
        return apply_rope_ref(x, cos, sin)
    return apply_rope_triton(x, cos, sin)


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t, dim = x.shape[0], x.shape[-1]
    if x.dim() == 2:
        view = x.unsqueeze(1)
    elif x.dim() == 3:
        view = x
    else:
        view = x.reshape(t, -1, dim)
    m = view.shape[1]
    out = torch.empty(t, m, dim, dtype=x.dtype, device=x.device)
    c, s = cos.float().contiguous(), sin.float().contiguous()
    kernel: Any = _rope_rows
    kernel[(t * m,)](view, c, s, out, m, view.stride(0), view.stride(1), HALF=dim // 2,
                     HALF_P2=next_pow2(dim // 2))
    return out.view(x.shape)


if HAS_TRITON:

    @triton.jit
    def _rms_norm_rows(x_ptr, w_ptr, out_ptr, stride_x, n, eps, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        pdl.pdl_wait(PDL)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
        y = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * n + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_rms_norm_rows(x_ptr, y_ptr, w_ptr, sum_ptr, out_ptr, n, eps, BLOCK: tl.constexpr,
                           PDL: tl.constexpr = False):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        pdl.pdl_wait(PDL)
        ty = sum_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + y).to(ty)
        tl.store(sum_ptr + row * n + cols, s, mask=mask)
        sf = s.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / n + eps)
        z = (sf * inv).to(ty).to(tl.float32)
        tl.store(out_ptr + row * n + cols, (w * z).to(ty), mask=mask)

    @triton.jit
    def _rope_rows(x_ptr, cos_ptr, sin_ptr, out_ptr, m, stride_t, stride_m,
                   HALF: tl.constexpr, HALF_P2: tl.constexpr):
        row = tl.program_id(0)
        t = row // m
        h = row % m
        i = tl.arange(0, HALF_P2)
        mask = i < HALF
        src = x_ptr + t * stride_t + h * stride_m + 2 * i
        even = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        odd = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t * HALF + i, mask=mask, other=0.0)
        s = tl.load(sin_ptr + t * HALF + i, mask=mask, other=0.0)
        dst = out_ptr + row * (2 * HALF) + 2 * i
        ty = out_ptr.dtype.element_ty
        tl.store(dst, (even * c - odd * s).to(ty), mask=mask)
        tl.store(dst + 1, (even * s + odd * c).to(ty), mask=mask)


__all__ = ["HAS_TRITON", "add_rms_norm", "add_rms_norm_ref", "apply_rope", "apply_rope_ref",
           "rms_norm", "rms_norm_ref"]
