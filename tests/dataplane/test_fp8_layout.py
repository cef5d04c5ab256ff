"""The FP8 latent token's byte layout: sizes, round trips, and the bytes FlashMLA expects."""

from __future__ import annotations

import pytest
import torch

from pdd_sidecar.kv import fp8_layout as fp8

pytestmark = pytest.mark.dataplane


def test_a_v2_token_is_656_bytes_against_1152_in_bf16() -> None:
    assert fp8.token_bytes(512, 64) == 656
    assert fp8.token_bytes_for("fp8", 512, 64, torch.bfloat16) == 656
    assert fp8.token_bytes_for("auto", 512, 64, torch.bfloat16) == 1152
    assert fp8.token_bytes(32, 16) == 32 + 4 + 32


def test_an_unknown_dtype_is_refused_naming_field_and_value() -> None:
    with pytest.raises(ValueError, match=r"kvCacheDtype 'fp16' is not one of auto, fp8"):
        fp8.check_kv_cache_dtype("fp16", "kvCacheDtype")


@pytest.mark.parametrize("nope,rope", [(512, 64), (32, 16), (200, 8)])
def test_round_trip_error_is_within_e4m3s_step_and_rope_is_exact_bf16(nope: int, rope: int) -> None:
    g = torch.Generator().manual_seed(nope)
    x = torch.randn(37, nope + rope, generator=g) * torch.logspace(-3, 2, 37).unsqueeze(1)
    packed = fp8.quantize_latents(x, nope)
    assert packed.dtype == torch.uint8 and packed.shape == (37, fp8.token_bytes(nope, rope))
    back = fp8.dequantize_latents(packed, nope, torch.float32)
    groups = torch.nn.functional.pad(x[:, :nope], (0, fp8.num_groups(nope) * 128 - nope))
    amax = groups.view(37, -1, 128).abs().amax(-1)
    bound = (amax / 8).repeat_interleave(128, dim=1)[:, :nope]  # e4m3 keeps 3 mantissa bits
    assert ((back[:, :nope] - x[:, :nope]).abs() <= bound + 1e-12).all()
    assert torch.equal(back[:, nope:], x[:, nope:].to(torch.bfloat16).float())


def test_the_bytes_are_values_then_fp32_scales_then_bf16_rope() -> None:
    x = torch.zeros(1, 512 + 64)
    x[0, 0] = 448.0 * 2  # group 0's scale becomes 2
    x[0, 200] = -448.0  # group 1's scale becomes 1
    x[0, 512] = 1.5
    packed = fp8.quantize_latents(x, 512)[0]
    assert packed[:512].view(torch.float8_e4m3fn)[0].float() == 448.0
    scales = packed[512:528].view(torch.float32)
    assert scales.tolist()[:2] == [2.0, 1.0] and all(s > 0 for s in scales.tolist())
    assert packed[528:].view(torch.bfloat16)[0].float() == 1.5


def test_zero_groups_round_trip_exactly() -> None:
    x = torch.zeros(3, 40)
    back = fp8.dequantize_latents(fp8.quantize_latents(x, 32), 32, torch.float32)
    assert torch.equal(back, x)


def test_a_packed_row_of_the_wrong_width_is_refused() -> None:
    with pytest.raises(ValueError, match="not an FP8 latent"):
        fp8.dequantize_latents(torch.zeros(2, 514, dtype=torch.uint8), 512, torch.float32)
