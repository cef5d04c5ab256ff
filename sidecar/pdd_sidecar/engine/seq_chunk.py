"""The unit of work of one engine step, shared by the eager step (rank_engine.py) and the padded
or graphed decode step (cuda_graphs.py); torch-free, so the worker builds it from its commands
without loading the engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SeqChunk:
    """Tokens of one sequence fed in a step: ``tokens`` at positions ``start..``, every earlier
    position already cached in ``block_ids`` (the sequence's whole table). A decode step is one
    token; a prefill chunk is many."""

    tokens: Sequence[int]
    start: int
    block_ids: Sequence[int]
