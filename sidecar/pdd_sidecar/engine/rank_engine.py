"""Per-rank execution of one request: prefill over the prompt and single-token decode steps over
the paged latent cache, with TP across heads and optional DCP across KV chunks.

Every rank of an instance runs the same calls with the same block table; ranks meet only in
collectives on ``comm`` (the TP group, which is also the DCP group since dcp is 1 or tp).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pdd_sidecar.engine.comm import Comm, SingleComm, TorchDistComm
from pdd_sidecar.engine.cuda_graphs import (
    DECODE_MODES,
    DEFAULT_BUCKETS,
    PREFILL_BUCKETS,
    PREFILL_MAX_PROMPTS,
    StaticDecode,
    StaticPrefill,
    check_buckets,
    default_decode_mode,
    stage,
    stage_prefill,
    table_width,
)
from pdd_sidecar.engine.dcp import dcp_merge
from pdd_sidecar.engine.device_queue import tensor_to_device, to_device
from pdd_sidecar.engine.launch_pacing import LaunchPacer
from pdd_sidecar.engine.overtaking import Overtaking, overtaking_enabled
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.engine.warmup_shape import fresh_prompt_lengths, warmup_fresh_blocks
from pdd_sidecar.kv import cache as kvc
from pdd_sidecar.kv.cache import PagedKVCache
from pdd_sidecar.model import fusion
from pdd_sidecar.model.kernels.chunk_attention import HAS_TRITON, merge_partials
from pdd_sidecar.model.kernels.dense_gemv import small_linear
from pdd_sidecar.model.kernels.kv_write import write_latents
from pdd_sidecar.model.kernels.latent_read import read_latent_blocks, read_latents
from pdd_sidecar.model.kernels.mla_decode import num_splits_for, paged_mla_decode, sm_count
from pdd_sidecar.model.kernels.norm_rope import add_rms_norm
from pdd_sidecar.model.mla import (
    absorb_q,
    absorbed_query_and_store,
    chunk_prefill_attention,
    prefill_attention,
    project_and_store,
    project_latent,
    project_q,
    rms_norm,
    unabsorb_v,
    unabsorb_v_flat,
    varlen_prefill_attention,
)
from pdd_sidecar.model.moe import dense_mlp, expert_path, moe
from pdd_sidecar.model.rank_model import RankModel
from pdd_sidecar.model.weights import LayerWeights

log = logging.getLogger(__name__)
# (tokens, positions, hidden) -> the first layer's input rows (RankEngine.hidden_from)
RowInput = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (layer index, its weights, normed input, cos, sin) -> attention output (a padded step's)
StaticAttend = Callable[[int, LayerWeights, torch.Tensor, torch.Tensor, torch.Tensor],
                        torch.Tensor]


def _add_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + y, rms_norm(x + y))``: one kernel when the model runs fused, else two."""
    if fusion.fused():
        return add_rms_norm(x, y, weight, eps)
    s = x + y
    return s, rms_norm(s, weight, eps)


