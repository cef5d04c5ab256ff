"""The per-layer Triton kernels against their torch references, run by Triton's interpreter on
the CPU (the GPU tests run them compiled): RMSNorm and rotary on the shapes and strided views the
model feeds them (hidden rows, the latent part of a kv_a row, the rope part of q and of kv_a);
the softmax/top-k router and the expert combine (with and without the sort's inverse order and
the shared experts' output)."""

from __future__ import annotations

import pytest
from test_cuda_graph_kernels import SHIM, _child

pytest.importorskip("triton")
pytestmark = pytest.mark.dataplane

CHILD = SHIM + r'''
from pdd_sidecar.model.kernels import norm_rope as nr

torch.manual_seed(0)


def close(got, want, tol, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    assert err < tol, (what, err)


for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -6)):  # bf16: two roundings
    for shape in ((5, 64), (3, 4, 48), (2, 576)):
        x = torch.randn(*shape).to(dtype)
        w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
        close(nr.rms_norm_triton(x, w, 1e-6), nr.rms_norm_ref(x, w, 1e-6), tol, shape)
    kv = torch.randn(6, 72).to(dtype)  # latent 64 + rope 8, as kv_a's output
    w = (1 + 0.1 * torch.randn(64)).to(dtype)
    close(nr.rms_norm_triton(kv[:, :64], w, 1e-6), nr.rms_norm_ref(kv[:, :64], w, 1e-6), tol,
          "latent view")
    angles = torch.rand(6, 4) * 100
    cos, sin = torch.cos(angles) * 1.1, torch.sin(angles) * 1.1
    close(nr.apply_rope_triton(kv[:, 64:], cos, sin), nr.apply_rope_ref(kv[:, 64:], cos, sin),
          tol, "k_pe view")
    q = torch.randn(6, 3, 24).to(dtype)  # 3 heads of nope 16 + rope 8
    close(nr.apply_rope_triton(q[..., 16:], cos, sin), nr.apply_rope_ref(q[..., 16:], cos, sin),
          tol, "q_pe view")
    print("norm rope", dtype, "ok")
'''


def test_norm_and_rope_kernels_in_the_interpreter() -> None:
    out = _child(CHILD)
    assert "norm rope torch.float32 ok" in out and "norm rope torch.bfloat16 ok" in out


ROUTE_CHILD = SHIM + r'''
from pdd_sidecar.model.kernels import moe_route as mr

torch.manual_seed(0)
for e, k in ((64, 6), (160, 6), (8, 2)):
    logits = torch.randn(9, e) * 3
    for normalize, scale in ((False, 1.0), (True, 2.5)):
        w, ids = mr.softmax_topk_triton(logits, k, normalize, scale)
        w_ref, ids_ref = mr.softmax_topk_ref(logits, k, normalize, scale)
        assert ids.dtype == ids_ref.dtype and w.dtype == w_ref.dtype
        order, order_ref = ids.argsort(-1), ids_ref.argsort(-1)
        assert torch.equal(ids.gather(1, order), ids_ref.gather(1, order_ref)), (e, k)
        err = float((w.gather(1, order) - w_ref.gather(1, order_ref)).abs().max())
        assert err < 1e-6, (e, k, normalize, err)
tie_w, tie_ids = mr.softmax_topk_triton(torch.zeros(2, 64), 6, False, 1.0)
assert tie_ids.tolist() == [list(range(6))] * 2 and float((tie_w - 1 / 64).abs().max()) < 1e-7
print("route ok")

for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -5)):  # bf16: rounded twice
    for t, k, hidden in ((5, 6, 100), (3, 2, 1100)):
        y = torch.randn(t * k, hidden).to(dtype)
        w = torch.rand(t, k)
        shared = torch.randn(t, hidden).to(dtype)
        src = mr.inverse_order(torch.randperm(t * k))
        for s_, sh in ((None, None), (src, None), (src, shared), (None, shared)):
            got = mr.combine_triton(y, w, s_, sh)
            want = mr.combine_ref(y, w, s_, sh)
            assert got.dtype == want.dtype and got.shape == want.shape
            err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
            assert err < tol, (dtype, t, k, hidden, s_ is None, sh is None, err)
    print("combine", dtype, "ok")
'''


def test_router_and_combine_kernels_in_the_interpreter() -> None:
    out = _child(ROUTE_CHILD)
    assert "route ok" in out and "combine torch.float32 ok" in out
    assert "combine torch.bfloat16 ok" in out
