"""Rotary position embedding for the decoupled rope part of MLA, with YaRN scaling.

DeepSeek-V2 rotates interleaved pairs ``(x[2i], x[2i+1])`` (transformers does it as a complex
multiply), not the two halves as Llama does; the rotation runs in fp32 and YaRN's attention factor
scales cos/sin, exactly as transformers computes them, so fp32 logits match to ~1e-6.
"""

from __future__ import annotations

import math

import torch

from pdd_sidecar.model.config import RopeConfig, yarn_get_mscale


def inv_freq_and_scale(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_get_mscale(factor, rope.mscale) / yarn_get_mscale(
            factor, rope.mscale_all_dim
        )
    else:
        attention_factor = yarn_get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


class Rotary:
    def __init__(self, rope: RopeConfig, dim: int, device: str | torch.device = "cpu") -> None:
        inv_freq, self.attention_factor = inv_freq_and_scale(rope, dim)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``[T, dim/2]`` cos and sin for ``positions``, YaRN attention factor applied."""
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq
        return torch.cos(freqs) * self.attention_factor, torch.sin(freqs) * self.attention_factor


