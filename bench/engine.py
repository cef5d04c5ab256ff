"""Prefill and decode of a DeepSeek-V2-Lite-sized model on one GPU against same-run ceilings.

The model has V2-Lite's dimensions (27 layers, hidden 2048, 16 heads, latent 512 + rope 64,
64 routed experts top-6 + 2 shared, first layer dense, vocab 102400) with random bf16 weights made
on the device, so no checkpoint is needed. Measured, each against a yardstick from the same run:

- prefill tokens/s at 1k and 8k tokens, as a fraction of a bf16 matmul's FLOP/s (the FLOPs a
  prompt needs: projections, the experts its tokens route to, causal attention);
- chunked prefill of 8k and 32k tokens (128k with ``--long``) through ``RankEngine.step``, one
  step per chunk of ``--chunk`` tokens continuing the sequence, as the scheduler runs a long
  prompt, against the same FLOP count and beside the one-pass prefill of the same prompt;
- decode time per step at batch x context, eager and replayed from a CUDA graph, as a fraction of
  the roofline: the bytes one step must read (attention and dense weights, the experts the batch
  routes to, lm_head, every sequence's KV) over the same-run HBM read rate;
- the paged decode attention kernel alone at long contexts against that read rate.

The decode step is a per-layer loop over the model's functions (the paged decode kernel, the
grouped-GEMM MoE, the dense projections) with static shapes, so it can be graph-captured. Every
decode row is also timed through the serving engine, ``RankEngine.step`` (host work included),
eager and replayed from the engine's CUDA graph of the batch's bucket; ``--engine`` adds batch-1
prefill and decode through ``RankEngine.prefill``/``decode_step``.

    python bench/engine.py --device cuda --json /tmp/engine.json
    python bench/engine.py --device cpu --small        # smoke run, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))

from pdd_sidecar.model import fusion  # noqa: E402
from pdd_sidecar.model.config import ModelConfig, RopeConfig  # noqa: E402
from pdd_sidecar.model.kernels import chunk_attention as ca  # noqa: E402
from pdd_sidecar.model.kernels import mla_decode as md  # noqa: E402
from pdd_sidecar.model.kernels.dense_gemv import small_linear  # noqa: E402
from pdd_sidecar.model.kernels.norm_rope import add_rms_norm  # noqa: E402
from pdd_sidecar.model.mla import (  # noqa: E402
    absorb_q,
    absorbed_query_and_store,
    prefill_attention,
    project_latent,
    project_q,
    rms_norm,
    unabsorb_v_flat,
)
from pdd_sidecar.model.moe import dense_mlp, moe, route  # noqa: E402
from pdd_sidecar.model.rope import Rotary  # noqa: E402
from pdd_sidecar.model.weights import (  # noqa: E402
    AttnWeights,
    LayerWeights,
    MLPWeights,
    MoEWeights,
    RankWeights,
    fuse_input_projections,
)

try:
    import triton
    import triton.language as tl
except ImportError:
    HAS_TRITON = False
else:
    HAS_TRITON = True


def v2_lite_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        num_hidden_layers=27,
        num_attention_heads=16,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        moe_intermediate_size=1408,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        max_position_embeddings=163840,
        rope=RopeConfig(
            rope_type="yarn",
            theta=10000.0,
            factor=40.0,
            original_max_position_embeddings=4096,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
    )


def v3_width_config(layers: int = 2) -> ModelConfig:
    """DeepSeek-V3's widths (7,168 hidden, 128 heads, 256 routed experts of 2,048, top 8, one
    shared, a 129,280-token head) in ``layers`` MoE layers, as many as one GPU holds (a layer's
    experts are 22.5 GB in bf16); its router in the greedy softmax form and its query
    projection unfactored, which change neither the experts read nor the step's shape."""
    return v2_lite_config().replace(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=layers,
        num_attention_heads=128,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=0,
    )


def small_config() -> ModelConfig:
    return v2_lite_config().replace(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        moe_intermediate_size=64,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
    )


