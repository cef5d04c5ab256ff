"""Which drafted tokens a verify step keeps: lossless by construction.

The verify step scores the sequence's last token and its ``k`` drafts in one pass, giving the
target distribution at ``k + 1`` positions. Each position's token is then drawn exactly as an
ordinary decode step would draw it (greedy, or the sampler seeded by the request's seed and the
token's index, ``engine/sampling.py``), and the drafts are kept while they equal those draws.
The first draw that differs from its draft is kept too (it is the token a plain step would have
produced there), and every later position is thrown away, since its distribution was conditioned
on a rejected draft. If all ``k`` drafts match, the draw at position ``k + 1`` is a bonus token.

So the output is token for token the output without speculation, greedy or sampled with a seed,
whatever the drafts were; for a draft that is a single token (n-gram, a greedy MTP head) this is
the speculative-sampling papers' rule with the draft's distribution a point mass: a draft ``d``
survives with probability ``p(d)``, and a rejected position emits a token drawn from ``p``
without ``d`` (the draw differs from ``d``).
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_tokens(drafts: Sequence[int], draws: Sequence[int]) -> list[int]:
    """The tokens a verify step emits: ``draws`` is the sampler's token at each of the
    ``len(drafts) + 1`` positions; returns 1 to ``len(drafts) + 1`` tokens."""
    if len(draws) != len(drafts) + 1:
        raise ValueError(f"need {len(drafts) + 1} draws for {len(drafts)} drafts, got {len(draws)}")
    out: list[int] = []
    for d, t in zip(drafts, draws, strict=False):
        out.append(t)
        if t != d:
            return out
    out.append(draws[-1])
    return out


__all__ = ["accepted_tokens"]
