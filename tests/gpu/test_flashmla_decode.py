"""FlashMLA (the optional ``sgl-flash-mla`` wheel) behind pdd's paged decode contract, against the
torch reference (run by hand on an SM90 GPU; skipped without CUDA or the wheel): dense bf16,
lengths of 0 giving output 0 and LSE ``-inf``, and
``paged_mla_decode`` under ``PDD_ATTENTION_BACKEND=flashmla`` inside a CUDA graph.

    PYTHONPATH=sidecar python -m pytest tests/gpu/test_flashmla_decode.py -q
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
flash_mla = pytest.importorskip("flash_mla")
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("FlashMLA's dense kernel is SM90's", allow_module_level=True)

from pdd_sidecar.model.kernels import decode_backend  # noqa: E402
from pdd_sidecar.model.kernels import mla_decode as md  # noqa: E402
from pdd_sidecar.model.kernels.flashmla_decode import flashmla_decode  # noqa: E402

DEV = torch.device("cuda")
C, R, BS, LAYERS = 512, 64, 64, 2
LENS = [0, 1, 64, 65, 700, 3000, 0, 4096]


def _case(heads: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    nb = 8 * 64 + 1
    kv = (torch.randn(nb, LAYERS, BS, C + R, device=DEV, generator=g) * 0.5).to(torch.bfloat16)
    perm = torch.randperm(nb - 1, device=DEV, generator=g) + 1
    tables = perm[: len(LENS) * 64].view(len(LENS), 64).to(torch.int32)
    lens = torch.tensor(LENS, dtype=torch.int32, device=DEV)
    q = (torch.randn(len(LENS), heads, C + R, device=DEV, generator=g)).to(torch.bfloat16)
    return kv, tables, lens, q


def _close(o: torch.Tensor, lse: torch.Tensor, ref_o: torch.Tensor, ref_l: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_l))
    assert bool((lse[torch.isinf(lse)] < 0).all()), "empty sequences: LSE -inf"
    fin = ~torch.isinf(ref_l)
    err = float((o - ref_o).abs().max() / ref_o.abs().max())
    assert err < 2e-2, err
    assert float((lse[fin] - ref_l[fin]).abs().max()) < 2e-2
    if (~fin).any():
        assert float(o[~fin].abs().max()) == 0.0, "empty sequences: output 0"


@pytest.mark.parametrize("heads", [16, 128])
def test_dense_bf16_matches_reference(heads: int) -> None:
    kv, tables, lens, q = _case(heads, 1)
    scale = 192**-0.5
    ref_o, ref_l = md.paged_mla_decode_ref(q, kv, 1, tables, lens, C, scale)
    o, lse = flashmla_decode(flash_mla, q, kv, 1, tables, lens, C, scale)
    _close(o, lse, ref_o, ref_l)


def test_backend_flashmla_in_a_graph() -> None:
    kv, tables, lens, q = _case(16, 3)
    scale = 192**-0.5
    decode_backend.set_current(decode_backend.load_backend("flashmla"))
    try:
        assert decode_backend.current().use_flashmla(q, kv, C)
        ref_o, ref_l = md.paged_mla_decode_ref(q, kv, 1, tables, lens, C, scale)
        md.paged_mla_decode(q, kv, 1, tables, lens, C, scale)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o, lse = md.paged_mla_decode(q, kv, 1, tables, lens, C, scale)
        graph.replay()
        torch.cuda.synchronize()
        _close(o, lse, ref_o, ref_l)
    finally:
        decode_backend.set_current(None)
