"""Routed-expert compute without host syncs: tokens sorted by expert into fixed-size buffers
and one grouped GEMM per projection (``torch._grouped_mm`` with ``offs``).

The per-expert loop in moe.py needs the set of chosen experts on the host (``.tolist()``), which
stalls the stream once per layer and cannot be captured in a CUDA graph. Here every shape depends
only on ``T * top_k``: sorting, counting (``scatter_add_``, not ``bincount``, whose output size
would depend on the data), the group ends, the gather and the un-permute all stay on the device.
The top-k partial outputs are summed in fp32 per token in slot order, so the result does not
depend on atomics' ordering.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pdd_sidecar.model.kernels import pdl
from pdd_sidecar.model.kernels.moe_route import combine, inverse_order
from pdd_sidecar.model.weights import MoEWeights

try:
    import triton
    import triton.language as tl
except ImportError:  # machines without a GPU may have no Triton: the grouped GEMMs serve
    HAS_TRITON = False
else:
    HAS_TRITON = True

# Up to this many (token, expert) pairs the per-pair GEMV kernels run instead of the grouped
# GEMMs: with a few rows per expert the GEMM tiles are mostly padding, while a GEMV reads each
# chosen expert's rows once at close to the memory rate. Decided from shapes only (graph-safe).
GEMV_MAX_PAIRS = 128
GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS = 32, 256, 4  # bench/engine.py --tune sweeps these
# Batch-1 decode (6 pairs, 8 with the shared experts inside): bench/engine.py --gemv-sweep on an
# H100, every MoE layer, shared inside: gate/up 1522 us at (8, 512, 4) against 1583 at
# (16, 512, 4); down 1449 us (78 % of the HBM read rate) against 1583 (72 %)
GEMV_FEW_PAIRS, GEMV_FEW_TILES = 16, (8, 512, 4)
GEMV_FEW_DOWN_TILES: tuple[int, int, int] | None = (8, 512, 4)  # None: GEMV_FEW_TILES

_AVAILABLE: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` has a device kernel for ``dtype`` on ``device`` (probed
    once: Hopper has one for bf16). A build that serves a dtype through a fallback reading the
    group offsets on the host (fp32 in torch 2.11) syncs every call and cannot be captured in
    a CUDA graph: the probe captures one call, and such a dtype counts as unavailable."""
    key = (str(device), dtype)
    if key not in _AVAILABLE:
        fn = getattr(torch, "_grouped_mm", None)
        if fn is None or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return False
        _AVAILABLE[key] = _probe_grouped_mm(fn, device, dtype)
    return _AVAILABLE[key]


def _probe_grouped_mm(fn: Any, device: torch.device, dtype: torch.dtype) -> bool:
    try:
        a = torch.ones(16, 16, dtype=dtype, device=device)
        w = torch.ones(2, 16, 16, dtype=dtype, device=device).transpose(-2, -1)
        offs = torch.tensor([8, 16], dtype=torch.int32, device=device)
        y = fn(a, w, offs=offs)
        if not torch.allclose(y.float(), torch.full_like(y, 16).float()):
            return False
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn(a, w, offs=offs)
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def can_group(x: torch.Tensor, w: MoEWeights) -> bool:
    """The grouped path applies: CUDA, a probed dtype, and 16-byte aligned rows (hidden and the
    rank's intermediate slice multiples of 8 elements)."""
    if not x.is_cuda or x.dtype != w.w_gate.dtype:
        return False
    hidden, inter = w.w_gate.shape[2], w.w_gate.shape[1]
    if hidden % 8 or inter % 8:
        return False
    return grouped_mm_available(x.device, x.dtype)


