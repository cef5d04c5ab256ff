"""Decode steps at bucketed batch sizes: static inputs, padding, and one CUDA graph per bucket.

A decode-only step (every chunk one token of a cached sequence) of ``n`` sequences is padded to
the smallest bucket ``B >= n``. Its inputs go into per-bucket static device buffers; the step is
captured once per bucket and replayed afterwards, so a step costs one graph launch instead of
thousands of kernel launches. Prefill chunks, mixed steps, batches above the largest bucket and
tables longer than the width bound run eagerly, as does everything on the CPU.

Padded rows feed token 0 at position 0 with a KV length of 0: the paged decode kernel gives them
output 0 and LSE ``-inf`` (weight 0 in the DCP merge), and their latents are not written (the
store is masked, so they never touch another sequence's KV and allocate nothing). Rows a DCP rank
does not hold are masked the same way. The only cost of padding is the padded rows' compute.

The padded step also runs eagerly (``decode_mode="padded"``): that is the CPU twin of the graph
path, which the dataplane tests check against the unpadded batch.

A step of fresh prompts only (up to ``PREFILL_MAX_PROMPTS`` of them, ``PREFILL_BUCKETS[-1]`` tokens
in all) is padded the same way, to the smallest prefill bucket that holds its tokens, and replayed
as a graph too. Eager, such a step is the host launching ~1,500 kernels: on an H200 a 1k-token
prompt took 38-67 ms (the time drifting with the host's speed) for ~22 ms of device work, and a
burst of 64 short prompts 53-120 ms. The prompts attend through the varlen kernel, each over
itself (a segment start per token); padded tokens come after them as a segment of their own, so
no real token sees them; their latents are not written, and the logits are each prompt's last
token's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.kv import cache as kvc
from pdd_sidecar.switch import switch

# Listed in env.py with every other variable; named here too so the engine (and what imports it
# on GPU machines: the benches, generate) needs nothing of the operator's packages.
PDD_CUDA_GRAPHS = "PDD_CUDA_GRAPHS"
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Prompt lengths of the prefill graphs: fine enough that padding wastes at most a third of a step,
# up to where a step is device-bound (8k: 135 ms of device time, host launches hidden under it).
PREFILL_BUCKETS: tuple[int, ...] = (32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
PREFILL_MAX_PROMPTS = 64  # prompts of one graphed prefill step (logits rows it computes)
DECODE_MODES = ("eager", "padded", "graph")


def graphs_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``PDD_CUDA_GRAPHS``: ``1`` (default) or ``0``; anything else is a configuration error
    that names the variable."""
    return switch(os.environ if env is None else env, PDD_CUDA_GRAPHS, True)


def default_decode_mode(device: torch.device, env: Mapping[str, str] | None = None) -> str:
    """The setting is checked on every device, so a typo fails on the CPU too. ``padded``
    runs the graphs' padded steps eagerly on any device: the CPU twin of graphs, for tests."""
    if (os.environ if env is None else env).get(PDD_CUDA_GRAPHS) == "padded":
        return "padded"
    enabled = graphs_enabled(env)
    return "graph" if device.type == "cuda" and enabled else "eager"


def check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    out = tuple(sorted(set(int(b) for b in buckets)))
    if not out or out[0] < 1:
        raise ValueError(f"graph buckets must be positive batch sizes, got {list(buckets)}")
    return out


def table_width(num_blocks: int, max_positions: int, block_size: int, dcp: int) -> int:
    """The bound on blocks per sequence the static tables are wide: what the longest sequence the
    model takes needs, but no more than the cache has. Longer tables fall back to eager."""
    need = kvc.num_table_blocks(max(1, max_positions), block_size, dcp)
    return max(1, min(num_blocks, need))


