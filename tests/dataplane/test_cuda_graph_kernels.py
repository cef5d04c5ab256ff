"""The two Triton kernels the graph-captured decode step relies on, run by Triton's interpreter on
the CPU (the GPU tests run them compiled): the paged decode with a split count fixed above what
the lengths need, whose empty splits store nothing and whose reduce must read only the splits
that stored (every fresh buffer is NaN-filled here, so a read of an unwritten split shows), and
the masked latent store of padded batches; then the engine's padded decode step on those kernels
(TP 1 and TP 2/DCP 2 thread ranks) against the eager step on the torch references.

The interpreter needs TRITON_INTERPRET=1 before the kernels are defined, so the checks run in a
child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.dataplane

ROOT = Path(__file__).resolve().parents[2]

SHIM = r'''
import numpy as np
import torch
import triton.runtime.interpreter as interp

# Some Triton/numpy pairs hand the interpreter integer masks where it wants booleans.
for name, at in (("create_masked_load", 0), ("create_masked_store", 1)):
    orig = getattr(interp.InterpreterBuilder, name)

    def fixed(self, ptrs, *rest, _orig=orig, _at=at):
        mask = rest[_at]
        if mask.data.dtype != np.bool_:
            mask.data = mask.data.astype(np.bool_)
        return _orig(self, ptrs, *rest)

    setattr(interp.InterpreterBuilder, name, fixed)

real_empty = torch.empty


def nan_empty(*args, **kwargs):
    t = real_empty(*args, **kwargs)
    if t.is_floating_point():
        t.fill_(float("nan"))
    return t


torch.empty = nan_empty
'''

CHILD = SHIM + r'''
from pdd_sidecar.model.kernels import mla_decode as md
from pdd_sidecar.model.kernels.kv_write import _write_rows

torch.manual_seed(0)
c, r, h, bs, layers = 32, 8, 4, 16, 2
lens = [0, 1, 17, 63, 100, 0, 33]
nb = 64
kv = torch.randn(nb, layers, bs, c + r)
perm = torch.randperm(nb).tolist()
width = 9
rows = []
for n in lens:
    k = max(1, -(-n // bs))
    ids = [perm.pop() for _ in range(k)]
    rows.append(ids + [perm[-1]] * (width - k))  # padding columns point at live foreign blocks
tables = torch.tensor(rows, dtype=torch.int32)
seq_lens = torch.tensor(lens, dtype=torch.int32)
q = torch.randn(len(lens), h, c + r)
ref_o, ref_l = md.paged_mla_decode_ref(q, kv, 1, tables, seq_lens, c, 0.3)
for splits in (1, 3, 7, 40):
    o, l = md.paged_mla_decode_triton(q, kv, 1, tables, seq_lens, c, 0.3, num_splits=splits)
    assert not torch.isnan(o).any() and not torch.isnan(l).any(), splits
    assert torch.equal(torch.isinf(l), torch.isinf(ref_l)), splits
    fin = ~torch.isinf(ref_l)
    assert float((o - ref_o).abs().max()) < 1e-4, splits
    assert float((l[fin] - ref_l[fin]).abs().max()) < 1e-4, splits
    print("decode splits", splits, "ok")

cache = real_empty(8, 2, 4, 40).fill_(3.0)
vals = torch.randn(4, 40)
blk = torch.tensor([1, 0, 5, 0])
off = torch.tensor([2, 0, 3, 0])
mask = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
layer = cache[:, 1]
_write_rows[(4,)](layer, blk, off, mask, vals, layer.stride(0), layer.stride(1), vals.stride(0),
                  L=40, L_P2=64)
want = real_empty(8, 2, 4, 40).fill_(3.0)
want[1, 1, 2] = vals[0]
want[5, 1, 3] = vals[2]
assert torch.equal(cache, want)
print("masked write ok")
'''


# The engine's padded decode step with the Triton kernels in place of their CPU references
# (fixed split count, masked store), against the eager step on the references: the buffers the
# engine stages (dtypes, widths, padded rows) are what the kernels expect.
ENGINE_CHILD = SHIM + r'''
import torch
from pdd_sidecar.engine import rank_engine
from pdd_sidecar.engine.comm import run_threads
from pdd_sidecar.engine.rank_engine import RankEngine, new_cache
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.model.kernels import mla_decode as md
from pdd_sidecar.model.kernels.kv_write import _write_rows
from pdd_sidecar.model.rank_model import load_rank_model

import threading

reference = rank_engine.paged_mla_decode
one_at_a_time = threading.Lock()  # the interpreter is not thread-safe; thread ranks share it


def paged(q, kv, layer, tables, lens, c, scale, num_splits=None):
    if num_splits is None:  # the eager step: the torch reference
        return reference(q, kv, layer, tables, lens, c, scale)
    with one_at_a_time:
        return md.paged_mla_decode_triton(q, kv, layer, tables, lens, c, scale, num_splits)


def write(kv, layer, blk, off, mask, values):
    lv = kv[:, layer]
    vals = values.to(kv.dtype).contiguous()
    with one_at_a_time:
        _write_rows[(values.shape[0],)](lv, blk, off, mask, vals, lv.stride(0), lv.stride(1),
                                       vals.stride(0), L=kv.shape[-1], L_P2=64)


rank_engine.paged_mla_decode = paged
rank_engine.write_latents = write
RankEngine._splits = lambda self, bucket: 7  # more splits than the short sequences fill

SENTINEL = 7.25


def run(rank, comm, tp, dcp, mode):
    model = load_rank_model("builtin", rank, tp, "float32", "cpu")
    cache = new_cache(model, 64, 4)
    cache.kv.fill_(SENTINEL)
    eng = RankEngine(model, cache, comm, dcp, decode_mode=mode, graph_buckets=(1, 2, 4, 8))
    tables = [[0, 60, 3, 50, 7, 40, 11, 30], [1, 61, 4, 51, 8, 41, 12, 31],
              [2, 62, 5, 52, 9, 42, 13, 32]]
    prompts = [[5, 9, 200, 3, 17], [1] * 11, [77, 4, 90]]
    nxt, pos, out = [], [], []
    for p, t in zip(prompts, tables):
        nxt.append(int(eng.step([SeqChunk(p, 0, t)])[0].argmax()))
        pos.append(len(p))
    for seqs in ([0], [0, 1, 2], [2, 1], [1], [0, 2, 1]):
        logits = eng.step([SeqChunk([nxt[s]], pos[s], tables[s]) for s in seqs])
        out.append(logits.clone())
        for s, t in zip(seqs, logits.argmax(-1).tolist()):
            nxt[s], pos[s] = t, pos[s] + 1
    return out, cache.kv.clone(), eng.padded_steps


for tp, dcp in ((1, 1), (2, 2)):
    ref = run_threads(tp, lambda r, c: run(r, c, tp, dcp, "eager"))
    got = run_threads(tp, lambda r, c: run(r, c, tp, dcp, "padded"))
    assert got[0][2] == 5 and ref[0][2] == 0
    for a, b in zip(ref[0][0], got[0][0]):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert float((a - b).abs().max()) < 1e-4, float((a - b).abs().max())
    for (_, kv_a, _), (_, kv_b, _) in zip(ref, got):
        assert torch.equal(kv_a == SENTINEL, kv_b == SENTINEL)
        assert float((kv_a - kv_b).abs().max()) < 1e-4
    print("engine", tp, dcp, "ok")
'''


def _child(code: str) -> str:
    path = os.pathsep.join([str(ROOT / "sidecar"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_graph_step_kernels_in_the_interpreter() -> None:
    out = _child(CHILD)
    assert "decode splits 40 ok" in out and "masked write ok" in out


def test_padded_engine_step_on_the_kernels_in_the_interpreter() -> None:
    out = _child(ENGINE_CHILD)
    assert "engine 1 1 ok" in out and "engine 2 2 ok" in out
