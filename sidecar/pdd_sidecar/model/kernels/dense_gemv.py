"""A dense projection of a few rows as a Triton GEMV: ``x [T, K] @ w[N, K].T``.

At decode batch 1 the layer's dense projections (the stacked query and latent projection, the
output projection) are matrix-vector products that cuBLAS serves at about half the HBM read rate
on an H100. Here one program reads ``BLOCK_N`` whole rows of ``w`` for one token in ``BLOCK_K``
slices and accumulates in fp32, as the routed experts' GEMV does. Measured on an H100 it is
slower than cuBLAS at its best tiles (51 % against 58 % for the 15 MB stacked projection), so
the model uses it only when ``fusion.dense_gemv_tokens()`` says so (default 0); it stays for
the bench's same-run comparison and for devices where it wins.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pdd_sidecar.model import fusion

try:
    import triton
    import triton.language as tl
except ImportError:  # machines without a GPU may have no Triton: F.linear serves them
    HAS_TRITON = False
else:
    HAS_TRITON = True

TILES = (16, 512, 4)  # BLOCK_N, BLOCK_K, warps: bench/engine.py --gemv-sweep measures others


def gemv_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.is_cuda and HAS_TRITON and x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype
            and x.shape[1] == w.shape[1] and x.stride(-1) == 1 and w.stride(-1) == 1
            and x.shape[0] > 0)


def linear_gemv(
    x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """``F.linear(x, w)`` (no bias), one Triton kernel where ``gemv_applies``."""
    if not gemv_applies(x, w):
        return F.linear(x, w)
    return linear_gemv_triton(x, w, tiles)


def linear_gemv_triton(
    x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, int, int] | None = None
) -> torch.Tensor:
    block_n, block_k, warps = tiles or TILES
    t, k = x.shape
    n = w.shape[0]
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    kernel: Any = _gemv_rows
    kernel[(t, triton.cdiv(n, block_n))](
        x, w, y, k, n, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return y


def small_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)``; on the fused path, up to ``fusion.dense_gemv_tokens()`` rows, the
    Triton GEMV."""
    if fusion.fused() and x.is_cuda and x.shape[0] <= fusion.dense_gemv_tokens():
        return linear_gemv(x, w)
    return F.linear(x, w)


if HAS_TRITON:

    @triton.jit
    def _gemv_rows(
        X, W, Y, K, N, stride_xt, stride_wn, stride_yt,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        nb = tl.program_id(1)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        rows = W + offs_n[:, None].to(tl.int64) * stride_wn
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            xv = tl.load(X + t * stride_xt + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            wv = tl.load(rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                         other=0.0)
            acc += tl.sum(wv.to(tl.float32) * xv[None, :], 1)
        tl.store(Y + t * stride_yt + offs_n, acc.to(Y.dtype.element_ty), mask=mask_n)


__all__ = ["HAS_TRITON", "TILES", "gemv_applies", "linear_gemv", "linear_gemv_triton",
           "small_linear"]