def sort_by_expert(
    ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, rows, offs)``: ``order`` sorts the flattened ``[T*k]`` choices by expert
    (stable), ``rows`` is the token of each sorted choice, ``offs [E]`` int32 the end of each
    expert's group."""
    flat = ids.flatten()
    # The narrowest key that holds an expert id: the radix sort makes one pass per key byte
    # (int64 ids took 27 us a layer at 64 tokens on an H100); equal keys keep their order.
    key = flat.to(torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 32767
                  else flat.dtype)
    order = torch.argsort(key, stable=True)
    rows = order // ids.shape[1]
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return order, rows, offs


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w: MoEWeights,
    gemv: bool | None = None,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every token, ``[T, hidden]`` in
    ``x``'s dtype, plus ``shared`` (the shared experts' output) when given. ``gemv`` forces
    either kernel family (tests, bench); by default the GEMV kernels take up to
    ``GEMV_MAX_PAIRS`` pairs."""
    t, k = ids.shape
    if gemv is None:
        gemv = HAS_TRITON and t * k <= GEMV_MAX_PAIRS
    if gemv:
        return combine(gemv_experts(x, ids, w), weights, None, shared)
    order, rows, offs = sort_by_expert(ids, w.w_gate.shape[0])
    xs = x.index_select(0, rows)
    g = torch._grouped_mm(xs, w.w_gate.transpose(-2, -1), offs=offs)
    u = torch._grouped_mm(xs, w.w_up.transpose(-2, -1), offs=offs)
    y = torch._grouped_mm(F.silu(g) * u, w.w_down.transpose(-2, -1), offs=offs)
    return combine(y, weights, inverse_order(order), shared)


def grouped_gemv_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w: MoEWeights,
    shared: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``grouped_experts``' result with the pairs sorted by expert and one program per
    (expert, slice of output rows) reading that slice of the expert's weights once for all its
    tokens (up to ``BLOCK_M`` at a time, gathered in registers: no padding rows in memory).
    The per-pair GEMV reads an expert once per pair, so at batch 16 (96 pairs over ~50
    experts) it read about twice the bytes. bf16/fp16 (tensor-core dots)."""
    t, k = ids.shape
    e, inter, hidden = w.w_gate.shape
    order, rows, offs = sort_by_expert(ids, e)
    bm, bn, bk, warps = tiles or GROUPED_GEMV_TILES
    pairs = t * k
    x = x.contiguous()
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    rows32 = rows.to(torch.int32)
    gate_up: Any = _grouped_gate_up
    gate_up[(e, triton.cdiv(inter, bn))](
        x, w.w_gate, w.w_up, rows32, offs, h,
        hidden, inter, x.stride(0), w.w_gate.stride(0), w.w_gate.stride(1),
        w.w_up.stride(0), w.w_up.stride(1), h.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **pdl.launch(x.device, t),
    )  # fmt: skip
    down: Any = _grouped_down
    down[(e, triton.cdiv(hidden, bn))](
        h, w.w_down, offs, y,
        inter, hidden, h.stride(0), w.w_down.stride(0), w.w_down.stride(1), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **pdl.launch(x.device, t),
    )  # fmt: skip
    return combine(y, weights, inverse_order(order), shared)


def grouped_gemv_applies(x: torch.Tensor, w: MoEWeights) -> bool:
    return (HAS_TRITON and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and x.dtype == w.w_gate.dtype and w.w_gate.stride(-1) == 1
            and w.w_up.stride(-1) == 1 and w.w_down.stride(-1) == 1)


# BLOCK_M, BLOCK_N, BLOCK_K, warps: at 16 tokens on an H100 the best of the swept tiles, every
# MoE layer 8146 us (88 % of the HBM read rate) against 8951 (80 %) for the per-pair GEMV
GROUPED_GEMV_TILES = (16, 64, 128, 4)