def _varlen_kernel_pays(n: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Two or more pieces, on CUDA in half precision: there one varlen call per layer replaces
    a chain of launches per piece. The CPU keeps the per-piece path, the reference."""
    return (n >= 2 and device.type == "cuda" and HAS_TRITON
            and dtype in (torch.float16, torch.bfloat16))


def batch_fresh_prompts(n_fresh: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a step's fresh prompts attend in one varlen kernel call per layer rather than one
    SDPA chain each (a single prompt keeps SDPA's flash kernel)."""
    return _varlen_kernel_pays(n_fresh, device, dtype)


def batch_continuing_chunks(n_chunks: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a step's prompt chunks that continue cached sequences (a long prompt's later
    chunks, a prefix-cache hit's suffix) attend in one varlen call per layer over all their
    contexts rather than one chain each, so a step of 64 cache hits costs one launch chain, not
    64. Apart from ``batch_fresh_prompts`` so each can be forced on its own."""
    return _varlen_kernel_pays(n_chunks, device, dtype)


def shared_prefix_entries(chunks: Sequence[SeqChunk], unit: int) -> int:
    """Leading table entries every chunk holds alike (the same cached blocks), counting only
    units that end before every chunk's first query; 0 for fewer than two chunks."""
    if len(chunks) < 2:
        return 0
    limit = min(c.start for c in chunks) // unit
    first = chunks[0].block_ids
    n = 0
    while n < limit and all(c.block_ids[n] == first[n] for c in chunks[1:]):
        n += 1
    return n


FreshRows = tuple[slice | torch.Tensor, torch.Tensor]

WARMUP_SHORTEST = 64


def warmup_lengths(below: int) -> list[int]:
    """The fresh prompt lengths the warm-up runs besides a whole chunk: doublings from
    WARMUP_SHORTEST, every one shorter than ``below``."""
    out: list[int] = []
    n = WARMUP_SHORTEST
    while n < below:
        out.append(n)
        n *= 2
    return out


def new_cache(
    model: RankModel, num_blocks: int, block_size: int, device: str | torch.device | None = None,
    kv_cache_dtype: str = "auto", extra_layers: int = 0,
) -> PagedKVCache:
    """``kv_cache_dtype``: ``auto`` (the model's dtype) or ``fp8`` (kv/fp8_layout.py).
    ``extra_layers``: layers after the model's (the MTP module's KV, engine/speculative/mtp.py),
    so a block holds a position's every latent and moves whole."""
    cfg = model.config
    return PagedKVCache(
        num_blocks,
        cfg.num_hidden_layers + extra_layers,
        block_size,
        cfg.latent_dim,
        model.dtype,
        model.device if device is None else device,
        kv_cache_dtype=kv_cache_dtype,
        kv_lora_rank=cfg.kv_lora_rank,
    )


def allocate_request(cache: PagedKVCache, num_tokens: int, dcp: int) -> list[int]:
    """The instance-level block table for a request of ``num_tokens`` tokens (prompt plus the
    tokens whose KV decode will write). Call it on every rank: allocation is deterministic, so
    every rank gets the same ids."""
    return cache.allocate(kvc.num_table_blocks(num_tokens, cache.block_size, dcp))


@dataclass(frozen=True)
class ChunkView:
    """A prompt chunk continuing a cached sequence: its table, the tokens this rank holds
    through the chunk's end (the chunk's own included) and the positions of its queries and of
    those tokens."""

    table: torch.Tensor
    n_local: int
    q_pos: torch.Tensor
    k_pos: torch.Tensor


@dataclass(frozen=True)
class ChunkBatch:
    """A step's continuing prompt chunks as one varlen attention: every chunk's local blocks
    gathered into one key range, and positions shifted so that each sequence owns a range of
    its own (``q_lo``, its start, hides the others' keys). The unfilled rows of a sequence's
    last block get positions past its queries and before the next range, so they stay ascending
    and nobody sees them.

    Table entries every chunk shares (the same cached blocks, from the start: a system prompt
    all of a step's prefix-cache hits begin with) are expanded and attended once, by every
    query, and merged with the rest by LSE (cascade attention), instead of once per
    sequence."""

    blocks: torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    q_lo: torch.Tensor
    shared: SharedBlocks | None = None


@dataclass(frozen=True)
class SharedBlocks:
    """The leading blocks every chunk of a batch holds alike, attended once by all queries at
    their own positions (every key precedes every query, so none is hidden)."""

    blocks: torch.Tensor
    k_pos: torch.Tensor
    q_pos: torch.Tensor


@dataclass
class CachedViews:
    """The continuing sequences of a step, as their attention needs them: prompt chunks (their
    rows of the step, in order; one view each, or one batch) and decode tokens (one padded
    block-table batch)."""

    chunks: list[ChunkView] = field(default_factory=list)
    batch: ChunkBatch | None = None
    chunk_rows: torch.Tensor | None = None
    decode_rows: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None


def comm_capturable(comm: Comm) -> bool:
    """Whether the step's collectives can live in a CUDA graph: one rank, or NCCL. Thread
    ranks exchange tensors through Python, which a graph would not replay."""
    if isinstance(comm, SingleComm) or comm.world_size == 1:
        return True
    return isinstance(comm, TorchDistComm) and not comm._gloo


class RankEngine:
    """``decode_mode``: ``"eager"`` runs every step as given; ``"padded"`` runs decode-only
    steps padded to a bucket through static buffers, eagerly (the CPU twin of graphs);
    ``"graph"`` (CUDA) captures that padded step once per bucket and replays it. None: graphs on
    CUDA unless ``PDD_CUDA_GRAPHS=0``, eager elsewhere. ``max_table_blocks`` bounds the block
    table of a graphed sequence (default: what ``max_position_embeddings`` needs, at most the
    cache's blocks); steps beyond it, beyond the largest bucket, or with prompt chunks run
    eagerly. ``prefill_buckets`` (default: ``PREFILL_BUCKETS`` in graph mode, none otherwise)
    are the token counts a step of fresh prompts only (at most ``PREFILL_MAX_PROMPTS``) is
    padded to, run as the decode steps are (padded eagerly, or replayed); more tokens or
    prompts, and steps with a continuing chunk, run eagerly. ``overtake`` (default: on a CUDA
    cache of one rank with prefill buckets, unless ``PDD_OVERTAKING=0``) runs those steps on a
    high-priority stream, ahead of device work queued before them (engine/overtaking.py); read
    their logits inside ``logits_context()``."""

    def __init__(
        self,
        model: RankModel,
        cache: PagedKVCache,
        comm: Comm,
        dcp: int = 1,
        decode_mode: str | None = None,
        graph_buckets: Sequence[int] = DEFAULT_BUCKETS,
        max_table_blocks: int | None = None,
        prefill_buckets: Sequence[int] | None = None,
        overtake: bool | None = None,
        extra_layers: int = 0,
        layer_base: int = 0,
        input_fn: RowInput | None = None,
    ) -> None:
        cfg = model.config
        if comm.world_size != model.tp or comm.rank != model.rank:
            raise ValueError(
                f"comm (rank {comm.rank} of {comm.world_size}) does not match the model "
                f"(rank {model.rank} of tp {model.tp})"
            )
        if dcp not in (1, model.tp):
            raise ValueError(f"dcp must be 1 or tp ({model.tp}), got {dcp}")
        if (cache.num_layers, cache.latent_dim) != (
                layer_base + cfg.num_hidden_layers + extra_layers, cfg.latent_dim):
            raise ValueError("cache shape does not match the model (layers, latent dim)")
        # The cache's layers: this model's from ``layer_base``, then ``extra_layers`` of
        # another's (the MTP module's, engine/speculative/mtp.py, after the main layers).
        self.layer_base = layer_base
        # The first layer's input from each row's token, position and a given hidden state, in
        # place of the token embedding (``hidden_from``: the MTP module's, mtp.py).
        self.input_fn = input_fn
        self.model = model
        self.cfg = cfg
        self.cache = cache
        self.comm = comm
        self.dcp = dcp
        self.rank = model.rank
        self.tp = model.tp
        capturable = comm_capturable(comm)
        mode = decode_mode
        if mode is None:
            mode = default_decode_mode(cache.device)
            if mode == "graph" and not capturable:
                mode = "eager"
        if mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {', '.join(DECODE_MODES)}, got {mode!r}")
        if mode == "graph" and cache.device.type != "cuda":
            raise ValueError(f"decode_mode 'graph' needs a CUDA cache, got {cache.device}")
        if mode == "graph" and not capturable:
            raise ValueError(f"decode_mode 'graph' needs NCCL collectives or one rank, not "
                             f"{type(comm).__name__}")
        self.decode_mode = mode
        if cache.device.type == "cuda":
            # SDPA's cuDNN backend builds a plan for every new sequence length on first use
            # (measured: +100 ms on the first 1k prompt after warm-up on an H200); flash needs
            # none, so the first request of each prompt length costs what the next one does.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.buckets = check_buckets(graph_buckets)
        if prefill_buckets is None:
            # PDD_CUDA_GRAPHS=padded (the CPU twin of graphs) pads prefills as graphs would
            twin = decode_mode is None and mode == "padded"
            prefill_buckets = PREFILL_BUCKETS if mode == "graph" or twin else ()
        if prefill_buckets and mode == "eager":
            raise ValueError("prefill_buckets need decode_mode 'padded' or 'graph', not 'eager'")
        self.prefill_buckets = check_buckets(prefill_buckets) if prefill_buckets else ()
        if max_table_blocks is not None and max_table_blocks < 1:
            raise ValueError(f"max_table_blocks must be >= 1, got {max_table_blocks}")
        self.table_width = max_table_blocks or table_width(
            cache.num_blocks, cfg.max_position_embeddings, cache.block_size, dcp)
        self._static: dict[int, StaticDecode] = {}
        self._static_prefill: dict[int, StaticPrefill] = {}
        # keyed (kind, bucket, want_logits), kind "decode" or "prefill"
        self._graphs: dict[tuple[str, int, bool],
                           tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self._no_graph: set[tuple[str, int, bool]] = set()  # padded eager instead
        self._pool: Any = None
        self.graph_captures = 0  # graphs captured so far (one per kind, bucket, logits flag)
        can_overtake = cache.device.type == "cuda" and self.tp == 1 and bool(self.prefill_buckets)
        if overtake is None:  # the setting is checked on every device: a typo fails on a CPU
            overtake = overtaking_enabled() and can_overtake
        elif overtake and not can_overtake:
            raise ValueError("overtake needs a CUDA cache, one rank and prefill buckets")
        # engine/overtaking.py: graphed fresh-prompt steps on a high-priority stream
        self.overtaking = Overtaking(cache.device, cache.block_size) if overtake else None
        if self.overtaking is not None:
            log.info("steps of fresh prompts up to %d tokens overtake queued device work "
                     "(a high-priority CUDA stream)", self.prefill_buckets[-1])
        self.logits_stream: torch.cuda.Stream | None = None  # where the last logits were made
        self.kept: dict[int, torch.Tensor] = {}  # the last step's kept hidden states (``step``)
        # Called after each layer an in-order eager step launches (engine/launch_pacing.py);
        # the driver sets it on a prefill whose steps may overtake.
        self.pacer: LaunchPacer | None = None
        self.padded_steps = 0  # decode steps that ran padded (replayed or eager)
        self.padded_prefills = 0  # prefill steps that ran padded (replayed or eager)
        self.split_steps = 0  # mixed steps run as a padded prefill and a padded decode step
        self._replayed = False  # the step being run replayed a graph (``_fence_replays``)

    # --- public API ----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, chunks: Sequence[SeqChunk], want_logits: bool = True,
             keep: Sequence[int] = ()) -> torch.Tensor | None:
        """One forward pass over every chunk of the batch; fp32 logits ``[len(chunks), V]`` of
        each chunk's last token (None without ``want_logits``: only rank 0 samples). The final
        hidden states of every position of the chunks ``keep`` names stay in ``kept`` (chunk
        index -> ``[T, H]``, on every rank) for their prompt log-probabilities (``logits``)
        and the MTP module (engine/speculative/mtp_served.py); such a step runs in order, on
        every rank alike: padded (a graph on CUDA) when every chunk is one decode token or a
        fresh prompt a prefill bucket holds, else eagerly."""
        if not chunks:
            raise ValueError("empty step")
        self.kept = {}
        self._replayed = False
        if keep:
            out = self._step_kept(chunks, want_logits, keep)
            self._fence_replays()
            self.logits_stream = None
            return out
        if self.overtakes(chunks, want_logits):
            assert self.overtaking is not None
            out = self.overtaking.run(chunks, lambda: self._prefill_padded(chunks, want_logits))
            self.logits_stream = self.overtaking.stream
            return out
        if self._prefill_paddable(chunks, want_logits):
            out = self._prefill_padded(chunks, want_logits)
            self._fence_replays()
        else:
            # Registered before its launch: a paced launch (``pacer``) lets steps overtake it
            # half-way, and those must see the blocks it writes. Ended whatever happens: a
            # step refused half-way (a bad token id) would otherwise stay pending for good,
            # and every step registered after it with it.
            launched = (None if self.overtaking is None
                        else self.overtaking.in_order(chunks))
            try:
                out = self._step_in_order(chunks, want_logits)
            finally:
                if launched is not None:
                    launched()
            self._fence_replays()
        # Set last: a step that overtook this one half-way set its own.
        self.logits_stream = None
        return out

    def _fence_replays(self) -> None:
        """An in-order step that replayed graphs (any bucket's: prefill, decode, a split mixed
        step's, a kept step's): a later overtaking step waits for them (engine/overtaking.py:
        every graph draws on one memory pool)."""
        if self.overtaking is not None and self._replayed:
            self.overtaking.after_graph()

    def overtakes(self, chunks: Sequence[SeqChunk], want_logits: bool = True) -> bool:
        """Whether ``step`` would run these chunks ahead of the device work queued before them
        (engine/overtaking.py): a graphed step of fresh prompts while in-order work is queued.
        The driver holds back in-order steps only."""
        return (self.overtaking is not None and self._prefill_paddable(chunks, want_logits)
                and self.overtaking.order.busy())

    def _step_in_order(self, chunks: Sequence[SeqChunk], want_logits: bool
                       ) -> torch.Tensor | None:
        if self.decode_mode != "eager" and self._paddable(chunks):
            return self._decode_padded(chunks, want_logits)
        split = self._split_at(chunks, want_logits)
        if split:
            head = self._prefill_padded(chunks[:split], want_logits)
            tail = self._decode_padded(chunks[split:], want_logits)
            self.split_steps += 1
            return None if head is None or tail is None else torch.cat([head, tail])
        pacer = self.pacer
        if pacer is not None and not pacer.paces(sum(len(c.tokens) for c in chunks)):
            pacer = None
        hidden = self._forward(chunks, None if pacer is None else pacer.after_layer)
        if not want_logits:
            return None
        ends = to_device([len(c.tokens) for c in chunks], torch.long, hidden.device).cumsum(0)
        return self._logits(hidden[ends - 1])

    def _step_kept(self, chunks: Sequence[SeqChunk], want_logits: bool,
                   keep: Sequence[int]) -> torch.Tensor | None:
        launched = None if self.overtaking is None else self.overtaking.in_order(chunks)
        try:
            if self.decode_mode != "eager" and self._paddable(chunks):
                return self._decode_padded_kept(chunks, want_logits, keep)
            if self._prefill_paddable(chunks, want_logits):
                return self._prefill_padded_kept(chunks, want_logits, keep)
            hidden = self._forward(chunks)
        finally:
            if launched is not None:
                launched()
        return self._keep_rows(chunks, hidden, want_logits, keep)

    def _keep_rows(self, chunks: Sequence[SeqChunk], hidden: torch.Tensor, want_logits: bool,
                   keep: Sequence[int]) -> torch.Tensor | None:
        """``kept`` from a step's hidden rows (the chunks' rows one after the other), and the
        logits of each chunk's last row."""
        lengths = [len(c.tokens) for c in chunks]
        offsets = [sum(lengths[:i]) for i in range(len(chunks))]
        self.kept = {i: hidden[offsets[i]:offsets[i] + lengths[i]] for i in keep}
        if not want_logits:
            return None
        ends = to_device(lengths, torch.long, hidden.device).cumsum(0)
        return self._logits(hidden[ends - 1])

    @torch.inference_mode()
    def hidden_from(self, chunks: Sequence[SeqChunk], hidden: torch.Tensor) -> torch.Tensor:
        """Every row's final hidden state before the final norm ``[N, H]``, the first layer's
        input ``input_fn(tokens, positions, hidden)`` (``hidden`` one row per token) instead
        of the embedding; each rank alike. Chunks of one token at cached
        positions (a sequence's several rows share its table and see each other's latents,
        as a verify step's rows do) run padded to a decode bucket, on CUDA replayed from its
        graph; other steps run eagerly, in order."""
        if not chunks:
            raise ValueError("empty step")
        if self.input_fn is None:
            raise ValueError("hidden_from needs the engine's input_fn")
        n = sum(len(c.tokens) for c in chunks)
        if hidden.shape != (n, self.cfg.hidden_size):
            raise ValueError(f"hidden: need [{n}, {self.cfg.hidden_size}], got "
                             f"{list(hidden.shape)}")
        self.kept = {}
        if self.decode_mode != "eager" and self._paddable(chunks):
            return self._rows_padded(chunks, hidden)
        dev = self.model.device
        tokens = to_device([t for c in chunks for t in c.tokens], torch.long, dev)
        positions = to_device([c.start + j for c in chunks for j in range(len(c.tokens))],
                              torch.long, dev)
        x = self.input_fn(tokens, positions, hidden.to(dev))
        launched = None if self.overtaking is None else self.overtaking.in_order(chunks)
        try:
            return self._forward(chunks, embeds=x, normed=False)
        finally:
            if launched is not None:
                launched()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states (``kept``'s rows)."""
        return self._logits(hidden)

    def logits_context(self) -> AbstractContextManager[Any]:
        """Where the last step's logits are read: an overtaking step's own stream, so that
        sampling them waits for that step alone, not for the work it overtook."""
        if self.logits_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.logits_stream)

    @torch.inference_mode()
    def prefill(
        self, token_ids: Sequence[int], block_ids: Sequence[int], all_logits: bool = False
    ) -> torch.Tensor:
        """Run the prompt from position 0, writing this rank's chunks of its KV into
        ``block_ids``. Returns fp32 logits of the last token ``[V]`` (``[T, V]`` if
        ``all_logits``)."""
        if len(token_ids) == 0:
            raise ValueError("empty prompt")
        hidden = self._forward([SeqChunk(token_ids, 0, block_ids)])
        return self._logits(hidden if all_logits else hidden[-1])

    @torch.inference_mode()
    def decode_step(self, token_id: int, position: int, block_ids: Sequence[int]) -> torch.Tensor:
        """Feed ``token_id`` at ``position`` (all earlier positions are cached); returns fp32
        logits ``[V]`` for the next token."""
        logits = self.step([SeqChunk([token_id], position, block_ids)])
        assert logits is not None
        return logits[0]

    @torch.inference_mode()
    def warm_up(self, block_ids: Sequence[int], prompt_tokens: int, chunk_tokens: int,
                batch_sizes: Sequence[int], want_logits: bool) -> None:
        """Run, once, the steps serving will run, so compilation and graph capture happen
        before the first request: a ``prompt_tokens`` prompt in chunks of ``chunk_tokens``
        (the fresh and the cached-latent paths), then a decode step at each batch size (a CUDA
        graph captured per bucket). Writes scratch KV into ``block_ids``, which the caller
        frees."""
        vocab = self.cfg.vocab_size
        tokens = [(7 * i + 1) % vocab for i in range(prompt_tokens)]
        bs = self.cache.block_size
        fresh = warmup_fresh_blocks(bs, self.dcp)
        main = list(block_ids[:len(block_ids) - 2 * fresh]) if prompt_tokens \
            else list(block_ids)
        for start in range(0, prompt_tokens, max(1, chunk_tokens)):
            self.step([SeqChunk(tokens[start:start + chunk_tokens], start, main)], want_logits)
        # Shorter fresh prompts too: a step's matmuls and attention pick (and load) their
        # kernels per shape, which a real prompt's first step would pay for otherwise.
        for n in warmup_lengths(min(chunk_tokens, prompt_tokens)):
            self.step([SeqChunk(tokens[:n], 0, main)], want_logits)
        if prompt_tokens > chunk_tokens:
            # The step shapes a busy prefill mixes: a continuing chunk beside one fresh prompt
            # (SDPA), beside two (the batched kernel), fresh prompts alone, and two continuing
            # chunks (their batched path).
            spare = list(block_ids[len(main):])
            short, long = fresh_prompt_lengths(bs)
            one = SeqChunk([(3 * i + 2) % vocab for i in range(short)], 0, spare[:fresh])
            two = SeqChunk([(5 * i + 4) % vocab for i in range(long)], 0, spare[fresh:])
            rest = SeqChunk(tokens[chunk_tokens:], chunk_tokens, main)
            steps = [[rest, one], [rest, one, two], [one, two]]
            if len(one.tokens) + 2 <= fresh * bs * self.dcp:
                more = [9 % vocab, 10 % vocab]
                steps.append([rest, SeqChunk(more, len(one.tokens), one.block_ids)])
            for chunks in steps:
                self.step(chunks, want_logits)
        for n in self.prefill_buckets:  # each prefill graph captured before serving
            if n <= prompt_tokens and kvc.num_table_blocks(
                    n, self.cache.block_size, self.dcp) <= len(main):
                self.step([SeqChunk(tokens[:n], 0, main)], want_logits)
        for n in batch_sizes:
            self.step([SeqChunk([1], 1, block_ids[:1]) for _ in range(n)], want_logits)
        if batch_sizes and prompt_tokens:
            # A decode's local prefill: a prompt's chunk beside running sequences in one step,
            # fresh (split into the graphs above, ``_split_at``) and continuing (eager).
            n = min(prompt_tokens, fresh_prompt_lengths(bs)[0])
            rows = [SeqChunk([1], 1, block_ids[:1]), SeqChunk([2], 1, block_ids[:1])]
            self.step([SeqChunk(tokens[:n], 0, main), *rows], want_logits)
            if 2 * n <= prompt_tokens:
                self.step([SeqChunk(tokens[n:2 * n], n, main), *rows], want_logits)
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize(self.cache.device)

    # --- internals -----------------------------------------------------------------------

    def _check_tokens(self, token_ids: Sequence[int]) -> None:
        """An out-of-range id would be a device-side assert on CUDA, fatal to the process."""
        bad = [t for t in token_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")

    def _check_table(self, block_ids: Sequence[int], num_tokens: int) -> None:
        need = kvc.num_table_blocks(num_tokens, self.cache.block_size, self.dcp)
        if len(block_ids) < need:
            raise ValueError(
                f"block table has {len(block_ids)} blocks, {num_tokens} tokens need {need} "
                f"(block_size {self.cache.block_size}, dcp {self.dcp})"
            )

    def _slots(self, chunks: Sequence[SeqChunk]) -> tuple[torch.Tensor, ...]:
        """Positions of every token of the step, and which of them this rank stores where
        (row, block id, offset): plain integer arithmetic on the host, then one copy each to
        the device, so a step costs no per-sequence device work or synchronisation."""
        bs, dcp, rank = self.cache.block_size, self.dcp, self.rank
        positions: list[int] = []
        mine: list[int] = []
        blk: list[int] = []
        off: list[int] = []
        row = 0
        for c in chunks:
            self._check_table(c.block_ids, c.start + len(c.tokens))
            table = c.block_ids
            for p in range(c.start, c.start + len(c.tokens)):
                g = p // bs
                positions.append(p)
                if dcp == 1 or g % dcp == rank:
                    mine.append(row)
                    blk.append(table[g // dcp])
                    off.append(p % bs)
                row += 1
        dev = self.cache.device
        return tuple(to_device(t, torch.long, dev) for t in (positions, mine, blk, off))

    def _forward(self, chunks: Sequence[SeqChunk],
                 after_layer: Callable[[int, int], None] | None = None,
                 embeds: torch.Tensor | None = None, normed: bool = True) -> torch.Tensor:
        cfg, w, dev = self.cfg, self.model.weights, self.model.device
        all_tokens = [t for c in chunks for t in c.tokens]
        self._check_tokens(all_tokens)
        if any(len(c.tokens) == 0 for c in chunks):
            raise ValueError("a chunk with no tokens")
        bounds = [0]
        for c in chunks:
            bounds.append(bounds[-1] + len(c.tokens))
        positions, mine, blk, off = self._slots(chunks)
        fresh = [i for i, c in enumerate(chunks) if c.start == 0]
        cached = [i for i, c in enumerate(chunks) if c.start > 0]
        views = self._cached_views(chunks, cached, bounds, w.embed.dtype)
        batch = self._fresh_rows(fresh, bounds, w.embed.dtype)
        positions = positions.to(dev)
        cos, sin = self.model.rotary.cos_sin(positions)
        if embeds is None:
            x = F.embedding(to_device(all_tokens, torch.long, dev), w.embed)
        else:
            if embeds.shape != (len(all_tokens), cfg.hidden_size):
                raise ValueError(f"embeds: need [{len(all_tokens)}, {cfg.hidden_size}], got "
                                 f"{list(embeds.shape)}")
            x = embeds.to(w.embed.dtype)
        for i, lw in enumerate(w.layers):
            layer = self.layer_base + i  # its latents' layer of the cache
            a = rms_norm(x, lw.input_norm, cfg.rms_norm_eps)
            q_nope, q_pe = project_q(a, lw.attn, cfg, cos, sin)
            latent = project_latent(a, lw.attn, cfg, cos, sin)
            if self.cache.fp8:  # quantised on write by the store kernel
                write_latents(self.cache.kv, layer, blk, off, None, latent[mine.to(latent.device)],
                              kv_lora_rank=cfg.kv_lora_rank)
            else:
                self.cache.write(layer, blk, off, latent[mine.to(latent.device)])
            latent = self.cache.stored(latent)  # fresh prompts attend over what is kept
            o = x.new_empty(x.shape[0], q_nope.shape[1], cfg.v_head_dim)
            if batch is not None:
                r, seg = batch
                o[r] = varlen_prefill_attention(q_nope[r], q_pe[r], latent[r], seg, lw.attn, cfg)
            else:
                for s in fresh:
                    a_, b_ = bounds[s], bounds[s + 1]
                    o[a_:b_] = prefill_attention(q_nope[a_:b_], q_pe[a_:b_], latent[a_:b_],
                                                 lw.attn, cfg)
            if views.decode_rows is not None:
                r = views.decode_rows
                q = absorb_q(q_nope[r], q_pe[r], lw.attn)
                o[r] = unabsorb_v(self._decode_attention(q, layer, views).to(x.dtype),
                                  lw.attn)
            if views.chunk_rows is not None:
                r = views.chunk_rows
                o[r] = self._chunk_attention(q_nope[r], q_pe[r], layer, lw, views).to(x.dtype)
            x = self._layer_rest(x, o, lw)
            if after_layer is not None:
                after_layer(i, len(w.layers))
        return rms_norm(x, w.norm, cfg.rms_norm_eps) if normed else x

    def _fresh_rows(
        self, fresh: Sequence[int], bounds: Sequence[int], dtype: torch.dtype
    ) -> FreshRows | None:
        """For the batched fresh path: the fresh prompts' rows of the step (a slice when they
        are one run, as in a step of prompts only) and, per row, the index of its prompt's first
        row among them. Built on the host, copied once per step; ``None`` keeps the per-prompt
        path. Under DCP every rank computes the fresh prompts whole, as the per-prompt path
        does."""
        dev = self.model.device
        if not batch_fresh_prompts(len(fresh), dev, dtype):
            return None
        rows: list[int] = []
        seg: list[int] = []
        for s in fresh:
            a, b = bounds[s], bounds[s + 1]
            seg.extend([len(rows)] * (b - a))
            rows.extend(range(a, b))
        seg_t = to_device(seg, torch.int32, dev)
        if rows[-1] - rows[0] + 1 == len(rows):
            return slice(rows[0], rows[-1] + 1), seg_t
        return to_device(rows, torch.long, dev), seg_t

    def _layer_rest(self, x: torch.Tensor, o: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        """A layer after attention: output projection, residual, MLP or MoE, residual; shared by
        the eager step and the captured decode step so both compute the same thing."""
        x, m = self._attn_residual(x, o, lw)
        return x + self._mlp(m, lw)

    def _attn_residual(self, x: torch.Tensor, o: torch.Tensor, lw: LayerWeights
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + o_proj(o), its post-attention norm)``: one kernel for the add and the norm."""
        lead = self.rank == 0  # adds the biases of row-sharded projections exactly once
        if lw.attn.o_bias is None:
            o = small_linear(o.flatten(1), lw.attn.o_proj)
        else:
            o = F.linear(o.flatten(1), lw.attn.o_proj, lw.attn.o_bias if lead else None)
        return _add_norm(x, self.comm.all_reduce(o) if self.tp > 1 else o, lw.post_norm,
                         self.cfg.rms_norm_eps)

    def _mlp(self, m: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        add_bias = self.rank == 0 or not lw.mlp_sharded
        if lw.moe is not None:
            y = moe(m, lw.moe, self.cfg, add_bias)
        else:
            assert lw.mlp is not None
            y = dense_mlp(m, lw.mlp, add_bias)
        return self.comm.all_reduce(y) if lw.mlp_sharded else y

    def _static_layers(
        self, x: torch.Tensor, buf: StaticDecode | StaticPrefill, attend: StaticAttend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers of a padded step, each one's projections, cache store and attention
        ``attend(layer, lw, normed input, cos, sin)``; returns the hidden rows before and after
        the final norm. Each layer's residual add after the MLP and the next layer's input
        norm (the final norm after the last) are one kernel (``add_rms_norm``), so a row's
        hidden state is read once between layers."""
        cfg, w = self.cfg, self.model.weights
        eps = cfg.rms_norm_eps
        cos, sin = self.model.rotary.cos_sin(buf.positions)
        a = rms_norm(x, w.layers[0].input_norm, eps)
        for i, lw in enumerate(w.layers):
            o = attend(i, lw, a, cos, sin)
            x, m = self._attn_residual(x, o, lw)
            nxt = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.norm
            x, a = _add_norm(x, self._mlp(m, lw), nxt, eps)
        return x, a

    def _cached_views(
        self, chunks: Sequence[SeqChunk], cached: Sequence[int], bounds: Sequence[int],
        dtype: torch.dtype,
    ) -> CachedViews:
        """Per sequence continuing a cached one: a prompt chunk gets its view (positions of its
        queries and of the local tokens it reads), or all of them one batch; decode tokens go
        into one padded block-table batch for the paged decode kernel. Built on the host,
        copied once per step."""
        bs, dev = self.cache.block_size, self.cache.device
        views = CachedViews()
        continuing = [chunks[s] for s in cached if len(chunks[s].tokens) > 1]
        if batch_continuing_chunks(len(continuing), dev, dtype):
            views.batch = self._chunk_batch(continuing)
        chunk_rows: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[Sequence[int]] = []
        decode_lens: list[int] = []
        for s in cached:
            c = chunks[s]
            end = c.start + len(c.tokens)
            n_local = kvc.local_token_count(end, bs, self.dcp, self.rank)
            if len(c.tokens) > 1:
                chunk_rows.extend(range(bounds[s], bounds[s + 1]))
                if views.batch is not None:
                    continue
                views.chunks.append(ChunkView(
                    table=to_device(list(c.block_ids), torch.long, dev),
                    n_local=n_local,
                    q_pos=torch.arange(c.start, end, device=dev),
                    k_pos=kvc.local_positions(n_local, bs, self.dcp, self.rank, dev),
                ))
                continue
            decode_rows.append(bounds[s])
            decode_tables.append(c.block_ids)
            decode_lens.append(n_local)
        if chunk_rows:
            views.chunk_rows = to_device(chunk_rows, torch.long, dev)
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            padded = [list(t) + [0] * (width - len(t)) for t in decode_tables]
            views.block_tables = to_device(padded, torch.int32, dev)
            views.seq_lens = to_device(decode_lens, torch.int32, dev)
            views.decode_rows = to_device(decode_rows, torch.long, dev)
        return views

    def _chunk_batch(self, chunks: Sequence[SeqChunk]) -> ChunkBatch:
        bs, dcp, rank = self.cache.block_size, self.dcp, self.rank
        shared = shared_prefix_entries(chunks, bs * dcp)
        blocks: list[int] = []
        q_pos: list[torch.Tensor] = []
        k_pos: list[torch.Tensor] = []
        q_lo: list[int] = []
        base = 0
        for c in chunks:
            end = c.start + len(c.tokens)
            n_local = kvc.local_token_count(end, bs, dcp, rank)
            nb = -(-n_local // bs)
            blocks.extend(c.block_ids[shared:nb])
            k_pos.append(kvc.local_positions(n_local, bs, dcp, rank)[shared * bs:] + base)
            k_pos.append(torch.arange(base + end, base + end + nb * bs - n_local))
            q_pos.append(torch.arange(base + c.start, base + end))
            q_lo.extend([base] * len(c.tokens))
            base += end + bs
        dev = self.cache.device
        q_pos_t = tensor_to_device(torch.cat(q_pos), dev)
        q_lo_t = to_device(q_lo, torch.long, dev)
        common = None
        if shared:
            common = SharedBlocks(
                blocks=to_device(list(chunks[0].block_ids[:shared]), torch.long, dev),
                k_pos=tensor_to_device(kvc.local_positions(shared * bs, bs, dcp, rank), dev),
                q_pos=q_pos_t - q_lo_t,  # each query's own position: its range starts at q_lo
            )
        return ChunkBatch(blocks=to_device(blocks, torch.long, dev), q_pos=q_pos_t,
                          k_pos=tensor_to_device(torch.cat(k_pos), dev), q_lo=q_lo_t,
                          shared=common)

    def _decode_attention(self, q: torch.Tensor, layer: int, views: CachedViews) -> torch.Tensor:
        """Absorbed ``q [N, Hl, L]`` of the step's decode tokens over their sequences' cached
        latent (this rank's chunks of it), as one batch through the paged kernel (Triton on
        CUDA), to this rank's heads' latent output ``[N, Hl, kv_lora]``; under DCP every rank
        attends with all heads and the partials merge by LSE in one go."""
        cfg = self.cfg
        assert views.block_tables is not None and views.seq_lens is not None
        if self.dcp > 1:
            q = self.comm.all_gather(q, dim=1)
        out, lse = paged_mla_decode(q, self.cache.kv, layer, views.block_tables, views.seq_lens,
                                    cfg.kv_lora_rank, cfg.softmax_scale)
        if self.dcp == 1:
            return out
        return dcp_merge(out, lse, self.comm)

    def _chunk_attention(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: int, lw: LayerWeights,
        views: CachedViews,
    ) -> torch.Tensor:
        """The step's continuing prompt chunks (rows in ``views.chunks`` order) over their
        sequences' cached latent, expanded into per-head keys and values as the one-pass prefill
        does, to this rank's heads' output ``[N, Hl, v]``. Under DCP, as for decode, every rank
        attends with all heads (queries and up-projections gathered over the group) over its
        own chunks, and the partials merge by LSE in one go."""
        cfg, comm = self.cfg, self.comm
        w_uk, w_uv = lw.attn.w_uk, lw.attn.w_uv
        if self.dcp > 1:
            nope = q_nope.shape[-1]
            q = comm.all_gather(torch.cat([q_nope, q_pe], -1), dim=1)
            q_nope, q_pe = q[..., :nope], q[..., nope:]
            w = comm.all_gather(torch.cat([w_uk, w_uv], 1), dim=0)
            w_uk, w_uv = w[:, :w_uk.shape[1]], w[:, w_uk.shape[1]:]
        n, h = q_nope.shape[0], q_nope.shape[1]
        cb = views.batch
        if cb is not None:
            out, lse = chunk_prefill_attention(
                q_nope, q_pe, self._read_blocks(layer, cb.blocks), cb.q_pos, cb.k_pos,
                w_uk, w_uv, cfg.softmax_scale, q_lo=cb.q_lo)
            sb = cb.shared
            if sb is not None:
                common = chunk_prefill_attention(
                    q_nope, q_pe, self._read_blocks(layer, sb.blocks), sb.q_pos, sb.k_pos,
                    w_uk, w_uv, cfg.softmax_scale)
                out, lse = merge_partials(*common, out, lse)
            return out if self.dcp == 1 else dcp_merge(out, lse, comm)
        out = torch.empty(n, h, cfg.v_head_dim, dtype=torch.float32, device=q_nope.device)
        lse = torch.empty(n, h, dtype=torch.float32, device=q_nope.device)
        a = 0
        for cv in views.chunks:
            b = a + cv.q_pos.shape[0]
            latent = self._read(layer, cv.table, cv.n_local)
            out[a:b], lse[a:b] = chunk_prefill_attention(
                q_nope[a:b], q_pe[a:b], latent, cv.q_pos, cv.k_pos, w_uk, w_uv,
                cfg.softmax_scale)
            a = b
        if self.dcp == 1:
            return out
        return dcp_merge(out, lse, comm)

    # --- decode steps padded to a bucket (engine/cuda_graphs.py) ---------------------------

    def _paddable(self, chunks: Sequence[SeqChunk]) -> bool:
        return (
            len(chunks) <= self.buckets[-1]
            and all(len(c.tokens) == 1 and c.start > 0 for c in chunks)
            and max(len(c.block_ids) for c in chunks) <= self.table_width
        )

    def _decode_padded(
        self, chunks: Sequence[SeqChunk], want_logits: bool
    ) -> torch.Tensor | None:
        buf = self._stage_decode(chunks)
        return self._replay_or_run(("decode", buf.tokens.shape[0], want_logits), len(chunks),
                                   lambda: self._decode_static(buf, want_logits))

    def _decode_padded_kept(self, chunks: Sequence[SeqChunk], want_logits: bool,
                            keep: Sequence[int]) -> torch.Tensor | None:
        """A padded decode step whose graph returns its rows' final normed hidden states; the
        rows ``keep`` names are kept, the logits taken from them after it."""
        buf = self._stage_decode(chunks)
        hidden = self._replay_or_run(("decode_kept", buf.tokens.shape[0], False), len(chunks),
                                     lambda: self._decode_static_hidden(buf))
        assert hidden is not None
        return self._keep_rows(chunks, hidden, want_logits, keep)

    def _stage_decode(self, chunks: Sequence[SeqChunk]) -> StaticDecode:
        """The bucket's static inputs filled for one-token rows (checked first)."""
        self._check_tokens([c.tokens[0] for c in chunks])
        for c in chunks:
            self._check_table(c.block_ids, c.start + 1)
        bucket = next(b for b in self.buckets if b >= len(chunks))
        buf = self._static.get(bucket)
        if buf is None:
            buf = StaticDecode.empty(bucket, self.table_width, self.cache.device)
            buf.num_splits = self._splits(bucket)
            self._static[bucket] = buf
        stage(buf, chunks, self.cache.block_size, self.dcp, self.rank)
        self.padded_steps += 1
        return buf

    def _split_at(self, chunks: Sequence[SeqChunk], want_logits: bool) -> int:
        """Where a step of fresh prompts followed by one-token rows of running sequences (a
        decode's local prefill beside its batch) splits into a padded prefill and a padded
        decode step; 0 where it does not. Eagerly, such a mixed step is the host launching
        every kernel of every layer (tens of ms on a GPU); split, it is two graph replays.
        The two parts share no sequence, so neither reads what the other writes."""
        if self.decode_mode == "eager":
            return 0
        k = next((i for i, c in enumerate(chunks) if c.start > 0), len(chunks))
        if not 0 < k < len(chunks):
            return 0
        head, tail = chunks[:k], chunks[k:]
        ok = self._prefill_paddable(head, want_logits) and self._paddable(tail)
        return k if ok else 0

    def runs_padded(self, chunks: Sequence[SeqChunk], want_logits: bool = True) -> bool:
        """Whether a step of these chunks runs as a padded (on CUDA: graphed) prefill."""
        return self._prefill_paddable(chunks, want_logits)

    def _prefill_paddable(self, chunks: Sequence[SeqChunk], want_logits: bool) -> bool:
        """Fresh prompts that a bucket holds; in graph mode not a bucket known to run eagerly
        (its experts need host syncs, or its capture failed): the padding would buy nothing
        there, so such steps run as given."""
        total = sum(len(c.tokens) for c in chunks)
        if not (self.prefill_buckets and len(chunks) <= PREFILL_MAX_PROMPTS
                and all(c.start == 0 and c.tokens for c in chunks)
                and total <= self.prefill_buckets[-1]):
            return False
        bucket = next(b for b in self.prefill_buckets if b >= total)
        return self.decode_mode != "graph" or ("prefill", bucket, want_logits) not in self._no_graph

    def _prefill_padded(self, chunks: Sequence[SeqChunk], want_logits: bool
                        ) -> torch.Tensor | None:
        buf = self._stage_prefill(chunks)
        return self._replay_or_run(("prefill", buf.tokens.shape[0], want_logits), len(chunks),
                                   lambda: self._prefill_static(buf, want_logits))

    def _prefill_padded_kept(self, chunks: Sequence[SeqChunk], want_logits: bool,
                             keep: Sequence[int]) -> torch.Tensor | None:
        """A padded prefill step whose graph returns every row's final normed hidden state;
        the rows of the chunks ``keep`` names are kept, the logits taken from the last rows
        after it."""
        buf = self._stage_prefill(chunks)
        rows = sum(len(c.tokens) for c in chunks)
        hidden = self._replay_or_run(("prefill_kept", buf.tokens.shape[0], False), rows,
                                     lambda: self._prefill_static_hidden(buf))
        assert hidden is not None
        return self._keep_rows(chunks, hidden, want_logits, keep)

    def _stage_prefill(self, chunks: Sequence[SeqChunk]) -> StaticPrefill:
        """The bucket's static inputs filled for fresh prompts (checked first)."""
        for c in chunks:
            self._check_tokens(c.tokens)
            self._check_table(c.block_ids, len(c.tokens))
        total = sum(len(c.tokens) for c in chunks)
        bucket = next(b for b in self.prefill_buckets if b >= total)
        buf = self._static_prefill.get(bucket)
        if buf is None:
            buf = StaticPrefill.empty(bucket, min(bucket, PREFILL_MAX_PROMPTS), self.cache.device)
            self._static_prefill[bucket] = buf
        stage_prefill(buf, chunks, self.cache.block_size, self.dcp, self.rank)
        self.padded_prefills += 1
        return buf

    def _replay_or_run(
        self, key: tuple[str, int, bool], rows: int, run: Callable[[], torch.Tensor | None]
    ) -> torch.Tensor | None:
        """A padded step's first ``rows`` rows of output: in graph mode its graph replayed
        (captured on first use), else ``run()`` eagerly. A replay's rows are copied out of the
        graph's own buffer, which the next replay overwrites."""
        kind, bucket, _ = key
        if (self.decode_mode == "graph" and key not in self._graphs
                and key not in self._no_graph and not self._capturable(bucket)):
            log.warning("%s bucket %d runs eagerly: its experts take the per-expert loop "
                        "(dtype without grouped GEMMs at this batch)", kind, bucket)
            self._no_graph.add(key)
        if self.decode_mode == "graph" and key not in self._no_graph:
            if key not in self._graphs:
                try:
                    self._graphs[key] = self._capture(run)
                except RuntimeError:
                    log.warning("CUDA graph capture of %s bucket %d failed; that bucket runs "
                                "eagerly", kind, bucket, exc_info=True)
                    self._no_graph.add(key)
            if key in self._graphs:
                graph, out = self._graphs[key]
                graph.replay()
                self._replayed = True
                return None if out is None else out[:rows].clone()
        out = run()
        return None if out is None else out[:rows]

    def _capturable(self, bucket: int) -> bool:
        """Whether every MoE layer's experts run without a host sync at this many tokens."""
        probe = torch.empty(bucket, self.cfg.hidden_size, dtype=self.model.dtype,
                            device=self.cache.device)
        return all(expert_path(probe, lw.moe, self.cfg.num_experts_per_tok) != "loop"
                   for lw in self.model.weights.layers if lw.moe is not None)

    def _splits(self, bucket: int) -> int | None:
        """The decode kernel's split count for a bucket, from the model's longest context
        rather than the table width (which follows the cache size), so two instances of one
        layout round the same step alike."""
        dev = self.cache.device
        if dev.type != "cuda":
            return None
        heads = self.cfg.num_attention_heads // self.tp * self.dcp
        groups = -(-heads // (16 if heads <= 16 else 32))
        bs = self.cache.block_size
        cap = kvc.num_table_blocks(max(1, self.cfg.max_position_embeddings), bs, self.dcp) * bs
        return num_splits_for(bucket, groups, cap, sm_count(dev))

    def share_graph_pool(self, other: RankEngine) -> None:
        """Capture into ``other``'s graph memory pool: graphs replayed one after another on
        one stream may share it, as each engine's buckets do (the MTP module's beside the main
        model's: its graphs then take little memory beyond what the main ones hold)."""
        if self.decode_mode == "graph" and other.decode_mode == "graph":
            if other._pool is None:
                other._pool = torch.cuda.graph_pool_handle()
            self._pool = other._pool

    def _capture(
        self, run: Callable[[], torch.Tensor | None]
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
        """Warm up on a side stream (kernel compilation, library handles, NCCL), then capture.
        Both runs write the same latents to the same slots; the capture itself executes
        nothing."""
        dev = self.cache.device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the KV pull threads may use CUDA while this thread captures
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = run()
        self.graph_captures += 1
        return graph, out

    def _decode_attend(self, buf: StaticDecode) -> StaticAttend:
        """A padded decode step's attention of layer ``i`` over ``buf``'s tables, after
        storing its rows' latents (masked)."""
        cfg, comm = self.cfg, self.comm

        def attend(i: int, lw: LayerWeights, a: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
            layer = self.layer_base + i
            q = absorbed_query_and_store(a, lw.attn, cfg, cos, sin, self.cache.kv, layer,
                                         buf.write_blocks, buf.write_offsets, buf.write_mask)
            if self.dcp > 1:
                q = comm.all_gather(q, dim=1)
            out, lse = paged_mla_decode(q, self.cache.kv, layer, buf.tables, buf.seq_lens,
                                        cfg.kv_lora_rank, cfg.softmax_scale, buf.num_splits)
            if self.dcp > 1:
                out = dcp_merge(out, lse, comm)
            return unabsorb_v_flat(out.to(a.dtype), lw.attn)

        return attend

    def _decode_static(self, buf: StaticDecode, want_logits: bool) -> torch.Tensor | None:
        """``_forward`` for one new token per row, reading only ``buf``'s tensors: no host
        values, no data-dependent shapes, so it can be captured."""
        hidden = self._decode_static_hidden(buf)  # every rank runs the layers
        return self._logits(hidden) if want_logits else None

    def _decode_static_hidden(self, buf: StaticDecode) -> torch.Tensor:
        """The padded decode step's final normed hidden rows ``[B, H]``."""
        x = F.embedding(buf.tokens, self.model.weights.embed)
        return self._static_layers(x, buf, self._decode_attend(buf))[1]

    def _rows_padded(self, chunks: Sequence[SeqChunk], hidden: torch.Tensor) -> torch.Tensor:
        """``hidden_from`` for one-token rows padded to their bucket (padded rows: a zero
        hidden state, token 0 at position 0, nothing stored)."""
        buf = self._stage_decode(chunks)
        n = len(chunks)
        if buf.hidden is None:
            buf.hidden = torch.zeros(buf.tokens.shape[0], self.cfg.hidden_size,
                                     dtype=self.model.dtype, device=self.cache.device)
        buf.hidden[:n].copy_(hidden)
        buf.hidden[n:].zero_()
        out = self._replay_or_run(("rows", buf.tokens.shape[0], False), n,
                                  lambda: self._rows_static(buf))
        assert out is not None
        return out

    def _rows_static(self, buf: StaticDecode) -> torch.Tensor:
        """``hidden_from``'s padded step, reading only ``buf``'s tensors (capturable)."""
        assert self.input_fn is not None and buf.hidden is not None
        x = self.input_fn(buf.tokens, buf.positions, buf.hidden)
        return self._static_layers(x, buf, self._decode_attend(buf))[0]

    def _prefill_static(self, buf: StaticPrefill, want_logits: bool) -> torch.Tensor | None:
        """``_forward`` for fresh prompts padded to their bucket, reading only ``buf``'s
        tensors (capturable): every rank attends over the whole prompts, as the eager path
        does, and stores its own chunks' latents. ``[P, V]`` logits, a row per prompt's last
        token (rows past the prompts: row 0's)."""
        hidden = self._prefill_static_hidden(buf)
        return self._logits(hidden.index_select(0, buf.last)) if want_logits else None

    def _prefill_static_hidden(self, buf: StaticPrefill) -> torch.Tensor:
        """The padded prefill's final normed hidden rows ``[B, H]``."""
        cfg, w = self.cfg, self.model.weights

        def attend(i: int, lw: LayerWeights, a: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
            q_nope, q_pe, latent = project_and_store(
                a, lw.attn, cfg, cos, sin, self.cache.kv, self.layer_base + i, buf.write_blocks,
                buf.write_offsets, buf.write_mask, want_latent=True)
            assert latent is not None
            # fresh prompts attend over what is kept (an FP8 cache's rounded latents)
            return varlen_prefill_attention(q_nope, q_pe, self.cache.stored(latent),
                                            buf.seg_start, lw.attn, cfg)

        return self._static_layers(F.embedding(buf.tokens, w.embed), buf, attend)[1]

    def _read_blocks(self, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
        """Every token of ``block_ids`` of ``layer`` as latents of the model's dtype; an FP8
        cache's through the dequantising reader (one pass on CUDA)."""
        if not self.cache.fp8:
            return self.cache.read_blocks(layer, block_ids)
        return read_latent_blocks(self.cache.kv, layer, block_ids,
                                  kv_lora_rank=self.cfg.kv_lora_rank, dtype=self.cache.dtype)

    def _read(self, layer: int, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` latents held in ``block_ids``, as ``_read_blocks``."""
        if not self.cache.fp8:
            return self.cache.read(layer, block_ids, num_tokens)
        if num_tokens == 0:
            return torch.empty(0, self.cfg.latent_dim, dtype=self.cache.dtype,
                               device=self.cache.device)
        return read_latents(self.cache.kv, layer, block_ids, num_tokens,
                            kv_lora_rank=self.cfg.kv_lora_rank, dtype=self.cache.dtype)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.model.weights.lm_head).float()
