"""A prefix-cache hit whose remainder would run eagerly runs as a graphed fresh prompt instead.

Why: a continuing chunk (a prompt whose first blocks came from the prefix cache) cannot use the
prefill graphs, which hold fresh prompts only, so its step launches every layer's kernels one by
one. On one H200 a chat turn of 128-token prompts took 131 ms to its first token with the
cache against 48 ms without (bench/prefix_cache.py): the launches cost more than the cached
tokens saved. Where the whole prompt fits a prefill graph, computing it again in the graph is
the faster step, so the hit is "never slower than a miss".

The recomputed prefix must not be written over the cached blocks other sequences read: its
local blocks are swapped for scratch blocks the driver keeps for this alone (never cached,
never handed out), and the sequence keeps the cached blocks in its own table. The rewritten step
is a fresh prompt in every respect, so its tokens are those of a cache miss. Pure and
torch-free: the driver applies it to a step's chunks before it broadcasts them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdd_sidecar.engine.seq_chunk import SeqChunk


def scratch_blocks_needed(largest_bucket: int, unit: int) -> int:
    """Local blocks the recomputed prefixes of one step may need: a step holds at most the
    largest prefill bucket's tokens, and prefixes are whole units (block_size x dcp)."""
    return largest_bucket // unit if largest_bucket and unit else 0


def recompute_in_graph(chunks: Sequence[SeqChunk], prompts: Sequence[Sequence[int]],
                       unit: int, scratch: Sequence[int],
                       graphed: Callable[[Sequence[SeqChunk]], bool]) -> list[SeqChunk] | None:
    """``chunks`` with every continuing chunk replaced by its whole prompt from position 0, the
    prefix's local blocks taken from ``scratch``; None when that is not a step ``graphed``
    runs padded (or replays), when a chunk's prefix is not whole units (``unit`` = block_size x
    dcp tokens), or when there is nothing to rewrite. ``prompts[i]`` is chunk i's prompt."""
    if all(c.start == 0 for c in chunks):
        return None
    free = list(scratch)
    out: list[SeqChunk] = []
    for chunk, prompt in zip(chunks, prompts, strict=True):
        if chunk.start == 0:
            out.append(chunk)
            continue
        if chunk.start % unit:
            return None
        local = chunk.start // unit
        if local > len(free) or len(chunk.block_ids) < local:
            return None
        table = [*free[:local], *chunk.block_ids[local:]]
        free = free[local:]
        out.append(SeqChunk([*prompt[:chunk.start], *chunk.tokens], 0, table))
    return out if graphed(out) else None


def prefix_blocks(chunks: Sequence[SeqChunk], unit: int) -> list[int]:
    """The cached blocks the continuing chunks read (their prefixes): what a rewritten step no
    longer reads but its hand-off still does."""
    return [b for c in chunks for b in c.block_ids[:c.start // unit]]
