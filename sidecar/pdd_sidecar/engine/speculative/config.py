"""How an instance speculates: the method, the drafts per step, and when it stops paying.

One object, built from the instance's settings (env.py) or by a bench or test directly; the
driver asks nothing else. Bad values fail at construction with a message naming the setting.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd_sidecar.engine.speculative.backoff import PauseBackoff
from pdd_sidecar.engine.speculative.ngram import NgramConfig

# "mtp": DeepSeek-V3's MTP module drafts (engine/speculative/mtp.py); refused at load for a
# checkpoint without one (model/mtp.py load_mtp_rank_model)
METHODS = ("ngram", "mtp")
DEFAULT_TOKENS = {"ngram": 3, "mtp": 1}  # MTP: one module, chained for more (acceptance drops)

# Above this many running sequences a decode step verifies no drafts. A verify step runs k + 1
# rows per drafting sequence through the same decode kernel as plain decoding (one CUDA graph
# bucket per row count, the largest 256 rows: 64 sequences at k = 3; more rows run eagerly).
# Set from bench/speculative.py on one H100 (V2-Lite width, 512-token contexts): at 81 %
# acceptance the modelled TPOT beat plain decoding at every measured batch up to 64 for k = 1,
# 2, 3 (1.34-2.7x; printed as "break-even batch ... above 64"), and the verify step of 64
# sequences cost 1.07-1.21x a plain step.
DEFAULT_MAX_BATCH = 64

# A sequence whose recent acceptance (an EMA of accepted / drafted tokens over its verify
# steps) falls below this drafts nothing for ``DEFAULT_PAUSE_STEPS`` steps, then tries one
# verify step again (text turns repetitive and back); each probe that misses as well doubles
# the pause up to ``DEFAULT_PAUSE_MAX_STEPS`` (engine/speculative/backoff.py). Set from
# bench/speculative.py's modelled curve on one H100: at batch 1-16 a verify step costs
# 1.25-1.8x a plain one (each extra row also routes to its own experts), so speculation pays
# from about 25 % (k = 1) to 40 % (k = 3) acceptance; at batch 32-64 from about 10 %.
DEFAULT_MIN_ACCEPTANCE = 0.35
DEFAULT_EMA_DECAY = 0.5  # weight of the past in the acceptance EMA, per verify step
DEFAULT_PAUSE_STEPS = 32
# Each probe after a pause that misses again doubles the pause, up to this many steps
# (engine/speculative/backoff.py): a sequence that never gets a draft right then costs about
# one verify step per 1024 steps (under 0.1 % of TPOT at a verify step of 1.6x a plain one).
DEFAULT_PAUSE_MAX_STEPS = 1024


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method`` drafts ``tokens`` tokens per sequence per decode step (n-gram: the longest
    ending of ``ngram_min`` .. ``ngram_max`` tokens that occurred before; mtp: the MTP module's
    greedy guesses, chained on its own output past the first); speculation is off
    for a step of more than ``max_batch`` running sequences, and per sequence while its
    acceptance EMA is below ``min_acceptance`` (``pause_steps``, doubled per failed probe up
    to ``pause_max_steps``)."""

    method: str = "ngram"
    tokens: int = 3
    ngram_max: int = 4
    ngram_min: int = 1
    max_batch: int = DEFAULT_MAX_BATCH
    min_acceptance: float = DEFAULT_MIN_ACCEPTANCE
    ema_decay: float = DEFAULT_EMA_DECAY
    pause_steps: int = DEFAULT_PAUSE_STEPS
    pause_max_steps: int = DEFAULT_PAUSE_MAX_STEPS

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
        self.backoff  # checks pause_steps, pause_max_steps  # noqa: B018

    @property
    def ngram(self) -> NgramConfig:
        return NgramConfig(k=self.tokens, max_n=self.ngram_max, min_n=self.ngram_min)

    @property
    def backoff(self) -> PauseBackoff:
        return PauseBackoff(self.pause_steps, self.pause_max_steps)

    @classmethod
    def from_settings(cls, method: str | None, tokens: int | None,
                      **more: int | float) -> SpeculativeConfig | None:
        """What the instance's settings ask for: None when ``method`` is unset or ``"off"``
        (no speculation); the other settings default as above."""
        if method in (None, "", "off"):
            return None
        default = DEFAULT_TOKENS.get(method, 3)
        return cls(method=method, tokens=default if tokens is None else int(tokens),
                   **more)  # type: ignore[arg-type]


__all__ = ["DEFAULT_MAX_BATCH", "METHODS", "SpeculativeConfig"]
