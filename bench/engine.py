"""Prefill and decode of a DeepSeek-V2-Lite-sized model on one GPU against same-run ceilings.

The model has V2-Lite's dimensions (27 layers, hidden 2048, 16 heads, latent 512 + rope 64,
64 routed experts top-6 + 2 shared, first layer dense, vocab 102400) with random bf16 weights made
on the device, so no checkpoint is needed. Measured, each against a yardstick from the same run:

- prefill tokens/s at 1k and 8k tokens, as a fraction of a bf16 matmul's FLOP/s (the FLOPs a
  prompt needs: projections, the experts its tokens route to, causal attention);
- decode time per step at batch x context, eager and replayed from a CUDA graph, as a fraction of
  the roofline: the bytes one step must read (attention and dense weights, the experts the batch
  routes to, lm_head, every sequence's KV) over the same-run HBM read rate;
- the paged decode attention kernel alone at long contexts against that read rate.

The decode step is a per-layer loop over the model's functions (the paged decode kernel, the
grouped-GEMM MoE, the dense projections) with static shapes, so it can be graph-captured. Where the
engine's own path imports, batch-1 decode and prefill are also timed through ``RankEngine``.

    python bench/engine.py --device cuda --json /tmp/engine.json
    python bench/engine.py --device cpu --small        # smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))

from pdd_sidecar.model.config import ModelConfig, RopeConfig  # noqa: E402
from pdd_sidecar.model.kernels import mla_decode as md  # noqa: E402
from pdd_sidecar.model.mla import (  # noqa: E402
    absorb_q,
    prefill_attention,
    project_latent,
    project_q,
    rms_norm,
)
from pdd_sidecar.model.moe import dense_mlp, moe, route  # noqa: E402
from pdd_sidecar.model.rope import Rotary  # noqa: E402
from pdd_sidecar.model.weights import (  # noqa: E402
    AttnWeights,
    LayerWeights,
    MLPWeights,
    MoEWeights,
    RankWeights,
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
    n = (64 << 20) if small else (2 << 30)  # bf16 elements: 128 MiB / 4 GiB
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
    m = 1024 if small else 8192
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

    def decode(
        self, kv: torch.Tensor, batch: Batch, record: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """fp32 logits ``[B, V]``; writes each token's latent into ``kv`` first. ``record``
        collects each MoE layer's expert ids (untimed runs only)."""
        cfg, w = self.cfg, self.w
        bs = kv.shape[2]
        cos, sin = self.rotary.cos_sin(batch.positions)
        blk = batch.tables.gather(1, (batch.positions // bs)[:, None].to(torch.int64))[:, 0]
        off = batch.positions % bs
        x = F.embedding(batch.tokens, w.embed)
        for i, lw in enumerate(w.layers):
            a = rms_norm(x, lw.input_norm, cfg.rms_norm_eps)
            q_nope, q_pe = project_q(a, lw.attn, cfg, cos, sin)
            kv[blk, i, off] = project_latent(a, lw.attn, cfg, cos, sin).to(kv.dtype)
            q = absorb_q(q_nope, q_pe, lw.attn)
            o, _ = md.paged_mla_decode(
                q, kv, i, batch.tables, batch.seq_lens, cfg.kv_lora_rank, cfg.softmax_scale
            )
            o = torch.einsum("bhc,hvc->bhv", o.to(x.dtype), lw.attn.w_uv)
            x = x + F.linear(o.flatten(1), lw.attn.o_proj)
            x = x + self._mlp(rms_norm(x, lw.post_norm, cfg.rms_norm_eps), lw, record)
        return F.linear(rms_norm(x, w.norm, cfg.rms_norm_eps), w.lm_head).float()

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


def graph_of(fn: Callable[[], torch.Tensor], device: torch.device) -> Callable[[], None]:
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


def bench_attention(
    kv: torch.Tensor,
    cfg: ModelConfig,
    b: int,
    ctx: int,
    ceil: dict[str, float],
    args: argparse.Namespace,
    **kernel: int,
) -> dict[str, Any]:
    """The decode kernel alone over ``b`` sequences of ``ctx`` tokens, rotating over layers so
    consecutive calls read different memory (not the L2)."""
    dev = kv.device
    batch = make_batch(b, ctx - 1, kv.shape[2], kv.shape[0], cfg, dev, seed=ctx + b)
    g = torch.Generator(device=dev).manual_seed(ctx)
    q = torch.randn(b, cfg.num_attention_heads, cfg.latent_dim, device=dev, generator=g)
    q = q.to(kv.dtype)
    layer = [0]

    def fn() -> object:
        layer[0] = (layer[0] + 1) % kv.shape[1]
        args_ = (q, kv, layer[0], batch.tables, batch.seq_lens, cfg.kv_lora_rank, 0.07)
        if dev.type == "cuda" and md.HAS_TRITON:
            return md.paged_mla_decode_triton(*args_, **kernel)  # type: ignore[arg-type]
        return md.paged_mla_decode_ref(*args_)

    t = time_fn(fn, dev, args.reps * 3, warmup=3)
    nbytes = b * ctx * cfg.latent_dim * kv.element_size()
    return {
        "batch": b,
        "context": ctx,
        "kernel": kernel,
        "ms": t * 1e3,
        "GBps": nbytes / t / 1e9,
        "of_hbm_read": nbytes / t / ceil["hbm_read_Bps"],
    }


def bench_prefill(
    model: Model, kv: torch.Tensor, t: int, ceil: dict[str, float], args: argparse.Namespace
) -> dict[str, Any]:
    dev, cfg = model.device, model.cfg
    bs = kv.shape[2]
    g = torch.Generator(device=dev).manual_seed(t)
    tokens = torch.randint(0, cfg.vocab_size, (t,), device=dev, generator=g)
    table = torch.randperm(kv.shape[0], device=dev, generator=g)[: -(-t // bs)].to(torch.int32)
    sec = time_fn(lambda: model.prefill(kv, tokens, table), dev, max(3, args.reps // 3), 1)
    flops = prefill_flops(cfg, t)
    return {
        "tokens": t,
        "ms": sec * 1e3,
        "tokens_per_s": t / sec,
        "TFLOPS": flops / sec / 1e12,
        "of_matmul": flops / sec / ceil["matmul_flops"],
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny model (forced on the CPU)")
    p.add_argument("--batches", type=_ints, default=None, help="default 1,16,64,256")
    p.add_argument("--contexts", type=_ints, default=None, help="default 1024,4096,8192,32768")
    p.add_argument("--prefill", type=_ints, default=None, help="default 1024,8192")
    p.add_argument("--attn-contexts", type=_ints, default=None, help="default 32768,65536,131072")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--kv-gib", type=float, default=72.0, help="KV cache budget on the device")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--tune", action="store_true", help="sweep the decode kernel's tunables")
    p.add_argument("--engine", action="store_true", help="also time RankEngine at batch 1")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible")
    small = args.small or dev.type == "cpu"
    cfg = small_config() if small else v2_lite_config()
    batches = args.batches or ([1, 4] if small else [1, 16, 64, 256])
    contexts = args.contexts or ([64, 256] if small else [1024, 4096, 8192, 32768])
    prefills = args.prefill or ([64, 256] if small else [1024, 8192])
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
        budget_blocks = int(args.kv_gib * 2**30 // per_tok)
        cases = [(b, c) for b in batches for c in contexts]
        fits = [(b, c) for b, c in cases if b * -(-(c + 1) // bs) <= budget_blocks]
        need = [b * -(-(c + 1) // bs) for b, c in fits]
        need += [-(-c // bs) for c in attn_ctx + prefills]
        num_blocks = max(need)
        kv = torch.empty(
            num_blocks, cfg.num_hidden_layers, bs, cfg.latent_dim, device=dev, dtype=dtype
        )
        for i in range(0, num_blocks, 1024):
            kv[i : i + 1024].normal_()
        print(f"weights {sum(_nbytes(t) for t in _tensors(w)) / 1e9:.2f} GB, KV cache "
              f"{_nbytes(kv) / 1e9:.1f} GB ({num_blocks} blocks of {bs})", flush=True)  # fmt: skip

        if args.tune and dev.type == "cuda":
            result["tune"] = tune(kv, cfg, ceil, args)

        rows_a = [bench_attention(kv, cfg, 1, c, ceil, args) for c in attn_ctx]
        rows_a.append(bench_attention(kv, cfg, 16 if not small else 2, attn_ctx[0], ceil, args))
        result["attention"] = rows_a
        print("\ndecode attention alone (paged kernel, bf16)")
        print(f"{'batch':>6} {'context':>8} {'ms':>8} {'GB/s':>8} {'of HBM read':>12}")
        for r in rows_a:
            print(f"{r['batch']:>6} {r['context']:>8} {r['ms']:>8.3f} {r['GBps']:>8.0f} "
                  f"{r['of_hbm_read']:>11.0%}", flush=True)  # fmt: skip

        rows_p = [bench_prefill(model, kv, t, ceil, args) for t in prefills]
        result["prefill"] = rows_p
        print("\nprefill (one prompt)")
        print(f"{'tokens':>7} {'ms':>9} {'tok/s':>9} {'TFLOP/s':>8} {'of matmul':>10}")
        for r in rows_p:
            print(f"{r['tokens']:>7} {r['ms']:>9.1f} {r['tokens_per_s']:>9.0f} "
                  f"{r['TFLOPS']:>8.0f} {r['of_matmul']:>9.0%}", flush=True)  # fmt: skip

        print("\ndecode step (all sequences at the same context)")
        print(f"{'batch':>6} {'context':>8} {'eager ms':>9} {'graph ms':>9} {'roof ms':>8} "
              f"{'of roof':>8} {'experts':>8} {'tok/s':>9}")  # fmt: skip
        rows_d = []
        for b, c in cases:
            if (b, c) not in fits:
                rows_d.append({"batch": b, "context": c, "skipped": "KV over the budget"})
                print(f"{b:>6} {c:>8}  skipped: KV {b * (c + 1) * per_tok / bs / 1e9:.0f} GB "
                      f"over the {args.kv_gib:.0f} GiB budget", flush=True)  # fmt: skip
                continue
            r = bench_decode(model, kv, b, c, ceil, args)
            rows_d.append(r)
            print(f"{b:>6} {c:>8} {r['eager_ms']:>9.2f} {r['graph_ms']:>9.2f} "
                  f"{r['roofline_ms']:>8.2f} {r['of_roofline']:>7.0%} "
                  f"{r['experts_used_mean']:>8.1f} {r['tokens_per_s']:>9.0f}",
                  flush=True)  # fmt: skip
        result["decode"] = rows_d

        if args.engine:
            result["engine"] = bench_engine_path(model, dtype, min(contexts), args)
            print(f"\nRankEngine batch 1: {result['engine']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def _tensors(w: RankWeights) -> list[torch.Tensor]:
    out = [w.embed, w.norm, w.lm_head]
    for lw in w.layers:
        for part in (lw.attn, lw.mlp, lw.moe, lw.moe.shared if lw.moe else None):
            if part is not None:
                out += [v for v in vars(part).values() if isinstance(v, torch.Tensor)]
        out += [lw.input_norm, lw.post_norm]
    return out


def tune(
    kv: torch.Tensor, cfg: ModelConfig, ceil: dict[str, float], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Decode-kernel tunables at batch 1 / 32k and batch 64 / 4k: block of tokens, warps,
    pipeline stages, and split count against the default heuristic."""
    rows = []
    print("\ntune: decode kernel (bf16)")
    variants = [
        {"block_n": 16, "num_warps": 4, "num_stages": 2},
        {"block_n": 32, "num_warps": 4, "num_stages": 2},
        {"block_n": 32, "num_warps": 4, "num_stages": 3},
        {"block_n": 64, "num_warps": 4, "num_stages": 2},
        {"block_n": 32, "num_warps": 8, "num_stages": 2},
        {"block_n": 64, "num_warps": 8, "num_stages": 2},
        {"block_n": 16, "num_warps": 4, "num_stages": 4},
    ]
    for b, c in ((1, 32768), (64, 4096)):
        for v in variants:
            for splits in (None, "x2"):
                kw: dict[str, Any] = dict(v)
                if splits:
                    hg = -(-cfg.num_attention_heads // 16)
                    sms = torch.cuda.get_device_properties(kv.device).multi_processor_count
                    kw["num_splits"] = 2 * md.num_splits_for(b, hg, c, sms)
                try:
                    r = bench_attention(kv, cfg, b, c, ceil, args, **kw)
                except Exception as e:  # a variant that does not compile (shared memory)
                    print(f"  {b:>3} {c:>6} {kw}: {type(e).__name__}: {str(e)[:80]}")
                    continue
                rows.append(r)
                print(f"  {b:>3} {c:>6} {kw}: {r['ms']:.3f} ms {r['of_hbm_read']:.0%}", flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
