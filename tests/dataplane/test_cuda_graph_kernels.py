"""The two Triton kernels the graph-captured decode step relies on, run by Triton's interpreter on
the CPU (the GPU tests run them compiled): the paged decode with a split count fixed above what
the lengths need, whose empty splits store nothing and whose reduce must read only the splits
that stored (every fresh buffer is NaN-filled here, so a read of an unwritten split shows), and
the masked latent store of padded batches.

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

CHILD = r'''
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


def test_graph_step_kernels_in_the_interpreter() -> None:
    path = os.pathsep.join([str(ROOT / "sidecar"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "decode splits 40 ok" in proc.stdout and "masked write ok" in proc.stdout
