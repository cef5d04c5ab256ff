"""Programmatic dependent launch (``PDD_PDL``, model/kernels/pdl.py) against ordinary launches
on a CUDA device of compute capability 9 or more (skipped elsewhere): the same decode steps,
eager and replayed from CUDA graphs, give the same logits bit for bit, step after step (a
kernel that read before its wait would read the kernel before it half-done, and differ).

    PYTHONPATH=sidecar python -m pytest tests/gpu/test_pdl.py -q
"""

from __future__ import annotations

import random
from collections.abc import Callable

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
    assert pdl.launch(DEV, 1) == {"PDL": True, "launch_pdl": True}
    assert pdl.launch(DEV, pdl.MAX_ROWS + 1) == {"PDL": False}
    assert pdl.launch(torch.device("cpu"), 1) == {"PDL": False}
    fusion.set_fused(None, pdl=False)
    assert pdl.launch(DEV, 1) == {"PDL": False}


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


# Each kernel launched right after one that lets it start at once and writes its input 200 us
# later: a kernel that reads before its wait reads the input's old contents (zeros) and differs
# from the same kernel launched the ordinary way.
if pdl.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _late_copy(SRC, DST, n, DELAY_NS: tl.constexpr, BLOCK: tl.constexpr):
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        start = tl.extra.cuda.globaltimer()
        now = start
        while now - start < DELAY_NS:
            now = tl.extra.cuda.globaltimer()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(DST + offs, tl.load(SRC + offs, mask=m), mask=m)


def _late(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` 200 us after the next kernel may launch (``dst`` contiguous)."""
    a, b = src.contiguous().view(torch.uint8).view(-1), dst.view(torch.uint8).view(-1)
    _late_copy[(triton.cdiv(a.numel(), 1024),)](a, b, a.numel(), DELAY_NS=200_000, BLOCK=1024,
                                                 launch_pdl=True)


def _cases() -> dict[str, tuple[list[torch.Tensor], Callable[[], object]]]:
    """name -> (the inputs written late, the last one just before the call; the call). The
    per-expert GEMV is left out: its sort runs ordinary kernels between the two."""
    from test_kernels import _decode_case, _moe_weights

    from pdd_sidecar.model.kernels import mla_decode as md
    from pdd_sidecar.model.kernels import moe_route as mr
    from pdd_sidecar.model.kernels import norm_rope as nr
    from pdd_sidecar.model.kernels import rope_kv_write as rk
    from pdd_sidecar.model.kernels.moe_grouped import gemv_experts

    torch.manual_seed(0)
    bf = torch.bfloat16
    x, y = torch.randn(4, 2048, device=DEV, dtype=bf), torch.randn(4, 2048, device=DEV, dtype=bf)
    nw = (1 + 0.1 * torch.randn(2048, device=DEV)).to(bf)
    mw = _moe_weights(64, 2048, 1408, bf)
    ids = torch.stack([torch.randperm(64, device=DEV)[:6] for _ in range(4)])
    weights = torch.rand(4, 6, device=DEV)
    ys = torch.randn(24, 2048, device=DEV, dtype=bf)
    order = torch.randperm(24, device=DEV)
    proj = torch.randn(4, 16 * 192 + 576, device=DEV, dtype=bf)
    q_pe, ckv = proj[:, : 16 * 192].view(4, 16, 192)[..., 128:], proj[:, 16 * 192:].contiguous()
    ang = torch.rand(4, 32, device=DEV) * 1000
    cos, sin = torch.cos(ang), torch.sin(ang)
    blk, off = torch.arange(4, device=DEV), torch.arange(4, device=DEV)
    mask = torch.ones(4, dtype=torch.int32, device=DEV)
    kv = torch.zeros(8, 2, 64, 576, device=DEV, dtype=bf)
    q, cache, table, lens = _decode_case([1000, 37, 4097], 16, 512, 64, 64, bf, seed=5)
    v2 = mr.Routing(k=6, normalize=False, scale=1.0)
    return {
        "rms_norm": ([x], lambda: nr.rms_norm(x, nw, 1e-6)),
        "add_rms_norm": ([x, y], lambda: nr.add_rms_norm(x, y, nw, 1e-6)),
        "router": ([x], lambda: mr.router_topk(x, mw.router, v2, always=2)),
        "combine": ([ys], lambda: mr.combine(ys, weights, order, y)),
        "gemv_experts": ([x, ids], lambda: gemv_experts(x, ids, mw, shared=False)),
        "rope_kv_write": ([ckv], lambda: (rk.rope_kv_write(ckv, q_pe, nw[:512], cos, sin, 1e-6,
                                                           kv, 1, blk, off, mask), kv.clone())),
        "decode_attention": ([q], lambda: md.paged_mla_decode_triton(q, cache, 1, table, lens,
                                                                     512, 0.1)),
    }


def _flat(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "router", "combine", "gemv_experts",
                                  "rope_kv_write", "decode_attention"])
def test_each_kernel_waits_for_its_input(name: str) -> None:
    inputs, call = _cases()[name]
    want = [t.clone() for t in _flat(call())]  # ordinary launches, the inputs in place
    fusion.set_fused(None, pdl=True)
    for _ in range(3):
        saved = [t.clone() for t in inputs]
        for t in inputs:
            t.zero_()
        for t, s in zip(inputs, saved, strict=True):
            _late(t, s)
        got = _flat(call())
        torch.cuda.synchronize()
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), f"{name}: read its input before the kernel that wrote it"