@dataclass
class StaticDecode:
    """One bucket's inputs, all on the device; the captured graph reads them in place."""

    tokens: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    write_blocks: torch.Tensor  # [B] int64: the block id of the new token's slot on this rank
    write_offsets: torch.Tensor  # [B] int64
    write_mask: torch.Tensor  # [B] int32: 1 where this rank stores the new token's latent
    tables: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32: tokens this rank holds, the new one included
    logits: torch.Tensor | None = None  # [B, V] fp32, the graph's output (rank 0 only)
    graph: torch.cuda.CUDAGraph | None = None
    width_used: int = 0  # table columns the last step filled (later columns may be stale)
    num_splits: int | None = None  # the decode kernel's, fixed per bucket (None: its default)
    hidden: torch.Tensor | None = None  # [B, H]: rows' given hidden states (hidden_from)

    @classmethod
    def empty(cls, batch: int, width: int, device: torch.device) -> StaticDecode:
        def z(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(z(batch), z(batch), z(batch), z(batch), z(batch, dtype=torch.int32),
                   z(batch, width, dtype=torch.int32), z(batch, dtype=torch.int32))


@dataclass
class StaticPrefill:
    """One prefill bucket's inputs (fresh prompts, ``B`` tokens in all with the padding, at most
    ``P`` prompts), on the device."""

    tokens: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64: each token's position in its prompt
    seg_start: torch.Tensor  # [B] int32: the row of its prompt's first token
    write_blocks: torch.Tensor  # [B] int64
    write_offsets: torch.Tensor  # [B] int64
    write_mask: torch.Tensor  # [B] int32: 1 where this rank stores the token's latent
    last: torch.Tensor  # [P] int64: the row of each prompt's last token (0 past the prompts)

    @classmethod
    def empty(cls, tokens: int, prompts: int, device: torch.device) -> StaticPrefill:
        def z(n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device)

        return cls(z(tokens), z(tokens), z(tokens, torch.int32), z(tokens), z(tokens),
                   z(tokens, torch.int32), z(prompts))


def stage_prefill(buf: StaticPrefill, chunks: Sequence[SeqChunk], block_size: int, dcp: int,
                  rank: int) -> None:
    """Fill ``buf`` for fresh prompts (checked by the caller): their tokens one after the other,
    each at positions 0.. of its own segment, this rank's chunks' slots; the padded rows are one
    segment after them, token 0 at position 0, with no slot."""
    bucket = buf.tokens.shape[0]
    head = torch.zeros(6, bucket, dtype=torch.int64)
    last = torch.zeros(buf.last.shape[0], dtype=torch.int64)
    row = 0
    for i, c in enumerate(chunks):
        n = len(c.tokens)
        pos = torch.arange(n, dtype=torch.int64)
        chunk_ids = pos // block_size
        mine = (chunk_ids % dcp == rank) if dcp > 1 else torch.ones(n, dtype=torch.bool)
        table = torch.tensor(list(c.block_ids), dtype=torch.int64)
        rows = slice(row, row + n)
        head[0, rows] = torch.tensor(list(c.tokens), dtype=torch.int64)
        head[1, rows] = pos
        head[2, rows] = row
        head[3, rows] = torch.where(mine, table[chunk_ids // dcp], 0)
        head[4, rows] = pos % block_size
        head[5, rows] = mine.to(torch.int64)
        row += n
        last[i] = row - 1
    head[2, row:] = row
    _copy_rows(head, [buf.tokens, buf.positions, buf.seg_start, buf.write_blocks,
                      buf.write_offsets, buf.write_mask])
    buf.last.copy_(last.to(buf.last.device, non_blocking=True))


def _copy_rows(head: torch.Tensor, bufs: Sequence[torch.Tensor]) -> None:
    """Row i of the host tensor ``head`` into ``bufs[i]``: one host-to-device copy, then a
    copy on the device per buffer."""
    head = head.to(bufs[0].device, non_blocking=True)
    for row, buf in zip(head, bufs, strict=True):
        buf.copy_(row)


def stage(
    buf: StaticDecode,
    chunks: Sequence[SeqChunk],
    block_size: int,
    dcp: int,
    rank: int,
) -> None:
    """Fill ``buf`` for ``chunks`` (decode tokens, checked by the caller): host arithmetic, one
    host tensor, a few copies. Rows past ``len(chunks)`` get the padding described above."""
    n, batch = len(chunks), buf.tokens.shape[0]
    width = max(len(c.block_ids) for c in chunks)
    pad = batch - n
    tok, pos, blk, off, mask, lens = [], [], [], [], [], []
    rows: list[list[int]] = []
    for c in chunks:
        p = c.start
        g = p // block_size
        tok.append(int(c.tokens[0]))
        pos.append(p)
        mine = dcp == 1 or g % dcp == rank
        blk.append(int(c.block_ids[g // dcp]) if mine else 0)
        off.append(p % block_size)
        mask.append(1 if mine else 0)
        lens.append(kvc.local_token_count(p + 1, block_size, dcp, rank))
        ids = list(c.block_ids)
        rows.append(ids + [0] * (width - len(ids)))
    zeros = [0] * pad
    head = torch.tensor([tok + zeros, pos + zeros, blk + zeros, off + zeros, mask + zeros,
                         lens + zeros], dtype=torch.int64)
    dev = buf.tokens.device
    _copy_rows(head, [buf.tokens, buf.positions, buf.write_blocks, buf.write_offsets,
                      buf.write_mask, buf.seq_lens])
    # Only the columns this step needs: a row never reads past its length, and padded rows have
    # length 0, so columns and rows beyond are never read and may hold an earlier step's ids.
    buf.tables[:n, :width].copy_(torch.tensor(rows, dtype=torch.int32).to(dev, non_blocking=True))
    buf.width_used = width


__all__ = [
    "DECODE_MODES",
    "DEFAULT_BUCKETS",
    "PREFILL_BUCKETS",
    "PREFILL_MAX_PROMPTS",
    "StaticDecode",
    "StaticPrefill",
    "check_buckets",
    "default_decode_mode",
    "graphs_enabled",
    "stage",
    "stage_prefill",
    "table_width",
]
