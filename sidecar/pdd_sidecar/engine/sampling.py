"""Choosing the next token on rank 0: greedy, or temperature / top-k / top-p with a seed.

Token ``i`` of a completion is drawn from a generator seeded by ``(seed, i)`` alone, so the
prefill (which draws token 0) and the decode (tokens 1..) sample one reproducible stream without
handing generator state across instances, and a request samples the same tokens whatever else
shares its batch.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdd_sidecar.engine.device_queue import to_device

_MASK63 = (1 << 63) - 1
_TINY = torch.finfo(torch.float32).tiny
_GOLDEN = 0x9E3779B97F4A7C15


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names the field."""


def _number(raw: Mapping[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingError(f"sampling.{key}: must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise SamplingError(f"sampling.{key}: out of range, got an integer of "
                            f"{int(value).bit_length()} bits") from None


def _integer(raw: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = raw.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(f"sampling.{key}: must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        """Also below float32's smallest normal: such a temperature is 0 or a denormal on the
        logits' device, and the distribution it asks for is the greedy one anyway."""
        return self.temperature < _TINY or self.top_k == 1

    @classmethod
    def parse(cls, raw: Any) -> SamplingParams:
        """From the instance API's ``sampling`` object; absent means greedy. Without a seed one is
        drawn here, once per request, so the request's own stream is still consistent."""
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise SamplingError(f"sampling: must be an object, got {type(raw).__name__}")
        temperature = _number(raw, "temperature", 0.0)
        if not 0.0 <= temperature <= 100.0:
            raise SamplingError(f"sampling.temperature: must be in [0, 100], got {temperature}")
        top_p = _number(raw, "top_p", 1.0)
        if not 0.0 < top_p <= 1.0:
            raise SamplingError(f"sampling.top_p: must be in (0, 1], got {top_p}")
        top_k = _integer(raw, "top_k", 0)
        assert top_k is not None
        if top_k < -1:
            raise SamplingError(f"sampling.top_k: must be -1, 0 (off) or >= 1, got {top_k}")
        seed = _integer(raw, "seed", None)
        if seed is None:
            seed = random.getrandbits(63)
        return cls(temperature, top_p, max(top_k, 0), seed & _MASK63)


def _generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed ^ ((index + 1) * _GOLDEN)) & _MASK63)
    return g


def _filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``logits [V]`` scaled by temperature with everything outside top-k / top-p at -inf."""
    # From the row's maximum down: a temperature as small as 5e-324 then gives 0 and -inf, never
    # inf - inf = nan (which torch.multinomial refuses, stopping the engine loop, and which any
    # draw would turn into a wrong token).
    x = logits.float()
    x = (x - x.max()) / p.temperature
    if 0 < p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= p.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return x


def pick_rows(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``logits[rows]`` without a host sync (a list index is copied to the device with one):
    the rows go up asynchronously on the current stream; all rows in order need no copy."""
    if list(rows) == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, to_device(list(rows), torch.long, logits.device))


def _draw(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One token from ``probs``: the draw ``torch.multinomial(probs, 1, generator=g)`` makes
    (its one-sample path: the argmax of the probabilities over exponential noise), without its
    check of the probabilities on the host, a sync; ``_filtered`` gives finite ones."""
    noise = torch.empty_like(probs).exponential_(1, generator=g)
    return torch.argmax(probs / noise)


def sample_on_device(logits: torch.Tensor, params: Sequence[SamplingParams],
                     indices: Sequence[int]) -> torch.Tensor:
    """One token per row of ``logits [B, V]``, left on the logits' device (int64 ``[B]``) with
    no host sync: the caller reads them when it chooses to wait. ``indices[b]`` is the
    completion index of the token being drawn for row ``b``."""
    out = torch.argmax(logits, dim=-1)
    for b, p in enumerate(params):
        if p.greedy:
            continue
        probs = _filtered(logits[b], p).softmax(-1)
        out[b] = _draw(probs, _generator(p.seed, indices[b], probs.device))
    return out


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           indices: Sequence[int]) -> list[int]:
    """``sample_on_device``, read on the host now."""
    return [int(t) for t in sample_on_device(logits, params, indices).tolist()]
