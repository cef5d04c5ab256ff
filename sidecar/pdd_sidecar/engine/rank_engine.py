"""Per-rank execution of one request: prefill over the prompt and single-token decode steps over
the paged latent cache, with TP across heads and optional DCP across KV chunks.

Every rank of an instance runs the same calls with the same block table; ranks meet only in
collectives on ``comm`` (the TP group, which is also the DCP group since dcp is 1 or tp).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pdd_sidecar.engine.comm import Comm
from pdd_sidecar.engine.dcp import dcp_merge
from pdd_sidecar.kv import cache as kvc
from pdd_sidecar.kv.cache import PagedKVCache
from pdd_sidecar.model.mla import (
    absorb_q,
    decode_attention,
    prefill_attention,
    project_latent,
    project_q,
    rms_norm,
    unabsorb_v,
)
from pdd_sidecar.model.moe import dense_mlp, moe
from pdd_sidecar.model.rank_model import RankModel


def new_cache(
    model: RankModel, num_blocks: int, block_size: int, device: str | torch.device | None = None
) -> PagedKVCache:
    cfg = model.config
    return PagedKVCache(
        num_blocks,
        cfg.num_hidden_layers,
        block_size,
        cfg.latent_dim,
        model.dtype,
        model.device if device is None else device,
    )


def allocate_request(cache: PagedKVCache, num_tokens: int, dcp: int) -> list[int]:
    """The instance-level block table for a request of ``num_tokens`` tokens (prompt plus the
    tokens whose KV decode will write). Call it on every rank: allocation is deterministic, so
    every rank gets the same ids."""
    return cache.allocate(kvc.num_table_blocks(num_tokens, cache.block_size, dcp))


class RankEngine:
    def __init__(self, model: RankModel, cache: PagedKVCache, comm: Comm, dcp: int = 1) -> None:
        cfg = model.config
        if comm.world_size != model.tp or comm.rank != model.rank:
            raise ValueError(
                f"comm (rank {comm.rank} of {comm.world_size}) does not match the model "
                f"(rank {model.rank} of tp {model.tp})"
            )
        if dcp not in (1, model.tp):
            raise ValueError(f"dcp must be 1 or tp ({model.tp}), got {dcp}")
        if (cache.num_layers, cache.latent_dim) != (cfg.num_hidden_layers, cfg.latent_dim):
            raise ValueError("cache shape does not match the model (layers, latent dim)")
        self.model = model
        self.cfg = cfg
        self.cache = cache
        self.comm = comm
        self.dcp = dcp
        self.rank = model.rank
        self.tp = model.tp

    # --- public API ----------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self, token_ids: Sequence[int], block_ids: Sequence[int], all_logits: bool = False
    ) -> torch.Tensor:
        """Run the prompt from position 0, writing this rank's chunks of its KV into
        ``block_ids``. Returns fp32 logits of the last token ``[V]`` (``[T, V]`` if
        ``all_logits``)."""
        if len(token_ids) == 0:
            raise ValueError("empty prompt")
        self._check_tokens(token_ids)
        table = self._table(block_ids, len(token_ids))
        tokens = torch.tensor(list(token_ids), dtype=torch.long, device=self.model.device)
        positions = torch.arange(len(token_ids), device=self.model.device)
        hidden = self._forward(tokens, positions, table, decode_len=None)
        return self._logits(hidden if all_logits else hidden[-1])

    @torch.inference_mode()
    def decode_step(self, token_id: int, position: int, block_ids: Sequence[int]) -> torch.Tensor:
        """Feed ``token_id`` at ``position`` (all earlier positions are cached); returns fp32
        logits ``[V]`` for the next token."""
        self._check_tokens([token_id])
        table = self._table(block_ids, position + 1)
        tokens = torch.tensor([token_id], dtype=torch.long, device=self.model.device)
        positions = torch.tensor([position], device=self.model.device)
        return self._logits(self._forward(tokens, positions, table, decode_len=position + 1)[0])

    # --- internals -----------------------------------------------------------------------

    def _check_tokens(self, token_ids: Sequence[int]) -> None:
        """An out-of-range id would be a device-side assert on CUDA, fatal to the process."""
        bad = [t for t in token_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")

    def _table(self, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
        need = kvc.num_table_blocks(num_tokens, self.cache.block_size, self.dcp)
        if len(block_ids) < need:
            raise ValueError(
                f"block table has {len(block_ids)} blocks, {num_tokens} tokens need {need} "
                f"(block_size {self.cache.block_size}, dcp {self.dcp})"
            )
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.cache.device)

    def _slots(
        self, positions: torch.Tensor, table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Which of ``positions`` this rank stores, and where (block id, offset)."""
        bs = self.cache.block_size
        pos = positions.to(self.cache.device)
        chunk = pos // bs
        if self.dcp > 1:
            mine = torch.nonzero(chunk % self.dcp == self.rank).flatten()
        else:
            mine = torch.arange(pos.shape[0], device=pos.device)
        return mine, table[chunk[mine] // self.dcp], pos[mine] % bs

    def _forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        table: torch.Tensor,
        decode_len: int | None,
    ) -> torch.Tensor:
        cfg, w, comm = self.cfg, self.model.weights, self.comm
        cos, sin = self.model.rotary.cos_sin(positions)
        mine, blk, off = self._slots(positions, table)
        lead = self.rank == 0  # adds the biases of row-sharded projections exactly once
        x = F.embedding(tokens, w.embed)
        for i, lw in enumerate(w.layers):
            a = rms_norm(x, lw.input_norm, cfg.rms_norm_eps)
            q_nope, q_pe = project_q(a, lw.attn, cfg, cos, sin)
            latent = project_latent(a, lw.attn, cfg, cos, sin)
            self.cache.write(i, blk, off, latent[mine.to(latent.device)])
            if decode_len is None:
                o = prefill_attention(q_nope, q_pe, latent, lw.attn, cfg)
            else:
                o = self._decode_attention(absorb_q(q_nope, q_pe, lw.attn)[0], i, table, decode_len)
                o = unabsorb_v(o.to(x.dtype), lw.attn).unsqueeze(0)
            o = F.linear(o.flatten(1), lw.attn.o_proj, lw.attn.o_bias if lead else None)
            x = x + (comm.all_reduce(o) if self.tp > 1 else o)
            m = rms_norm(x, lw.post_norm, cfg.rms_norm_eps)
            add_bias = lead or not lw.mlp_sharded
            if lw.moe is not None:
                y = moe(m, lw.moe, cfg, add_bias)
            else:
                assert lw.mlp is not None
                y = dense_mlp(m, lw.mlp, add_bias)
            x = x + (comm.all_reduce(y) if lw.mlp_sharded else y)
        return rms_norm(x, w.norm, cfg.rms_norm_eps)

    def _decode_attention(
        self, q: torch.Tensor, layer: int, table: torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        """``q [Hl, L]`` (absorbed) to this rank's heads' latent output ``[Hl, kv_lora]``."""
        n_local = kvc.local_token_count(num_tokens, self.cache.block_size, self.dcp, self.rank)
        kv = self.cache.read(layer, table, n_local)
        if self.dcp == 1:
            return decode_attention(q, kv, self.cfg.kv_lora_rank, self.cfg.softmax_scale)[0]
        q_all = self.comm.all_gather(q, dim=0)
        out, lse = decode_attention(q_all, kv, self.cfg.kv_lora_rank, self.cfg.softmax_scale)
        return dcp_merge(out, lse, self.comm)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.model.weights.lm_head).float()
