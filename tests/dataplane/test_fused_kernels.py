"""The decode step's fused kernels against their torch references, run by Triton's interpreter
on the CPU (tests/gpu runs them compiled): the residual add with RMSNorm, the one-kernel router
(partial logits per hidden slice, summed by the block's last program) with always-chosen slots,
RoPE with the latent's norm and the masked cache store (strided views of the fused projection's
output, rows masked out writing nothing), and the routed experts' GEMV with the shared experts
as always-chosen experts."""

from __future__ import annotations

import pytest
from test_cuda_graph_kernels import SHIM, _child

pytest.importorskip("triton")
pytestmark = pytest.mark.dataplane

CHILD = SHIM + r'''
import dataclasses
import torch.nn.functional as F
from pdd_sidecar.model.kernels import norm_rope as nr
from pdd_sidecar.model.kernels import moe_route as mr
from pdd_sidecar.model.kernels import rope_kv_write as rk
from pdd_sidecar.model.kernels import moe_grouped as mg
from pdd_sidecar.model.weights import MLPWeights, MoEWeights

torch.manual_seed(0)


def close(got, want, tol, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    assert err < tol, (what, err)


for dtype in (torch.float32, torch.bfloat16):
    x, y = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
    w = (1 + 0.1 * torch.randn(96)).to(dtype)
    s, m = nr.add_rms_norm_triton(x, y, w, 1e-6)
    s_ref, m_ref = nr.add_rms_norm_ref(x, y, w, 1e-6)
    close(s, s_ref, 1e-7 if dtype == torch.float32 else 2 ** -7, "sum")
    close(m, m_ref, 1e-6 if dtype == torch.float32 else 2 ** -7, "add norm")
print("add_rms_norm ok")

R = mr.Routing
# (tokens, experts, hidden, routing, always, V3's bias): V2's greedy softmax, V2's group-limited
# softmax (a group ranked by its best), V3's sigmoid (by its two best biased; one expert
# normalised too)
CASES = [(1, 64, 300, R(6, False, 1.0), 2, False), (19, 8, 128, R(2, False, 1.0), 0, False),
         (3, 160, 256, R(6, False, 1.0), 1, False),
         (7, 160, 200, R(6, False, 16.0, n_group=8, topk_group=3), 1, False),
         (18, 64, 136, R(6, True, 2.5, sigmoid=True, n_group=8, topk_group=4), 1, True),
         (5, 32, 128, R(1, True, 2.5, sigmoid=True, n_group=4, topk_group=1), 0, True),
         (4, 48, 128, R(8, True, 1.0, sigmoid=True), 2, False)]
changed = {"groups": 0, "bias": 0}
for t, e, hidden, r, always, biased in CASES:
    x = torch.randn(t, hidden).to(torch.bfloat16)
    router = torch.randn(e, hidden) * 0.3
    bias = torch.randn(e) * 0.3 if biased else None
    assert mr.kernel_routes(r, e, bias), r
    for normalize, scale in ((r.normalize, r.scale), (not r.normalize, 2 * r.scale)):
        rs = dataclasses.replace(r, normalize=normalize, scale=scale)
        k = rs.k
        wt, ids = mr.router_topk_triton(x, router, rs, always, bias)
        wr, ir = mr.router_topk_ref(x, router, rs, always, bias)
        assert wt.shape == (t, k + always) and ids.dtype == ir.dtype
        o, o_ref = ids[:, :k].argsort(-1), ir[:, :k].argsort(-1)
        assert torch.equal(ids[:, :k].gather(1, o), ir[:, :k].gather(1, o_ref)), (t, e, rs)
        # the logits summed in another order: a few ulps of the scaled weights
        assert float((wt[:, :k].gather(1, o) - wr[:, :k].gather(1, o_ref)).abs().max()) < (
            1e-5 * max(1.0, rs.scale))
        assert torch.equal(ids[:, k:], ir[:, k:]) and torch.equal(wt[:, k:], wr[:, k:])
    # every counter back to 0 for the next call
    assert int(mr.block_counters(torch.device("cpu")).abs().sum()) == 0
    # the groups and the bias each changed some token's choice: the cases exercise them
    picked = ir[:, :k].sort(-1).values
    if r.grouped:
        free = mr.router_topk_ref(x, router, dataclasses.replace(rs, n_group=1), 0, bias)[1]
        changed["groups"] += not torch.equal(picked, free.sort(-1).values)
    if biased:
        unbiased = mr.router_topk_ref(x, router, rs, 0, None)[1]
        changed["bias"] += not torch.equal(picked, unbiased.sort(-1).values)
assert changed["groups"] >= 2 and changed["bias"] >= 1, changed
# past 256 experts the router tile would not fit an H100's shared memory: the reference routes
assert mr.kernel_routes(R(8, True, 1.0), 256, None)
assert not mr.kernel_routes(R(8, True, 1.0), 512, None)
x = torch.randn(5, 128).to(torch.bfloat16)
router = torch.randn(20, 128) * 0.3
router[3] = router[5]  # an exact tie: the lower id first, and the best in slot 0
wt, ids = mr.router_topk_triton(x, router, R(6, True, 1.0))
scores = torch.nn.functional.linear(x.float(), router).softmax(-1)
first = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :6]
assert torch.equal(ids, first), (ids, first)
print("router ok")

for dtype in (torch.float32, torch.bfloat16):
    t, heads, kvl, rope, bs, nblk = 5, 3, 64, 16, 4, 6
    proj = torch.randn(t, heads * 24 + kvl + rope).to(dtype)  # [q | ckv] rows, as qkv_a's
    q = proj[:, : heads * 24].view(t, heads, 24)
    q_pe, ckv = q[..., 8:], proj[:, heads * 24:]
    nw = (1 + 0.1 * torch.randn(kvl)).to(dtype)
    ang = torch.rand(t, rope // 2) * 50
    cos, sin = torch.cos(ang) * 1.2, torch.sin(ang) * 1.2
    blk = torch.tensor([5, 0, 3, 1, 2])
    off = torch.tensor([1, 3, 0, 2, 2])
    mask = torch.tensor([1, 1, 0, 1, 1], dtype=torch.int32)
    kv = torch.zeros(nblk, 2, bs, kvl + rope, dtype=dtype)
    kv_ref = kv.clone()
    got_q, got_lat = rk.rope_kv_write_triton(ckv, q_pe, nw, cos, sin, 1e-6, kv, 1, blk, off,
                                             mask, want_latent=True)
    want_q, want_lat = rk.rope_kv_write_ref(ckv, q_pe, nw, cos, sin, 1e-6, kv_ref, 1, blk, off,
                                            mask, want_latent=True)
    close(got_q, want_q, 1e-6 if dtype == torch.float32 else 2 ** -7, "q rope")
    close(got_lat, want_lat, 1e-6 if dtype == torch.float32 else 2 ** -6, "latent")
    close(kv, kv_ref, 1e-6 if dtype == torch.float32 else 2 ** -6, "cache")
    assert float(kv[3, 1, 0].abs().sum()) == 0 and float(kv[:, 0].abs().sum()) == 0  # masked
    buf = torch.zeros(heads, t, 8 + rope, dtype=dtype)  # head-major, as the absorbed query
    into = buf[:, :, 8:].transpose(0, 1)
    rk.rope_kv_write_triton(ckv, q_pe, nw, cos, sin, 1e-6, kv, 1, blk, off, mask, q_out=into)
    close(into, want_q, 1e-6 if dtype == torch.float32 else 2 ** -7, "q into a strided buffer")
    assert float(buf[:, :, :8].abs().sum()) == 0
    # an FP8 cache (uint8 bytes, kv/fp8_layout.py): the kernel computes the latent, the
    # quantising writer stores it, as the reference's
    from pdd_sidecar.kv import fp8_layout
    nb = fp8_layout.token_bytes(kvl, rope)
    k8, k8_ref = torch.zeros(nblk, 2, bs, nb, dtype=torch.uint8), torch.zeros(nblk, 2, bs, nb,
                                                                               dtype=torch.uint8)
    rk.rope_kv_write_triton(ckv, q_pe, nw, cos, sin, 1e-6, k8, 1, blk, off, mask)
    rk.rope_kv_write_ref(ckv, q_pe, nw, cos, sin, 1e-6, k8_ref, 1, blk, off, mask)
    deq = fp8_layout.dequantize_latents(k8[blk, 1, off], kvl, torch.float32)
    deq_ref = fp8_layout.dequantize_latents(k8_ref[blk, 1, off], kvl, torch.float32)
    close(deq, deq_ref, 0.07, "fp8 cache")  # e4m3: a step of 1/16 at most between neighbours
    assert int(k8[3, 1, 0].sum()) == 0 and int(k8[:, 0].sum()) == 0
print("rope_kv_write ok")

e, inter, hidden, parts = 6, 32, 64, 2
dt = torch.float32
wg, wu = torch.randn(e, inter, hidden) / 8, torch.randn(e, inter, hidden) / 8
wd = torch.randn(e, hidden, inter) / 6
sh = MLPWeights(torch.randn(parts * inter, hidden) / 8, torch.randn(parts * inter, hidden) / 8,
                torch.randn(hidden, parts * inter) / 6)
mw = MoEWeights(router=torch.randn(e, hidden), w_gate=wg, w_up=wu, w_down=wd, shared=sh)
assert mg.shared_chunks(mw) == parts
x = torch.randn(3, hidden)
weights, ids = mr.softmax_topk_ref(torch.randn(3, e), 2, True, 1.0)
w_all, ids_all = mr.always_slots(weights, ids, e, parts)
y = mg.gemv_experts(x, ids_all, mw, block_n=16, block_k=32, num_warps=4, shared=True)
got = mr.combine_ref(y, w_all, None, None)
h = F.silu(F.linear(x, sh.gate)) * F.linear(x, sh.up)
want = mg.loop_experts(x, weights, ids, mw) + F.linear(h, sh.down)
close(got, want, 1e-5, "shared in gemv")
y2 = mg.gemv_experts(x, ids_all, mw, block_n=16, block_k=32, num_warps=4, shared=True,
                     down_tiles=(8, 16, 2))
close(mr.combine_ref(y2, w_all, None, None), want, 1e-5, "down tiles apart")
print("shared gemv ok")

from pdd_sidecar.model.kernels import dense_gemv as dg
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)):
    wd_ = (torch.randn(40, 300) / 17).to(dtype)
    x_ = torch.randn(3, 400).to(dtype)[:, :300]  # a strided row view, as the attention output
    y_ = dg.linear_gemv_triton(x_, wd_, (16, 128, 4))
    close(y_, F.linear(x_.float(), wd_.float()).to(dtype), tol, "dense gemv")
print("dense gemv ok")

# fp32 here (the interpreter's dots do not take bf16); bf16 in tests/gpu
for dtype, tol in ((torch.float32, 1e-4),):
    e_, inter_, hid_, k_ = 8, 48, 80, 2
    mw_ = MoEWeights(router=torch.randn(e_, hid_),
                     w_gate=(torch.randn(e_, inter_, hid_) / 9).to(dtype),
                     w_up=(torch.randn(e_, inter_, hid_) / 9).to(dtype),
                     w_down=(torch.randn(e_, hid_, inter_) / 7).to(dtype), shared=None)
    t_ = 21  # 42 pairs over 8 experts: groups longer than one BLOCK_M of 16, and empty ones
    # expert 0 takes every token (21 pairs: two tiles of BLOCK_M 16), 6 and 7 none
    ids_ = torch.stack([torch.zeros(t_, dtype=torch.long), torch.randint(1, e_ - 2, (t_,))], 1)
    wts_ = torch.rand(t_, k_)
    x_ = torch.randn(t_, hid_).to(dtype)
    sh_ = torch.randn(t_, hid_).to(dtype)
    got_ = mg.grouped_gemv_experts(x_, wts_, ids_, mw_, sh_, tiles=(16, 16, 32, 4))
    fw = MoEWeights(mw_.router, mw_.w_gate.float(), mw_.w_up.float(), mw_.w_down.float(), None)
    want_ = mg.loop_experts(x_.float(), wts_, ids_, fw) + sh_.float()
    close(got_.float(), want_, tol, ("grouped gemv", dtype))
print("grouped gemv ok")
'''


def test_fused_decode_kernels_in_the_interpreter() -> None:
    out = _child(CHILD)
    for what in ("add_rms_norm", "router", "rope_kv_write", "shared gemv", "dense gemv",
                 "grouped gemv"):
        assert f"{what} ok" in out, what
