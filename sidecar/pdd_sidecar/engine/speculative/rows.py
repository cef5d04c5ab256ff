"""A verify step's rows as the sampler sees them: each position drawn exactly as a plain decode
step would draw it there.

A sequence with drafts ``d1..dk`` fed at position ``p`` is ``k + 1`` one-token rows of the step
(positions ``p..p+k``, one table): the paged decode kernel gives row ``j`` the keys up to
``p + j``, the drafts' latents included (every row's latent is stored before the layer attends),
so row ``j``'s logits are the model's next-token distribution after the text and ``d1..dj``.
Row ``j`` is then sampled as plain decoding samples completion token ``i + j``: the same
seeded generator (``engine/sampling.py``: seeded by the request's seed and the token's index),
the controls over the history with ``d1..dj`` appended (penalties, ``min_tokens``), and under
structured output the mask of the grammar advanced by ``d1..dj``. Only then does
``verify.accepted_tokens`` keep the drafts that equal those draws: the output is plain
decoding's, token for token, whatever was drafted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdd_sidecar.engine.sampling import TokenHistory


def grammar_drafts(grammar: Any, drafts: Sequence[int]) -> tuple[list[int], list[Any]]:
    """``drafts`` cut before the first one the grammar refuses or that completes it (a
    completed grammar ends the sequence there, so nothing after it is drawn), with the
    grammar's state at each of the ``len(kept) + 1`` positions: the sequence's own matcher
    first (left untouched), then copies advanced by each kept draft. ``grammar``: an
    ``engine/grammar_mask.Constrained``."""
    states = [grammar]
    kept: list[int] = []
    cur = None
    for d in drafts:
        nxt = (grammar.matcher if cur is None else cur).deep_copy()
        if not nxt.consume_token(d) or nxt.is_stopped():
            break
        cur = nxt
        kept.append(d)
        states.append(grammar._replace(matcher=nxt))
    return kept, states


def row_histories(history: TokenHistory | None, drafts: Sequence[int]
                  ) -> list[TokenHistory | None]:
    """The history each of the ``len(drafts) + 1`` rows is sampled with: row ``j`` as if
    ``drafts[:j]`` were generated (None stays None: the row asks for no control)."""
    if history is None:
        return [None] * (len(drafts) + 1)
    return [history if j == 0 else history._replace(generated=[*history.generated, *drafts[:j]])
            for j in range(len(drafts) + 1)]


__all__ = ["grammar_drafts", "row_histories"]