def loop_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w: MoEWeights
) -> torch.Tensor:
    """The reference: one dense pass per chosen expert (host sync for the set of experts)."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == e)
        h = x[rows]
        h = F.silu(F.linear(h, w.w_gate[e])) * F.linear(h, w.w_up[e])
        y = F.linear(h, w.w_down[e]) * weights[rows, slot, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


def shared_chunks(w: MoEWeights) -> int:
    """How many routed-sized experts the shared experts make (their intermediate rows cut in
    the routed experts' width: a SwiGLU's intermediate dimension splits into parts whose
    down-projections sum), or 0 where they cannot run inside the routed experts' GEMV (none,
    biases, another width or layout)."""
    sh = w.shared
    if sh is None or sh.gate_bias is not None or sh.up_bias is not None or (
            sh.down_bias is not None):
        return 0
    e, inter, hidden = w.w_gate.shape
    rows = sh.gate.shape[0]
    if (rows % inter or sh.gate.shape != (rows, hidden) or sh.up.shape != (rows, hidden)
            or sh.down.shape != (hidden, rows) or sh.gate.dtype != w.w_gate.dtype
            or sh.gate.stride() != (w.w_gate.stride(1), 1)
            or sh.up.stride() != (w.w_up.stride(1), 1) or sh.down.stride(1) != 1
            or w.w_down.stride(2) != 1):
        return 0
    return rows // inter


def gemv_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    w: MoEWeights,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    shared: bool = False,
    down_tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Each (token, expert) pair's expert output ``[T*k, hidden]`` (unweighted), two Triton
    kernels: gate and up fused with SiLU, then down. With ``shared``, ids ``E + j`` are the
    ``j``-th routed-sized part of the shared experts (``shared_chunks``), run by the same
    kernels from the shared weights."""
    t, k = ids.shape
    e, inter, hidden = w.w_gate.shape
    sh = w.shared if shared else None
    if shared and (sh is None or shared_chunks(w) == 0):
        raise ValueError("shared=True needs shared experts that shared_chunks() can split")
    pairs = t * k
    few = pairs <= GEMV_FEW_PAIRS  # narrower, longer tiles: more programs for few pairs
    block_n = block_n or (GEMV_FEW_TILES[0] if few else GEMV_BLOCK_N)
    block_k = block_k or (GEMV_FEW_TILES[1] if few else GEMV_BLOCK_K)
    num_warps = num_warps or (GEMV_FEW_TILES[2] if few else GEMV_WARPS)
    dn, dk, dw = down_tiles or (GEMV_FEW_DOWN_TILES if few and GEMV_FEW_DOWN_TILES else None) or (
        block_n, block_k, num_warps)
    flat = ids.reshape(-1).contiguous()
    x = x.contiguous()
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    sg, su, sd = (sh.gate, sh.up, sh.down) if sh is not None else (w.w_gate, w.w_up, w.w_down)
    sd_row = sh.down.stride(0) if sh is not None else w.w_down.stride(1)
    gate_up: Any = _gemv_gate_up
    gate_up[(pairs, triton.cdiv(inter, block_n))](
        x, w.w_gate, w.w_up, sg, su, flat, h,
        hidden, inter, e, x.stride(0), w.w_gate.stride(0), w.w_gate.stride(1),
        w.w_up.stride(0), w.w_up.stride(1), h.stride(0),
        TOPK=k, BLOCK_N=block_n, BLOCK_K=block_k, HAS_SHARED=sh is not None,
        num_warps=num_warps, **pdl.launch(x.device, t),
    )  # fmt: skip
    down: Any = _gemv_down
    down[(pairs, triton.cdiv(hidden, dn))](
        h, w.w_down, sd, flat, y,
        inter, hidden, e, h.stride(0), w.w_down.stride(0), w.w_down.stride(1), sd_row,
        y.stride(0),
        BLOCK_N=dn, BLOCK_K=dk, HAS_SHARED=sh is not None, num_warps=dw,
        **pdl.launch(x.device, t),
    )  # fmt: skip
    return y


