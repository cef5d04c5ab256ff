"""The MoE layer's routing (V2's softmax with greedy or group-limited top-k, V3's biased
sigmoid with group-limited top-k) and the combine of the chosen experts' outputs, each one Triton
kernel on CUDA beside its torch reference.

In torch the routing is a projection, a softmax or sigmoid, group scores, masks, two top-ks, a
gather and a scaling, and the combine an unsort, two upcasts, a product, a sum and a downcast:
small kernels that at decode batch sizes cost more than the bytes they move. The kernels run the
same fp32 arithmetic; ties in a top-k go to the lowest id (torch's order among exact ties is
unspecified).
"""

from __future__ import annotations

from dataclasses import dataclass
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

MAX_EXPERTS = 1024  # one row of scores in one program
# The one-kernel router's [experts, 128] fp32 tile of the router weights sits in shared memory:
# 139 KB at 256 experts, 270 KB at 512, over an H100's 227 KB.
ROUTER_MAX_EXPERTS = 256


@dataclass(frozen=True)
class Routing:
    """What a checkpoint's router does with its logits (``model/moe.py`` reads it from the
    config): ``k`` experts a token, their weights normalised to sum to one or not, then scaled.
    Softmax scores (V2) or sigmoid scores (V3, whose ``e_score_correction_bias`` steers the
    choice but not the weights, and which normalises even a single expert). With ``n_group``
    > 1 a token picks among the ``topk_group`` best groups of consecutive experts only, a
    group ranked by its best score (softmax, V2's ``group_limited_greedy``) or by the sum of
    its two best biased scores (sigmoid, V3's ``noaux_tc``)."""

    k: int
    normalize: bool
    scale: float
    sigmoid: bool = False
    n_group: int = 1
    topk_group: int = 1

    @property
    def grouped(self) -> bool:
        return self.n_group > 1

    @property
    def normalizes(self) -> bool:
        return self.normalize and (self.k > 1 or self.sigmoid)


