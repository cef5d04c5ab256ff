"""The decode step's fused kernels on CUDA against their torch references, at V2-Lite's shapes:
no host sync, captured in a CUDA graph and replayed on new inputs; and the MoE layer fused
(one-kernel router, shared experts in the GEMV) against the unfused layer.

    PYTHONPATH=sidecar python -m pytest tests/gpu/test_fused_kernels.py -q
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from test_kernels import _moe_weights, no_host_sync, rel_err  # noqa: E402

from pdd_sidecar.model import fusion  # noqa: E402
from pdd_sidecar.model.config import ModelConfig  # noqa: E402
from pdd_sidecar.model.kernels import moe_route as mr  # noqa: E402
from pdd_sidecar.model.kernels import norm_rope as nr  # noqa: E402
from pdd_sidecar.model.kernels import rope_kv_write as rk  # noqa: E402
from pdd_sidecar.model.moe import moe  # noqa: E402

DEV = torch.device("cuda")


def _graphed(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_add_rms_norm_equals_add_then_norm(rows: int) -> None:
    x = torch.randn(rows, 2048, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(rows, 2048, device=DEV, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(2048, device=DEV)).to(torch.bfloat16)
    with no_host_sync():
        s, m = nr.add_rms_norm(x, y, w, 1e-6)
    s_ref, m_ref = nr.add_rms_norm_ref(x, y, w, 1e-6)
    assert torch.equal(s, s_ref)
    assert rel_err(m, m_ref) < 1e-2 and torch.equal(m, nr.rms_norm(s_ref, w, 1e-6))


# (experts, routing, with V3's bias): V2-Lite's greedy softmax, V2's group-limited softmax,
# V3's biased sigmoid over groups
ROUTINGS = {
    "v2-lite": (64, mr.Routing(6, True, 2.0), False),
    "v2-groups": (160, mr.Routing(6, False, 16.0, n_group=8, topk_group=3), False),
    "v3": (256, mr.Routing(8, True, 2.5, sigmoid=True, n_group=8, topk_group=4), True),
}


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("always", [0, 2])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 16, 64, 300])
def test_router_kernel_matches_reference_and_replays(tokens: int, always: int,
                                                     routing: str) -> None:
    torch.manual_seed(tokens)
    e, r, biased = ROUTINGS[routing]
    k = r.k
    x = torch.randn(tokens, 2048, device=DEV, dtype=torch.bfloat16)
    router = torch.randn(e, 2048, device=DEV) * 0.02
    bias = torch.randn(e, device=DEV) * 0.05 if biased else None
    plain = dataclasses.replace(r, normalize=False, scale=1.0)
    assert mr.kernel_routes(r, e, bias)
    with no_host_sync():
        w, ids = mr.router_topk(x, router, plain, always, bias)
    graph, out = _graphed(lambda: mr.router_topk(x, router, r, always, bias))
    for step in range(3):
        if step:
            x.normal_()
            graph.replay()
            w, ids = out  # type: ignore[misc]
        w_ref, ids_ref = mr.router_topk_ref(x, router, r if step else plain, always, bias)
        o, o_ref = ids[:, :k].argsort(-1), ids_ref[:, :k].argsort(-1)
        same = (ids[:, :k].gather(1, o) == ids_ref[:, :k].gather(1, o_ref)).all(-1)
        assert float(same.float().mean()) >= 0.99, step  # a near-tie may break either way
        assert rel_err(w[same][:, :k].sort(-1).values, w_ref[same][:, :k].sort(-1).values) < 1e-5
        assert torch.equal(ids[:, k:], ids_ref[:, k:]) and torch.equal(w[:, k:], w_ref[:, k:])
    again, _ = mr.router_topk(x, router, r, always, bias)
    assert torch.equal(again, mr.router_topk(x, router, r, always, bias)[0])  # determinism


def test_router_launches_on_two_streams_at_once_keep_apart() -> None:
    """An overtaking prefill step's router runs on its own stream beside a queued chunk's: each
    launch counts only its own programs (a shared counter let one launch's last program read
    the other's partial logits, or never fire)."""
    torch.manual_seed(0)
    router = torch.randn(64, 2048, device=DEV) * 0.02
    chunk = torch.randn(8192, 2048, device=DEV, dtype=torch.bfloat16)
    rows = [torch.randn(n, 2048, device=DEV, dtype=torch.bfloat16) for n in (1, 3, 16)]
    want_chunk = mr.router_topk(chunk, router, mr.Routing(6, True, 1.0))[1]
    want_rows = [mr.router_topk(r, router, mr.Routing(6, True, 1.0))[1] for r in rows]
    side = torch.cuda.Stream(priority=-1)
    got_chunk, got_rows = [], []
    torch.cuda.synchronize()
    for _ in range(10):
        got_chunk.append(mr.router_topk(chunk, router, mr.Routing(6, True, 1.0))[1])
        with torch.cuda.stream(side):
            for _ in range(10):
                got_rows.append([mr.router_topk(r, router, mr.Routing(6, True, 1.0))[1]
                                 for r in rows])
    torch.cuda.synchronize()
    assert all(torch.equal(g, want_chunk) for g in got_chunk)
    assert all(torch.equal(g, w) for gs in got_rows for g, w in zip(gs, want_rows, strict=True))


@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_rope_kv_write_matches_reference(tokens: int) -> None:
    torch.manual_seed(1)
    bf = torch.bfloat16
    proj = torch.randn(tokens, 16 * 192 + 576, device=DEV, dtype=bf)
    q = proj[:, : 16 * 192].view(tokens, 16, 192)
    q_pe, ckv = q[..., 128:], proj[:, 16 * 192:]
    nw = (1 + 0.1 * torch.randn(512, device=DEV)).to(bf)
    ang = torch.rand(tokens, 32, device=DEV) * 1000
    cos, sin = torch.cos(ang), torch.sin(ang)
    blk = torch.randperm(64, device=DEV)[:tokens]
    off = torch.randint(0, 64, (tokens,), device=DEV)
    mask = (torch.arange(tokens, device=DEV) % 5 != 3).to(torch.int32)
    kv = torch.zeros(64, 3, 64, 576, device=DEV, dtype=bf)
    kv_ref = kv.clone()
    with no_host_sync():
        got_q, got_lat = rk.rope_kv_write(ckv, q_pe, nw, cos, sin, 1e-6, kv, 2, blk, off, mask,
                                          want_latent=True)
    want_q, want_lat = rk.rope_kv_write_ref(ckv, q_pe, nw, cos, sin, 1e-6, kv_ref, 2, blk, off,
                                            mask, want_latent=True)
    assert got_lat is not None and want_lat is not None
    assert rel_err(got_q, want_q) < 1e-2 and rel_err(got_lat, want_lat) < 1e-2
    assert rel_err(kv, kv_ref) < 1e-2
    assert torch.equal(kv != 0, kv_ref != 0)  # the masked rows and other layers untouched


@pytest.mark.parametrize("v3", [False, True], ids=["v2", "v3"])
@pytest.mark.parametrize("shared_tokens", [1, 64])
@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 9, 16, 64])
def test_fused_moe_matches_unfused(tokens: int, shared_tokens: int, v3: bool) -> None:
    """V2's greedy softmax, and V3's biased sigmoid over groups (the router kernel and the
    shared experts in the GEMV for both)."""
    routing: dict = (dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=4,
                          topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
                     if v3 else {})
    cfg = ModelConfig(
        vocab_size=16, hidden_size=2048, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, moe_intermediate_size=256, n_routed_experts=16,
        n_shared_experts=2, num_experts_per_tok=6, **routing,
    )  # fmt: skip
    torch.manual_seed(tokens)
    w = _moe_weights(16, 2048, 256, torch.bfloat16)
    if v3:
        w = dataclasses.replace(w, score_bias=torch.randn(16, device=DEV) * 0.05)
    x = torch.randn(tokens, 2048, device=DEV).to(torch.bfloat16)
    try:
        fusion.set_fused(False)
        want = moe(x, w, cfg)
        fusion.set_fused(True, shared_tokens)
        moe(x, w, cfg)
        with no_host_sync():
            got = moe(x, w, cfg)
        graph, out = _graphed(lambda: moe(x, w, cfg))
        graph.replay()
    finally:
        fusion.set_fused(None)
    assert rel_err(got, want) < 2e-2 and rel_err(out, want) < 2e-2  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_absorbed_query_and_unabsorb_fused_match_unfused(tokens: int) -> None:
    """The fused path's query (one GEMV, RoPE and the W_UK product into one buffer) and value
    un-absorption against the unfused functions, on the bench's V2-Lite-shaped layer."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from engine import random_weights, v2_lite_config

    from pdd_sidecar.model.mla import absorbed_query_and_store, unabsorb_v, unabsorb_v_flat
    from pdd_sidecar.model.rope import Rotary

    cfg = v2_lite_config().replace(num_hidden_layers=1, first_k_dense_replace=1,
                                   vocab_size=128, intermediate_size=64)
    w = random_weights(cfg, torch.bfloat16, DEV).layers[0].attn
    assert w.qkv_a is not None and w.q_proj is not None
    assert w.q_proj.data_ptr() == w.qkv_a.data_ptr()  # a view: no second copy
    x = torch.randn(tokens, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    pos = torch.randint(0, 4000, (tokens,), device=DEV)
    cos, sin = Rotary(cfg.rope, cfg.qk_rope_head_dim, DEV).cos_sin(pos)
    blk = torch.arange(tokens, device=DEV) // 2  # a slot each: blocks of two tokens
    off = torch.arange(tokens, device=DEV) % 2
    mask = torch.ones(tokens, dtype=torch.int32, device=DEV)
    caches, qs = [], []
    try:
        for on in (False, True):
            fusion.set_fused(on)
            kv = torch.zeros(64, 1, 2, cfg.latent_dim, device=DEV, dtype=torch.bfloat16)
            qs.append(absorbed_query_and_store(x, w, cfg, cos, sin, kv, 0, blk, off, mask))
            caches.append(kv)
        out = torch.randn(tokens, 16, cfg.kv_lora_rank, device=DEV).to(torch.bfloat16)
        flat = unabsorb_v_flat(out, w)
    finally:
        fusion.set_fused(None)
    assert qs[1].shape == qs[0].shape and rel_err(qs[1], qs[0]) < 1e-2
    assert rel_err(caches[1], caches[0]) < 1e-2
    assert rel_err(flat, unabsorb_v(out, w).flatten(1)) < 1e-2


@pytest.mark.parametrize("n,k", [(3648, 2048), (2048, 2048)])
@pytest.mark.parametrize("tiles", [None, (8, 1024, 4), (32, 256, 4)])
def test_dense_gemv_matches_linear_and_replays(n: int, k: int, tiles: tuple | None) -> None:
    from pdd_sidecar.model.kernels import dense_gemv as dg

    w = (torch.randn(n, k, device=DEV) / k**0.5).to(torch.bfloat16)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    with no_host_sync():
        got = dg.linear_gemv(x, w, tiles)
    assert rel_err(got, torch.nn.functional.linear(x, w)) < 1e-2
    graph, out = _graphed(lambda: dg.linear_gemv(x, w, tiles))
    x.normal_()
    graph.replay()
    assert rel_err(out, torch.nn.functional.linear(x, w)) < 1e-2  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [2, 16, 21, 64])
def test_grouped_gemv_matches_loop_and_replays(tokens: int) -> None:
    from test_kernels import _as_float

    from pdd_sidecar.model.kernels.moe_grouped import grouped_gemv_experts, loop_experts

    torch.manual_seed(tokens)
    w = _moe_weights(64, 2048, 1408, torch.bfloat16)
    x = torch.randn(tokens, 2048, device=DEV).to(torch.bfloat16)
    weights = torch.rand(tokens, 6, device=DEV)
    ids = torch.stack([torch.randperm(64, device=DEV)[:6] for _ in range(tokens)])
    ids[:, 0] = 3  # one expert for every token: more than one tile of 16 rows at 21 and 64
    with no_host_sync():
        got = grouped_gemv_experts(x, weights, ids, w)
    want = loop_experts(x.float(), weights, ids, _as_float(w))
    assert rel_err(got, want) < 1e-2
    graph, out = _graphed(lambda: grouped_gemv_experts(x, weights, ids, w))
    x.normal_()
    graph.replay()
    assert rel_err(out, loop_experts(x.float(), weights, ids, _as_float(w))) < 1e-2  # type: ignore[arg-type]
