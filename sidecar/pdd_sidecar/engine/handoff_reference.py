"""P/D without the network: the exact expectation for a prefill and a decode whose layouts round
differently. Each prompt is prefilled in the prefill's layout, its latents are moved by sequence
position into the decode layout's caches (each position to the rank the decode's DCP rule gives
it), and it is decoded there from the prefill's first token. A P/D run must produce these tokens
bit for bit in any dtype: what differs from them is the hand-off, not rounding. (A single instance
of the decode layout computes the prompt's latents in its own reduction order, so in bf16 it can
differ from a P/D pair whose prefill layout is another.)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from pdd_sidecar.engine.comm import Comm, run_threads
from pdd_sidecar.engine.generate import rank_device, run_procs
from pdd_sidecar.engine.rank_engine import RankEngine, allocate_request, new_cache
from pdd_sidecar.kv.cache import (
    PagedKVCache,
    local_positions,
    local_token_count,
    num_table_blocks,
)
from pdd_sidecar.model.config import BUILTIN_SEED
from pdd_sidecar.model.rank_model import load_rank_model

Exported = tuple[int, torch.Tensor]  # the first token, and the prompt's latents [T, layers, L]


def _local_slots(cache: PagedKVCache, table: list[int], num_tokens: int, dcp: int,
                 rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(positions, block ids, offsets)`` of the tokens this rank holds, in storage order."""
    n = local_token_count(num_tokens, cache.block_size, dcp, rank)
    dev = cache.kv.device
    j = torch.arange(n, device=dev)
    ids = torch.tensor(table, dtype=torch.long, device=dev)
    return (local_positions(n, cache.block_size, dcp, rank, dev),
            ids[j // cache.block_size], j % cache.block_size)


@dataclass(frozen=True)
class LayoutRun:
    """Every prompt in one launch of one layout: with ``imported`` None, prefill and export each
    prompt's first token and latents; else decode each from its imported latents."""

    model: str
    tp: int
    dcp: int
    dtype: str
    block_size: int
    device: str
    seed: int
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    imported: tuple[Exported, ...] | None = None
    kv_cache_dtype: str = "auto"

    def run(self, rank: int, comm: Comm) -> list[Exported] | list[list[int]]:
        device = rank_device(self.device, rank)
        model = load_rank_model(self.model, rank, self.tp, self.dtype, device, self.seed)
        longest = max(len(p) for p in self.prompts) + self.max_tokens
        # one prompt at a time: each frees its blocks before the next
        cache = new_cache(model, num_table_blocks(longest, self.block_size, self.dcp),
                          self.block_size, kv_cache_dtype=self.kv_cache_dtype)
        engine = RankEngine(model, cache, comm, self.dcp)
        if self.imported is None:
            return [self._export(engine, cache, comm, rank, p) for p in self.prompts]
        return [self._decode(engine, cache, rank, p, e)
                for p, e in zip(self.prompts, self.imported, strict=True)]

    def _export(self, engine: RankEngine, cache: PagedKVCache, comm: Comm, rank: int,
                prompt: tuple[int, ...]) -> Exported:
        t = len(prompt)
        table = allocate_request(cache, t, self.dcp)
        first = int(torch.argmax(engine.prefill(prompt, table)))
        latents = cache.kv.new_zeros(t, cache.num_layers, cache.kv.shape[-1])
        pos, ids, offs = _local_slots(cache, table, t, self.dcp, rank)
        latents[pos] = cache.kv[ids, :, offs]
        if self.dcp > 1:  # each position held by one rank, zeros elsewhere: the sum is exact
            latents = comm.all_reduce(latents)
        cache.free(table)
        return first, latents.cpu()

    def _decode(self, engine: RankEngine, cache: PagedKVCache, rank: int,
                prompt: tuple[int, ...], exported: Exported) -> list[int]:
        first, latents = exported
        t = len(prompt)
        table = allocate_request(cache, t + self.max_tokens - 1, self.dcp)
        pos, ids, offs = _local_slots(cache, table, t, self.dcp, rank)
        cache.kv[ids, :, offs] = latents.to(cache.kv.device, cache.kv.dtype)[pos]
        tokens = [first]
        for step in range(1, self.max_tokens):
            logits = engine.decode_step(tokens[-1], t + step - 1, table)
            tokens.append(int(torch.argmax(logits)))
        cache.free(table)
        return tokens


def _launch(spec: LayoutRun, launcher: str) -> list[Exported] | list[list[int]]:
    if launcher == "procs" and spec.tp > 1:
        return run_procs(spec)  # type: ignore[no-any-return]
    if launcher not in ("inproc", "procs"):
        raise ValueError(f"launcher must be inproc or procs, got {launcher!r}")
    result = run_threads(spec.tp, spec.run)[0]
    assert result is not None
    return result


def handoff_generate(
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    prefill: tuple[int, int],
    decode: tuple[int, int],
    dtype: str = "float32",
    block_size: int = 16,
    device: str = "cpu",
    launcher: str = "inproc",
    seed: int = BUILTIN_SEED,
    kv_cache_dtype: str = "auto",
) -> list[list[int]]:
    """Greedy tokens per prompt of a P/D pair (``(tp, dcp)`` each) with the hand-off done in
    memory: two launches, one per layout, whatever the number of prompts."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be non-empty token lists")
    for side, (tp, dcp) in (("prefill", prefill), ("decode", decode)):
        if tp < 1 or dcp not in (1, tp):
            raise ValueError(f"{side}: dcp must be 1 or tp ({tp}), got {dcp}")
    runs = [LayoutRun(model, tp, dcp, dtype, block_size, device, seed,
                      tuple(tuple(int(x) for x in p) for p in prompts), max_tokens,
                      kv_cache_dtype=kv_cache_dtype)
            for tp, dcp in (prefill, decode)]
    exported: list[Exported] = _launch(runs[0], launcher)  # type: ignore[assignment]
    decoded = _launch(replace(runs[1], imported=tuple(exported)), launcher)
    return decoded  # type: ignore[return-value]
