"""P/D with MTP drafts, the hand-off done in memory (engine/handoff_reference.py's way): what a
served prefill and decode must do for the decode's drafts to be the module's from its first step.

The prefill runs the prompt, samples the first token, then runs the MTP module over every prompt
position (the token after the last is the first token), so the module's latents (the cache's
last layer) move with the prompt's blocks; it sends the last position's hidden state as the
hand-off record's ``draft_state`` (kv/handoff.py, through its wire form). The decode imports the
latents, runs the module at the last prompt position from that state and drafts in its first
step; without the state it drafts from its next step and counts it (``missing_draft_state``).
Here the prefill ran the module at the last position too, so the later drafts are the same; a
served prefill stops one short (mtp_served.py), and without the state that latent is never
written on the decode: its later drafts attend a damaged context (fewer accepted; the tokens
are plain decoding's either way).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from pdd_sidecar.engine.comm import Comm, run_threads
from pdd_sidecar.engine.generate import GenerationResult, rank_device, speculate_mtp
from pdd_sidecar.engine.handoff_reference import _local_slots
from pdd_sidecar.engine.rank_engine import RankEngine, allocate_request, new_cache
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.engine.speculative.config import SpeculativeConfig
from pdd_sidecar.engine.speculative.draft_state import decode_draft_state, encode_draft_state
from pdd_sidecar.engine.speculative.mtp import MTPDrafter
from pdd_sidecar.kv.cache import num_table_blocks
from pdd_sidecar.kv.handoff import DraftState
from pdd_sidecar.model.rank_model import load_rank_model

# the first token, every prompt position's latents [T, layers, L], the draft state's wire form
Exported = tuple[int, torch.Tensor, dict[str, Any] | None]


@dataclass(frozen=True)
class _Side:
    model: str
    tp: int
    dcp: int
    block_size: int
    prompt: tuple[int, ...]
    max_tokens: int
    cfg: SpeculativeConfig
    send_state: bool
    imported: Exported | None = None

    def run(self, rank: int, comm: Comm) -> Any:
        model = load_rank_model(self.model, rank, self.tp, "float32", rank_device("cpu", rank))
        t = len(self.prompt)
        cache = new_cache(model, num_table_blocks(t + self.max_tokens, self.block_size,
                                                  self.dcp), self.block_size, extra_layers=1)
        engine = RankEngine(model, cache, comm, self.dcp, extra_layers=1)
        drafter = MTPDrafter.load(self.model, model, cache, comm, self.dcp, like=engine)
        if self.imported is None:
            table = allocate_request(cache, t, self.dcp)
            logits = engine.step([SeqChunk(self.prompt, 0, table)], keep=[0])
            assert logits is not None
            first = int(torch.argmax(logits[0]))
            hidden = engine.kept[0]
            drafter.draft([(SeqChunk([*self.prompt[1:], first], 0, table), hidden)], [0])
            latents = cache.kv.new_zeros(t, cache.num_layers, cache.kv.shape[-1])
            pos, ids, offs = _local_slots(cache, table, t, self.dcp, rank)
            latents[pos] = cache.kv[ids, :, offs]
            if self.dcp > 1:
                latents = comm.all_reduce(latents)
            state = (json.loads(json.dumps(encode_draft_state(hidden[-1], t - 1).to_wire()))
                     if self.send_state else None)
            return first, latents.cpu(), state
        first, latents, wire = self.imported
        table = allocate_request(cache, t + self.max_tokens - 1, self.dcp)
        pos, ids, offs = _local_slots(cache, table, t, self.dcp, rank)
        cache.kv[ids, :, offs] = latents[pos]
        out = GenerationResult(token_ids=[first])
        pending = None
        if wire is not None:
            h = decode_draft_state(DraftState.parse(wire, t), model.config.hidden_size)
            pending = (t - 1, [first], h[None])
        else:
            out.missing_draft_state += 1
        speculate_mtp(engine, drafter, self.cfg, self.max_tokens, table, t, pending, out)
        return out


def mtp_handoff_generate(model: str, prompt: list[int], max_tokens: int,
                         prefill: tuple[int, int], decode: tuple[int, int],
                         cfg: SpeculativeConfig, send_state: bool = True,
                         block_size: int = 16) -> GenerationResult:
    """Greedy tokens of one prompt through a P/D pair (``(tp, dcp)`` each, threads, CPU fp32)
    speculating with MTP on the decode; ``send_state``: whether the prefill sends the draft
    state."""
    sides = [_Side(model, tp, dcp, block_size, tuple(prompt), max_tokens, cfg, send_state)
             for tp, dcp in (prefill, decode)]
    exported = run_threads(sides[0].tp, sides[0].run)[0]
    d = sides[1]
    res = run_threads(d.tp, _Side(d.model, d.tp, d.dcp, d.block_size, d.prompt, d.max_tokens,
                                  d.cfg, d.send_state, exported).run)[0]
    assert isinstance(res, GenerationResult)
    return res


__all__ = ["mtp_handoff_generate"]
