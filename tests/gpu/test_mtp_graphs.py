"""The MTP module's decode-side rows replayed from CUDA graphs (engine/speculative/mtp.py)
against the same rows padded eagerly (run by hand on a CUDA machine; skipped without one): the
same drafts, the same stored latents to rounding, one capture per bucket shared with the main
model's graph memory pool, and the main model's latents untouched.

    PYTHONPATH=sidecar python -m pytest tests/gpu/test_mtp_graphs.py -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dataplane"))

from test_mtp import mtp_checkpoint  # noqa: E402,F401  (the fixture: a V3 checkpoint + module)

from pdd_sidecar.engine.comm import SingleComm  # noqa: E402
from pdd_sidecar.engine.rank_engine import RankEngine, allocate_request, new_cache  # noqa: E402
from pdd_sidecar.engine.seq_chunk import SeqChunk  # noqa: E402
from pdd_sidecar.engine.speculative.mtp import MTPDrafter  # noqa: E402
from pdd_sidecar.model.rank_model import load_rank_model  # noqa: E402

BLOCK = 16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphed_rows_draft_as_the_padded_module(mtp_checkpoint, dtype):  # noqa: F811
    path = mtp_checkpoint[0]
    lens, ks = [40, 25, 33, 60, 12], [1, 2, 3, 1, 2]

    def run(mode: str) -> tuple[list[list[list[int]]], torch.Tensor, MTPDrafter]:
        model = load_rank_model(path, 0, 1, dtype, "cuda")
        h = model.config.hidden_size
        g = torch.Generator().manual_seed(3)
        hidden = [torch.randn(n, h, generator=g).to("cuda", model.dtype) for n in lens]
        after = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
                 for n in lens]
        cache = new_cache(model, 256, BLOCK, extra_layers=1)
        main = RankEngine(model, cache, SingleComm(), decode_mode=mode, extra_layers=1)
        drafter = MTPDrafter.load(path, model, cache, SingleComm(), like=main)
        tables = [allocate_request(cache, 96, 1) for _ in lens]
        drafter.draft([(SeqChunk(after[i][:8], 0, tables[i]), hidden[i][:8])
                       for i in range(len(lens))], [0] * len(lens))
        out = []
        pos = 8
        while pos < min(lens):
            n = 1 + pos % 3  # the fed token and up to two kept drafts
            out.append(drafter.draft([(SeqChunk(after[i][pos:pos + n], pos, tables[i]),
                                       hidden[i][pos:pos + n]) for i in range(len(lens))], ks))
            pos += n
        assert cache.kv[:, :-1].float().abs().sum() == 0  # only the module's layer written
        return out, cache.kv[:, -1].float().clone(), drafter

    padded, padded_kv, _ = run("padded")
    graph, graph_kv, drafter = run("graph")
    assert graph == padded
    tol = 1e-5 if dtype == "float32" else 1e-2
    assert float((graph_kv - padded_kv).abs().max()) <= tol
    eng = drafter.engine
    assert eng.padded_steps > 0
    assert dtype == "float32" or eng.graph_captures >= 1  # fp32 experts may not capture
    print(f"{dtype}: {eng.graph_captures} MTP graphs for {eng.padded_steps} padded calls")
