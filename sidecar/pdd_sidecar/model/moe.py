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
    always_slots,
    combine,
    router_topk,
    softmax_topk,
    topk_weights,
)
from pdd_sidecar.model.weights import MLPWeights, MoEWeights


def dense_mlp(x: torch.Tensor, w: MLPWeights, add_bias: bool = True) -> torch.Tensor:
    """``add_bias`` is False on all but one rank of a sharded MLP so the sum has one bias."""
    h = F.silu(F.linear(x, w.gate, w.gate_bias)) * F.linear(x, w.up, w.up_bias)
    return F.linear(h, w.down, w.down_bias if add_bias else None)


def route(
    x: torch.Tensor, router: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] fp32, expert ids [T, k])``. ``bias`` is V3's ``e_score_correction_bias``:
    it steers which experts are chosen but not how much they weigh."""
    logits = F.linear(x.float(), router)
    k = cfg.num_experts_per_tok
    if cfg.scoring_func == "sigmoid":
        return _route_noaux_tc(logits, cfg, bias)
    if cfg.topk_method != "group_limited_greedy":
        return softmax_topk(logits, k, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    assert cfg.n_group and cfg.topk_group
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    n_exp = scores.shape[-1]
    groups = scores.view(-1, cfg.n_group, n_exp // cfg.n_group).max(dim=-1).values
    keep = torch.zeros_like(groups)
    keep.scatter_(1, torch.topk(groups, k=cfg.topk_group, dim=-1, sorted=False)[1], 1)
    mask = keep.unsqueeze(-1).expand(-1, cfg.n_group, n_exp // cfg.n_group).reshape(-1, n_exp)
    scores = scores.masked_fill(~mask.bool(), 0.0)
    return topk_weights(scores, k, cfg.norm_topk_prob, cfg.routed_scaling_factor)


def _route_noaux_tc(
    logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router, op for op as transformers runs it (the same ops keep near-ties
    broken the same way): groups ranked by the sum of their two best biased scores, experts
    picked among the ``topk_group`` best groups, weighted by their unbiased scores."""
    assert cfg.n_group and cfg.topk_group
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    n_exp, g = scores.shape[-1], cfg.n_group
    groups = choice.view(-1, g, n_exp // g).topk(2, dim=-1)[0].sum(dim=-1)
    keep = torch.zeros_like(groups)
    keep.scatter_(1, torch.topk(groups, k=cfg.topk_group, dim=-1, sorted=False)[1], 1)
    mask = keep.unsqueeze(-1).expand(-1, g, n_exp // g).reshape(-1, n_exp)
    choice = choice.masked_fill(~mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def expert_path(x: torch.Tensor, w: MoEWeights, top_k: int) -> str:
    """``"gemv"`` or ``"grouped"`` (CUDA, no host sync, graph-capturable) or ``"loop"`` (the
    reference; it syncs). From shapes and dtypes only: up to ``GEMV_MAX_PAIRS`` (token, expert)
    pairs the Triton GEMVs serve any dtype, above that the grouped GEMMs where they exist."""
    if not x.is_cuda or x.dtype != w.w_gate.dtype:
        return "loop"
    if mg.HAS_TRITON and x.shape[0] * top_k <= mg.GEMV_MAX_PAIRS:
        return "gemv"
    return "grouped" if can_group(x, w) else "loop"


def fused_route_applies(cfg: ModelConfig, w: MoEWeights) -> bool:
    """The one-kernel router (``router_topk``) serves V2's greedy softmax routing; V3's sigmoid
    and group-limited routing keep ``route``."""
    return (cfg.scoring_func == "softmax" and cfg.topk_method == "greedy"
            and w.score_bias is None)


def moe(x: torch.Tensor, w: MoEWeights, cfg: ModelConfig, add_bias: bool = True) -> torch.Tensor:
    if fusion.fused() and x.is_cuda and fused_route_applies(cfg, w):
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
    if fusion.fused_router():
        weights, ids = router_topk(x, w.router, k, cfg.norm_topk_prob,
                                   cfg.routed_scaling_factor, always=parts if fold else 0)
    else:
        weights, ids = always_slots(*route(x, w.router, cfg), w.router.shape[0],
                                    parts if fold else 0)
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
