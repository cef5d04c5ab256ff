"""The FP8 latent token: the one byte layout every writer, reader and mover of FP8 KV shares.

FlashMLA's FP8 MLA cache (also vLLM's and SGLang's) keeps a token's latent as the ``kv_lora_rank``
no-RoPE values in float8 e4m3 with one float32 scale per 128 of them, then the RoPE part in
bf16, kept exact because it carries position: 512 + 4 x 4 + 64 x 2 = 656 bytes against 1,152 in
bf16. pdd keeps the same order so a decode kernel that reads FlashMLA's layout reads pdd's
cache, and a hand-off moves these bytes unchanged. A cache in this layout is a ``uint8`` tensor
whose last dimension is :func:`token_bytes`.

Scales are ``amax / 448`` per group (448 is e4m3's largest finite value), never zero, so an
all-zero group round-trips exactly and no reader divides by zero.
"""

from __future__ import annotations

from typing import Final

import torch

# ``auto``: the model's dtype. ``fp8``: this module's layout. The API's values (the CRD's
# kvCacheDtype, PDD_KV_CACHE_DTYPE), named once in pdd_api.
from pdd_api.models import KV_CACHE_DTYPES

GROUP: Final = 128
E4M3_MAX: Final = 448.0
SCALE_BYTES: Final = 4
ROPE_BYTES: Final = 2
_MIN_SCALE: Final = 1e-10


def check_kv_cache_dtype(value: str, field: str = "kv_cache_dtype") -> str:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"{field} {value!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return value


def num_groups(nope: int) -> int:
    return -(-nope // GROUP)


def token_bytes(nope: int, rope: int) -> int:
    """Bytes of one FP8 token of one layer: 656 for ``kv_lora_rank`` 512 and RoPE 64."""
    return nope + SCALE_BYTES * num_groups(nope) + ROPE_BYTES * rope


def token_bytes_for(kv_cache_dtype: str, nope: int, rope: int, model_dtype: torch.dtype) -> int:
    """Bytes one token of one layer takes in the pool, whichever dtype the cache keeps."""
    if check_kv_cache_dtype(kv_cache_dtype) == "fp8":
        return token_bytes(nope, rope)
    return (nope + rope) * torch.empty((), dtype=model_dtype).element_size()


def quantize_latents(values: torch.Tensor, nope: int) -> torch.Tensor:
    """``[N, nope + rope]`` float latents to ``[N, token_bytes]`` uint8 in this layout."""
    if values.dim() != 2 or values.shape[1] <= nope:
        raise ValueError(f"values must be [N, {nope} + rope], got {tuple(values.shape)}")
    n, width = values.shape
    rope = width - nope
    groups = num_groups(nope)
    x = values[:, :nope].float()
    padded = torch.nn.functional.pad(x, (0, groups * GROUP - nope)).view(n, groups, GROUP)
    scale = (padded.abs().amax(dim=-1) / E4M3_MAX).clamp_min(_MIN_SCALE)
    q = (padded / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch.empty(n, token_bytes(nope, rope), dtype=torch.uint8, device=values.device)
    out[:, :nope] = q.view(n, groups * GROUP)[:, :nope].view(torch.uint8)
    s_end = nope + SCALE_BYTES * groups
    out[:, nope:s_end] = scale.contiguous().view(torch.uint8)
    out[:, s_end:] = values[:, nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def dequantize_latents(packed: torch.Tensor, nope: int, dtype: torch.dtype) -> torch.Tensor:
    """``[N, token_bytes]`` uint8 back to ``[N, nope + rope]`` of ``dtype``."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(
            f"packed must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}"
        )
    n, width = packed.shape
    groups = num_groups(nope)
    s_end = nope + SCALE_BYTES * groups
    rope_bytes = width - s_end
    if rope_bytes <= 0 or rope_bytes % ROPE_BYTES:
        raise ValueError(f"{width} bytes a token is not an FP8 latent of {nope} no-RoPE values")
    packed = packed.contiguous()
    q = packed[:, :nope].contiguous().view(torch.float8_e4m3fn).float()
    scale = packed[:, nope:s_end].contiguous().view(torch.float32)
    idx = torch.arange(nope, device=packed.device) // GROUP
    nope_vals = q * scale[:, idx]
    rope_vals = packed[:, s_end:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope_vals, rope_vals], dim=1).to(dtype)


__all__ = [
    "E4M3_MAX",
    "GROUP",
    "KV_CACHE_DTYPES",
    "check_kv_cache_dtype",
    "dequantize_latents",
    "num_groups",
    "quantize_latents",
    "token_bytes",
    "token_bytes_for",
]
