"""The RMSNorm and rotary Triton kernels against their torch references, run by Triton's
interpreter on the CPU (the GPU tests run them compiled), on the shapes and strided views the
model feeds them: hidden rows, the latent part of a kv_a row, the rope part of q and of kv_a."""

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