def random_weights(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> RankWeights:
    """tp-1 weights drawn on the device, scaled 1/sqrt(fan_in) so activations stay O(1)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def lin(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, device=device, dtype=dtype, generator=g)
        return t.mul_(shape[-1] ** -0.5)

    def norm(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    h, heads = cfg.hidden_size, cfg.num_attention_heads
    layers = []
    for i in range(cfg.num_hidden_layers):
        attn = AttnWeights(
            q_proj=lin(heads * cfg.qk_head_dim, h),
            q_a_proj=None,
            q_a_bias=None,
            q_a_norm=None,
            q_b_proj=None,
            kv_a_proj=lin(cfg.latent_dim, h),
            kv_a_bias=None,
            kv_a_norm=norm(cfg.kv_lora_rank),
            w_uk=lin(heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank),
            w_uv=lin(heads, cfg.v_head_dim, cfg.kv_lora_rank),
            o_proj=lin(h, heads * cfg.v_head_dim),
            o_bias=None,
        )
        attn = fuse_input_projections(attn)
        dense, moe_w = None, None
        if cfg.is_moe_layer(i):
            e, inter = cfg.n_routed_experts or 0, cfg.moe_intermediate_size
            sh = inter * (cfg.n_shared_experts or 0)
            moe_w = MoEWeights(
                router=lin(e, h).float(),
                w_gate=lin(e, inter, h),
                w_up=lin(e, inter, h),
                w_down=lin(e, h, inter),
                shared=MLPWeights(lin(sh, h), lin(sh, h), lin(h, sh)) if sh else None,
            )
        else:
            inter = cfg.intermediate_size
            dense = MLPWeights(lin(inter, h), lin(inter, h), lin(h, inter))
        layers.append(LayerWeights(norm(h), norm(h), attn, dense, moe_w, mlp_sharded=False))
    embed = torch.randn(cfg.vocab_size, h, device=device, dtype=dtype, generator=g)
    return RankWeights(embed=embed, layers=layers, norm=norm(h), lm_head=lin(cfg.vocab_size, h))


# --- timing and ceilings --------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median seconds per call; CUDA events on the GPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


if HAS_TRITON:

    @triton.jit
    def _read_kernel(X, OUT, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n, other=0.0)
        tl.store(OUT + pid, tl.sum(x.to(tl.float32), 0))


def measure_ceilings(device: torch.device, small: bool) -> dict[str, float]:
    """HBM read (bytes/s: the best of a Triton read kernel and torch's sum), device copy
    (bytes read + written per second) and bf16 matmul FLOP/s, on random data."""
    n = (8 << 20) if small else (2 << 30)  # bf16 elements: 16 MiB / 4 GiB
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    reps = 5 if small else 20
    t_sum = time_fn(lambda: x.sum(dtype=torch.float32), device, reps)
    read = {"sum": 2 * n / t_sum}
    if device.type == "cuda" and HAS_TRITON:
        block = 8192
        out = torch.empty(-(-n // block), device=device, dtype=torch.float32)
        kernel: Any = _read_kernel
        t_k = time_fn(lambda: kernel[(out.numel(),)](x, out, n, BLOCK=block), device, reps)
        read["triton"] = 2 * n / t_k
    half = x[: n // 2]
    dst = torch.empty_like(half)
    t_copy = time_fn(lambda: dst.copy_(half), device, reps)
    m = 512 if small else 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    t_mm = time_fn(lambda: a @ b, device, reps)
    return {
        "hbm_read_Bps": max(read.values()),
        "read_sum_Bps": read["sum"],
        "read_triton_Bps": read.get("triton", float("nan")),
        "copy_Bps": 2 * (n // 2) * 2 / t_copy,
        "matmul_flops": 2 * m**3 / t_mm,
    }


# --- the model's per-layer loop ---------------------------------------------------------------


@dataclass
class Batch:
    """Static decode inputs (graph-capturable): one new token per sequence."""

    tokens: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64, the new token's position
    tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, positions + 1


class Model:
    def __init__(self, cfg: ModelConfig, w: RankWeights, device: torch.device) -> None:
        self.cfg, self.w, self.device = cfg, w, device
        self.rotary = Rotary(cfg.rope, cfg.qk_rope_head_dim, device)
        self._pre_c: Callable[..., tuple[torch.Tensor, torch.Tensor]] = self.pre
        self._post_c: Callable[..., torch.Tensor] = self.post

    def decode(
        self,
        kv: torch.Tensor,
        batch: Batch,
        record: list[torch.Tensor] | None = None,
        compiled: bool = False,
    ) -> torch.Tensor:
        """fp32 logits ``[B, V]``; writes each token's latent into ``kv`` first. ``record``
        collects each MoE layer's expert ids (untimed runs only). ``compiled``: the parts
        before and after attention go through ``torch.compile`` (fused elementwise work);
        the cache write and the paged kernel stay outside it."""
        cfg, w = self.cfg, self.w
        bs = kv.shape[2]
        cos, sin = self.rotary.cos_sin(batch.positions)
        blk = batch.tables.gather(1, (batch.positions // bs)[:, None].to(torch.int64))[:, 0]
        off = batch.positions % bs
        if fusion.fused() and record is None and not compiled:
            return self._decode_fused(kv, batch, cos, sin, blk, off)
        pre, post = (self._pre_c, self._post_c) if compiled else (self.pre, self.post)
        x = F.embedding(batch.tokens, w.embed)
        for i, lw in enumerate(w.layers):
            q, latent = pre(x, lw, cos, sin)
            kv[blk, i, off] = latent
            o, _ = md.paged_mla_decode(
                q, kv, i, batch.tables, batch.seq_lens, cfg.kv_lora_rank, cfg.softmax_scale
            )
            if record is not None and lw.moe is not None:
                x_mid = x + self._attn_out(o, x.dtype, lw)
                m = rms_norm(x_mid, lw.post_norm, cfg.rms_norm_eps)
                record.append(route(m, lw.moe.router, cfg)[1])
            x = post(x, o, lw)
        return F.linear(rms_norm(x, w.norm, cfg.rms_norm_eps), w.lm_head).float()

    def _decode_fused(
        self, kv: torch.Tensor, batch: Batch, cos: torch.Tensor, sin: torch.Tensor,
        blk: torch.Tensor, off: torch.Tensor,
    ) -> torch.Tensor:
        """``decode`` on the fused kernels, as ``RankEngine``'s padded step runs them: one
        GEMV for the query and the latent, RoPE with the store, the residual adds with the
        norms, the one-kernel router (and the shared experts in the GEMV at small batches)."""
        cfg, w = self.cfg, self.w
        eps = cfg.rms_norm_eps
        mask = torch.ones_like(blk, dtype=torch.int32)
        x = F.embedding(batch.tokens, w.embed)
        a = rms_norm(x, w.layers[0].input_norm, eps)
        for i, lw in enumerate(w.layers):
            q = absorbed_query_and_store(a, lw.attn, cfg, cos, sin, kv, i, blk, off, mask)
            o, _ = md.paged_mla_decode(
                q, kv, i, batch.tables, batch.seq_lens, cfg.kv_lora_rank, cfg.softmax_scale
            )
            o = small_linear(unabsorb_v_flat(o.to(x.dtype), lw.attn), lw.attn.o_proj)
            x, m = add_rms_norm(x, o, lw.post_norm, eps)
            nxt = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.norm
            x, a = add_rms_norm(x, self._mlp(m, lw, None), nxt, eps)
        return F.linear(a, w.lm_head).float()

    def pre(
        self, x: torch.Tensor, lw: LayerWeights, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed query ``[B, H, L]`` and the cache entry ``[B, L]`` of each new token."""
        a = rms_norm(x, lw.input_norm, self.cfg.rms_norm_eps)
        q_nope, q_pe = project_q(a, lw.attn, self.cfg, cos, sin)
        latent = project_latent(a, lw.attn, self.cfg, cos, sin).to(x.dtype)
        return absorb_q(q_nope, q_pe, lw.attn), latent

    def _attn_out(self, o: torch.Tensor, dtype: torch.dtype, lw: LayerWeights) -> torch.Tensor:
        o = torch.einsum("bhc,hvc->bhv", o.to(dtype), lw.attn.w_uv)
        return F.linear(o.flatten(1), lw.attn.o_proj)

    def post(self, x: torch.Tensor, o: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        """Attention output projection, residual, then the MLP or MoE and its residual."""
        x = x + self._attn_out(o, x.dtype, lw)
        return x + self._mlp(rms_norm(x, lw.post_norm, self.cfg.rms_norm_eps), lw, None)

    def compile(self) -> None:
        self._pre_c = torch.compile(self.pre, dynamic=False)
        self._post_c = torch.compile(self.post, dynamic=False)

    def prefill(self, kv: torch.Tensor, tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """One prompt from position 0 (fused attention, latents written to ``kv``); fp32
        logits of its last token."""
        cfg, w = self.cfg, self.w
        bs = kv.shape[2]
        pos = torch.arange(tokens.shape[0], device=tokens.device)
        cos, sin = self.rotary.cos_sin(pos)
        blk, off = table[pos // bs].long(), pos % bs
        x = F.embedding(tokens, w.embed)
        for i, lw in enumerate(w.layers):
            a = rms_norm(x, lw.input_norm, cfg.rms_norm_eps)
            q_nope, q_pe = project_q(a, lw.attn, cfg, cos, sin)
            latent = project_latent(a, lw.attn, cfg, cos, sin)
            kv[blk, i, off] = latent.to(kv.dtype)
            o = prefill_attention(q_nope, q_pe, latent, lw.attn, cfg)
            x = x + F.linear(o.flatten(1), lw.attn.o_proj)
            x = x + self._mlp(rms_norm(x, lw.post_norm, cfg.rms_norm_eps), lw, None)
        return F.linear(rms_norm(x[-1:], w.norm, cfg.rms_norm_eps), w.lm_head).float()

    def _mlp(
        self, m: torch.Tensor, lw: LayerWeights, record: list[torch.Tensor] | None
    ) -> torch.Tensor:
        if lw.moe is None:
            assert lw.mlp is not None
            return dense_mlp(m, lw.mlp)
        if record is not None:
            record.append(route(m, lw.moe.router, self.cfg)[1])
        return moe(m, lw.moe, self.cfg)


# --- byte and FLOP counts ----------------------------------------------------------------------


def _nbytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def step_bytes(
    cfg: ModelConfig, w: RankWeights, experts_used: list[int], batch: int, kv_tokens: int
) -> dict[str, int]:
    """Bytes one decode step must read: each weight it uses once, the routed experts its tokens
    chose (``experts_used`` per MoE layer), ``batch`` embedding rows and every cached latent."""
    attn = dense = shared = routed = 0
    moe_i = 0
    for lw in w.layers:
        a = lw.attn
        attn += _nbytes(a.q_proj, a.q_a_proj, a.q_a_norm, a.q_b_proj, a.kv_a_proj, a.kv_a_norm)
        attn += _nbytes(a.w_uk, a.w_uv, a.o_proj, lw.input_norm, lw.post_norm)
        if lw.moe is not None:
            mw = lw.moe
            per_expert = _nbytes(mw.w_gate[0], mw.w_up[0], mw.w_down[0])
            routed += experts_used[moe_i] * per_expert
            moe_i += 1
            shared += _nbytes(mw.router)
            if mw.shared is not None:
                shared += _nbytes(mw.shared.gate, mw.shared.up, mw.shared.down)
        else:
            assert lw.mlp is not None
            dense += _nbytes(lw.mlp.gate, lw.mlp.up, lw.mlp.down)
    head = _nbytes(w.lm_head, w.norm) + batch * cfg.hidden_size * w.embed.element_size()
    kv = kv_tokens * cfg.num_hidden_layers * cfg.latent_dim * w.embed.element_size()
    return {
        "attn_weights": attn,
        "dense_mlp": dense,
        "shared_and_router": shared,
        "routed_experts": routed,
        "head_embed": head,
        "kv": kv,
    }


def prefill_flops(cfg: ModelConfig, t: int) -> float:
    """Matmul FLOPs of a ``t``-token prompt: projections, the expansion of the latent into
    per-head keys and values, causal attention (half the square), the experts each token uses,
    and lm_head for the last token."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    per_tok = heads * cfg.qk_head_dim * h + cfg.latent_dim * h + h * heads * cfg.v_head_dim
    per_tok += heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank
    attn_layer = heads * t * (t + 1) / 2 * (cfg.qk_head_dim + cfg.v_head_dim)
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        mlp = 3 * cfg.intermediate_size * h
        if cfg.is_moe_layer(i):
            inter = cfg.moe_intermediate_size
            n = cfg.num_experts_per_tok + (cfg.n_shared_experts or 0)
            mlp = 3 * inter * h * n + (cfg.n_routed_experts or 0) * h
        total += 2 * t * (per_tok + mlp) + 2 * attn_layer
    return total + 2 * cfg.vocab_size * h


# --- the measurements -----------------------------------------------------------------------


def make_batch(
    b: int, ctx: int, bs: int, num_blocks: int, cfg: ModelConfig, device: torch.device, seed: int
) -> Batch:
    """``b`` sequences of ``ctx`` cached tokens plus the new one, tables of shuffled blocks."""
    per = -(-(ctx + 1) // bs)
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randperm(num_blocks, device=device, generator=g)[: b * per]
    return Batch(
        tokens=torch.randint(0, cfg.vocab_size, (b,), device=device, generator=g),
        positions=torch.full((b,), ctx, device=device, dtype=torch.int64),
        tables=ids.view(b, per).to(torch.int32),
        seq_lens=torch.full((b,), ctx + 1, device=device, dtype=torch.int32),
    )


def graph_of(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench_decode(
    model: Model,
    kv: torch.Tensor,
    b: int,
    ctx: int,
    ceil: dict[str, float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    cfg, dev = model.cfg, model.device
    batch = make_batch(b, ctx, kv.shape[2], kv.shape[0], cfg, dev, seed=b * 7919 + ctx)
    record: list[torch.Tensor] = []
    model.decode(kv, batch, record)
    used = [int(torch.unique(ids).numel()) for ids in record]
    t_eager = time_fn(lambda: model.decode(kv, batch), dev, args.reps)
    t_graph = float("nan")
    if dev.type == "cuda" and not args.no_graphs:
        replay = graph_of(lambda: model.decode(kv, batch), dev)
        t_graph = time_fn(replay, dev, args.reps * 3)
        del replay
    parts = step_bytes(cfg, model.w, used, b, b * (ctx + 1))
    total = sum(parts.values())
    roof = total / ceil["hbm_read_Bps"]
    best = min(t_eager, t_graph) if not math.isnan(t_graph) else t_eager
    return {
        "batch": b,
        "context": ctx,
        "eager_ms": t_eager * 1e3,
        "graph_ms": t_graph * 1e3,
        "roofline_ms": roof * 1e3,
        "of_roofline": roof / best,
        "bytes": total,
        "bytes_parts": parts,
        "experts_used_mean": statistics.mean(used) if used else 0.0,
        "tokens_per_s": b / best,
    }


def engine_over(model: Model, kv: torch.Tensor, mode: str) -> Any:
    """A ``RankEngine`` (the serving path) over the bench's weights and KV tensor."""
    from pdd_sidecar.engine.comm import SingleComm
    from pdd_sidecar.engine.rank_engine import RankEngine
    from pdd_sidecar.kv.cache import PagedKVCache
    from pdd_sidecar.model.rank_model import RankModel

    cfg, dev = model.cfg, model.device
    cache = PagedKVCache(1, cfg.num_hidden_layers, kv.shape[2], cfg.latent_dim, kv.dtype, dev)
    cache.kv, cache.num_blocks = kv, kv.shape[0]  # the engine reads and writes; allocates none
    rm = RankModel(cfg, model.w, model.rotary, 0, 1, kv.dtype, dev)
    return RankEngine(rm, cache, SingleComm(), decode_mode=mode)


def bench_engine_decode(
    model: Model, kv: torch.Tensor, b: int, ctx: int, args: argparse.Namespace
) -> dict[str, float]:
    """One decode step of ``b`` sequences through ``RankEngine.step``, host work included:
    eager, and replayed from the engine's CUDA graph of the batch's bucket."""
    cfg, dev = model.cfg, model.device
    batch = make_batch(b, ctx, kv.shape[2], kv.shape[0], cfg, dev, seed=b * 7919 + ctx)
    from pdd_sidecar.engine.seq_chunk import SeqChunk

    tables = batch.tables.tolist()
    toks = batch.tokens.tolist()
    chunks = [SeqChunk([toks[i]], ctx, tables[i]) for i in range(b)]
    out: dict[str, float] = {}
    modes = ["eager"] + (["graph"] if dev.type == "cuda" and not args.no_graphs else [])
    for mode in modes:
        eng = engine_over(model, kv, mode)
        t0 = time.perf_counter()
        eng.step(chunks)  # the graph's capture
        sync(dev)
        if mode == "graph":
            out["engine_capture_s"] = time.perf_counter() - t0
        out[f"engine_{mode}_ms"] = time_fn(lambda e=eng: e.step(chunks), dev, args.reps) * 1e3
        del eng
    return out


def bench_compiled(
    model: Model,
    kv: torch.Tensor,
    b: int,
    ctx: int,
    ceil: dict[str, float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The decode step with the work around attention through ``torch.compile`` (fusing the
    small elementwise kernels), replayed from a CUDA graph; compile time reported apart."""
    cfg, dev = model.cfg, model.device
    batch = make_batch(b, ctx, kv.shape[2], kv.shape[0], cfg, dev, seed=b * 7919 + ctx)
    t0 = time.perf_counter()
    model.decode(kv, batch, compiled=True)
    sync(dev)
    compile_s = time.perf_counter() - t0
    replay = graph_of(lambda: model.decode(kv, batch, compiled=True), dev)
    t = time_fn(replay, dev, args.reps * 3)
    record: list[torch.Tensor] = []
    model.decode(kv, batch, record)
    used = [int(torch.unique(ids).numel()) for ids in record]
    roof = sum(step_bytes(cfg, model.w, used, b, b * (ctx + 1)).values()) / ceil["hbm_read_Bps"]
    return {
        "batch": b,
        "context": ctx,
        "compiled_graph_ms": t * 1e3,
        "roofline_ms": roof * 1e3,
        "of_roofline": roof / t,
        "compile_s": compile_s,
    }


def bench_attention(
    kv: torch.Tensor,
    cfg: ModelConfig,
    b: int,
    ctx: int,
    ceil: dict[str, float],
    args: argparse.Namespace,
    **kernel: int,
) -> dict[str, Any]:
    """The decode kernel alone over ``b`` sequences of ``ctx`` tokens: one call per layer, so
    consecutive calls read different memory (not the L2), replayed from a CUDA graph so launch
    gaps do not count."""
    dev = kv.device
    batch = make_batch(b, ctx - 1, kv.shape[2], kv.shape[0], cfg, dev, seed=ctx + b)
    g = torch.Generator(device=dev).manual_seed(ctx)
    q = torch.randn(b, cfg.num_attention_heads, cfg.latent_dim, device=dev, generator=g)
    q = q.to(kv.dtype)
    layers = kv.shape[1]

    def call(layer: int) -> object:
        args_ = (q, kv, layer, batch.tables, batch.seq_lens, cfg.kv_lora_rank, 0.07)
        if dev.type == "cuda" and md.HAS_TRITON:
            return md.paged_mla_decode_triton(*args_, **kernel)  # type: ignore[arg-type]
        return md.paged_mla_decode_ref(*args_)

    def every_layer() -> None:
        for i in range(layers):
            call(i)

    run = graph_of(every_layer, dev) if dev.type == "cuda" else every_layer
    t = time_fn(run, dev, args.reps, warmup=2) / layers
    nbytes = b * ctx * cfg.latent_dim * kv.element_size()
    return {
        "batch": b,
        "context": ctx,
        "kernel": kernel,
        "ms": t * 1e3,
        "GBps": nbytes / t / 1e9,
        "of_hbm_read": nbytes / t / ceil["hbm_read_Bps"],
    }


def bench_moe(
    model: Model, t: int, ceil: dict[str, float], args: argparse.Namespace
) -> dict[str, Any]:
    """Routed experts alone for ``t`` tokens (every MoE layer once, graph-replayed): the GEMV
    kernels and the grouped GEMMs, against the bytes of the experts the tokens chose."""
    from pdd_sidecar.model.kernels.moe_grouped import HAS_TRITON as MOE_TRITON
    from pdd_sidecar.model.kernels.moe_grouped import grouped_experts, loop_experts

    cfg, dev = model.cfg, model.device
    layers = [lw.moe for lw in model.w.layers if lw.moe is not None]
    g = torch.Generator(device=dev).manual_seed(t)
    x = torch.randn(t, cfg.hidden_size, device=dev, generator=g).to(layers[0].w_gate.dtype)
    routes = [route(x, mw.router, cfg) for mw in layers]
    used = statistics.mean(int(torch.unique(ids).numel()) for _, ids in routes)
    per_expert = _nbytes(layers[0].w_gate[0], layers[0].w_up[0], layers[0].w_down[0])
    nbytes = used * per_expert
    row: dict[str, Any] = {"tokens": t, "experts_used_mean": used, "bytes": nbytes}
    Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, MoEWeights], torch.Tensor]
    modes: dict[str, Fn] = {"loop": loop_experts}
    if dev.type == "cuda":
        modes = {"grouped_mm": lambda x, wt, ids, mw: grouped_experts(x, wt, ids, mw, False)}
        if MOE_TRITON:
            modes["gemv"] = lambda x, wt, ids, mw: grouped_experts(x, wt, ids, mw, True)
    for name, fn in modes.items():

        def every_layer(fn: Fn = fn) -> None:
            for mw, (wt, ids) in zip(layers, routes, strict=True):
                fn(x, wt, ids, mw)

        run = graph_of(every_layer, dev) if dev.type == "cuda" else every_layer
        sec = time_fn(run, dev, args.reps, warmup=2) / len(layers)
        row[f"{name}_us"] = sec * 1e6
        row[f"{name}_of_hbm"] = nbytes / sec / ceil["hbm_read_Bps"]
    return row


def kernel_times(fn: Callable[[], object], device: torch.device) -> list[tuple[str, float]]:
    """``(kernel name, GPU seconds)`` of every kernel one call of ``fn`` ran, in launch order,
    from the profiler's CUDA activity (kernels replayed from a CUDA graph included where the
    profiler reports them). Memory copies and sets count as kernels too: they take the stream."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    sync(device)
    acts = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    out = []
    for ev in prof.events():
        dt = getattr(ev, "device_type", None)
        on_device = dt is not None and "CUDA" in str(dt)
        if device.type == "cuda" and not on_device:
            continue
        us: float = (ev.device_time if hasattr(ev, "device_time") else ev.cuda_time) or 0.0
        if device.type != "cuda":
            if ev.cpu_children:  # the CPU has no kernels: count the leaves of the op tree
                continue
            us = ev.cpu_time
        out.append((ev.name, float(us) * 1e-6))
    return out


def short_kernel_name(name: str, width: int = 64) -> str:
    """A kernel's name without template arguments and parameter lists, cut to ``width``."""
    depth, keep = 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
        elif depth == 0:
            keep.append(ch)
    short = "".join(keep).replace("void ", "").strip() or name
    short = short.rsplit("::", 1)[-1] if "at::native" in name else short
    return short[:width]


def group_kernels(
    times: list[tuple[str, float]], layers: int, step_s: float
) -> list[dict[str, Any]]:
    """Kernel times grouped by (short) name, most time first: calls and GPU time per step, per
    layer (divided by ``layers``) and as a share of ``step_s`` (the step's wall time)."""
    groups: dict[str, list[float]] = {}
    for name, sec in times:
        groups.setdefault(short_kernel_name(name), []).append(sec)
    rows = [
        {
            "kernel": k,
            "calls": len(v),
            "us_per_step": sum(v) * 1e6,
            "us_per_layer": sum(v) * 1e6 / layers,
            "us_per_call": sum(v) * 1e6 / len(v),
            "of_step": sum(v) / step_s if step_s > 0 else float("nan"),
        }
        for k, v in groups.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def breakdown(
    fn: Callable[[], object], device: torch.device, layers: int, step_s: float, rows: int = 24
) -> tuple[str, dict[str, Any]]:
    """Where one call's time goes: the kernels it ran grouped by name, per step and per layer,
    against ``step_s`` (its timed wall time); the gap is launch and idle time between kernels."""
    times = kernel_times(fn, device)
    groups = group_kernels(times, layers, step_s)
    busy = sum(s for _, s in times)
    lines = [f"{'kernel':<64} {'calls':>6} {'us/step':>9} {'us/layer':>9} {'us/call':>8} "
             f"{'of step':>8}"]  # fmt: skip
    for g in groups[:rows]:
        lines.append(f"{g['kernel']:<64} {g['calls']:>6} {g['us_per_step']:>9.1f} "
                     f"{g['us_per_layer']:>9.2f} {g['us_per_call']:>8.2f} "
                     f"{g['of_step']:>7.1%}")  # fmt: skip
    if len(groups) > rows:
        rest = groups[rows:]
        lines.append(f"{f'({len(rest)} other kernels)':<64} {sum(g['calls'] for g in rest):>6} "
                     f"{sum(g['us_per_step'] for g in rest):>9.1f}")  # fmt: skip
    gap = step_s - busy
    share = gap / step_s if step_s else float("nan")
    lines.append(f"kernels {len(times)} ({len(times) / layers:.1f} a layer), busy "
                 f"{busy * 1e6:.0f} us, step {step_s * 1e6:.0f} us, between kernels "
                 f"{gap * 1e6:.0f} us ({share:.0%})")  # fmt: skip
    summary = {"kernels": len(times), "busy_us": busy * 1e6, "step_us": step_s * 1e6,
               "groups": groups}  # fmt: skip
    return "\n".join(lines), summary


def decode_breakdown(
    model: Model, kv: torch.Tensor, b: int, ctx: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Per-kernel time of one decode step of ``b`` sequences at ``ctx``: the bench's loop
    replayed from its CUDA graph (eager where there are no graphs) and, unless
    ``--no-engine``, ``RankEngine.step`` replayed from its bucket's graph, each against its
    own timed step."""
    cfg, dev = model.cfg, model.device
    layers = cfg.num_hidden_layers
    batch = make_batch(b, ctx, kv.shape[2], kv.shape[0], cfg, dev, seed=b * 7919 + ctx)
    graphs = dev.type == "cuda" and not args.no_graphs
    def step() -> object:
        return model.decode(kv, batch)

    loop: Callable[[], object] = graph_of(step, dev) if graphs else step
    runs: list[tuple[str, Callable[[], object]]] = [("loop " + ("graph" if graphs else "eager"),
                                                     loop)]
    if not args.no_engine:
        from pdd_sidecar.engine.seq_chunk import SeqChunk

        tables, toks = batch.tables.tolist(), batch.tokens.tolist()
        chunks = [SeqChunk([toks[i]], ctx, tables[i]) for i in range(b)]
        eng = engine_over(model, kv, "graph" if graphs else "eager")
        runs.append(("RankEngine.step " + ("graph" if graphs else "eager"),
                     lambda: eng.step(chunks)))
    out: dict[str, Any] = {"batch": b, "context": ctx}
    for name, fn in runs:
        sec = time_fn(fn, dev, args.reps * 2)
        text, summary = breakdown(fn, dev, layers, sec)
        if summary["kernels"] == 0 and graphs:  # the profiler saw no kernels inside the graph
            text += "\n(no kernels reported inside the graph: see the eager breakdown)"
        print(f"\nbreakdown: {name}, batch {b}, context {ctx}, {layers} layers "
              f"(step {sec * 1e3:.3f} ms)\n{text}", flush=True)
        out[name] = summary
    return out


def bench_prefill(
    model: Model, kv: torch.Tensor, t: int, ceil: dict[str, float], args: argparse.Namespace,
    graph_engine: Any = None,
) -> dict[str, Any]:
    """One prompt's eager one-pass prefill against its bound and, where ``graph_engine`` (a
    graph-mode ``engine_over``, shared by the rows: each bucket captured once) has a bucket for
    it, the serving path's time."""
    dev, cfg = model.device, model.cfg
    bs = kv.shape[2]
    g = torch.Generator(device=dev).manual_seed(t)
    tokens = torch.randint(0, cfg.vocab_size, (t,), device=dev, generator=g)
    table = torch.randperm(kv.shape[0], device=dev, generator=g)[: -(-t // bs)].to(torch.int32)
    reps = 1 if t > 32768 else max(3, args.reps // 3)
    sec = time_fn(lambda: model.prefill(kv, tokens, table), dev, reps, 1)
    flops = prefill_flops(cfg, t)
    bound = prefill_bound_s(cfg, model.w, t, ceil)
    row = {
        "tokens": t,
        "ms": sec * 1e3,
        "tokens_per_s": t / sec,
        "TFLOPS": flops / sec / 1e12,
        "of_matmul": flops / sec / ceil["matmul_flops"],
        "bound_ms": bound * 1e3,
        "of_bound": bound / sec,
        "graph_ms": float("nan"),
        "graph_of_bound": float("nan"),
    }
    from pdd_sidecar.engine.seq_chunk import SeqChunk

    if graph_engine is not None and t <= max(graph_engine.prefill_buckets, default=0):
        chunk = [SeqChunk(tokens.tolist(), 0, table.tolist())]
        g_sec = time_fn(lambda: graph_engine.step(chunk), dev, reps, 2)
        row.update(graph_ms=g_sec * 1e3, graph_of_bound=bound / g_sec)
    return row


def prefill_bound_s(cfg: ModelConfig, w: RankWeights, t: int, ceil: dict[str, float]) -> float:
    """The least time a ``t``-token prompt can take: its FLOPs at the matmul rate or the weights
    it must read at the HBM read rate, whichever is longer (a 1k prompt reads nearly every expert,
    about 96 tokens each, so its weights bound it). Distinct experts under uniform routing."""
    e, k = cfg.n_routed_experts or 0, cfg.num_experts_per_tok
    used = round(e * (1 - (1 - k / e) ** t)) if e else 0
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    nbytes = sum(step_bytes(cfg, w, [used] * n_moe, t, t).values())
    return max(prefill_flops(cfg, t) / ceil["matmul_flops"], nbytes / ceil["hbm_read_Bps"])


def bench_chunked_prefill(
    model: Model,
    kv: torch.Tensor,
    t: int,
    chunk: int,
    ceil: dict[str, float],
    one_pass: dict[str, Any] | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """A ``t``-token prompt through ``RankEngine.step`` in chunks of ``chunk`` tokens, each
    chunk a step continuing the sequence (logits of its last token, as rank 0 samples), beside
    ``one_pass`` (``bench_prefill``'s row for the same length). FLOPs: ``prefill_flops``, the
    one-pass count, so re-expanding the cached latent per chunk counts as overhead."""
    from pdd_sidecar.engine.seq_chunk import SeqChunk

    dev, cfg = model.device, model.cfg
    bs = kv.shape[2]
    g = torch.Generator(device=dev).manual_seed(t + 1)
    tokens = torch.randint(0, cfg.vocab_size, (t,), device=dev, generator=g).tolist()
    table = torch.randperm(kv.shape[0], device=dev, generator=g)[: -(-t // bs)].tolist()
    eng = engine_over(model, kv, "eager")
    steps = [SeqChunk(tokens[a:a + chunk], a, table) for a in range(0, t, chunk)]

    def run() -> None:
        for c in steps:
            eng.step([c])

    long = t > 32768
    sec = time_fn(run, dev, 1 if long else max(2, args.reps // 5), 1)
    flops = prefill_flops(cfg, t)
    row: dict[str, Any] = {
        "tokens": t,
        "chunk": chunk,
        "steps": len(steps),
        "s": sec,
        "TFLOPS": flops / sec / 1e12,
        "of_matmul": flops / sec / ceil["matmul_flops"],
    }
    h = ca.LAST_LAUNCH.get("fwd")  # absent on the CPU (the reference ran)
    if h is not None:
        row["kernel_regs_spills"] = [getattr(h, "n_regs", None), getattr(h, "n_spills", None)]
        row["kernel_config"] = ca.LAST_LAUNCH.get("config")
    if one_pass is not None:
        row["one_pass_s"] = one_pass.get("ms", float("nan")) / 1e3
        row["one_pass_of_matmul"] = one_pass.get("of_matmul", float("nan"))
    return row


def bench_batched_prefill(
    model: Model, kv: torch.Tensor, n: int, t: int, ceil: dict[str, float],
    args: argparse.Namespace, cached: int = 0,
) -> dict[str, Any]:
    """``n`` prompts of ``t`` new tokens in one ``RankEngine.step`` (logits of each last
    token, as the scheduler samples), fresh or each continuing ``|cached|`` tokens already in
    the cache (a prefix-cache hit's suffix; negative: in blocks all of them share), as the
    engine runs it (on CUDA their attention is one varlen kernel call per layer) and with one
    attention call per prompt, the path before it. FLOPs: those of the ``t`` new tokens of
    each, attending over ``|cached| + t``."""
    from pdd_sidecar.engine import rank_engine
    from pdd_sidecar.engine.seq_chunk import SeqChunk

    dev, cfg = model.device, model.cfg
    bs = kv.shape[2]
    shared, cached = cached < 0, abs(cached)
    per = -(-(cached + t) // bs)
    g = torch.Generator(device=dev).manual_seed(n * t + cached)
    blocks = torch.randperm(kv.shape[0], device=dev, generator=g)[: n * per].tolist()
    common = cached // bs if shared else 0
    chunks = [
        SeqChunk(torch.randint(0, cfg.vocab_size, (t,), generator=g, device=dev).tolist(),
                 cached, blocks[:common] + blocks[i * per + common:(i + 1) * per])
        for i in range(n)
    ]  # fmt: skip
    eng = engine_over(model, kv, "eager")
    reps = max(3, args.reps // 3)
    name = "batch_continuing_chunks" if cached else "batch_fresh_prompts"
    rule = getattr(rank_engine, name)
    batched = rule(n, dev, kv.dtype)
    sec = time_fn(lambda: eng.step(chunks), dev, reps, 1)
    try:
        setattr(rank_engine, name, lambda *_: False)
        sec_each = time_fn(lambda: eng.step(chunks), dev, reps, 1)
    finally:
        setattr(rank_engine, name, rule)
    flops = n * (prefill_flops(cfg, cached + t) - prefill_flops(cfg, cached))
    return {
        "prompts": n,
        "tokens": t,
        "cached": cached,
        "cached_shared": shared,
        "batched_attention": batched,
        "ms": sec * 1e3,
        "tokens_per_s": n * t / sec,
        "of_matmul": flops / sec / ceil["matmul_flops"],
        "per_prompt_attention_ms": sec_each * 1e3,
    }


def bench_engine_path(
    model: Model, dtype: torch.dtype, ctx: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Batch-1 decode and prefill through ``RankEngine`` (the serving path), when it imports."""
    try:
        from pdd_sidecar.engine.comm import SingleComm
        from pdd_sidecar.engine.rank_engine import RankEngine
        from pdd_sidecar.kv.cache import PagedKVCache
        from pdd_sidecar.model.rank_model import RankModel
    except Exception as e:  # the engine is optional here: report why it did not run
        return {"error": f"{type(e).__name__}: {e}"}
    cfg, dev = model.cfg, model.device
    bs = args.block_size
    cache = PagedKVCache(-(-(ctx + 8) // bs), cfg.num_hidden_layers, bs, cfg.latent_dim, dtype, dev)
    rm = RankModel(cfg, model.w, model.rotary, 0, 1, dtype, dev)
    eng = RankEngine(rm, cache, SingleComm())
    ids = list(range(cache.num_blocks))
    prompt = torch.randint(0, cfg.vocab_size, (ctx,)).tolist()
    try:
        t_pre = time_fn(lambda: eng.prefill(prompt, ids), dev, 3, 1)
        t_dec = time_fn(lambda: eng.decode_step(prompt[-1], ctx, ids), dev, args.reps, 2)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"context": ctx, "prefill_ms": t_pre * 1e3, "decode_ms": t_dec * 1e3}


# --- main ----------------------------------------------------------------------------------


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _batches_of_prompts(s: str) -> list[tuple[int, int, int]]:
    """``NxT`` (fresh), ``NxT+C`` (each continuing C cached tokens of its own) or ``NxT+Cs``
    (C cached tokens in blocks all N share, as prefix-cache hits of one system prompt) items,
    comma-separated; a shared C is given negative here."""
    out = []
    for item in filter(None, s.split(",")):
        n, _, rest = item.partition("x")
        t, _, c = rest.partition("+")
        cached = -int(c[:-1]) if c.endswith("s") else int(c or 0)
        out.append((int(n), int(t), cached))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny model (forced on the CPU)")
    p.add_argument("--batches", type=_ints, default=None, help="default 1,16,64,256")
    p.add_argument("--contexts", type=_ints, default=None, help="default 1024,4096,8192,32768")
    p.add_argument("--prefill", type=_ints, default=None, help="default 1024,8192")
    p.add_argument("--chunked", type=_ints, default=None,
                   help="prompt lengths prefilled in chunks through RankEngine.step; default "
                        "8192,32768 (and 131072 with --long)")
    p.add_argument("--chunk", type=int, default=None, help="chunk tokens (default 8192)")
    p.add_argument("--batched", type=_batches_of_prompts, default=None,
                   help="NxT,...: N fresh prompts of T tokens in one RankEngine.step; default "
                        "64x32,8x1024")
    p.add_argument("--long", action="store_true", help="also a 128k-token chunked prefill")
    p.add_argument("--chunk-config", type=_ints, default=None,
                   help="BLOCK_M,BLOCK_N,warps,stages: the chunk-attention kernel's first launch "
                        "config (default 128,64,8,2)")
    p.add_argument("--attn-contexts", type=_ints, default=None, help="default 32768,65536,131072")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--kv-gib", type=float, default=None,
                   help="KV cache budget on the device (default: free memory after the weights "
                        "less --headroom-gib)")
    p.add_argument("--headroom-gib", type=float, default=12.0,
                   help="device memory left beside the KV cache for activations, graphs and "
                        "the prefill rows (default 12)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--tune", action="store_true", help="sweep the decode kernel's tunables")
    p.add_argument("--gemv-sweep", action="store_true",
                   help="batch-1 tiles of the dense and expert GEMVs (CUDA)")
    p.add_argument("--engine", action="store_true", help="also time RankEngine at batch 1")
    p.add_argument("--no-engine", action="store_true",
                   help="skip the decode rows through RankEngine.step (eager and graph)")
    p.add_argument("--moe-tokens", type=_ints, default=None, help="default 1,4,16,64,256")
    p.add_argument(
        "--breakdown", type=_ints, default=None,
        help="B,ctx[,B,ctx...]: per-kernel GPU time of one decode step, grouped by kernel, per "
             "layer and against the step",
    )
    p.add_argument(
        "--compile",
        type=_ints,
        default=None,
        help="B,ctx,B,ctx,...: also time those decode steps with torch.compile around attention",
    )
    p.add_argument("--breakdown-prefill", type=int, default=None, help="tokens: per-kernel time")
    p.add_argument("--fusion", default=None,
                   help="comma list of the model's kernel paths the decode rows and breakdowns "
                        "time, each in this run: off (unfused), on (fused, defaults), options "
                        "after on: +shared=N (shared experts in the GEMV up to N tokens), "
                        "+router=apart, +dense=N (Triton GEMV for the dense projections up to N "
                        "tokens), +grouped=A-B (per-expert GEMV from A up to B tokens; N: from 2), "
                        "+pdl (programmatic dependent launches); default "
                        "off,on on CUDA, on on the CPU")
    p.add_argument("--breakdown-fusion", default=None,
                   help="the --fusion items the breakdowns run (default: all of them)")
    p.add_argument("--only", default="", help="comma list of sections: attn,moe,prefill,decode")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible")
    small = args.small or dev.type == "cpu"
    variants = [v.strip() for v in (args.fusion or ("off,on" if dev.type == "cuda" else "on")
                                    ).split(",") if v.strip()]
    for v in variants:
        try:
            with fusion_variant(v):
                pass
        except ValueError as e:
            p.error(str(e))
    cfg = small_config() if small else v2_lite_config()
    batches = args.batches or ([1, 4] if small else [1, 16, 64, 256])
    contexts = args.contexts or ([64, 256] if small else [1024, 4096, 8192, 32768])
    prefills = args.prefill or ([64, 256] if small else [1024, 8192])
    chunked = args.chunked or ([256] if small else [8192, 32768] + [131072] * args.long)
    chunk = args.chunk or (64 if small else 8192)
    batched = args.batched or ([(4, 16, 0), (2, 64, 0), (4, 16, 32), (4, 16, -32)] if small
                               else [(64, 32, 0), (8, 1024, 0), (64, 128, 2048),
                                     (64, 128, -2048)])
    if args.chunk_config:
        if len(args.chunk_config) != 4:
            p.error(f"--chunk-config takes BLOCK_M,BLOCK_N,warps,stages, got {args.chunk_config}")
        keys = ("block_m", "block_n", "num_warps", "num_stages")
        ca.CONFIGS.insert(0, dict(zip(keys, args.chunk_config, strict=True)))
    if chunk < 1:
        p.error(f"--chunk must be >= 1, got {chunk}")
    attn_ctx = args.attn_contexts or ([512] if small else [32768, 65536, 131072])
    dtype = torch.bfloat16
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    tv = triton.__version__ if HAS_TRITON else "none"
    print(f"engine bench: {'small' if small else 'DeepSeek-V2-Lite'} dims, bf16, {name}, "
          f"torch {torch.__version__}, triton {tv}", flush=True)  # fmt: skip
    result: dict[str, Any] = {"device": name, "torch": torch.__version__, "triton": tv}
    result["config"] = "small" if small else "v2-lite"

    ceil = measure_ceilings(dev, small)
    result["ceilings"] = ceil
    print(
        f"same-run ceilings: HBM read {ceil['hbm_read_Bps'] / 1e9:.0f} GB/s "
        f"(triton {ceil['read_triton_Bps'] / 1e9:.0f}, sum {ceil['read_sum_Bps'] / 1e9:.0f}), "
        f"copy {ceil['copy_Bps'] / 1e9:.0f} GB/s, bf16 matmul "
        f"{ceil['matmul_flops'] / 1e12:.1f} TFLOP/s",
        flush=True,
    )

    with torch.inference_mode():
        w = random_weights(cfg, dtype, dev)
        model = Model(cfg, w, dev)
        bs = args.block_size
        per_tok = cfg.num_hidden_layers * bs * cfg.latent_dim * 2
        args.kv_gib = kv_budget_gib(dev, args.kv_gib, args.headroom_gib, small)
        budget_blocks = int(args.kv_gib * 2**30 // per_tok)
        cases = [(b, c) for b in batches for c in contexts]
        fits = [(b, c) for b, c in cases if b * -(-(c + 1) // bs) <= budget_blocks]
        need = [b * -(-(c + 1) // bs) for b, c in fits]
        attn_batch = 2 if small else 16
        need += [-(-c // bs) for c in attn_ctx + prefills + chunked]
        need += [n * -(-(t + abs(c)) // bs) for n, t, c in batched]
        need += [attn_batch * -(-attn_ctx[0] // bs)]
        num_blocks = max(need)
        kv = torch.empty(
            num_blocks, cfg.num_hidden_layers, bs, cfg.latent_dim, device=dev, dtype=dtype
        )
        for i in range(0, num_blocks, 1024):
            kv[i : i + 1024].normal_()
        print(f"weights {sum(_nbytes(t) for t in _tensors(w)) / 1e9:.2f} GB, KV cache "
              f"{_nbytes(kv) / 1e9:.1f} GB ({num_blocks} blocks of {bs}; budget "
              f"{args.kv_gib:.1f} GiB)", flush=True)  # fmt: skip
        result["kv_budget_gib"] = args.kv_gib

        if args.tune and dev.type == "cuda":
            result["tune"] = tune(model, kv, ceil, args)
        if args.gemv_sweep and dev.type == "cuda":
            result["gemv_sweep"] = gemv_sweep(model, ceil, args)

        only = set(filter(None, args.only.split(",")))

        def want(section: str) -> bool:
            return not only or section in only

        if args.breakdown:
            if len(args.breakdown) % 2:
                p.error(f"--breakdown takes B,ctx pairs, got {args.breakdown}")
            pairs_b = list(zip(args.breakdown[::2], args.breakdown[1::2], strict=True))
            result["breakdown"] = []
            for variant in (args.breakdown_fusion or ",".join(variants)).split(","):
                with fusion_variant(variant):
                    for b_, c_ in pairs_b:
                        print(f"\n(fusion {variant})", end="")
                        row = decode_breakdown(model, kv, b_, c_, args)
                        row["fusion"] = variant
                        result["breakdown"].append(row)
        if args.breakdown_prefill:
            t_ = args.breakdown_prefill
            print(f"\nbreakdown: one prefill of {t_} tokens")
            toks = torch.randint(0, cfg.vocab_size, (t_,), device=dev)
            tab = torch.arange(-(-t_ // bs), device=dev, dtype=torch.int32)
            step = time_fn(lambda: model.prefill(kv, toks, tab), dev, 3, 1)
            text, _ = breakdown(lambda: model.prefill(kv, toks, tab), dev,
                                cfg.num_hidden_layers, step)
            print(text, flush=True)

        if want("moe"):
            moe_tokens = args.moe_tokens or ([1, 4] if small else [1, 4, 16, 64, 256])
            rows_m = [bench_moe(model, t, ceil, args) for t in moe_tokens]
            result["moe"] = rows_m
            print("\nrouted experts alone (per MoE layer)")
            names = [k[:-3] for k in rows_m[0] if k.endswith("_us")]
            print(f"{'tokens':>7} {'experts':>8} {'MB':>7}"
                  + "".join(f" {n + ' us':>14} {'of HBM':>7}" for n in names))  # fmt: skip
            for r in rows_m:
                print(f"{r['tokens']:>7} {r['experts_used_mean']:>8.1f} {r['bytes'] / 1e6:>7.1f}"
                      + "".join(f" {r[n + '_us']:>14.1f} {r[n + '_of_hbm']:>6.0%}" for n in names),
                      flush=True)  # fmt: skip

        if want("attn"):
            rows_a = [bench_attention(kv, cfg, 1, c, ceil, args) for c in attn_ctx]
            rows_a.append(bench_attention(kv, cfg, attn_batch, attn_ctx[0], ceil, args))
            result["attention"] = rows_a
            print("\ndecode attention alone (paged kernel, bf16)")
            print(f"{'batch':>6} {'context':>8} {'ms':>8} {'GB/s':>8} {'of HBM read':>12}")
            for r in rows_a:
                print(f"{r['batch']:>6} {r['context']:>8} {r['ms']:>8.3f} {r['GBps']:>8.0f} "
                      f"{r['of_hbm_read']:>11.0%}", flush=True)  # fmt: skip

        if want("prefill"):
            graphs = model.device.type == "cuda" and not args.no_graphs
            graph_engine = engine_over(model, kv, "graph") if graphs else None
            rows_p = [bench_prefill(model, kv, t, ceil, args, graph_engine) for t in prefills]
            del graph_engine
            result["prefill"] = rows_p
            print("\nprefill (one prompt)")
            print("(eager: the model's functions; graph: RankEngine.step replayed from its "
                  "prompt-length bucket, as the serving path runs it; bound: the longer of the "
                  "FLOPs at the matmul rate and the weights at the HBM read rate)")
            print(f"{'tokens':>7} {'ms':>9} {'tok/s':>9} {'TFLOP/s':>8} {'of matmul':>10} "
                  f"{'bound ms':>9} {'of bound':>9} {'graph ms':>9} {'of bound':>9}")
            for r in rows_p:
                print(f"{r['tokens']:>7} {r['ms']:>9.1f} {r['tokens_per_s']:>9.0f} "
                      f"{r['TFLOPS']:>8.0f} {r['of_matmul']:>9.0%} {r['bound_ms']:>9.2f} "
                      f"{r['of_bound']:>8.0%} {r['graph_ms']:>9.1f} "
                      f"{r['graph_of_bound']:>8.0%}", flush=True)  # fmt: skip
            print(f"\nprefill in chunks of {chunk} through RankEngine.step (one step a chunk), "
                  f"beside the one-pass prefill; FLOPs of the one-pass count")
            print(f"{'tokens':>7} {'steps':>6} {'s':>8} {'TFLOP/s':>8} {'of matmul':>10} "
                  f"{'1-pass s':>9} {'of matmul':>10}")  # fmt: skip
            by_len = {r["tokens"]: r for r in rows_p}
            rows_k = []
            for t in chunked:
                try:
                    one = by_len.get(t) or bench_prefill(model, kv, t, ceil, args)
                except torch.OutOfMemoryError as e:
                    one = {"error": f"one pass: {str(e)[:200]}"}
                try:
                    r = bench_chunked_prefill(model, kv, t, chunk, ceil, one, args)
                except torch.OutOfMemoryError as e:
                    r = {"tokens": t, "chunk": chunk, "error": str(e)[:300]}
                    print(f"{t:>7}  out of memory: {r['error']}", flush=True)
                    rows_k.append(r)
                    continue
                rows_k.append(r)
                print(f"{t:>7} {r['steps']:>6} {r['s']:>8.3f} {r['TFLOPS']:>8.0f} "
                      f"{r['of_matmul']:>9.0%} {r.get('one_pass_s', float('nan')):>9.3f} "
                      f"{r.get('one_pass_of_matmul', float('nan')):>9.0%}"
                      + (f"  kernel {r['kernel_config']} regs/spills {r['kernel_regs_spills']}"
                         if "kernel_config" in r else ""), flush=True)  # fmt: skip
            result["prefill_chunked"] = rows_k
            print("\nprefill of several prompts in one RankEngine.step (fresh, or each new "
                  "tokens after cached ones, as a prefix-cache hit), their attention in one call "
                  "per layer (batched) and one call per prompt")
            print(f"{'prompts':>8} {'tokens':>7} {'cached':>7} {'ms':>9} {'tok/s':>9} "
                  f"{'of matmul':>10} {'per-prompt ms':>14}")  # fmt: skip
            rows_b = []
            for n, t, c in batched:
                r = bench_batched_prefill(model, kv, n, t, ceil, args, c)
                rows_b.append(r)
                print(f"{n:>8} {t:>7} {abs(c):>6}{'s' if c < 0 else ' '} "
                      f"{r['ms']:>9.1f} {r['tokens_per_s']:>9.0f} "
                      f"{r['of_matmul']:>9.0%} {r['per_prompt_attention_ms']:>14.1f}"
                      + ("" if r["batched_attention"] else "  (per-prompt path here)"),
                      flush=True)  # fmt: skip
            result["prefill_batched"] = rows_b

        if want("decode"):
            print("\ndecode step (all sequences at the same context)")
            print("(loop: the model's functions in a static per-layer loop; engine: "
                  "RankEngine.step, host work included, eager and from its bucket's CUDA graph)")
            print(f"{'fusion':>7} {'batch':>6} {'context':>8} {'eager ms':>9} {'graph ms':>9} "
                  f"{'roof ms':>8} {'of roof':>8} {'experts':>8} {'tok/s':>9} {'eng eager':>10} "
                  f"{'eng graph':>10} {'of roof':>7}")  # fmt: skip
            rows_d = []
            for b, c in cases:
                if (b, c) not in fits:
                    rows_d.append({"batch": b, "context": c, "skipped": "KV over the budget"})
                    print(f"{'':>7} {b:>6} {c:>8}  skipped: KV "
                          f"{b * (c + 1) * per_tok / bs / 1e9:.0f} GB over the "
                          f"{args.kv_gib:.0f} GiB budget", flush=True)  # fmt: skip
                    continue
                for variant in variants:
                    with fusion_variant(variant):
                        r = bench_decode(model, kv, b, c, ceil, args)
                        if not args.no_engine:
                            try:
                                r.update(bench_engine_decode(model, kv, b, c, args))
                            except Exception as e:  # the loop's figures stand without these
                                r["engine_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    r["fusion"] = variant
                    eng_ms = r.get("engine_graph_ms", r.get("engine_eager_ms", float("nan")))
                    r["engine_of_roofline"] = r["roofline_ms"] / eng_ms
                    rows_d.append(r)
                    print(f"{variant:>7} {b:>6} {c:>8} {r['eager_ms']:>9.2f} {r['graph_ms']:>9.2f} "
                          f"{r['roofline_ms']:>8.2f} {r['of_roofline']:>7.0%} "
                          f"{r['experts_used_mean']:>8.1f} {r['tokens_per_s']:>9.0f} "
                          f"{r.get('engine_eager_ms', float('nan')):>10.2f} "
                          f"{r.get('engine_graph_ms', float('nan')):>10.2f} "
                          f"{r['engine_of_roofline']:>7.0%}"
                          + (f"  {r['engine_error']}" if "engine_error" in r else ""),
                          flush=True)  # fmt: skip
            result["decode"] = rows_d

        if args.compile and dev.type == "cuda":
            dyn = torch._dynamo.config
            for name in ("cache_size_limit", "recompile_limit"):
                if hasattr(dyn, name):
                    setattr(dyn, name, 64)
            model.compile()
            print("\ndecode step, torch.compile around the paged kernel, CUDA graph")
            rows_c = []
            pairs = list(zip(args.compile[::2], args.compile[1::2], strict=True))
            for b, c in pairs:
                try:
                    r = bench_compiled(model, kv, b, c, ceil, args)
                except Exception as e:  # compile support differs between torch builds
                    print(f"{b:>6} {c:>8}  {type(e).__name__}: {str(e)[:300]}", flush=True)
                    rows_c.append({"batch": b, "context": c, "error": str(e)[:500]})
                    continue
                rows_c.append(r)
                print(f"{b:>6} {c:>8} graph {r['compiled_graph_ms']:.2f} ms, roofline "
                      f"{r['roofline_ms']:.2f} ms: {r['of_roofline']:.0%} "
                      f"(compile {r['compile_s']:.0f} s)", flush=True)  # fmt: skip
            result["compiled"] = rows_c

        if args.engine:
            result["engine"] = bench_engine_path(model, dtype, min(contexts), args)
            print(f"\nRankEngine batch 1: {result['engine']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


@contextlib.contextmanager
def fusion_variant(name: str) -> Iterator[None]:
    """The model's kernel path for the block (``--fusion``): ``off``, or ``on`` with options
    ``+shared=N`` (the shared experts in the routed GEMV up to N tokens), ``+router=apart``
    (the router's fp32 projection and its softmax/top-k kernel apart), ``+dense=N`` (the
    dense projections as Triton GEMVs up to N tokens; 0: cuBLAS) and ``+grouped=A-B`` (the
    per-expert GEMV from A up to B tokens; ``+grouped=N``: from 2; 0: never) and ``+pdl``
    (the Triton kernels as programmatic dependent launches; ``+pdl=0``: not)."""
    kind, *opts = name.split("+")
    settings: dict[str, Any] = {}
    for opt in opts:
        key, _, value = opt.partition("=")
        lo, dash, hi = value.partition("-")
        if key in ("shared", "dense") and value.isdigit():
            settings[key] = int(value)
        elif key == "grouped" and lo.isdigit() and (hi.isdigit() or not dash):
            settings[key] = (int(lo), int(hi)) if dash else (2, int(lo))
        elif key == "router" and value in ("apart", "fused"):
            settings["router"] = value == "fused"
        elif key == "pdl" and value in ("", "1", "0"):
            settings["pdl"] = value != "0"
        else:
            kind = "?"
    if kind not in ("on", "off") or (kind == "off" and opts):
        raise ValueError(f"--fusion: each item is off or on[+shared=N][+router=apart]"
                         f"[+dense=N][+grouped=[A-]B][+pdl], got {name!r}")
    fusion.set_fused(kind == "on", settings.get("shared"), settings.get("router"),
                     settings.get("dense"), settings.get("grouped"), settings.get("pdl"))
    try:
        yield
    finally:
        fusion.set_fused(None)


def kv_budget_gib(
    device: torch.device, asked: float | None, headroom_gib: float, small: bool
) -> float:
    """The KV cache budget: ``asked`` when given, else the device's free memory (after the
    weights, torch's cached but unused blocks returned) less ``headroom_gib``; on the CPU or the
    small model 1 GiB. Refuses a budget that leaves nothing, naming the figures."""
    if asked is not None:
        if asked <= 0:
            raise SystemExit(f"--kv-gib must be positive, got {asked}")
        return asked
    if device.type != "cuda" or small:
        return 1.0
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = free / 2**30 - headroom_gib
    if budget <= 0:
        raise SystemExit(f"--headroom-gib {headroom_gib} leaves no KV cache: "
                         f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
    return budget


def _tensors(w: RankWeights) -> list[torch.Tensor]:
    out = [w.embed, w.norm, w.lm_head]
    for lw in w.layers:
        for part in (lw.attn, lw.mlp, lw.moe, lw.moe.shared if lw.moe else None):
            if part is not None:  # qkv_a: the stacked q and kv_a, already counted as views
                out += [v for k, v in vars(part).items()
                        if isinstance(v, torch.Tensor) and k != "qkv_a"]
        out += [lw.input_norm, lw.post_norm]
    return out


def gemv_sweep(model: Model, ceil: dict[str, float], args: argparse.Namespace) -> dict[str, Any]:
    """Batch-1 tiles (BLOCK_N, BLOCK_K, warps) of the GEMVs, every layer once, graph-replayed,
    against the bytes read: the dense projections (stacked q/kv_a and o_proj) as Triton GEMVs
    beside cuBLAS, and the routed experts' GEMV with the shared experts inside, its gate/up
    tiles and its down tiles swept apart."""
    from pdd_sidecar.model.kernels import dense_gemv as dg
    from pdd_sidecar.model.kernels import moe_grouped as mg
    from pdd_sidecar.model.kernels.moe_route import router_topk
    from pdd_sidecar.model.moe import routing

    cfg, dev = model.cfg, model.device
    tiles = [(16, 512, 4), (8, 512, 4), (16, 256, 4), (32, 256, 4), (32, 512, 8), (16, 1024, 8),
             (8, 1024, 4), (64, 256, 8)]  # fmt: skip
    out: dict[str, Any] = {}
    g = torch.Generator(device=dev).manual_seed(5)
    x = torch.randn(1, cfg.hidden_size, device=dev, generator=g).to(model.w.embed.dtype)

    def timed(fn: Callable[[], object], nbytes: int) -> tuple[float, float]:
        sec = time_fn(graph_of(fn, dev), dev, args.reps, warmup=2)
        return sec * 1e6, nbytes / sec / ceil["hbm_read_Bps"]

    print("\ngemv sweep, batch 1: us over every layer (of HBM read)")
    for name in ("qkv_a", "o_proj"):
        ws = [getattr(lw.attn, name) for lw in model.w.layers]
        if any(w_ is None for w_ in ws):
            continue
        nbytes = sum(_nbytes(w_) for w_ in ws)
        xs = x if name == "qkv_a" else x[:, : ws[0].shape[1]].contiguous()
        rows = {"cublas": timed(lambda ws=ws, xs=xs: [F.linear(xs, w_) for w_ in ws], nbytes)}
        for t_ in tiles:
            rows[str(t_)] = timed(lambda ws=ws, xs=xs, t_=t_: [dg.linear_gemv(xs, w_, t_)
                                                                 for w_ in ws], nbytes)
        out[name] = rows
        print(f"  {name:<7} " + "  ".join(f"{k} {us:.0f} ({f:.0%})" for k, (us, f) in rows.items()),
              flush=True)  # fmt: skip
    layers = [lw.moe for lw in model.w.layers if lw.moe is not None]
    parts = mg.shared_chunks(layers[0])
    routes = [router_topk(x, mw.router, routing(cfg), parts, mw.score_bias) for mw in layers]
    per = _nbytes(layers[0].w_gate[0], layers[0].w_up[0], layers[0].w_down[0])
    nbytes = len(layers) * per * (cfg.num_experts_per_tok + parts)
    for which in ("gate_up", "down"):
        rows = {}
        for t_ in tiles:
            kw: dict[str, Any] = ({"block_n": t_[0], "block_k": t_[1], "num_warps": t_[2],
                                   "down_tiles": mg.GEMV_FEW_TILES}
                                  if which == "gate_up" else {"down_tiles": t_})
            rows[str(t_)] = timed(lambda kw=kw: [mg.gemv_experts(x, ids, mw, shared=parts > 0,
                                                                 **kw)
                                                 for mw, (_, ids) in zip(layers, routes,
                                                                         strict=True)], nbytes)
        out["experts_" + which] = rows
        print(f"  experts, {which} tiles swept: "
              + "  ".join(f"{k} {us:.0f} ({f:.0%})" for k, (us, f) in rows.items()), flush=True)
    print("gemv sweep, 16 tokens: the routed experts (shared apart), us over every MoE layer "
          "(of HBM read of the experts chosen)")
    x16 = torch.randn(16, cfg.hidden_size, device=dev, generator=g).to(x.dtype)
    r16 = [route(x16, mw.router, cfg) for mw in layers]
    used = sum(int(torch.unique(ids).numel()) for _, ids in r16)
    nbytes = used * per
    rows = {
        "per-pair gemv": timed(lambda: [mg.grouped_experts(x16, wt, ids, mw, True)
                                        for mw, (wt, ids) in zip(layers, r16, strict=True)],
                               nbytes),
        "grouped_mm": timed(lambda: [mg.grouped_experts(x16, wt, ids, mw, False)
                                     for mw, (wt, ids) in zip(layers, r16, strict=True)], nbytes),
    }
    for gt in ((16, 64, 128, 4), (16, 32, 128, 4), (16, 64, 64, 4), (16, 128, 64, 4),
               (16, 32, 256, 4), (16, 64, 256, 8), (16, 128, 128, 8)):
        rows[str(gt)] = timed(lambda gt=gt: [mg.grouped_gemv_experts(x16, wt, ids, mw, None, gt)
                                             for mw, (wt, ids) in zip(layers, r16, strict=True)],
                              nbytes)
    out["experts_16"] = rows
    print("  " + "  ".join(f"{k} {us:.0f} ({f:.0%})" for k, (us, f) in rows.items()), flush=True)
    return out


def tune(
    model: Model, kv: torch.Tensor, ceil: dict[str, float], args: argparse.Namespace
) -> dict[str, list[dict[str, Any]]]:
    """Sweeps of the decode kernel's tunables (block of tokens, warps, pipeline stages, split
    count against the heuristic) and of the expert GEMV's tiles."""
    from pdd_sidecar.model.kernels import moe_grouped as mg

    cfg = model.cfg
    rows: list[dict[str, Any]] = []
    print("\ntune: decode kernel (bf16); regs/spills of the split kernel")
    variants = [
        {"block_n": 16, "num_warps": 4, "num_stages": 2},
        {"block_n": 32, "num_warps": 4, "num_stages": 2},
        {"block_n": 32, "num_warps": 4, "num_stages": 3},
        {"block_n": 64, "num_warps": 4, "num_stages": 2},
        {"block_n": 32, "num_warps": 8, "num_stages": 2},
        {"block_n": 64, "num_warps": 8, "num_stages": 2},
    ]
    sms = torch.cuda.get_device_properties(kv.device).multi_processor_count
    hg = -(-cfg.num_attention_heads // 16)
    for b, c in ((1, 1024), (1, 32768), (16, 32768), (64, 4096)):
        auto = md.num_splits_for(b, hg, -(-c // kv.shape[2]) * kv.shape[2], sms)
        for v in variants:
            for splits in (auto, max(1, auto // 2), min(md.MAX_SPLITS, 2 * auto)):
                kw: dict[str, Any] = dict(v, num_splits=splits)
                try:
                    r = bench_attention(kv, cfg, b, c, ceil, args, **kw)
                except Exception as e:  # a variant that does not compile (shared memory)
                    print(f"  {b:>3} {c:>6} {kw}: {type(e).__name__}: {str(e)[:80]}")
                    continue
                h = md.LAST_LAUNCH.get("split")
                regs = (getattr(h, "n_regs", "?"), getattr(h, "n_spills", "?"))
                r["regs_spills"] = regs
                rows.append(r)
                print(f"  {b:>3} {c:>6} {kw}: {r['ms'] * 1e3:.1f} us {r['of_hbm_read']:.0%} "
                      f"regs/spills {regs}", flush=True)  # fmt: skip
    moe_rows: list[dict[str, Any]] = []
    print("\ntune: expert GEMV (block_n, block_k, warps)")
    saved = (mg.GEMV_BLOCK_N, mg.GEMV_BLOCK_K, mg.GEMV_WARPS)
    saved_few, saved_down = mg.GEMV_FEW_TILES, mg.GEMV_FEW_DOWN_TILES
    mg.GEMV_FEW_DOWN_TILES = None  # both kernels take the swept tiles
    for t in (1, 16):
        for bn, bk, nw in ((32, 256, 4), (16, 256, 4), (64, 256, 4), (32, 512, 4), (32, 256, 8),
                           (64, 512, 8), (16, 512, 4)):  # fmt: skip
            mg.GEMV_BLOCK_N, mg.GEMV_BLOCK_K, mg.GEMV_WARPS = bn, bk, nw
            mg.GEMV_FEW_TILES = (bn, bk, nw)
            r = bench_moe(model, t, ceil, args)
            r["tiles"] = (bn, bk, nw)
            moe_rows.append(r)
            print(f"  tokens {t:>3} {(bn, bk, nw)}: {r['gemv_us']:.1f} us "
                  f"{r['gemv_of_hbm']:.0%} (grouped_mm {r['grouped_mm_us']:.1f} us)",
                  flush=True)  # fmt: skip
    mg.GEMV_BLOCK_N, mg.GEMV_BLOCK_K, mg.GEMV_WARPS = saved
    mg.GEMV_FEW_TILES, mg.GEMV_FEW_DOWN_TILES = saved_few, saved_down
    return {"attention": rows, "moe": moe_rows}


if __name__ == "__main__":
    raise SystemExit(main())
