"""Weights: Hugging Face safetensors checkpoints (single file or sharded with an index), the
seeded built-in model, and slicing of one rank's tensor-parallel share.

TP layout: attention is sharded by head (q/q_b and kv_b by output rows, o_proj by input columns,
its output summed over ranks). Dense MLP, shared experts and every routed expert are sharded by
intermediate dimension (gate/up rows, down columns; summed over ranks) when that dimension
divides by tp, and replicated otherwise. The router, embeddings, norms, kv_a projections and the
LM head are replicated: they are small next to the experts and replication keeps every rank's
hidden state and greedy token identical with no extra collective.

FP8 checkpoints (DeepSeek's e4m3 weights with a ``weight_scale_inv`` per block) are dequantized
slice by slice as a rank reads its share, so a rank's shard boundary may fall inside a block.
Multi-token-prediction layers (V3's ``model.layers.{num_hidden_layers}+``) are not part of the
main model: ``model/mtp.py`` loads them, through this loader, for drafting.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from pdd_sidecar.model.config import ConfigError, Fp8BlockQuant, ModelConfig

log = logging.getLogger(__name__)


class TensorSource(Protocol):
    def has(self, name: str) -> bool: ...

    def names(self) -> list[str]: ...

    def get(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tensor, or its ``[start:stop]`` range along ``dim``, on CPU."""
        ...