if HAS_TRITON:

    @triton.jit
    def _grouped_gate_up(
        X, WG, WU, ROWS, OFFS, H,
        K, N, stride_xt, stride_ge, stride_gn, stride_ue, stride_un, stride_ht,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        e = tl.program_id(0)
        nb = tl.program_id(1)
        pdl.pdl_wait(PDL)
        end = tl.load(OFFS + e)
        start = tl.load(OFFS + e - 1, mask=e > 0, other=0)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        g_rows = WG + e.to(tl.int64) * stride_ge + offs_n[:, None] * stride_gn
        u_rows = WU + e.to(tl.int64) * stride_ue + offs_n[:, None] * stride_un
        for m0 in range(start, end, BLOCK_M):
            pm = m0 + tl.arange(0, BLOCK_M)
            live = pm < end
            tok = tl.load(ROWS + pm, mask=live, other=0).to(tl.int64)
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                xv = tl.load(X + tok[:, None] * stride_xt + offs_k[None, :],
                             mask=live[:, None] & mask_k[None, :], other=0.0)
                m2 = mask_n[:, None] & mask_k[None, :]
                wg = tl.load(g_rows + offs_k[None, :], mask=m2, other=0.0)
                wu = tl.load(u_rows + offs_k[None, :], mask=m2, other=0.0)
                acc_g = tl.dot(xv, tl.trans(wg), acc_g)
                acc_u = tl.dot(xv, tl.trans(wu), acc_u)
            g = acc_g.to(H.dtype.element_ty).to(tl.float32)  # the reference rounds g and u
            u = acc_u.to(H.dtype.element_ty).to(tl.float32)
            hv = g / (1.0 + tl.exp(-g)) * u
            tl.store(H + pm[:, None].to(tl.int64) * stride_ht + offs_n[None, :],
                     hv.to(H.dtype.element_ty), mask=live[:, None] & mask_n[None, :])

    @triton.jit
    def _grouped_down(
        H, WD, OFFS, Y,
        K, N, stride_ht, stride_de, stride_dn, stride_yt,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        e = tl.program_id(0)
        nb = tl.program_id(1)
        end = tl.load(OFFS + e)  # the sort's, two kernels back: complete (pdl.py)
        start = tl.load(OFFS + e - 1, mask=e > 0, other=0)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        d_rows = WD + e.to(tl.int64) * stride_de + offs_n[:, None].to(tl.int64) * stride_dn
        pdl.pdl_wait(PDL)
        for m0 in range(start, end, BLOCK_M):
            pm = m0 + tl.arange(0, BLOCK_M)
            live = pm < end
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                hv = tl.load(H + pm[:, None].to(tl.int64) * stride_ht + offs_k[None, :],
                             mask=live[:, None] & mask_k[None, :], other=0.0)
                wd = tl.load(d_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                             other=0.0)
                acc = tl.dot(hv, tl.trans(wd), acc)
            tl.store(Y + pm[:, None].to(tl.int64) * stride_yt + offs_n[None, :],
                     acc.to(Y.dtype.element_ty), mask=live[:, None] & mask_n[None, :])

    @triton.jit
    def _gemv_gate_up(
        X, WG, WU, SG, SU, IDS, H,
        K, N, E, stride_xt, stride_ge, stride_gn, stride_ue, stride_un, stride_ht,
        TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        HAS_SHARED: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        s = tl.program_id(0)
        nb = tl.program_id(1)
        pdl.pdl_wait(PDL)
        tok = s // TOPK
        e = tl.load(IDS + s).to(tl.int64)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        g_base = WG + e * stride_ge
        u_base = WU + e * stride_ue
        if HAS_SHARED:
            if e >= E:  # a part of the shared experts: rows (e - E) * N .. of their weights
                g_base = SG + (e - E) * N * stride_gn
                u_base = SU + (e - E) * N * stride_un
        g_rows = g_base + offs_n[:, None] * stride_gn
        u_rows = u_base + offs_n[:, None] * stride_un
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            xv = tl.load(X + tok * stride_xt + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            m2 = mask_n[:, None] & mask_k[None, :]
            wg = tl.load(g_rows + offs_k[None, :], mask=m2, other=0.0)
            wu = tl.load(u_rows + offs_k[None, :], mask=m2, other=0.0)
            acc_g += tl.sum(wg.to(tl.float32) * xv[None, :], 1)
            acc_u += tl.sum(wu.to(tl.float32) * xv[None, :], 1)
        g = acc_g.to(H.dtype.element_ty).to(tl.float32)  # the reference rounds g and u first
        u = acc_u.to(H.dtype.element_ty).to(tl.float32)
        hv = g / (1.0 + tl.exp(-g)) * u
        tl.store(H + s * stride_ht + offs_n, hv.to(H.dtype.element_ty), mask=mask_n)

    @triton.jit
    def _gemv_down(
        H, WD, SD, IDS, Y,
        K, N, E, stride_ht, stride_de, stride_dn, stride_sdn, stride_yt,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SHARED: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        s = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(IDS + s).to(tl.int64)  # the router's, two kernels back: complete (pdl.py)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        rows = WD + e * stride_de + offs_n[:, None].to(tl.int64) * stride_dn
        if HAS_SHARED:
            if e >= E:  # a part of the shared experts: their down's columns (e - E) * K ..
                rows = SD + (e - E) * K + offs_n[:, None].to(tl.int64) * stride_sdn
        pdl.pdl_wait(PDL)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            hv = tl.load(H + s * stride_ht + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            wd = tl.load(rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc += tl.sum(wd.to(tl.float32) * hv[None, :], 1)
        tl.store(Y + s * stride_yt + offs_n, acc.to(Y.dtype.element_ty), mask=mask_n)
