"""The one-kernel MoE router (model/kernels/moe_route.py) in Triton's interpreter on the CPU
against its torch reference: one token and several blocks of tokens, with and without the
always-chosen slots, normalised and scaled, with an exact tie. The CUDA runs of the same checks
are tests/gpu/test_fused_kernels.py (and two streams' launches at once)."""

from __future__ import annotations

import pytest
from test_cuda_graph_kernels import SHIM, _child

pytest.importorskip("triton")
pytestmark = pytest.mark.dataplane

CHILD = SHIM + r'''
from pdd_sidecar.model.kernels import moe_route as mr

for tokens in (1, 2, 5, 19, 33):
    for always, norm, scale in ((0, False, 1.0), (2, True, 2.5)):
        torch.manual_seed(tokens * 10 + always)
        e, k, hidden = 20, 6, 160  # experts not a power of two; hidden not a split multiple
        x = torch.randn(tokens, hidden).to(torch.bfloat16)
        router = torch.randn(e, hidden) * 0.05
        router[3] = router[5]  # an exact tie: the lower id goes first in both
        w, ids = mr.router_topk_triton(x, router, k, norm, scale, always)
        w_ref, ids_ref = mr.router_topk_ref(x, router, k, norm, scale, always)
        # torch.topk orders exact ties as it likes; the kernels give the lower id first
        scores = torch.nn.functional.linear(x.float(), router).softmax(-1)
        first = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        tied = (ids_ref[:, :k].sort(-1).values != first.sort(-1).values).any(-1)
        ids_ref[tied, :k] = first[tied]
        w_ref[tied, :k] = torch.nan  # weights compared where the reference picked the same
        assert not torch.isnan(w).any(), (tokens, always)
        o, o_ref = ids[:, :k].argsort(-1), ids_ref[:, :k].argsort(-1)
        assert torch.equal(ids[:, :k].gather(1, o), ids_ref[:, :k].gather(1, o_ref)), (
            tokens, always, ids, ids_ref)
        diff = (w[:, :k].gather(1, o) - w_ref[:, :k].gather(1, o_ref))[~tied]
        assert diff.numel() == 0 or float(diff.abs().max()) < 1e-5
        assert int(tied.sum()) <= 1 + tokens // 2
        assert torch.equal(ids[:, k:], ids_ref[:, k:]) and torch.equal(w[:, k:], w_ref[:, k:])
        best = w[:, :k].argmax(-1)  # slot order: the best first, as the block kernel writes
        assert torch.equal(best, torch.zeros_like(best)), (tokens, w)
        print("router", tokens, always, "ok")
'''


def test_router_kernels_match_the_reference_in_the_interpreter() -> None:
    out = _child(CHILD)
    assert out.count(" ok") == 10, out
