"""Drafts from DeepSeek-V3's MTP module (model/mtp.py), run by the engine beside the main model.

The module is one more decoder layer: position ``i`` reads the main model's final normed hidden
state ``h_i`` and the token at ``i + 1`` and predicts the token at ``i + 2``. Its latent KV is
one more layer of the main paged cache, after the main layers (``new_cache(...,
extra_layers=1)``): the same block table and DCP split (each rank stores the module's latents of
the blocks it stores for the main layers), one allocator, a block's bytes counting the module's
latents, and a block that moves (a hand-off, the host tier) carrying them with the rest.

After each verify step the engine hands the drafter the main model's hidden states of the
positions whose tokens are now known (the fed token and the accepted drafts) with the tokens
that follow them; the module runs over those positions (writing its KV there) and the argmax
of its logits at the last one is draft 1. Draft ``j + 1`` chains the module on its own output
(its hidden state before the shared head's norm, as vLLM feeds it back) and draft ``j``, one
position on; those chained positions' KV is overwritten by the next step's run from the main
model's hidden states. A draft is a greedy guess: the verify step's keep rule
(engine/speculative/verify.py) keeps the output plain decoding's whatever it drafts.

In a decode step the module runs over a few positions per sequence (the fed token and the
kept drafts, then one per chained draft): those run as one-token rows through the paged decode
kernel, as a verify step's rows do, padded to a batch bucket and on CUDA replayed from a graph
of the module's own (``RankEngine.hidden_from``; captured by ``warm_up``, in the main model's
graph memory pool). A prompt's positions (a prefill's, or a prompt prefilled on the decode)
run as chunks, eagerly.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import torch

from pdd_sidecar.engine.comm import Comm
from pdd_sidecar.engine.cuda_graphs import DEFAULT_BUCKETS
from pdd_sidecar.engine.device_queue import to_device
from pdd_sidecar.engine.rank_engine import RankEngine
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.kv.cache import PagedKVCache
from pdd_sidecar.model.kernels.norm_rope import rms_norm
from pdd_sidecar.model.mtp import MTPWeights, load_mtp_rank_model, mtp_input
from pdd_sidecar.model.rank_model import RankModel

# A chunk of at most this many positions after cached ones runs as one-token rows (a decode
# step's: the fed token and up to k kept drafts); longer ones (a prompt's) as a chunk.
ROWS_MAX = 8


class MTPDrafter:
    """One rank's MTP module and its KV; every rank of the instance makes the same calls (the
    module's layer is TP-sharded like a main one, and its collectives meet the other ranks')."""

    def __init__(self, weights: MTPWeights, model: RankModel, main_cache: PagedKVCache,
                 comm: Comm, dcp: int, main_layers: int, like: RankEngine | None = None
                 ) -> None:
        """``main_cache``: the main model's (``main_layers`` layers), built with
        ``extra_layers=1``; the module's latents are its last layer. ``like``: the main
        model's engine, whose decode mode and buckets the module's rows take and whose graph
        memory pool its graphs share; without it the module runs eagerly."""
        if main_cache.num_layers != main_layers + 1:
            raise ValueError(f"the MTP module's KV is the cache's layer {main_layers}: build "
                             f"the cache with extra_layers=1 ({main_layers + 1} layers), got "
                             f"{main_cache.num_layers}")
        self.w = weights
        self.eps = model.config.rms_norm_eps
        self.cache = main_cache
        self.engine = RankEngine(
            model, main_cache, comm, dcp,
            decode_mode=like.decode_mode if like is not None else "eager",
            graph_buckets=like.buckets if like is not None else DEFAULT_BUCKETS,
            max_table_blocks=like.table_width if like is not None else None,
            prefill_buckets=(), overtake=False, layer_base=main_layers, input_fn=self._input)
        if like is not None:
            self.engine.share_graph_pool(like)

    def _input(self, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
               ) -> torch.Tensor:
        return mtp_input(self.w, self.eps, hidden, tokens, positions)

    @classmethod
    def load(cls, model: str | Path, main: RankModel, main_cache: PagedKVCache, comm: Comm,
             dcp: int = 1, seed: int = 0, like: RankEngine | None = None) -> MTPDrafter:
        """The module of checkpoint ``model`` beside ``main``; a ConfigError naming the setting
        and the model when it has none."""
        w, m = load_mtp_rank_model(model, main, seed)
        return cls(w, m, main_cache, comm, dcp, main.config.num_hidden_layers, like)

    @torch.inference_mode()
    def draft(self, seqs: Sequence[tuple[SeqChunk, torch.Tensor]], k: Sequence[int]
              ) -> list[list[int]]:
        """Per sequence ``(chunk, hidden)``: the chunk's tokens are the tokens at positions
        ``start + 1 ..`` (each the token after the position of its row), ``hidden`` ``[n, H]``
        the main model's final normed hidden states at positions ``start ..``; the module runs
        there (its KV written) and drafts up to ``k[i]`` tokens following the last position's
        next token (none where ``k[i]`` is 0: the KV is still written, so a later step may
        draft). Positions beyond a chunk's end get the chained drafts' KV, overwritten later."""
        if not seqs:
            return []
        chunks = [c for c, _ in seqs]
        out: list[list[int]] = [[] for _ in seqs]
        dev = self.w.embed.device
        hidden = seqs[0][1] if len(seqs) == 1 else torch.cat([h for _, h in seqs])
        last = self._run(chunks, hidden.to(dev))
        todo = [i for i in range(len(seqs)) if k[i] > 0]
        depth = 0
        while todo:
            logits = self.engine.logits(rms_norm(_rows(last, todo), self.w.norm, self.eps))
            picks = torch.argmax(logits, -1).tolist()  # the one wait for the device a depth
            for i, t in zip(todo, picks, strict=True):
                out[i].append(int(t))
            depth += 1
            todo_next = [i for i in todo if len(out[i]) < k[i]]
            if not todo_next:
                break
            nxt = [SeqChunk([out[i][-1]], chunks[i].start + len(chunks[i].tokens) - 1 + depth,
                            chunks[i].block_ids) for i in todo_next]
            ran = self._run(nxt, _rows(last, todo_next))
            if len(todo_next) == last.shape[0]:
                last = ran
            else:
                last = last.index_copy(0, to_device(todo_next, torch.long, dev), ran)
            todo = todo_next
        return out

    def _run(self, chunks: Sequence[SeqChunk], hidden: torch.Tensor) -> torch.Tensor:
        """The module over the chunks' rows (module docstring: rows or chunks); its output
        hidden state (before the shared head's norm) at each chunk's last row
        ``[len(chunks), H]``."""
        rows: Sequence[SeqChunk] = chunks
        if all(c.start > 0 and len(c.tokens) <= ROWS_MAX for c in chunks):
            rows = [SeqChunk([t], c.start + j, c.block_ids)
                    for c in chunks for j, t in enumerate(c.tokens)]
        h = self.engine.hidden_from(rows, hidden)
        lengths = {len(c.tokens) for c in chunks}
        if len(lengths) == 1:  # a view and one copy: no index from the host
            n = lengths.pop()
            return h.reshape(len(chunks), n, -1)[:, n - 1].clone()
        ends = list(itertools.accumulate(len(c.tokens) for c in chunks))
        return h.index_select(0, to_device([e - 1 for e in ends], torch.long, h.device))

    @torch.inference_mode()
    def warm_up(self, block_ids: Sequence[int], batch_sizes: Sequence[int]) -> None:
        """A draft over ``n`` one-token rows for each of ``batch_sizes``, so each bucket's
        graph is captured before serving. Writes scratch latents into ``block_ids[0]``."""
        h = torch.zeros(1, self.w.embed.shape[1], dtype=self.w.embed.dtype,
                        device=self.w.embed.device)
        for n in batch_sizes:
            self.draft([(SeqChunk([1], 1, block_ids[:1]), h)] * n, [1] * n)


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t``'s ``rows`` without an index from the host where they are all of them in order."""
    if rows == list(range(t.shape[0])):
        return t
    return t.index_select(0, to_device(rows, torch.long, t.device))


__all__ = ["MTPDrafter"]
