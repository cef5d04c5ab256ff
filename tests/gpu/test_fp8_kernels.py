"""The FP8 latent kernels compiled on a CUDA device against the torch references of
kv/fp8_layout.py (run by hand; skipped without CUDA): the quantising store byte for byte against
``quantize_latents``, the block reader against ``dequantize_latents``, the paged decode over an
FP8 cache against the reference on the dequantised latents (V2-Lite's 512 + 64, 16 and 128
heads, splits as the engine picks them and fixed), with no host sync.

    PYTHONPATH=sidecar python -m pytest tests/gpu/test_fp8_kernels.py -q
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from pdd_sidecar.kv import fp8_layout  # noqa: E402
from pdd_sidecar.model.kernels import mla_decode as md  # noqa: E402
from pdd_sidecar.model.kernels.kv_write import write_latents  # noqa: E402
from pdd_sidecar.model.kernels.latent_read import read_latent_blocks  # noqa: E402

DEV = torch.device("cuda")
C, R, BS, LAYERS = 512, 64, 64, 3


def _filled(num_blocks: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 cache whose every slot of layer 1 holds a quantised random latent (the latents
    returned as written, bf16 as the model makes them)."""
    kv = torch.zeros(num_blocks, LAYERS, BS, fp8_layout.token_bytes(C, R), dtype=torch.uint8,
                     device=DEV)
    n = num_blocks * BS
    vals = (torch.randn(n, C + R, device=DEV, generator=g)
            * torch.rand(n, 1, device=DEV, generator=g) * 4).to(torch.bfloat16)
    ids = torch.arange(n, device=DEV)
    write_latents(kv, 1, ids // BS, ids % BS, None, vals, kv_lora_rank=C)
    return kv, vals


def test_store_is_quantize_latents_byte_for_byte() -> None:
    g = torch.Generator(device=DEV).manual_seed(1)
    kv, vals = _filled(40, g)
    got = kv[:, 1].reshape(-1, kv.shape[-1])
    want = fp8_layout.quantize_latents(vals, C)
    differ = (got != want).sum().item()
    assert differ == 0, f"{differ} bytes of {got.numel()} differ"
    assert int(kv[:, 0].count_nonzero()) == 0 and int(kv[:, 2].count_nonzero()) == 0
    # masked rows store nothing
    before = kv.clone()
    idx = torch.arange(8, device=DEV)
    write_latents(kv, 1, idx, idx, torch.zeros(8, dtype=torch.int32, device=DEV), vals[:8],
                  kv_lora_rank=C)
    assert torch.equal(kv, before)


def test_reader_is_dequantize_latents() -> None:
    g = torch.Generator(device=DEV).manual_seed(2)
    kv, _ = _filled(12, g)
    order = torch.tensor([7, 0, 11, 3], device=DEV)
    rows = torch.cat([kv[int(b), 1] for b in order])
    for dtype in (torch.bfloat16, torch.float32):
        got = read_latent_blocks(kv, 1, order, kv_lora_rank=C, dtype=dtype)
        assert torch.equal(got, fp8_layout.dequantize_latents(rows, C, dtype)), dtype


@pytest.mark.parametrize("variant", ["groups", "tile"])
@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_decode_matches_reference_on_dequantised_latents(heads: int, variant: str) -> None:
    g = torch.Generator(device=DEV).manual_seed(3)
    kv, _ = _filled(96, g)
    deq = fp8_layout.dequantize_latents(kv.reshape(-1, kv.shape[-1]), C, torch.bfloat16)
    plain = deq.view(*kv.shape[:3], C + R)
    lens = [0, 1, 63, 64, 65, 700, 2000, 4000]
    perm = torch.randperm(96, device=DEV, generator=g).tolist()
    width = 64
    tables = torch.tensor([[perm[(i * 11 + j) % 96] for j in range(width)]
                           for i in range(len(lens))], dtype=torch.int32, device=DEV)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = (torch.randn(len(lens), heads, C + R, device=DEV, generator=g) * 0.5).to(torch.bfloat16)
    scale = 192 ** -0.5
    want_o, want_l = md.paged_mla_decode_triton(q, plain, 1, tables, sl, C, scale)
    ref_o, ref_l = md.paged_mla_decode_ref(q, kv, 1, tables, sl, C, scale)
    fin = ~torch.isinf(ref_l)
    for splits in (None, 1, 7, 64):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            o, lse = md.paged_mla_decode_triton(q, kv, 1, tables, sl, C, scale, splits,
                                                fp8_kernel=variant)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_l)), splits
        err = float((o - ref_o).abs().max() / ref_o.abs().max())
        # the FP8 kernel rounds p * scale to bf16 where the bf16 kernel rounds the latent:
        # both are within bf16 rounding of the reference
        err_bf16 = float((want_o - ref_o).abs().max() / ref_o.abs().max())
        assert err < max(2e-2, 2 * err_bf16), (splits, err, err_bf16)
        assert float((lse[fin] - ref_l[fin]).abs().max()) < 2e-2, splits