class DictSource:
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def has(self, name: str) -> bool:
        return name in self.state

    def names(self) -> list[str]:
        return list(self.state)

    def get(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        t = self.state[name]
        return t.narrow(dim, start, (t.shape[dim] if stop is None else stop) - start)


class SafetensorsSource:
    """Reads only the slices a rank needs, so a rank never materialises the whole checkpoint."""

    def __init__(self, model_dir: str | Path) -> None:
        from safetensors import safe_open

        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
            self._where = {k: self.dir / v for k, v in files.items()}
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"{self.dir}: no *.safetensors files")
            self._where = {}
            for p in shards:
                with safe_open(str(p), framework="pt") as f:
                    self._where.update({k: p for k in f.keys()})  # noqa: SIM118
        self._open = {p: safe_open(str(p), framework="pt") for p in set(self._where.values())}

    def has(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{self.dir}: checkpoint has no tensor {name!r}")
        sl = self._open[self._where[name]].get_slice(name)
        index = [slice(None)] * len(sl.get_shape())
        index[dim] = slice(start, stop)
        return sl[tuple(index)]


class Fp8BlockSource:
    """Dequantizes e4m3 tensors to fp32 as they are read: ``w = q * scale_inv`` per block, the
    product DeepSeek's and transformers' dequantization compute, so the fp32 weights are the same
    bits either way."""

    def __init__(
        self, inner: TensorSource, quant: Fp8BlockQuant, device: torch.device | None = None
    ) -> None:
        self.inner, self.quant, self.block = inner, quant, quant.block
        self.device = device

    def on(self, device: torch.device) -> Fp8BlockSource:
        """The same source dequantizing on ``device``: an accelerator does the multiply far
        faster than the host, and IEEE fp32 gives the same bits on either."""
        return Fp8BlockSource(self.inner, self.quant, device)

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def names(self) -> list[str]:
        return self.inner.names()

    def get(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        q = self.inner.get(name, dim, start, stop)
        if q.dtype != torch.float8_e4m3fn:
            _refuse_quantized_dtype(name, q)
            return q
        scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
        if q.dim() != 2 or not name.endswith(".weight") or not self.inner.has(scale_name):
            raise ConfigError(
                f"checkpoint tensor {name!r} is float8_e4m3fn but has no 2-D block scale "
                f"{scale_name!r}"
            )
        size, full = q.shape[dim], q.shape[1 - dim]  # only ``dim`` is sliced
        stop = start + size
        b = self.block[dim]
        s = self.inner.get(scale_name, dim, start // b, -(-stop // b)).float()
        want = -(-full // self.block[1 - dim])
        if s.dim() != 2 or s.shape[1 - dim] != want or s.shape[dim] != -(-stop // b) - start // b:
            raise ConfigError(
                f"checkpoint tensor {scale_name!r} has shape {list(s.shape)} for blocks "
                f"{list(self.block)} of {name!r}"
            )
        if self.device is not None and self.device.type != "cpu":
            q, s = q.to(self.device), s.to(self.device)
        s = s.repeat_interleave(b, dim).narrow(dim, start - (start // b) * b, size)
        s = s.repeat_interleave(self.block[1 - dim], 1 - dim).narrow(1 - dim, 0, full)
        return q.float() * s


def _refuse_quantized_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return
    raise ConfigError(
        f"checkpoint tensor {name!r} has dtype {str(t.dtype).removeprefix('torch.')}, which "
        "config.json's quantization_config does not describe (float32, bfloat16, float16, or "
        "float8_e4m3fn with quantization_config.quant_method 'fp8')"
    )


class CheckedSource:
    """Unquantized checkpoints: a quantized tensor read as if it were plain would be served as
    garbage, so any dtype but a float one is refused."""

    def __init__(self, inner: TensorSource) -> None:
        self.inner = inner

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def names(self) -> list[str]:
        return self.inner.names()

    def get(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        t = self.inner.get(name, dim, start, stop)
        _refuse_quantized_dtype(name, t)
        return t


def open_source(model: str | Path, config: ModelConfig, seed: int) -> TensorSource:
    from pdd_sidecar.model.config import BUILTIN

    if str(model) == BUILTIN:
        return DictSource(builtin_state_dict(config, seed))
    src = SafetensorsSource(model)
    if config.quantization is not None:
        return Fp8BlockSource(src, config.quantization)
    return CheckedSource(src)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def skipped_layers(cfg: ModelConfig, src: TensorSource) -> list[int]:
    """Layer indices past ``num_hidden_layers`` in the checkpoint: V3's multi-token-prediction
    modules, which are left on disk."""
    found = {int(m.group(1)) for n in src.names() if (m := _LAYER.match(n))}
    return sorted(i for i in found if i >= cfg.num_hidden_layers)


# --- the built-in model ----------------------------------------------------------------------


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a transformers DeepSeek-V2 checkpoint (per-expert layout), in order."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = (h,)
        s[p + "post_attention_layernorm.weight"] = (h,)
        a = p + "self_attn."
        if cfg.q_lora_rank is None:
            s[a + "q_proj.weight"] = (heads * cfg.qk_head_dim, h)
        else:
            s[a + "q_a_proj.weight"] = (cfg.q_lora_rank, h)
            s[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            s[a + "q_b_proj.weight"] = (heads * cfg.qk_head_dim, cfg.q_lora_rank)
        s[a + "kv_a_proj_with_mqa.weight"] = (cfg.latent_dim, h)
        s[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        s[a + "kv_b_proj.weight"] = (
            heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            cfg.kv_lora_rank,
        )
        s[a + "o_proj.weight"] = (h, heads * cfg.v_head_dim)
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            assert cfg.n_routed_experts
            inter = cfg.moe_intermediate_size
            s[m + "gate.weight"] = (cfg.n_routed_experts, h)
            for e in range(cfg.n_routed_experts):
                s[m + f"experts.{e}.gate_proj.weight"] = (inter, h)
                s[m + f"experts.{e}.up_proj.weight"] = (inter, h)
                s[m + f"experts.{e}.down_proj.weight"] = (h, inter)
            if cfg.n_shared_experts:
                sh = inter * cfg.n_shared_experts
                s[m + "shared_experts.gate_proj.weight"] = (sh, h)
                s[m + "shared_experts.up_proj.weight"] = (sh, h)
                s[m + "shared_experts.down_proj.weight"] = (h, sh)
        else:
            s[m + "gate_proj.weight"] = (cfg.intermediate_size, h)
            s[m + "up_proj.weight"] = (cfg.intermediate_size, h)
            s[m + "down_proj.weight"] = (h, cfg.intermediate_size)
    s["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, h)
    return s


def builtin_state_dict(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic fp32 weights from ``seed`` (CPU generator, fixed order), identical on every
    process and machine. Scaled 1/sqrt(fan_in) so activations stay O(1) and greedy tokens are
    decided by clear margins rather than near-ties."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in hf_shapes(cfg).items():
        if len(shape) == 1:
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name == "model.embed_tokens.weight":
            out[name] = torch.randn(shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g) / math.sqrt(shape[1])
    return out


def write_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    max_shard_tensors: int | None = None,
) -> Path:
    """Save as a Hugging Face directory: one ``model.safetensors``, or shards plus an index."""
    from safetensors.torch import save_file

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    names = list(state)
    if max_shard_tensors is None or len(names) <= max_shard_tensors:
        save_file({k: state[k].contiguous() for k in names}, str(d / "model.safetensors"))
        return d
    groups = [names[i : i + max_shard_tensors] for i in range(0, len(names), max_shard_tensors)]
    weight_map = {}
    for j, grp in enumerate(groups):
        fname = f"model-{j + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: state[k].contiguous() for k in grp}, str(d / fname))
        weight_map.update({k: fname for k in grp})
    index = {"metadata": {}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return d


# --- one rank's share ---------------------------------------------------------------------


@dataclass
class AttnWeights:
    q_proj: torch.Tensor | None  # [Hl*qk, hidden] when q_lora_rank is None
    q_a_proj: torch.Tensor | None  # [q_lora, hidden]
    q_a_bias: torch.Tensor | None
    q_a_norm: torch.Tensor | None
    q_b_proj: torch.Tensor | None  # [Hl*qk, q_lora]
    kv_a_proj: torch.Tensor  # [kv_lora + rope, hidden]
    kv_a_bias: torch.Tensor | None
    kv_a_norm: torch.Tensor  # [kv_lora]
    w_uk: torch.Tensor  # [Hl, nope, kv_lora]
    w_uv: torch.Tensor  # [Hl, v, kv_lora]
    o_proj: torch.Tensor  # [hidden, Hl*v]
    o_bias: torch.Tensor | None  # added once, after the sum over ranks
    # [q rows + kv_a rows, hidden]: q_proj (or q_a_proj) and kv_a_proj stacked, both of them
    # views into it (fuse_input_projections), so one GEMV reads the layer's input projections
    qkv_a: torch.Tensor | None = None


def fuse_input_projections(w: AttnWeights) -> AttnWeights:
    """Stacks the projections that read the layer's normed input (``q_proj`` or ``q_a_proj``,
    and ``kv_a_proj``) into ``qkv_a`` and makes them views of it: no more memory, and the decode
    step runs one GEMV where it ran two. Left as is where either has a bias (the checkpoints
    pdd serves have none) or the dtypes differ."""
    q = w.q_proj if w.q_proj is not None else w.q_a_proj
    if (q is None or w.q_a_bias is not None or w.kv_a_bias is not None or w.qkv_a is not None
            or q.dtype != w.kv_a_proj.dtype or q.shape[1] != w.kv_a_proj.shape[1]):
        return w
    both = torch.cat([q, w.kv_a_proj], 0)
    n = q.shape[0]
    w.qkv_a = both
    if w.q_proj is not None:
        w.q_proj = both[:n]
    else:
        w.q_a_proj = both[:n]
    w.kv_a_proj = both[n:]
    return w


@dataclass
class MLPWeights:
    gate: torch.Tensor  # [I (or I/tp), hidden]
    up: torch.Tensor
    down: torch.Tensor  # [hidden, I (or I/tp)]
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@dataclass
class MoEWeights:
    router: torch.Tensor  # [E, hidden], always fp32 (routing is computed in fp32)
    w_gate: torch.Tensor  # [E, I (or I/tp), hidden]
    w_up: torch.Tensor
    w_down: torch.Tensor  # [E, hidden, I (or I/tp)]
    shared: MLPWeights | None
    score_bias: torch.Tensor | None = None  # [E] fp32, V3's e_score_correction_bias


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: AttnWeights
    mlp: MLPWeights | None
    moe: MoEWeights | None
    mlp_sharded: bool  # True: this rank holds a slice and the output is summed over ranks


@dataclass
class RankWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor


def load_rank_weights(
    cfg: ModelConfig,
    src: TensorSource,
    rank: int,
    tp: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> RankWeights:
    heads = cfg.num_attention_heads
    if heads % tp:
        raise ValueError(f"tp ({tp}) must divide num_attention_heads ({heads})")
    hl = heads // tp
    if isinstance(src, Fp8BlockSource):
        src = src.on(torch.device(device))
    extra = skipped_layers(cfg, src)
    if extra and rank == 0:
        log.info(
            "skipping %d multi-token-prediction layer(s) (model.layers.%s): not used for decoding",
            len(extra),
            ",".join(map(str, extra)),
        )

    def t(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=dtype).contiguous()

    def opt(name: str) -> torch.Tensor | None:
        return t(src.get(name)) if src.has(name) else None

    def shard(name: str, dim: int, size: int, n: int, r: int) -> torch.Tensor:
        return src.get(name, dim, r * size // n, (r + 1) * size // n)

    def mlp(prefix: str, inter: int, sharded: bool) -> MLPWeights:
        n, r = (tp, rank) if sharded else (1, 0)
        gb, ub = prefix + "gate_proj.bias", prefix + "up_proj.bias"
        return MLPWeights(
            gate=t(shard(prefix + "gate_proj.weight", 0, inter, n, r)),
            up=t(shard(prefix + "up_proj.weight", 0, inter, n, r)),
            down=t(shard(prefix + "down_proj.weight", 1, inter, n, r)),
            gate_bias=t(shard(gb, 0, inter, n, r)) if src.has(gb) else None,
            up_bias=t(shard(ub, 0, inter, n, r)) if src.has(ub) else None,
            down_bias=opt(prefix + "down_proj.bias"),
        )

    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qk, nv = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
        kv_b = src.get(a + "kv_b_proj.weight", 0, rank * hl * nv, (rank + 1) * hl * nv)
        kv_b = kv_b.reshape(hl, nv, cfg.kv_lora_rank)
        lora = cfg.q_lora_rank is not None
        attn = AttnWeights(
            q_proj=None
            if lora
            else t(src.get(a + "q_proj.weight", 0, rank * hl * qk, (rank + 1) * hl * qk)),
            q_a_proj=t(src.get(a + "q_a_proj.weight")) if lora else None,
            q_a_bias=opt(a + "q_a_proj.bias"),
            q_a_norm=t(src.get(a + "q_a_layernorm.weight")) if lora else None,
            q_b_proj=(
                t(src.get(a + "q_b_proj.weight", 0, rank * hl * qk, (rank + 1) * hl * qk))
                if lora
                else None
            ),
            kv_a_proj=t(src.get(a + "kv_a_proj_with_mqa.weight")),
            kv_a_bias=opt(a + "kv_a_proj_with_mqa.bias"),
            kv_a_norm=t(src.get(a + "kv_a_layernorm.weight")),
            w_uk=t(kv_b[:, : cfg.qk_nope_head_dim]),
            w_uv=t(kv_b[:, cfg.qk_nope_head_dim :]),
            o_proj=t(
                src.get(
                    a + "o_proj.weight",
                    1,
                    rank * hl * cfg.v_head_dim,
                    (rank + 1) * hl * cfg.v_head_dim,
                )
            ),
            o_bias=opt(a + "o_proj.bias"),
        )
        attn = fuse_input_projections(attn)
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            assert cfg.n_routed_experts
            inter = cfg.moe_intermediate_size
            sharded = inter % tp == 0
            n, r = (tp, rank) if sharded else (1, 0)
            lo, hi = r * inter // n, (r + 1) * inter // n
            if src.has(m + "experts.gate_up_proj"):  # transformers v5 fused layout
                w_gate = src.get(m + "experts.gate_up_proj", 1, lo, hi)
                w_up = src.get(m + "experts.gate_up_proj", 1, inter + lo, inter + hi)
                w_down = src.get(m + "experts.down_proj", 2, lo, hi)
            else:
                e_ = range(cfg.n_routed_experts)
                w_gate = torch.stack(
                    [src.get(m + f"experts.{e}.gate_proj.weight", 0, lo, hi) for e in e_]
                )
                w_up = torch.stack(
                    [src.get(m + f"experts.{e}.up_proj.weight", 0, lo, hi) for e in e_]
                )
                w_down = torch.stack(
                    [src.get(m + f"experts.{e}.down_proj.weight", 1, lo, hi) for e in e_]
                )
            shared = None
            if cfg.n_shared_experts:
                shared = mlp(m + "shared_experts.", inter * cfg.n_shared_experts, sharded)
            bias = None
            if cfg.scoring_func == "sigmoid":
                bias = src.get(m + "gate.e_score_correction_bias").to(device, torch.float32)
            moe = MoEWeights(
                router=src.get(m + "gate.weight").to(device=device, dtype=torch.float32),
                w_gate=t(w_gate),
                w_up=t(w_up),
                w_down=t(w_down),
                shared=shared,
                score_bias=bias,
            )
            dense = None
        else:
            sharded = cfg.intermediate_size % tp == 0
            dense, moe = mlp(m, cfg.intermediate_size, sharded), None
        layers.append(
            LayerWeights(
                input_norm=t(src.get(p + "input_layernorm.weight")),
                post_norm=t(src.get(p + "post_attention_layernorm.weight")),
                attn=attn,
                mlp=dense,
                moe=moe,
                mlp_sharded=sharded and tp > 1,
            )
        )
    embed = t(src.get("model.embed_tokens.weight"))
    head = embed if cfg.tie_word_embeddings else t(src.get("lm_head.weight"))
    return RankWeights(
        embed=embed, layers=layers, norm=t(src.get("model.norm.weight")), lm_head=head
    )
