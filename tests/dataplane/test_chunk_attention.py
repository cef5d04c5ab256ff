"""Chunk attention (a continuing prompt chunk over expanded keys with explicit positions, output
and LSE): the sliced torch reference against one dense softmax and against the one-pass prefill's
causal attention; the Triton kernel, run by Triton's interpreter on the CPU, against the
reference on ragged shapes, DCP-style sparse key positions, queries that see nothing, and the
real tile sizes; then the engine's chunked prefill on the kernel against the one-pass prefill.

The interpreter needs TRITON_INTERPRET=1 before the kernels are defined, so those checks run in a
child process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdd_sidecar.model.kernels.chunk_attention import chunk_attention_ref, merge_partials

pytestmark = pytest.mark.dataplane


def _inputs(m: int, n: int, h: int, dn: int, dr: int, dv: int, seed: int) -> tuple[torch.Tensor,
                                                                                   ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g)
                 for s in ((m, h, dn), (m, h, dr), (n, h, dn), (n, dr), (n, h, dv)))


def _dense(qn, qr, kn, kr, v, q_pos, k_pos, scale):
    """One softmax over every key at once, visibility as a mask."""
    s = (torch.einsum("mhd,nhd->mhn", qn, kn) + torch.einsum("mhd,nd->mhn", qr, kr)) * scale
    s = s.masked_fill((k_pos[None, :] > q_pos[:, None])[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)
    return torch.einsum("mhn,nhv->mhv", p, v), lse


@pytest.mark.parametrize("slice_keys", [1, 5, 64, None])
def test_reference_slices_equal_one_softmax(slice_keys: int | None) -> None:
    # keys of blocks 1 and 3 of 4-token blocks (a DCP rank's share); queries 2..13, so the
    # first ones see nothing and the rest see a growing prefix
    k_pos = torch.tensor([p for p in range(16) if (p // 4) % 2 == 1])
    q_pos = torch.arange(2, 14)
    qn, qr, kn, kr, v = _inputs(12, len(k_pos), 3, 16, 8, 12, seed=1)
    out, lse = chunk_attention_ref(qn, qr, kn, kr, v, q_pos, k_pos, 0.3, slice_keys)
    want_out, want_lse = _dense(qn, qr, kn, kr, v, q_pos, k_pos, 0.3)
    blind = q_pos < 4
    assert torch.isinf(lse[blind]).all() and (out[blind] == 0).all()
    assert torch.isfinite(lse[~blind]).all()
    assert torch.allclose(out, want_out, atol=1e-6)
    assert torch.allclose(lse[~blind], want_lse[~blind], atol=1e-6)


def test_reference_equals_causal_sdpa_of_the_whole_prompt() -> None:
    """A chunk at 10..24 over keys 0..24 is the one-pass prefill's causal attention's last rows."""
    qn, qr, kn, kr, v = _inputs(25, 25, 4, 16, 8, 16, seed=2)
    q = torch.cat([qn, qr], -1).transpose(0, 1)
    k = torch.cat([kn, kr[:, None].expand(-1, 4, -1)], -1).transpose(0, 1)
    want = F.scaled_dot_product_attention(q, k, v.transpose(0, 1), is_causal=True,
                                          scale=0.25).transpose(0, 1)
    out, _ = chunk_attention_ref(qn[10:], qr[10:], kn, kr, v, torch.arange(10, 25),
                                 torch.arange(25), 0.25, slice_keys=7)
    assert torch.allclose(out, want[10:], atol=1e-6)


def test_merge_of_two_halves_equals_the_whole() -> None:
    qn, qr, kn, kr, v = _inputs(6, 20, 2, 16, 8, 16, seed=3)
    pos = torch.arange(20)
    q_pos = torch.full((6,), 19)
    a = chunk_attention_ref(qn, qr, kn[:9], kr[:9], v[:9], q_pos, pos[:9], 0.2)
    b = chunk_attention_ref(qn, qr, kn[9:], kr[9:], v[9:], q_pos, pos[9:], 0.2)
    whole = chunk_attention_ref(qn, qr, kn, kr, v, q_pos, pos, 0.2)
    nothing = chunk_attention_ref(qn, qr, kn[:0], kr[:0], v[:0], q_pos, pos[:0], 0.2)
    for got in (merge_partials(*a, *b), merge_partials(*merge_partials(*a, *b), *nothing)):
        assert torch.allclose(got[0], whole[0], atol=1e-6)
        assert torch.allclose(got[1], whole[1], atol=1e-6)


def test_bad_shapes_name_the_argument() -> None:
    qn, qr, kn, kr, v = _inputs(4, 6, 2, 16, 8, 16, seed=4)
    with pytest.raises(ValueError, match="k_pe"):
        chunk_attention_ref(qn, qr, kn, kr[:, :4], v, torch.arange(4), torch.arange(6), 0.2)
    with pytest.raises(ValueError, match="q_pos"):
        chunk_attention_ref(qn, qr, kn, kr, v, torch.arange(5), torch.arange(6), 0.2)


KERNEL_CHILD = r'''
from pdd_sidecar.model.kernels import chunk_attention as ca

torch.manual_seed(0)


def check(m, n, h, dn, dr, dv, q_pos, k_pos, dtype, tol, config, what):
    qn, qr = torch.randn(m, h, dn).to(dtype), torch.randn(m, h, dr).to(dtype)
    kn, kr = torch.randn(n, h, dn).to(dtype), torch.randn(n, dr).to(dtype)
    v = torch.randn(n, h, dv).to(dtype)
    want_o, want_l = ca.chunk_attention_ref(qn, qr, kn, kr, v, q_pos, k_pos, 0.15, slice_keys=13)
    got_o, got_l = ca.chunk_attention_triton(qn, qr, kn, kr, v, q_pos, k_pos, 0.15, config)
    assert got_o.dtype == torch.float32 and got_o.shape == (m, h, dv), what
    assert got_l.dtype == torch.float32 and got_l.shape == (m, h), what
    assert not torch.isnan(got_o).any() and not torch.isnan(got_l).any(), what
    assert torch.equal(torch.isinf(got_l), torch.isinf(want_l)), what
    fin = ~torch.isinf(want_l)
    err_o = float((got_o - want_o).abs().max())
    err_l = float((got_l - want_l)[fin].abs().max()) if fin.any() else 0.0
    assert err_o < tol and err_l < tol, (what, err_o, err_l)


small = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 2}
bs = 4
sparse = torch.tensor([p for p in range(90) if (p // bs) % 2 == 1])  # rank 1 of dcp 2
# fp16 stands in for bf16: this interpreter's bf16 dot reads garbage (tests/gpu checks bf16)
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2 ** -8)):
    for cfg in (small, ca.CONFIGS[1]):
        # a chunk at the end of a dense context: ragged query and key counts
        check(37, 53, 3, 16, 8, 16, torch.arange(16, 53), torch.arange(53), dtype, tol, cfg,
              "dense tail")
        # DCP rank 1's keys (odd blocks); queries in blocks 0 of the context see none
        check(21, len(sparse), 2, 16, 8, 16, torch.arange(69, 90), sparse, dtype, tol, cfg,
              "sparse")
        check(19, len(sparse), 2, 16, 8, 16, torch.arange(0, 19), sparse, dtype, tol, cfg,
              "sparse, early queries")
        # V2-Lite's head dims: qk 128 + 64, v 128
        check(20, 70, 2, 128, 64, 128, torch.arange(50, 70), torch.arange(70), dtype, tol, cfg,
              "v2-lite dims")
    print("kernel", dtype, "ok")
# the default launch (the first config that compiles), and a query count of one tile exactly
check(128, 200, 1, 16, 8, 16, torch.arange(72, 200), torch.arange(200), torch.float32, 1e-5,
      None, "default config")
# a context slice: every key before every query (the whole tile runs unmasked)
check(16, 96, 2, 16, 8, 16, torch.arange(500, 516), torch.arange(96), torch.float32, 1e-5,
      small, "all visible")
e_o, e_l = ca.chunk_attention_triton(torch.randn(3, 2, 16), torch.randn(3, 2, 8),
                                     torch.randn(0, 2, 16), torch.randn(0, 8),
                                     torch.randn(0, 2, 16), torch.arange(3),
                                     torch.arange(0), 0.1)
assert (e_o == 0).all() and torch.isinf(e_l).all()
start, full_lo, full, end = ca.tile_bounds(torch.arange(69, 90), sparse, 16, 16)
assert full.tolist() == [32, 32] and end.tolist() == [41, 44], (full, end)
assert start.tolist() == [0, 0] and full_lo.tolist() == [0, 0], (start, full_lo)
print("kernel edges ok")
'''

VARLEN_CHILD = r'''
import dataclasses

from pdd_sidecar.model import mla
from pdd_sidecar.model.kernels import chunk_attention as ca
from pdd_sidecar.model.rank_model import load_rank_model

torch.manual_seed(0)
small = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 2}


def segments(lengths):
    return torch.cat([torch.full((n,), sum(lengths[:i])) for i, n in enumerate(lengths)])


# the kernel with segment starts against the reference with them: ragged segments straddling
# tiles, one token long, and a tile of several whole segments
for lengths in ((1, 5, 16, 33), (40,), (3, 3, 3, 3, 3, 1)):
    t = sum(lengths)
    lo, pos = segments(lengths), torch.arange(t)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2 ** -8)):
        qn, qr = torch.randn(t, 2, 16).to(dtype), torch.randn(t, 2, 8).to(dtype)
        kn, kr, v = torch.randn(t, 2, 16).to(dtype), torch.randn(t, 8).to(dtype), \
            torch.randn(t, 2, 16).to(dtype)
        want_o, want_l = ca.chunk_attention_ref(qn, qr, kn, kr, v, pos, pos, 0.2, q_lo=lo)
        for cfg in (small, ca.CONFIGS[1]):
            got_o, got_l = ca.chunk_attention_triton(qn, qr, kn, kr, v, pos, pos, 0.2, cfg,
                                                     q_lo=lo)
            err = max(float((got_o - want_o).abs().max()), float((got_l - want_l).abs().max()))
            assert err < tol, (lengths, dtype, cfg, err)
print("varlen kernel ok")

# tiles of 16 over segments starting at 0, 1, 6 and 22: tiles 0 to 2 run from their earliest
# segment start's key tile to their last query, with no key tile every query sees (so fully
# masked); tile 3 (queries 48..54, all of the segment from 22) runs keys 16..54, 32..47 unmasked
start, full_lo, full_hi, end = ca.tile_bounds(torch.arange(55), torch.arange(55), 16, 16,
                                              segments([1, 5, 16, 33])).tolist()
assert start == [0, 0, 16, 16] and end == [16, 32, 48, 55], (start, end)
assert full_lo == [16, 32, 48, 32] and full_hi == [16, 32, 48, 48], (full_lo, full_hi)

# the model's fresh prompts in one call equal each prompt through prefill_attention (fp16 in
# this interpreter for the half-precision path; bf16 is checked on the GPU)
model = load_rank_model("builtin", 0, 1, "float32", "cpu")
cfg, attn = model.config, model.weights.layers[0].attn
lengths = [1, 5, 16, 33]
t = sum(lengths)
x = torch.randn(t, cfg.hidden_size)
pos = torch.cat([torch.arange(n) for n in lengths])
cos, sin = model.rotary.cos_sin(pos)
q_nope, q_pe = mla.project_q(x, attn, cfg, cos, sin)
latent = mla.project_latent(x, attn, cfg, cos, sin)
want = torch.cat([
    mla.prefill_attention(q_nope[a:a + n], q_pe[a:a + n], latent[a:a + n], attn, cfg)
    for a, n in zip(segments(lengths).unique().tolist(), lengths)
])
mla.chunk_attention = lambda *args, q_lo: ca.chunk_attention_triton(*args, small, q_lo=q_lo)
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 4e-3)):
    half = dataclasses.replace(attn, w_uk=attn.w_uk.to(dtype), w_uv=attn.w_uv.to(dtype))
    got = mla.varlen_prefill_attention(q_nope.to(dtype), q_pe.to(dtype), latent.to(dtype),
                                       segments(lengths), half, cfg)
    assert got.dtype == dtype and got.shape == want.shape
    err = float((got.float() - want).abs().max())
    assert err < tol, (dtype, err)
print("varlen mla ok")

# the engine: a step of four fresh prompts on the kernel equals each prompt prefilled alone
from pdd_sidecar.engine import rank_engine
from pdd_sidecar.engine.comm import SingleComm
from pdd_sidecar.engine.seq_chunk import SeqChunk

calls = []


def kernel(*args, q_lo):
    calls.append(1)
    return ca.chunk_attention_triton(*args, small, q_lo=q_lo)


mla.chunk_attention = kernel
rank_engine.batch_fresh_prompts = lambda n, dev, dt: n >= 2
prompts = [[(i * 37 + s * 11 + 5) % 256 for i in range(n)] for s, n in enumerate(lengths)]
alone, eng = (rank_engine.RankEngine(model, rank_engine.new_cache(model, 64, 4), SingleComm())
              for _ in range(2))
tables = [rank_engine.allocate_request(alone.cache, len(p), 1) for p in prompts]
assert [rank_engine.allocate_request(eng.cache, len(p), 1) for p in prompts] == tables
want = torch.stack([alone.prefill(p, t) for p, t in zip(prompts, tables)])
assert not calls, "a single prompt took the batched path"
got = eng.step([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
assert calls, "the kernel never ran"
err = max(float((got - want).abs().max()), float((eng.cache.kv - alone.cache.kv).abs().max()))
assert err < 1e-4, err
print("varlen engine ok")
'''

ENGINE_CHILD = r'''
import threading

from pdd_sidecar.engine import rank_engine
from pdd_sidecar.engine.comm import run_threads
from pdd_sidecar.engine.rank_engine import RankEngine, allocate_request, new_cache
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.model import mla
from pdd_sidecar.model.kernels import chunk_attention as ca
from pdd_sidecar.model.rank_model import load_rank_model

one_at_a_time = threading.Lock()  # the interpreter is not thread-safe; thread ranks share it
calls = []


def kernel(*args, q_lo=None):
    with one_at_a_time:
        calls.append(1)
        return ca.chunk_attention_triton(*args, {"block_m": 16, "block_n": 16, "num_warps": 4,
                                                 "num_stages": 2}, q_lo=q_lo)


mla.chunk_attention = kernel
mla.EXPANDED_SLICE_BYTES = 20 * 8 * 32 * 4  # slices of 20 or 40 tokens: merged by LSE
rank_engine.batch_continuing_chunks = lambda n, dev, dt: n >= 2
# two prompts chunked in the same steps: their later chunks take the batched continuing path
prompts = [[(i * 37 + 5) % 256 for i in range(45)], [(i * 13 + 2) % 256 for i in range(30)]]


def run(rank, comm, tp, dcp):
    model = load_rank_model("builtin", rank, tp, "float32", "cpu")
    one = RankEngine(model, new_cache(model, 64, 4), comm, dcp)
    tables = [allocate_request(one.cache, len(p), dcp) for p in prompts]
    wholes = [one.prefill(p, t, all_logits=True) for p, t in zip(prompts, tables)]
    eng = RankEngine(model, new_cache(model, 64, 4), comm, dcp)
    for p in prompts:
        allocate_request(eng.cache, len(p), dcp)
    worst = 0.0
    for start in range(0, len(prompts[0]), 17):
        live = [i for i, p in enumerate(prompts) if start < len(p)]
        out = eng.step([SeqChunk(prompts[i][start:start + 17], start, tables[i]) for i in live])
        for row, i in enumerate(live):
            end = min(start + 17, len(prompts[i]))
            worst = max(worst, float((out[row] - wholes[i][end - 1]).abs().max()))
    worst = max(worst, float((eng.cache.kv - one.cache.kv).abs().max()))
    return worst


for tp, dcp in ((1, 1), (2, 2)):
    calls.clear()
    worst = max(run_threads(tp, lambda r, c: run(r, c, tp, dcp)))
    assert calls, "the kernel never ran"
    assert worst < 1e-4, (tp, dcp, worst)
    print("engine", tp, dcp, "ok")
'''


def _child(code: str) -> str:
    pytest.importorskip("triton")
    from test_cuda_graph_kernels import SHIM
    from test_cuda_graph_kernels import _child as run_child

    return run_child(SHIM + code)


def test_kernel_in_the_interpreter_equals_the_reference() -> None:
    out = _child(KERNEL_CHILD)
    assert "kernel torch.float32 ok" in out and "kernel torch.float16 ok" in out
    assert "kernel edges ok" in out


def test_chunked_prefill_on_the_kernel_in_the_interpreter() -> None:
    out = _child(ENGINE_CHILD)
    assert "engine 1 1 ok" in out and "engine 2 2 ok" in out


def test_fresh_prompts_in_one_kernel_call_in_the_interpreter() -> None:
    out = _child(VARLEN_CHILD)
    assert "varlen kernel ok" in out and "varlen mla ok" in out and "varlen engine ok" in out
