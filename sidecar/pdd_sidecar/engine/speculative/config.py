"""How an instance speculates: the method, the drafts per step, and when it stops paying.

One object, built from the instance's settings (env.py) or by a bench or test directly; the
driver asks nothing else. Bad values fail at construction with a message naming the setting.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd_sidecar.engine.speculative.ngram import NgramConfig

METHODS = ("ngram",)  # "mtp" joins once the MTP head is loaded (issue 47 item 1)

# Above this many running sequences a decode step verifies no drafts. A verify step runs k + 1
# rows per drafting sequence through the same decode kernel as plain decoding (one CUDA graph
# bucket per row count); at small batch a decode step reads every weight for a handful of rows
# and the extra rows are nearly free, while at large batch the step is compute- and
# KV-read-bound and rows cost about their share. Set from bench/speculative.py (the batch at
# which the verify step's time over the expected accepted tokens at 81 % acceptance, k = 1,
# stops beating plain decoding on one H100, V2-Lite width); printed by that bench as
# "break-even batch".
DEFAULT_MAX_BATCH = 16

# A sequence whose recent acceptance (an EMA of accepted / drafted tokens over its verify
# steps) falls below this drafts nothing for ``DEFAULT_PAUSE_STEPS`` steps, then tries again
# (text turns repetitive and back). At k = 1 a draft pays when the verify row costs less than
# the acceptance it buys; a few percent is below anything that pays at any batch.
DEFAULT_MIN_ACCEPTANCE = 0.1
DEFAULT_EMA_DECAY = 0.5  # weight of the past in the acceptance EMA, per verify step
DEFAULT_PAUSE_STEPS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method`` drafts ``tokens`` tokens per sequence per decode step (n-gram: the longest
    ending of ``ngram_min`` .. ``ngram_max`` tokens that occurred before); speculation is off
    for a step of more than ``max_batch`` running sequences, and per sequence while its
    acceptance EMA is below ``min_acceptance``."""

    method: str = "ngram"
    tokens: int = 3
    ngram_max: int = 4
    ngram_min: int = 1
    max_batch: int = DEFAULT_MAX_BATCH
    min_acceptance: float = DEFAULT_MIN_ACCEPTANCE
    ema_decay: float = DEFAULT_EMA_DECAY
    pause_steps: int = DEFAULT_PAUSE_STEPS

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative.method: must be one of {', '.join(METHODS)}, got "
                             f"{self.method!r}")
        self.ngram  # checks tokens, ngram_min, ngram_max  # noqa: B018
        if self.max_batch < 0:
            raise ValueError(f"speculative.max_batch: must be >= 0, got {self.max_batch}")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"speculative.min_acceptance: must be in [0, 1], got "
                             f"{self.min_acceptance}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"speculative.ema_decay: must be in [0, 1), got {self.ema_decay}")
        if self.pause_steps < 0:
            raise ValueError(f"speculative.pause_steps: must be >= 0, got {self.pause_steps}")

    @property
    def ngram(self) -> NgramConfig:
        return NgramConfig(k=self.tokens, max_n=self.ngram_max, min_n=self.ngram_min)

    @classmethod
    def from_settings(cls, method: str | None, tokens: int | None,
                      **more: int | float) -> SpeculativeConfig | None:
        """What the instance's settings ask for: None when ``method`` is unset or ``"off"``
        (no speculation); the other settings default as above."""
        if method in (None, "", "off"):
            return None
        return cls(method=method, tokens=3 if tokens is None else int(tokens),
                   **more)  # type: ignore[arg-type]


__all__ = ["DEFAULT_MAX_BATCH", "METHODS", "SpeculativeConfig"]
