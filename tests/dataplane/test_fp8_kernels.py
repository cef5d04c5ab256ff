"""The kernels over an FP8 (``uint8``) latent cache against kv/fp8_layout.py's torch round trip:
the masked store quantises exactly as ``quantize_latents``, the block reader returns what
``dequantize_latents`` returns, and the paged decode over FP8 blocks equals the reference on the
dequantised latents. The torch paths run directly; the Triton kernels run in Triton's interpreter
in a child process (it needs TRITON_INTERPRET=1 before the kernels are defined), with its
float32 -> e4m3 / bf16 casts rounding to nearest even as the GPU's do; tests/gpu checks the
compiled kernels against the same references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cuda_graph_kernels import SHIM  # the interpreter's mask fix, NaN-filled fresh buffers

from pdd_sidecar.kv import fp8_layout
from pdd_sidecar.model.kernels.kv_write import write_latents
from pdd_sidecar.model.kernels.latent_read import latent_dim, read_latent_blocks, read_latents
from pdd_sidecar.model.kernels.mla_decode import paged_mla_decode, paged_mla_decode_ref

pytestmark = pytest.mark.dataplane

ROOT = Path(__file__).resolve().parents[2]
C, R, H, BS, LAYERS = 32, 8, 4, 16, 2


def _fp8_cache(num_blocks: int, c: int = C, r: int = R) -> torch.Tensor:
    return torch.zeros(num_blocks, LAYERS, BS, fp8_layout.token_bytes(c, r), dtype=torch.uint8)


def test_masked_fp8_store_is_quantize_latents() -> None:
    g = torch.Generator().manual_seed(3)
    kv = _fp8_cache(8).fill_(0xAB)
    vals = torch.randn(5, C + R, generator=g) * 4
    blk = torch.tensor([1, 0, 5, 7, 2])
    off = torch.tensor([2, 0, 3, 15, 9])
    mask = torch.tensor([1, 0, 1, 1, 0], dtype=torch.int32)
    write_latents(kv, 1, blk, off, mask, vals, kv_lora_rank=C)
    want = _fp8_cache(8).fill_(0xAB)
    packed = fp8_layout.quantize_latents(vals, C)
    for i in (0, 2, 3):
        want[blk[i], 1, off[i]] = packed[i]
    assert torch.equal(kv, want)
    everything = _fp8_cache(8)
    write_latents(everything, 0, blk, off, None, vals, kv_lora_rank=C)
    assert torch.equal(everything[blk, 0, off], packed)


def test_fp8_store_refuses_what_does_not_fit() -> None:
    kv = _fp8_cache(2)
    vals = torch.zeros(1, C + R)
    idx = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="kv_lora_rank is required"):
        write_latents(kv, 0, idx, idx, None, vals)
    with pytest.raises(ValueError, match="is 50 bytes.*takes 52"):
        write_latents(kv[..., :-2], 0, idx, idx, None, vals, kv_lora_rank=C)


def test_block_reader_dequantises_and_passes_bf16_through() -> None:
    g = torch.Generator().manual_seed(4)
    kv = _fp8_cache(6)
    vals = torch.randn(6 * BS, C + R, generator=g)
    ids = torch.arange(6 * BS)
    write_latents(kv, 1, ids // BS, ids % BS, None, vals, kv_lora_rank=C)
    order = torch.tensor([4, 1, 5])
    got = read_latent_blocks(kv, 1, order, kv_lora_rank=C, dtype=torch.float32)
    rows = torch.cat([kv[int(b), 1] for b in order])
    assert torch.equal(got, fp8_layout.dequantize_latents(rows, C, torch.float32))
    assert read_latent_blocks(kv, 1, order, kv_lora_rank=C).dtype == torch.bfloat16
    part = read_latents(kv, 1, order, 20, kv_lora_rank=C, dtype=torch.float32)
    assert torch.equal(part, got[:20])
    assert latent_dim(kv, C) == C + R
    plain = torch.randn(6, LAYERS, BS, C + R, generator=g)
    assert torch.equal(read_latent_blocks(plain, 0, order, kv_lora_rank=C),
                       torch.cat([plain[int(b), 0] for b in order]))
    with pytest.raises(ValueError, match="kv_lora_rank 31"):
        latent_dim(kv, 31)


def test_decode_over_fp8_equals_reference_on_dequantised_latents() -> None:
    g = torch.Generator().manual_seed(5)
    kv = _fp8_cache(16)
    flat = torch.randn(16 * BS, C + R, generator=g)
    ids = torch.arange(16 * BS)
    write_latents(kv, 0, ids // BS, ids % BS, None, flat, kv_lora_rank=C)
    deq = fp8_layout.dequantize_latents(kv.reshape(-1, kv.shape[-1]), C, torch.float32)
    plain = deq.view(16, LAYERS, BS, C + R)
    tables = torch.tensor([[3, 9, 1, 0], [12, 4, 7, 2], [5, 5, 5, 5]], dtype=torch.int32)
    lens = torch.tensor([40, 64, 0], dtype=torch.int32)
    q = torch.randn(3, H, C + R, generator=g)
    out, lse = paged_mla_decode(q, kv, 0, tables, lens, C, 0.2)
    want_o, want_l = paged_mla_decode_ref(q, plain, 0, tables, lens, C, 0.2)
    assert torch.equal(out, want_o) and torch.equal(lse, want_l)
    with pytest.raises(ValueError, match="FP8 kv_cache's last dimension"):
        paged_mla_decode(q, kv[..., :-2], 0, tables, lens, C, 0.2)


CHILD = r'''
import numpy as np
import torch
import triton.language as tl
import triton.runtime.interpreter as interp
from pdd_sidecar.kv import fp8_layout as f8

# The interpreter rounds float32 -> e4m3 / bf16 without carrying a rounded-up mantissa into the
# exponent (126.8 becomes 64) or by truncation; the GPU rounds to nearest even, as torch does.
_TORCH = {tl.float8e4nv: torch.float8_e4m3fn, tl.bfloat16: torch.bfloat16}


def _rounding(orig):
    def cast(self, src, dst_type, *rest):
        dst = dst_type.scalar
        if src.dtype.scalar == tl.float32 and dst in _TORCH:
            t = torch.from_numpy(np.ascontiguousarray(src.data)).to(_TORCH[dst])
            bits = t.view(torch.uint8 if dst == tl.float8e4nv else torch.int16).numpy()
            return interp.TensorHandle(bits.view(interp._get_np_dtype(dst_type)), dst)
        return orig(self, src, dst_type, *rest)
    return cast


for name in ("create_fp_to_fp", "cast_impl"):
    setattr(interp.InterpreterBuilder, name, _rounding(getattr(interp.InterpreterBuilder, name)))
from pdd_sidecar.model.kernels import kv_write as kw, latent_read as lr, mla_decode as md

torch.manual_seed(0)
h, bs, layers, nb = 4, 16, 2, 10


for c, r in ((32, 8), (256, 16), (320, 8)):
    tb = f8.token_bytes(c, r)
    vals = torch.randn(nb * bs, c + r) * torch.rand(nb * bs, 1) * 3
    vals[7] = 0.0  # an all-zero row: the smallest scale, exact zeros
    kv = torch.full((nb, layers, bs, tb), 0xAB, dtype=torch.uint8)
    ids = torch.arange(nb * bs)
    mask = torch.ones(nb * bs, dtype=torch.int32)
    mask[5] = 0
    kw._write_fp8_triton(kv, 1, ids // bs, ids % bs, mask, vals, c)
    got = kv[:, 1].reshape(-1, tb)
    want = f8.quantize_latents(vals, c)
    assert bool((got[5] == 0xAB).all()), "masked row written"
    keep = mask.bool()
    assert torch.equal(got[keep], want[keep])
    assert bool((kv[:, 0] == 0xAB).all()), "other layer written"
    print("store", c, "ok")

    order = torch.tensor([3, 0, 7])
    a = lr._read_fp8_triton(kv, 1, order, c, c + r, torch.float32)
    b = lr.read_latent_blocks(kv, 1, order, kv_lora_rank=c, dtype=torch.float32)
    assert torch.equal(a, b)
    print("read", c, "ok")

    lens = [0, 1, 17, 63, 100, 33]
    tables = (torch.arange(len(lens) * 7, dtype=torch.int32).view(len(lens), 7) * 5) % nb
    sl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), h, c + r)
    ro, rl = md.paged_mla_decode_ref(q, kv, 1, tables, sl, c, 0.3)
    fin = ~torch.isinf(rl)
    for variant, splits in (("groups", 1), ("groups", 3), ("groups", 9), ("tile", 1),
                            ("tile", 3)):
        o, l = md.paged_mla_decode_triton(q, kv, 1, tables, sl, c, 0.3, num_splits=splits,
                                          fp8_kernel=variant)
        assert torch.equal(torch.isinf(l), torch.isinf(rl)), splits
        err = float((o - ro).abs().max())
        assert err < 1e-4, (c, variant, splits, err)
        assert float((l[fin] - rl[fin]).abs().max()) < 1e-4, splits
    print("decode", c, "ok")
'''


def test_fp8_kernels_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    path = os.pathsep.join([str(ROOT / "sidecar"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", SHIM + CHILD], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for c in (32, 256, 320):
        for what in ("store", "read", "decode"):
            assert f"{what} {c} ok" in proc.stdout, proc.stdout
