"""A prefix-cache hit recomputed in a prefill graph: the continuing chunk becomes its whole
prompt from position 0, its prefix written to scratch blocks (never the cached ones), only when
the result is a step the graphs run."""

from __future__ import annotations

from collections.abc import Sequence

from pdd_sidecar.engine.graphed_hits import (
    prefix_blocks,
    recompute_in_graph,
    scratch_blocks_needed,
)
from pdd_sidecar.engine.seq_chunk import SeqChunk

PROMPT_A = list(range(100, 150))  # 50 tokens
PROMPT_B = list(range(200, 240))  # 40 tokens
SCRATCH = [90, 91, 92, 93, 94, 95]


def always(_: Sequence[SeqChunk]) -> bool:
    return True


def test_a_hit_becomes_its_whole_prompt_with_the_prefix_on_scratch() -> None:
    hit = SeqChunk(PROMPT_A[32:], 32, [7, 8, 9, 10])  # 2 cached blocks of 16 (dcp 1)
    got = recompute_in_graph([hit], [PROMPT_A], 16, SCRATCH, always)
    assert got == [SeqChunk(PROMPT_A, 0, [90, 91, 9, 10])]


def test_several_hits_get_disjoint_scratch_and_fresh_prompts_stay() -> None:
    a = SeqChunk(PROMPT_A[32:], 32, [7, 8, 9, 10])
    fresh = SeqChunk([1, 2, 3], 0, [11])
    b = SeqChunk(PROMPT_B[32:], 32, [7, 8, 12])  # the same cached blocks as a
    got = recompute_in_graph([a, fresh, b], [PROMPT_A, [1, 2, 3], PROMPT_B], 16, SCRATCH,
                             always)
    assert got is not None
    assert got[1] == fresh
    assert got[0].block_ids[:2] == [90, 91] and got[2].block_ids[:2] == [92, 93]
    assert got[2] == SeqChunk(PROMPT_B, 0, [92, 93, 12])
    assert set(b for c in got for b in c.block_ids).isdisjoint({7, 8})  # cached: untouched


def test_dcp_units_map_to_local_blocks() -> None:
    # dcp 2, block 16: a unit is 32 tokens and one local block per rank
    hit = SeqChunk(PROMPT_A[32:], 32, [4, 5])
    got = recompute_in_graph([hit], [PROMPT_A], 32, SCRATCH, always)
    assert got == [SeqChunk(PROMPT_A, 0, [90, 5])]


def test_nothing_to_rewrite_or_no_graph_or_too_little_scratch_keeps_the_step() -> None:
    fresh = SeqChunk([1, 2, 3], 0, [11])
    assert recompute_in_graph([fresh], [[1, 2, 3]], 16, SCRATCH, always) is None
    hit = SeqChunk(PROMPT_A[32:], 32, [7, 8, 9, 10])
    assert recompute_in_graph([hit], [PROMPT_A], 16, SCRATCH, lambda _: False) is None
    assert recompute_in_graph([hit], [PROMPT_A], 16, SCRATCH[:1], always) is None
    ragged = SeqChunk(PROMPT_A[20:], 20, [7, 8, 9, 10])  # a chunk boundary inside a unit
    assert recompute_in_graph([ragged], [PROMPT_A], 16, SCRATCH, always) is None


def test_the_graph_check_sees_the_rewritten_step() -> None:
    seen: list[list[SeqChunk]] = []

    def graphed(chunks: Sequence[SeqChunk]) -> bool:
        seen.append(list(chunks))
        return sum(len(c.tokens) for c in chunks) <= 64

    hit = SeqChunk(PROMPT_A[32:], 32, [7, 8, 9, 10])
    assert recompute_in_graph([hit], [PROMPT_A], 16, SCRATCH, graphed) is not None
    assert [len(c.tokens) for c in seen[-1]] == [50]
    both = [hit, SeqChunk(PROMPT_B[32:], 32, [7, 8, 12])]
    assert recompute_in_graph(both, [PROMPT_A, PROMPT_B], 16, SCRATCH, graphed) is None


def test_scratch_covers_the_largest_bucket_and_prefix_blocks_are_the_cached_ones() -> None:
    assert scratch_blocks_needed(2048, 64) == 32
    assert scratch_blocks_needed(2048, 16 * 2) == 64
    assert scratch_blocks_needed(0, 16) == 0
    chunks = [SeqChunk(PROMPT_A[32:], 32, [7, 8, 9]), SeqChunk([1], 0, [11])]
    assert prefix_blocks(chunks, 16) == [7, 8]
