"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the text's
ending, for any model and at no model cost.

Repetitive output (code edits, quoting, extraction, JSON echoing the prompt) is where drafts
get accepted; a text whose ending never occurred before gets no draft, so the step is an
ordinary decode step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NgramConfig:
    """``k`` tokens drafted from the longest matching ending of ``min_n`` .. ``max_n`` tokens."""

    k: int = 3
    max_n: int = 4
    min_n: int = 1

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"speculative.tokens: must be >= 1, got {self.k}")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(
                f"speculative.ngram: need 1 <= min_n <= max_n, got min_n {self.min_n}, "
                f"max_n {self.max_n}"
            )


def propose(tokens: Sequence[int], cfg: NgramConfig) -> list[int]:
    """Up to ``cfg.k`` draft tokens continuing ``tokens`` (prompt and output so far); ``[]`` when
    no ending of ``min_n`` or more tokens occurred earlier. Longer endings win; among equal
    lengths the latest occurrence wins (recent text predicts best)."""
    n_tok = len(tokens)
    for n in range(min(cfg.max_n, n_tok - 1), cfg.min_n - 1, -1):
        tail = list(tokens[n_tok - n:])
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start] == tail[0] and list(tokens[start:start + n]) == tail:
                follow = tokens[start + n:start + n + cfg.k]
                if follow:
                    return list(follow)
    return []


__all__ = ["NgramConfig", "propose"]