def topk_weights(
    scores: torch.Tensor, k: int, normalize: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best scores per token as weights (optionally summing to one), scaled."""
    weights, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
    if normalize and k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def softmax_topk_ref(
    logits: torch.Tensor, k: int, normalize: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return topk_weights(logits.softmax(dim=-1, dtype=torch.float32), k, normalize, scale)


def softmax_topk(
    logits: torch.Tensor, k: int, normalize: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] fp32, expert ids [T, k] int64)`` of a greedy softmax router."""
    t, e = logits.shape
    if not (logits.is_cuda and HAS_TRITON) or e > MAX_EXPERTS or k > e or t == 0:
        return softmax_topk_ref(logits, k, normalize, scale)
    return softmax_topk_triton(logits, k, normalize, scale)


def softmax_topk_triton(
    logits: torch.Tensor, k: int, normalize: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    t, e = logits.shape
    src = logits.float()
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    kernel: Any = _softmax_topk_rows
    kernel[(t,)](src, weights, ids, src.stride(0), e, float(scale), K=k,
                 K_P2=max(2, 1 << (k - 1).bit_length()), E_P2=max(16, 1 << (e - 1).bit_length()),
                 NORMALIZE=bool(normalize and k > 1))
    return weights, ids


def always_slots(
    weights: torch.Tensor, ids: torch.Tensor, first_id: int, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` more slots per token, weight 1 and ids ``first_id ..``: experts every token takes
    (the shared ones, run by the routed experts' kernels)."""
    if n == 0:
        return weights, ids
    t = ids.shape[0]
    extra = torch.arange(first_id, first_id + n, device=ids.device, dtype=ids.dtype)
    return (torch.cat([weights, weights.new_ones(t, n)], 1),
            torch.cat([ids, extra.expand(t, n)], 1))


def _group_mask(choice: torch.Tensor, r: Routing) -> torch.Tensor:
    """True for the experts of each token's ``topk_group`` best groups."""
    n_exp, g = choice.shape[-1], r.n_group
    per = choice.view(-1, g, n_exp // g)
    groups = per.topk(2, dim=-1)[0].sum(dim=-1) if r.sigmoid else per.max(dim=-1).values
    keep = torch.zeros_like(groups)
    keep.scatter_(1, torch.topk(groups, k=r.topk_group, dim=-1, sorted=False)[1], 1)
    return keep.unsqueeze(-1).expand(-1, g, n_exp // g).reshape(-1, n_exp).bool()


def route_ref(
    logits: torch.Tensor, r: Routing, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] fp32, expert ids [T, k])`` from fp32 logits, op for op as transformers
    routes DeepSeek-V2 and V3 (the same ops keep near-ties broken the same way)."""
    if not r.sigmoid:
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if r.grouped:
            scores = scores.masked_fill(~_group_mask(scores, r), 0.0)
        return topk_weights(scores, r.k, r.normalize, r.scale)
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if r.grouped:
        choice = choice.masked_fill(~_group_mask(choice, r), float("-inf"))
    ids = torch.topk(choice, k=r.k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if r.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * r.scale, ids


def router_topk_ref(
    x: torch.Tensor, router: torch.Tensor, r: Routing, always: int = 0,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router from the hidden rows: fp32 logits ``x @ router.T``, ``route_ref``, then
    ``always`` slots (``always_slots``, ids from ``E``)."""
    w, ids = route_ref(torch.nn.functional.linear(x.float(), router), r, bias)
    return always_slots(w, ids, router.shape[0], always)


ROUTER_BLOCK_T, ROUTER_BLOCK_K = 16, 128
_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}
MAX_ROUTER_TOKENS = 16384  # token blocks with a counter each


def kernel_routes(r: Routing, e: int, bias: torch.Tensor | None) -> bool:
    """Whether ``_router_topk_blocks`` computes this routing over ``e`` experts: groups that
    split the experts evenly and hold the ``k`` picks (and two experts each, for V3's group
    score), a bias only with sigmoid scores."""
    if e > ROUTER_MAX_EXPERTS or not 0 < r.k <= e or (bias is not None and (
            not r.sigmoid or bias.shape != (e,) or bias.dtype != torch.float32)):
        return False
    if not r.grouped:
        return True
    per = e // r.n_group
    return (e % r.n_group == 0 and 0 < r.topk_group <= r.n_group and r.k <= r.topk_group * per
            and (per >= 2 or not r.sigmoid))


def router_topk(
    x: torch.Tensor, router: torch.Tensor, r: Routing, always: int = 0,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_topk_ref`` in one kernel on CUDA: the logits of a block of tokens are split
    over the hidden dimension into programs (each reads a slice of the fp32 router, so a single
    token still spreads the read over many SMs), and the block's last program to finish sums
    the partial logits in a fixed order (deterministic), scores them, picks the groups and the
    top-k, and writes the weights and ids with the ``always`` slots."""
    t, hidden = x.shape
    e = router.shape[0]
    if (not (x.is_cuda and HAS_TRITON) or not kernel_routes(r, e, bias) or t == 0
            or t > MAX_ROUTER_TOKENS or router.shape[1] != hidden or router.dtype != torch.float32
            or x.stride(-1) != 1 or router.stride(-1) != 1):
        return router_topk_ref(x, router, r, always, bias)
    return router_topk_triton(x, router, r, always, bias)


def block_counters(device: torch.device) -> torch.Tensor:
    """The arrival counters of the current stream's router launches (zeroed once; each launch
    leaves its own zeroed again). One set per stream: launches on two streams at once (an
    overtaking prefill step beside a queued chunk) would otherwise count each other's programs
    and read partial logits. Graphs capture the capture stream's set; they never run at once
    (they share one memory pool)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    counters = _COUNTERS.get(key)
    if counters is None:
        counters = torch.zeros(MAX_ROUTER_TOKENS // ROUTER_BLOCK_T + 1, dtype=torch.int32,
                               device=device)
        _COUNTERS[key] = counters
    return counters


def router_topk_triton(
    x: torch.Tensor, router: torch.Tensor, r: Routing, always: int = 0,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, hidden = x.shape
    e = router.shape[0]
    counters = block_counters(x.device)
    splits = triton.cdiv(hidden, ROUTER_BLOCK_K)
    e_p2 = next_pow2(e)
    part = torch.empty(splits, t, e_p2, dtype=torch.float32, device=x.device)
    kk = r.k + always
    weights = torch.empty(t, kk, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, kk, dtype=torch.int64, device=x.device)
    kernel: Any = _router_topk_blocks
    kernel[(triton.cdiv(t, ROUTER_BLOCK_T), splits)](
        x, router, bias if bias is not None else router, part, counters, weights, ids, t, e,
        hidden, x.stride(0), router.stride(0), float(r.scale), K=r.k, ALWAYS=always,
        KK_P2=max(2, 1 << (kk - 1).bit_length()), E_P2=e_p2, SPLITS=splits,
        BLOCK_T=ROUTER_BLOCK_T, BLOCK_K=ROUTER_BLOCK_K, NORMALIZE=r.normalizes,
        SIGMOID=r.sigmoid, HAS_BIAS=bias is not None, N_GROUP=r.n_group,
        G_P2=max(2, next_pow2(r.n_group)), TOPK_GROUP=r.topk_group, num_warps=4,
        **pdl.launch(x.device, t),
    )  # fmt: skip
    return weights, ids


def combine_ref(y: torch.Tensor, weights: torch.Tensor, src: torch.Tensor | None,
                shared: torch.Tensor | None) -> torch.Tensor:
    """``sum_j weights[t, j] * y[src[t*k + j]]`` (``src`` None: ``y`` is already in
    ``[T*k]`` order), rounded to ``y``'s dtype, plus ``shared``."""
    t, k = weights.shape
    picked = y if src is None else y.index_select(0, src)
    out = (picked.view(t, k, -1).float() * weights.view(t, k, 1).float()).sum(1).to(y.dtype)
    return out if shared is None else out + shared


def combine(y: torch.Tensor, weights: torch.Tensor, src: torch.Tensor | None,
            shared: torch.Tensor | None) -> torch.Tensor:
    if not (y.is_cuda and HAS_TRITON) or y.stride(-1) != 1 or weights.numel() == 0 or (
            shared is not None and (shared.dtype != y.dtype or shared.stride(-1) != 1)):
        return combine_ref(y, weights, src, shared)
    return combine_triton(y, weights, src, shared)


def combine_triton(y: torch.Tensor, weights: torch.Tensor, src: torch.Tensor | None,
                   shared: torch.Tensor | None) -> torch.Tensor:
    t, k = weights.shape
    hidden = y.shape[-1]
    out = torch.empty(t, hidden, dtype=y.dtype, device=y.device)
    w = weights.float().contiguous()
    r = src if src is not None else w  # any tensor: not read without HAS_SRC
    s = shared if shared is not None else out
    block = 512
    kernel: Any = _combine_rows
    kernel[(t, triton.cdiv(hidden, block))](
        y, w, r, s, out, y.stride(0), s.stride(0), hidden, K=k, BLOCK=block,
        HAS_SRC=src is not None, HAS_SHARED=shared is not None, **pdl.launch(y.device, t),
    )  # fmt: skip
    return out


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """``src`` for ``combine`` from a sort's ``order``: where each pair's output went."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return inv


if HAS_TRITON:

    @triton.jit
    def _softmax_topk_rows(
        L, W, IDS, stride_l, e, scale,
        K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, NORMALIZE: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        idx = tl.arange(0, E_P2)
        live = idx < e
        x = tl.load(L + row * stride_l + idx, mask=live, other=float("-inf"))
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        p = tl.where(live, p, -1.0)
        slot = tl.arange(0, K_P2)
        vals = tl.zeros([K_P2], dtype=tl.float32)
        picks = tl.zeros([K_P2], dtype=tl.int64)
        for j in tl.static_range(K):
            best = tl.max(p, axis=0)
            at = tl.min(tl.where(p == best, idx, E_P2), axis=0)
            vals = tl.where(slot == j, best, vals)
            picks = tl.where(slot == j, at.to(tl.int64), picks)
            p = tl.where(idx == at, -1.0, p)
        if NORMALIZE:
            vals = vals / (tl.sum(vals, axis=0) + 1e-20)
        out = row * K + slot
        tl.store(W + out, vals * scale, mask=slot < K)
        tl.store(IDS + out, picks, mask=slot < K)

    @triton.jit
    def _router_topk_blocks(
        X, R, BIAS, PART, CNT, W, IDS, t, e, hidden, stride_x, stride_r, scale,
        K: tl.constexpr, ALWAYS: tl.constexpr, KK_P2: tl.constexpr, E_P2: tl.constexpr,
        SPLITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
        NORMALIZE: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
        N_GROUP: tl.constexpr, G_P2: tl.constexpr, TOPK_GROUP: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        tb = tl.program_id(0)
        sp = tl.program_id(1)
        rows = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        live_t = rows < t
        ex = tl.arange(0, E_P2)
        live_e = ex < e
        cols = sp * BLOCK_K + tl.arange(0, BLOCK_K)
        live_k = cols < hidden
        rv = tl.load(R + ex[:, None] * stride_r + cols[None, :],
                     mask=live_e[:, None] & live_k[None, :], other=0.0)
        pdl.pdl_wait(PDL)  # the router's weights are read while the kernel before finishes
        xv = tl.load(X + rows[:, None].to(tl.int64) * stride_x + cols[None, :],
                     mask=live_t[:, None] & live_k[None, :], other=0.0).to(tl.float32)
        logits = tl.dot(xv, tl.trans(rv), input_precision="ieee")  # [BLOCK_T, E_P2]
        mine = PART + (sp * t + rows[:, None]).to(tl.int64) * E_P2 + ex[None, :]
        tl.store(mine, logits, mask=live_t[:, None])
        tl.debug_barrier()
        done = tl.atomic_add(CNT + tb, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:  # the block's last program: every partial is written
            acc = tl.zeros([BLOCK_T, E_P2], dtype=tl.float32)
            # unrolled, so every partial's load is in flight at once (a rolled loop waits for
            # each L2 read in turn: 10 us a call); summed in a fixed order, the same every run
            for j in tl.static_range(SPLITS):
                src = PART + (j * t + rows[:, None]).to(tl.int64) * E_P2 + ex[None, :]
                acc += tl.load(src, mask=live_t[:, None], other=0.0, cache_modifier=".cg")
            acc = tl.where(live_e[None, :], acc, float("-inf"))
            if SIGMOID:
                p = tl.sigmoid(acc)
            else:
                p = tl.exp(acc - tl.max(acc, axis=1)[:, None])
                p = p / tl.sum(p, axis=1)[:, None]
            choice = p
            if HAS_BIAS:
                choice = p + tl.load(BIAS + ex, mask=live_e, other=0.0)[None, :]
            choice = tl.where(live_e[None, :], choice, float("-inf"))
            if N_GROUP > 1:
                grp = ex // (e // N_GROUP)
                gsel = tl.arange(0, G_P2)
                gscore = tl.full([BLOCK_T, G_P2], float("-inf"), tl.float32)
                for g in tl.static_range(N_GROUP):
                    c = tl.where(grp[None, :] == g, choice, float("-inf"))
                    top = tl.max(c, axis=1)
                    if SIGMOID:  # V3: the sum of the group's two best
                        at = tl.min(tl.where(c == top[:, None], ex[None, :], E_P2), axis=1)
                        top += tl.max(tl.where(ex[None, :] == at[:, None], float("-inf"), c),
                                      axis=1)
                    gscore = tl.where(gsel[None, :] == g, top[:, None], gscore)
                keep = tl.zeros([BLOCK_T, E_P2], dtype=tl.int32)
                for _ in tl.static_range(TOPK_GROUP):
                    best = tl.max(gscore, axis=1)
                    at = tl.min(tl.where(gscore == best[:, None], gsel[None, :], G_P2), axis=1)
                    keep = tl.where(grp[None, :] == at[:, None], 1, keep)
                    gscore = tl.where(gsel[None, :] == at[:, None], float("-inf"), gscore)
                choice = tl.where(keep != 0, choice, float("-inf"))
            slot = tl.arange(0, KK_P2)
            vals = tl.zeros([BLOCK_T, KK_P2], dtype=tl.float32)
            picks = tl.zeros([BLOCK_T, KK_P2], dtype=tl.int64)
            for j in tl.static_range(K):
                best = tl.max(choice, axis=1)
                at = tl.min(tl.where(choice == best[:, None], ex[None, :], E_P2), axis=1)
                hit = ex[None, :] == at[:, None]
                val = tl.sum(tl.where(hit, p, 0.0), axis=1)  # the unbiased score
                vals = tl.where(slot[None, :] == j, val[:, None], vals)
                picks = tl.where(slot[None, :] == j, at[:, None].to(tl.int64), picks)
                choice = tl.where(hit, float("-inf"), choice)
            if NORMALIZE:
                routed = slot[None, :] < K
                vals = vals / (tl.sum(tl.where(routed, vals, 0.0), axis=1)[:, None] + 1e-20)
            vals = vals * scale
            extra = (slot[None, :] >= K) & (slot[None, :] < K + ALWAYS)
            vals = tl.where(extra, 1.0, vals)
            picks = tl.where(extra, (e + slot[None, :] - K).to(tl.int64), picks)
            out = rows[:, None].to(tl.int64) * (K + ALWAYS) + slot[None, :]
            m = live_t[:, None] & (slot[None, :] < K + ALWAYS)
            tl.store(W + out, vals, mask=m)
            tl.store(IDS + out, picks, mask=m)
            tl.atomic_xchg(CNT + tb, 0)  # ready for the next call (and the next replay)

    @triton.jit
    def _combine_rows(
        Y, W, SRC, S, OUT, stride_y, stride_s, hidden,
        K: tl.constexpr, BLOCK: tl.constexpr, HAS_SRC: tl.constexpr, HAS_SHARED: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        t = tl.program_id(0)
        pdl.pdl_wait(PDL)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            if HAS_SRC:
                r = tl.load(SRC + t * K + j).to(tl.int64)
            else:
                r = (t * K + j).to(tl.int64)
            w = tl.load(W + t * K + j)
            acc += w * tl.load(Y + r * stride_y + cols, mask=m, other=0.0).to(tl.float32)
        ty = OUT.dtype.element_ty
        res = acc.to(ty)
        if HAS_SHARED:
            s = tl.load(S + t.to(tl.int64) * stride_s + cols, mask=m, other=0.0)
            res = (res.to(tl.float32) + s.to(tl.float32)).to(ty)
        tl.store(OUT + t.to(tl.int64) * hidden + cols, res, mask=m)


__all__ = ["HAS_TRITON", "Routing", "always_slots", "combine", "combine_ref", "inverse_order",
           "kernel_routes", "route_ref", "router_topk", "router_topk_ref", "softmax_topk",
           "softmax_topk_ref", "topk_weights"]
