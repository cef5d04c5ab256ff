"""Which kernel runs paged MLA decode attention on CUDA: the Triton kernel (mla_decode.py, always
there) or FlashMLA's dense bf16 kernel (the optional ``sgl-flash-mla`` wheel, SM90), chosen once
per process from ``PDD_ATTENTION_BACKEND`` and logged.

- ``triton``: the Triton kernel everywhere.
- ``flashmla``: FlashMLA wherever it takes the call (bf16 cache, 64-token blocks, 512 + 64
  latents); a start-up error if the wheel does not load or the GPU is not SM90.
- ``auto`` (default): FlashMLA only at the shapes where it beat the Triton kernel in the same-run
  bench (``bench/decode_attention.py``, H100): at least ``FLASHMLA_MIN_HEADS`` query heads a
  rank (1.11x at 128 heads x 1 x 32k, 2.45x at 128 x 64 x 4k); with 16 heads (V2-Lite, or V3's
  128 over TP 8) Triton was faster at every shape (FlashMLA's time 1.04-4.2x Triton's). Triton
  also for FP8 caches (FlashMLA's dense FP8 kernel takes a per-tensor-scaled 576-byte token, not
  pdd's 656-byte layout) and wherever the wheel is missing.

The rule reads shapes only (batch, heads), never the lengths' values, so a captured graph keeps
its kernel.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Final

import torch

from pdd_sidecar.model.kernels import flashmla_decode

log = logging.getLogger(__name__)

ENV: Final = "PDD_ATTENTION_BACKEND"
CHOICES: Final = ("auto", "flashmla", "triton")
# From bench/decode_attention.py on an H100 (the module's docstring gives the figures).
FLASHMLA_MIN_HEADS = 64


def flashmla_wins(batch: int, heads: int) -> bool:
    """Whether ``auto`` sends a ``batch x heads`` decode to FlashMLA; the measured winner
    depended on the heads only."""
    return heads >= FLASHMLA_MIN_HEADS


@dataclass(frozen=True)
class DecodeBackend:
    choice: str
    module: ModuleType | None = None  # flash_mla, when it loaded

    def use_flashmla(
        self, q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int
    ) -> bool:
        if self.module is None or not q.is_cuda:
            return False
        if not flashmla_decode.supports(kv_cache, kv_lora_rank):
            return False
        return self.choice == "flashmla" or flashmla_wins(q.shape[0], q.shape[1])

    @property
    def summary(self) -> str:
        if self.module is None:
            return f"{ENV}={self.choice}: Triton"
        if self.choice == "flashmla":
            return f"{ENV}=flashmla: FlashMLA for bf16 caches, Triton for FP8"
        return (
            f"{ENV}=auto: FlashMLA for bf16 caches at >= {FLASHMLA_MIN_HEADS} heads, "
            f"Triton otherwise and for FP8"
        )


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def load_backend(
    choice: str | None = None,
    importer: Callable[[str], ModuleType] = importlib.import_module,
    sm90: Callable[[], bool] = _sm90,
) -> DecodeBackend:
    """The backend for ``choice`` (default: the environment's, else ``auto``), logged."""
    value = choice if choice is not None else os.environ.get(ENV, "auto")
    if value not in CHOICES:
        raise ValueError(f"{ENV} {value!r} is not one of {', '.join(CHOICES)}")
    backend = DecodeBackend(value)
    if value != "triton":
        why = ""
        try:
            module = importer("flash_mla")
        except (ImportError, OSError) as e:
            why = f"flash_mla does not import ({e}); install it with pip install 'pdd[flashmla]'"
        else:
            if not sm90():
                why = "FlashMLA's dense kernel runs on SM90 (H100/H200) only"
            else:
                backend = DecodeBackend(value, module)
        if why and value == "flashmla":
            raise RuntimeError(f"{ENV}=flashmla: {why}")
        if why:
            log.info("decode attention: %s; using Triton", why)
    log.info("decode attention: %s", backend.summary)
    return backend


_CURRENT: DecodeBackend | None = None


def current() -> DecodeBackend:
    """The process's backend, chosen at the first CUDA decode (the engine's start-up warm-up)."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = load_backend()
    return _CURRENT


def set_current(backend: DecodeBackend | None) -> None:
    """Pin the backend (tests, benches); ``None`` chooses again from the environment."""
    global _CURRENT
    _CURRENT = backend


__all__ = [
    "CHOICES",
    "ENV",
    "DecodeBackend",
    "current",
    "flashmla_wins",
    "load_backend",
    "set_current",
]
