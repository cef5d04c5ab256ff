"""DeepSeek-V2/V3 model configuration, read from a Hugging Face ``config.json``.

Both the v5 ``rope_parameters`` layout and the older ``rope_theta`` + ``rope_scaling`` layout are
accepted, so checkpoints written by either transformers generation (or DeepSeek's remote code)
load the same way. Keys a config leaves out take transformers' default for its ``model_type``:
transformers writes a V3 config.json without ``scoring_func``, and reading it with V2's defaults
would serve the checkpoint with the wrong router. Anything this model does not implement (another
architecture, router, rope layout or quantization) is refused, naming the key and its value.
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


V2, V3 = "deepseek_v2", "deepseek_v3"
ARCHITECTURES = {V2: "DeepseekV2ForCausalLM", V3: "DeepseekV3ForCausalLM"}

# transformers' DeepseekV3Config defaults for every key the model reads.
_V3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "num_nextn_predict_layers": 1,
}


class ConfigError(ValueError):
    """The checkpoint's config describes something this model does not implement."""


@dataclass(frozen=True)
class Fp8BlockQuant:
    """e4m3 weights with one fp32 scale (``weight_scale_inv``) per ``block`` of ``[out, in]``."""

    block: tuple[int, int] = (128, 128)


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
    model_type: str = V2
    scoring_func: str = "softmax"
    num_nextn_predict_layers: int = 0
    quantization: Fp8BlockQuant | None = None

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
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

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
        model_type = _model_type(d)
        if model_type == V3:
            return cls._from_v3_dict(d)
        if d.get("scoring_func", "softmax") != "softmax":
            raise ConfigError(f"scoring_func {d['scoring_func']!r} is not supported (softmax only)")
        topk_method = d.get("topk_method") or "greedy"
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"topk_method {topk_method!r} is not supported")
        n_heads = int(d["num_attention_heads"])
        _check_common(d, n_heads)
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
            model_type=V2,
            quantization=_quantization(d),
        )

    @classmethod
    def _from_v3_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """transformers' DeepseekV3: sigmoid scores, ``noaux_tc`` selection (bias-corrected,
        group-limited by the sum of each group's top two) and every layer from
        ``first_k_dense_replace`` on an MoE layer. transformers ignores ``scoring_func``,
        ``topk_method`` and ``moe_layer_freq``; a config that sets them to anything else asks
        for a model that transformers would not run either, so it is refused."""
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if key in d and d[key] != want:
                raise ConfigError(f"{key} {d[key]!r} is not supported for deepseek_v3 ({want!r})")
        if d.get("moe_layer_freq", 1) != 1:
            raise ConfigError(
                f"moe_layer_freq {d['moe_layer_freq']!r} is not supported for deepseek_v3 (1)"
            )
        if d.get("rope_interleave", True) is not True:
            raise ConfigError(
                f"rope_interleave {d['rope_interleave']!r} is not supported (interleaved rope only)"
            )
        def get(key: str) -> Any:
            return d[key] if key in d else _V3_DEFAULTS[key]

        _check_common(d, int(get("num_attention_heads")))

        def opt_int(key: str) -> int | None:
            v = get(key)
            return None if v is None else int(v)

        n_exp, n_group, topk_group = int(get("n_routed_experts")), get("n_group"), get("topk_group")
        k = int(get("num_experts_per_tok"))
        for key, v in (("n_group", n_group), ("topk_group", topk_group)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{key} {v!r} is not supported (a positive integer)")
        if n_exp % n_group or n_exp // n_group < 2:
            raise ConfigError(
                f"n_group {n_group} must divide n_routed_experts ({n_exp}) into groups of at "
                "least 2 experts (a group scores by its top two)"
            )
        if topk_group > n_group:
            raise ConfigError(f"topk_group {topk_group} exceeds n_group ({n_group})")
        if not 1 <= k <= topk_group * (n_exp // n_group):
            raise ConfigError(
                f"num_experts_per_tok {k} is not in 1..{topk_group * (n_exp // n_group)} "
                "(the experts of topk_group groups)"
            )
        max_pos = int(get("max_position_embeddings"))
        return cls(
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=int(get("num_hidden_layers")),
            num_attention_heads=int(get("num_attention_heads")),
            kv_lora_rank=int(get("kv_lora_rank")),
            q_lora_rank=opt_int("q_lora_rank"),
            qk_nope_head_dim=int(get("qk_nope_head_dim")),
            qk_rope_head_dim=int(get("qk_rope_head_dim")),
            v_head_dim=int(get("v_head_dim")),
            moe_intermediate_size=int(get("moe_intermediate_size")),
            n_routed_experts=n_exp,
            n_shared_experts=int(get("n_shared_experts")),
            num_experts_per_tok=k,
            routed_scaling_factor=float(get("routed_scaling_factor")),
            first_k_dense_replace=int(get("first_k_dense_replace") or 0),
            moe_layer_freq=1,
            topk_method="noaux_tc",
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=bool(get("norm_topk_prob")),
            rms_norm_eps=float(get("rms_norm_eps")),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            hidden_act="silu",
            attention_bias=bool(get("attention_bias")),
            mlp_bias=False,
            rope=_rope_from_hf(d, max_pos),
            model_type=V3,
            scoring_func="sigmoid",
            num_nextn_predict_layers=int(
                d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 1)) or 0
            ),
            quantization=_quantization(d),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir}: no config.json (not a Hugging Face model dir)")
        return cls.from_hf_dict(json.loads(path.read_text()))

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-v5 config.json, so a built-in model can be written as a checkpoint."""
        skip = ("rope", "model_type", "quantization")
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
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
            architectures=[self.architecture],
            model_type=self.model_type,
            num_key_value_heads=self.num_attention_heads,
            rope_parameters=rope,
        )
        if self.quantization is not None:
            d["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": list(self.quantization.block),
            }
        return d


def _model_type(d: dict[str, Any]) -> str:
    """A config with neither key is a hand-written V2 one (the remote-code era wrote both)."""
    archs = d.get("architectures")
    model_type = d.get("model_type")
    if model_type is None and archs is None:
        return V2
    if model_type is None:
        by_arch = {a: t for t, a in ARCHITECTURES.items()}
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in by_arch:
            raise ConfigError(
                f"architectures {archs!r} is not supported ({' or '.join(ARCHITECTURES.values())})"
            )
        return by_arch[archs[0]]
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            f"model_type {model_type!r} is not supported ({' or '.join(ARCHITECTURES)})"
        )
    if archs is not None and archs != [ARCHITECTURES[model_type]]:
        raise ConfigError(
            f"architectures {archs!r} is not supported for model_type {model_type!r} "
            f"([{ARCHITECTURES[model_type]!r}])"
        )
    return str(model_type)


def _check_common(d: dict[str, Any], n_heads: int) -> None:
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {d['hidden_act']!r} is not supported (silu only)")
    kv_heads = d.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != n_heads:
        raise ConfigError(
            f"num_key_value_heads {kv_heads!r} is not supported: MLA has no grouped KV heads, "
            f"it must equal num_attention_heads ({n_heads})"
        )


def _quantization(d: dict[str, Any]) -> Fp8BlockQuant | None:
    """DeepSeek's own FP8 release format, the one transformers calls ``fp8``: e4m3 weights,
    fp32 block scales, activations quantized on the fly (which dequantizing at load drops)."""
    q = d.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"quantization_config {q!r} is not supported (a mapping)")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(
            f"quantization_config.quant_method {method!r} is not supported "
            "('fp8' with block scales only)"
        )
    for key, want in (("fmt", "e4m3"), ("activation_scheme", "dynamic")):
        if q.get(key, want) != want:
            raise ConfigError(
                f"quantization_config.{key} {q[key]!r} is not supported ({want!r} only)"
            )
    block = q.get("weight_block_size")
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ConfigError(
            f"quantization_config.weight_block_size {block!r} is not supported "
            "(two positive integers; per-tensor scales are not implemented)"
        )
    return Fp8BlockQuant(block=(block[0], block[1]))


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
