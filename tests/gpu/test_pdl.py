"""Programmatic dependent launch (``PDD_PDL``, model/kernels/pdl.py) against ordinary launches
on a CUDA device of compute capability 9 or more (skipped elsewhere): the same decode steps,
eager and replayed from CUDA graphs, give the same logits bit for bit, step after step (a
kernel that read before its wait would read the kernel before it half-done, and differ).

    PYTHONPATH=sidecar python -m pytest tests/gpu/test_pdl.py -q
"""

from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from test_cuda_graphs import BLOCK, DEV, NUM_BLOCKS, _model  # noqa: E402

from pdd_sidecar.engine.comm import SingleComm  # noqa: E402
from pdd_sidecar.engine.rank_engine import RankEngine, new_cache  # noqa: E402
from pdd_sidecar.engine.seq_chunk import SeqChunk  # noqa: E402
from pdd_sidecar.model import fusion  # noqa: E402
from pdd_sidecar.model.kernels import pdl  # noqa: E402

BUCKETS = (1, 2, 4, 8, 16, 32, 64)

if not pdl.supported(DEV):
    pytest.skip("programmatic dependent launch needs compute capability 9 and a Triton with "
                "griddepcontrol", allow_module_level=True)


@pytest.fixture(autouse=True)
def _restore() -> object:
    yield
    fusion.set_fused(None)


def test_launch_asks_for_pdl_only_when_switched_on() -> None:
    fusion.set_fused(None, pdl=True)
    assert pdl.launch(DEV) == {"PDL": True, "launch_pdl": True}
    assert pdl.launch(torch.device("cpu")) == {"PDL": False}
    fusion.set_fused(None, pdl=False)
    assert pdl.launch(DEV) == {"PDL": False}


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_decode_steps_with_pdl_equal_ordinary_launches(mode: str) -> None:
    model = _model("small", torch.bfloat16)  # V2's MoE: the router, the GEMVs, the combine
    cfg = model.config
    engines = {on: RankEngine(model, new_cache(model, NUM_BLOCKS, BLOCK), SingleComm(),
                              decode_mode=mode, graph_buckets=BUCKETS, prefill_buckets=())
               for on in (False, True)}
    rng = random.Random(7)
    ids = list(range(NUM_BLOCKS))
    rng.shuffle(ids)
    tables, pos, nxt = [], [], []
    for _ in range(64):
        n = rng.choice([1, 17, 100, 600])
        table = [ids.pop() for _ in range(-(-(n + 80) // BLOCK))]
        prompt = [rng.randrange(cfg.vocab_size) for _ in range(n)]
        outs = []
        for on, eng in engines.items():
            fusion.set_fused(None, pdl=on)
            outs.append(eng.step([SeqChunk(prompt, 0, table)]))
        assert torch.equal(outs[0], outs[1])
        tables.append(table)
        pos.append(n)
        nxt.append(int(outs[0][0].argmax()))
    sizes = [1, 2, 3, 8, 16, 33, 64, 1, 1, 1, 2, 64, 64, 5, 1] * 4
    for step, size in enumerate(sizes):
        seqs = rng.sample(range(64), size)
        chunks = [SeqChunk([nxt[s]], pos[s], tables[s]) for s in seqs]
        outs = []
        for on, eng in engines.items():
            fusion.set_fused(None, pdl=on)
            outs.append(eng.step(chunks))
        diff = float((outs[0].float() - outs[1].float()).abs().max())
        assert torch.equal(outs[0], outs[1]), f"step {step} (batch {size}): max |diff| {diff}"
        for s, t in zip(seqs, outs[0].argmax(-1).tolist(), strict=True):
            nxt[s] = t
            pos[s] += 1
    assert torch.equal(engines[False].cache.kv, engines[True].cache.kv)
