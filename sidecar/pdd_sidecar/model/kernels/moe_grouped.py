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

import torch
import torch.nn.functional as F

from pdd_sidecar.model.weights import MoEWeights

_AVAILABLE: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs for ``dtype`` on ``device`` (probed once: it exists
    on Hopper for bf16; other chips and dtypes may lack a kernel)."""
    key = (str(device), dtype)
    if key not in _AVAILABLE:
        ok = False
        fn = getattr(torch, "_grouped_mm", None)
        if fn is not None and device.type == "cuda":
            try:
                a = torch.ones(16, 16, dtype=dtype, device=device)
                w = torch.ones(2, 16, 16, dtype=dtype, device=device)
                offs = torch.tensor([8, 16], dtype=torch.int32, device=device)
                y = fn(a, w.transpose(-2, -1), offs=offs)
                ok = bool(torch.allclose(y.float(), torch.full_like(y, 16).float()))
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _AVAILABLE[key] = ok
    return _AVAILABLE[key]


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
    order = torch.argsort(flat, stable=True)
    rows = order // ids.shape[1]
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return order, rows, offs


def grouped_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w: MoEWeights
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every token, ``[T, hidden]`` in
    ``x``'s dtype (shared experts not included)."""
    t, k = ids.shape
    order, rows, offs = sort_by_expert(ids, w.w_gate.shape[0])
    xs = x.index_select(0, rows)
    g = torch._grouped_mm(xs, w.w_gate.transpose(-2, -1), offs=offs)
    u = torch._grouped_mm(xs, w.w_up.transpose(-2, -1), offs=offs)
    y = torch._grouped_mm(F.silu(g) * u, w.w_down.transpose(-2, -1), offs=offs)
    unsorted = torch.empty_like(y).index_copy_(0, order, y)
    out = (unsorted.view(t, k, -1).float() * weights.view(t, k, 1).float()).sum(1)
    return out.to(x.dtype)


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
