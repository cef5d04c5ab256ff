"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the text's
ending, for any model and at no model cost.

Repetitive output (code edits, quoting, extraction, JSON echoing the prompt) is where drafts
get accepted; a text whose ending never occurred before gets no draft, so the step is an
ordinary decode step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


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


# A first feed at least this long (a prompt) is indexed in bulk: a Python dict of every n-gram
# of a 128k-token prompt took 1.2 s of the driver's thread (every running sequence waited) and
# 65 MiB; the arrays take a few hundredths of that.
BULK_TOKENS = 1024
_MASK = (1 << 64) - 1
_P = 0x100000001B3  # odd: the polynomial hash of an n-gram, mod 2**64


def _hash(tokens: Sequence[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * _P + t + 1) & _MASK
    return h


class NgramIndex:
    """``propose`` for a text that only grows, at a cost per step independent of its length:
    every n-gram (``min_n`` .. ``max_n`` tokens) that has a follower maps to its latest start,
    updated as tokens are appended. A decode step drafts for every running sequence; a scan of
    a few thousand tokens in Python per sequence per step would cost more than the step.

    A long first feed (the prompt) goes into sorted arrays of the n-grams' 64-bit hashes and
    latest starts (numpy, vectorised); what follows into a dict. A hash found is checked
    against the text, so a collision only costs a draft."""

    def __init__(self, cfg: NgramConfig) -> None:
        self.cfg = cfg
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}
        self._bulk: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # n -> (hashes, starts)

    def extend(self, tokens: Sequence[int]) -> None:
        if not self.tokens and len(tokens) >= BULK_TOKENS:
            self._index_bulk(tokens)
            return
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

    def _index_bulk(self, tokens: Sequence[int]) -> None:
        """Every n-gram of ``tokens`` with a follower in them: its hash and latest start."""
        self.tokens.extend(tokens)
        arr = np.asarray(tokens, dtype=np.uint64) + np.uint64(1)
        size = len(arr)
        h = np.zeros(size, dtype=np.uint64)
        for n in range(1, self.cfg.max_n + 1):
            # h[s]: the hash of tokens[s : s + n]
            h = h[:size - n + 1] * np.uint64(_P) + arr[n - 1:]
            if n < self.cfg.min_n or size - n < 1:
                continue
            starts = h[:size - n]  # those with a follower
            order = np.argsort(starts, kind="stable")  # equal hashes: starts ascending
            ordered = starts[order]
            last = np.ones(len(ordered), dtype=bool)
            last[:-1] = ordered[1:] != ordered[:-1]
            self._bulk[n] = (ordered[last], order[last])

    def _bulk_start(self, n: int, tail: list[int]) -> int | None:
        found = self._bulk.get(n)
        if found is None:
            return None
        hashes, starts = found
        key = np.uint64(_hash(tail))
        i = int(np.searchsorted(hashes, key))
        if i == len(hashes) or hashes[i] != key:
            return None
        s = int(starts[i])
        return s if self.tokens[s:s + n] == tail else None

    def _start(self, n: int) -> int | None:
        """The latest start of an earlier occurrence of the text's last ``n`` tokens."""
        tail = self.tokens[len(self.tokens) - n:]
        s = self._latest.get(tuple(tail))  # later than any of the bulk's
        return self._bulk_start(n, tail) if s is None else s

    def propose(self, k: int | None = None) -> list[int]:
        """What ``propose(self.tokens, cfg)`` returns, at most ``k`` tokens (default cfg.k).

        An ending that never occurred before has no longer ending that did (an occurrence of
        the longer one holds one of the shorter), so the longest that did is found by
        bisection: about log2(``max_n``) + 1 lookups instead of up to ``max_n``."""
        toks, cfg = self.tokens, self.cfg
        k = cfg.k if k is None else k
        lo, hi = cfg.min_n, min(cfg.max_n, len(toks) - 1)
        if hi < lo:
            return []
        best: tuple[int, int] | None = None  # (n, start) of the longest ending found so far
        while lo <= hi:
            n = (lo + hi) // 2
            s = self._start(n)
            if s is None:
                hi = n - 1
            else:
                best, lo = (n, s), n + 1
        if best is None:
            return []
        n, s = best
        return toks[s + n:s + n + k]


__all__ = ["NgramConfig", "NgramIndex", "propose"]
