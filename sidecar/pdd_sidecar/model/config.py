"""DeepSeek-V2 model configuration, read from a Hugging Face ``config.json``.

Both the v5 ``rope_parameters`` layout and the older ``rope_theta`` + ``rope_scaling`` layout are
accepted, so checkpoints written by either transformers generation (or DeepSeek's remote code)
load the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILTIN = "builtin"
BUILTIN_SEED = 1234


class ConfigError(ValueError):
    """The checkpoint's config describes something this model does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int = 0
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    num_experts_per_tok: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the KV cache: compressed KV plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return (
            bool(self.n_routed_experts)
            and layer >= self.first_k_dense_replace
            and layer % max(self.moe_layer_freq, 1) == 0
        )

    @property
    def softmax_scale(self) -> float:
        """YaRN's ``mscale_all_dim`` enlarges the logits scale as DeepSeek and transformers do."""
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if r.rope_type != "default" and r.mscale_all_dim:
            m = yarn_get_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if d.get("scoring_func", "softmax") != "softmax":
            raise ConfigError(f"scoring_func {d['scoring_func']!r} is not supported (softmax only)")
        topk_method = d.get("topk_method") or "greedy"
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"topk_method {topk_method!r} is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {d['hidden_act']!r} is not supported (silu only)")
        n_heads = int(d["num_attention_heads"])
        kv_heads = d.get("num_key_value_heads")
        if kv_heads not in (None, n_heads):
            raise ConfigError("MLA has no grouped KV heads: num_key_value_heads must equal heads")
        max_pos = int(d.get("max_position_embeddings", 4096))
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=n_heads,
            kv_lora_rank=int(d["kv_lora_rank"]),
            q_lora_rank=None if d.get("q_lora_rank") is None else int(d["q_lora_rank"]),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            v_head_dim=int(d["v_head_dim"]),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
            n_routed_experts=d.get("n_routed_experts"),
            n_shared_experts=d.get("n_shared_experts"),
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 1),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(d.get("first_k_dense_replace", 0)),
            moe_layer_freq=int(d.get("moe_layer_freq", 1)),
            topk_method=topk_method,
            n_group=d.get("n_group"),
            topk_group=d.get("topk_group"),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            hidden_act="silu",
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            rope=_rope_from_hf(d, max_pos),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir}: no config.json (not a Hugging Face model dir)")
        return cls.from_hf_dict(json.loads(path.read_text()))

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-v5 config.json, so a built-in model can be written as a checkpoint."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "rope"}
        r = self.rope
        rope: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta}
        if r.rope_type == "yarn":
            rope.update(
                factor=r.factor,
                original_max_position_embeddings=r.original_max_position_embeddings,
                beta_fast=r.beta_fast,
                beta_slow=r.beta_slow,
                mscale=r.mscale,
                mscale_all_dim=r.mscale_all_dim,
            )
        d.update(
            architectures=["DeepseekV2ForCausalLM"],
            model_type="deepseek_v2",
            num_key_value_heads=self.num_attention_heads,
            rope_parameters=rope,
        )
        return d


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _rope_from_hf(d: dict[str, Any], max_pos: int) -> RopeConfig:
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta") or d.get("rope_theta") or 10000.0)
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type != "yarn":
        raise ConfigError(f"rope type {rope_type!r} is not supported (default or yarn)")
    orig = (
        d.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or max_pos
    )
    factor = params.get("factor")
    if factor is None:
        factor = max_pos / orig
    af = params.get("attention_factor")
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=None if af is None else float(af),
        truncate=bool(params.get("truncate", True)),
    )


def builtin_config() -> ModelConfig:
    """The tiny default model: every architectural feature on (q LoRA, YaRN, dense then MoE with
    shared experts), 8 heads and intermediate sizes divisible by 8 so tp up to 8 shards evenly,
    and a 256-token vocabulary so a byte-level tokenizer fits."""
    return ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=8,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        max_position_embeddings=8192,
        rope=RopeConfig(
            rope_type="yarn",
            theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=2048,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
    )


def load_config(model: str | Path) -> ModelConfig:
    if str(model) == BUILTIN:
        return builtin_config()
    return ModelConfig.from_pretrained(model)
