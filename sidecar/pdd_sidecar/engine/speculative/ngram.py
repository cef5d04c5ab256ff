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


class NgramIndex:
    """``propose`` for a text that only grows, at a cost per step independent of its length:
    every n-gram (``min_n`` .. ``max_n`` tokens) that has a follower maps to its latest start,
    updated as tokens are appended. A decode step drafts for every running sequence; a scan of
    a few thousand tokens in Python per sequence per step would cost more than the step."""

    def __init__(self, cfg: NgramConfig) -> None:
        self.cfg = cfg
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        toks, latest = self.tokens, self._latest
        lo, hi = self.cfg.min_n, self.cfg.max_n
        for t in tokens:
            toks.append(t)
            end = len(toks) - 1  # the n-grams ending just before the new token now have it
            for n in range(lo, hi + 1):
                s = end - n
                if s < 0:
                    break
                latest[tuple(toks[s:end])] = s

    def propose(self, k: int | None = None) -> list[int]:
        """What ``propose(self.tokens, cfg)`` returns, at most ``k`` tokens (default cfg.k)."""
        toks, cfg = self.tokens, self.cfg
        k = cfg.k if k is None else k
        n_tok = len(toks)
        for n in range(min(cfg.max_n, n_tok - 1), cfg.min_n - 1, -1):
            s = self._latest.get(tuple(toks[n_tok - n:]))
            if s is not None:
                return toks[s + n:s + n + k]
        return []


__all__ = ["NgramConfig", "NgramIndex", "propose"]
