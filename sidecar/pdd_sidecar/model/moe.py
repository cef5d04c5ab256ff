"""Dense SwiGLU MLP and the DeepSeek mixture of experts: V2's softmax top-k routing (optional
group-limited selection) or V3's sigmoid ``noaux_tc`` routing, ``routed_scaling_factor``, shared
experts.

Routing is computed in fp32 from the replicated router on every rank, so all ranks pick the same
experts; a TP rank then runs its intermediate slice of every selected expert and the partial
outputs are summed over ranks by the caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdd_sidecar.model import fusion
from pdd_sidecar.model.config import ModelConfig
from pdd_sidecar.model.kernels import moe_grouped as mg
from pdd_sidecar.model.kernels.moe_grouped import (
    can_group,
    gemv_experts,
    grouped_experts,
    grouped_gemv_applies,
    grouped_gemv_experts,
    loop_experts,
    shared_chunks,
)
from pdd_sidecar.model.kernels.moe_route import (
    Routing,
    always_slots,
    combine,
    route_ref,
    router_topk,
    softmax_topk,
)
from pdd_sidecar.model.weights import MLPWeights, MoEWeights


def dense_mlp(x: torch.Tensor, w: MLPWeights, add_bias: bool = True) -> torch.Tensor:
    """``add_bias`` is False on all but one rank of a sharded MLP so the sum has one bias."""
    h = F.silu(F.linear(x, w.gate, w.gate_bias)) * F.linear(x, w.up, w.up_bias)
    return F.linear(h, w.down, w.down_bias if add_bias else None)


def routing(cfg: ModelConfig) -> Routing:
    """The checkpoint's routing: V2's softmax (greedy, or ``group_limited_greedy``) or V3's
    sigmoid ``noaux_tc``, always group-limited."""
    sigmoid = cfg.scoring_func == "sigmoid"
    if not (sigmoid or cfg.topk_method == "group_limited_greedy"):
        return Routing(cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    assert cfg.n_group and cfg.topk_group
    return Routing(cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routed_scaling_factor,
                   sigmoid=sigmoid, n_group=cfg.n_group, topk_group=cfg.topk_group)


def route(
    x: torch.Tensor, router: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] fp32, expert ids [T, k])``. ``bias`` is V3's ``e_score_correction_bias``:
    it steers which experts are chosen but not how much they weigh."""
    r, logits = routing(cfg), F.linear(x.float(), router)
    if not (r.sigmoid or r.grouped):  # the softmax and top-k in one kernel on CUDA
        return softmax_topk(logits, r.k, r.normalize, r.scale)
    return route_ref(logits, r, bias)


def expert_path(x: torch.Tensor, w: MoEWeights, top_k: int) -> str:
    """``"gemv"`` or ``"grouped"`` (CUDA, no host sync, graph-capturable) or ``"loop"`` (the
    reference; it syncs). From shapes and dtypes only: up to ``GEMV_MAX_PAIRS`` (token, expert)
    pairs the Triton GEMVs serve any dtype, above that the grouped GEMMs where they exist."""
    if not x.is_cuda or x.dtype != w.w_gate.dtype:
        return "loop"
    if mg.HAS_TRITON and x.shape[0] * top_k <= mg.GEMV_MAX_PAIRS:
        return "gemv"
    return "grouped" if can_group(x, w) else "loop"


def moe(x: torch.Tensor, w: MoEWeights, cfg: ModelConfig, add_bias: bool = True) -> torch.Tensor:
    if fusion.fused() and x.is_cuda:
        return _moe_fused(x, w, cfg, add_bias)
    weights, ids = route(x, w.router, cfg, w.score_bias)
    path = expert_path(x, w, cfg.num_experts_per_tok)
    shared = None if w.shared is None else dense_mlp(x, w.shared, add_bias)
    if path != "loop":
        return grouped_experts(x, weights, ids, w, gemv=path == "gemv", shared=shared)
    out = loop_experts(x, weights, ids, w)
    return out if shared is None else out + shared


def _moe_fused(x: torch.Tensor, w: MoEWeights, cfg: ModelConfig, add_bias: bool) -> torch.Tensor:
    """``moe`` with the router in one kernel and, up to ``fusion.shared_in_gemv_tokens()``
    tokens on the GEMV path, the shared experts as always-chosen experts of the routed GEMV
    (one pair of kernels reads every weight the step needs, one combine sums them)."""
    k = cfg.num_experts_per_tok
    path = expert_path(x, w, k)
    parts = shared_chunks(w)
    fold = (path == "gemv" and parts > 0 and x.shape[0] <= fusion.shared_in_gemv_tokens()
            and x.shape[0] * (k + parts) <= mg.GEMV_MAX_PAIRS)
    always = parts if fold else 0
    if fusion.fused_router():
        weights, ids = router_topk(x, w.router, routing(cfg), always, w.score_bias)
    else:
        weights, ids = always_slots(*route(x, w.router, cfg, w.score_bias), w.router.shape[0],
                                    always)
    if fold:
        return combine(gemv_experts(x, ids, w, shared=True), weights, None, None)
    shared = None if w.shared is None else dense_mlp(x, w.shared, add_bias)
    lo, hi = fusion.grouped_gemv_tokens()
    if path != "loop" and max(lo, 2) <= x.shape[0] <= hi and grouped_gemv_applies(x, w):
        return grouped_gemv_experts(x, weights, ids, w, shared)
    if path != "loop":
        return grouped_experts(x, weights, ids, w, gemv=path == "gemv", shared=shared)
    out = loop_experts(x, weights, ids, w)
    return out if shared is None else out + shared
