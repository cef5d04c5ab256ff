"""DeepSeek-V3 against transformers' own DeepseekV3 on checkpoints the tests write.

Covers what V3 adds to V2: sigmoid scores with ``noaux_tc`` selection (score-correction bias,
group-limited by each group's top two), normalised or raw top-k weights times
``routed_scaling_factor``, defaults taken from transformers for keys a config.json leaves out,
FP8 block-quantized weights, multi-token-prediction layers left on disk, and refusal of
checkpoints this model does not implement. References come from transformers loading the very
directory we serve, so its reading of the config is part of the oracle.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from model_fixtures import (
    BF16_MAX_TOL,
    BF16_Q90_TOL,
    FP32_TOL,
    LAYOUTS,
    V3_GROUPED,
    V3_YARN,
    hf_reference,
    max_diff,
    reference_diffs,
    result_diffs,
    write_v3_checkpoint,
)
from safetensors.torch import load_file, save_file

assert hasattr(transformers, "DeepseekV3ForCausalLM"), "the oracle needs transformers' DeepSeek-V3"

from pdd_api.models_catalog import KNOWN_MODELS  # noqa: E402
from pdd_sidecar.engine.generate import generate_result  # noqa: E402
from pdd_sidecar.model.config import ConfigError, ModelConfig  # noqa: E402
from pdd_sidecar.model.moe import route  # noqa: E402
from pdd_sidecar.model.rank_model import load_rank_model  # noqa: E402

pytestmark = [
    pytest.mark.dataplane,
    pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
]

STEPS = 16
PROMPT = [5, 77, 12, 200, 31, 9, 150, 64, 3, 99, 18, 240, 7, 45, 128, 66, 90, 21, 180, 2, 33]

# transformers' DeepseekV3Config defaults, which "grouped-defaults" leaves out of config.json.
ROUTING_KEYS = (
    "n_group",
    "topk_group",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "routed_scaling_factor",
    "norm_topk_prob",
    "n_shared_experts",
)

VARIANTS: dict[str, dict[str, Any]] = {
    # one group: plain top-k over bias-corrected sigmoid scores
    "ungrouped-yarn": dict(
        num_hidden_layers=3,
        q_lora_rank=48,
        n_routed_experts=8,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        rope_parameters=V3_YARN,
    ),
    # 8 groups of 2, best 4 groups, 8 experts, 3 dense layers, scale 2.5, normalised weights:
    # every routing key is transformers' default and absent from config.json
    "grouped-defaults": dict(num_hidden_layers=4, q_lora_rank=None, n_routed_experts=16),
    "grouped-raw-weights": V3_GROUPED,
}


def _write_v3(name: str, path: Path) -> None:
    drop = ROUTING_KEYS if name == "grouped-defaults" else ()
    write_v3_checkpoint(path, VARIANTS[name], seed=len(name), drop_keys=drop)


def _load_hf(path: Path) -> torch.nn.Module:
    return transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf_case(request, tmp_path_factory):
    path: Path = tmp_path_factory.mktemp(request.param)
    _write_v3(request.param, path)
    model = _load_hf(path)
    return request.param, path, model, hf_reference(model, PROMPT, STEPS)


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_matches_transformers_fp32(hf_case, tp, dcp):
    name, path, _, ref = hf_case
    res = generate_result(path, PROMPT, STEPS + 1, tp=tp, dcp=dcp, block_size=8, keep_logits=True)
    assert res.token_ids == ref[2], name
    diff_prompt, diff_steps = reference_diffs(res, ref)
    print(f"v3 {name} tp{tp} dcp{dcp}: prompt {diff_prompt:.2e} decode {diff_steps:.2e}")
    assert diff_prompt <= FP32_TOL, name
    assert diff_steps <= FP32_TOL, name
    assert float(ref[0].std()) > 1000 * FP32_TOL
    assert len(set(ref[2])) > 1


def test_config_reads_transformers_fields(hf_case):
    name, path, _, _ = hf_case
    assert "scoring_func" not in json.loads((path / "config.json").read_text())
    ours = ModelConfig.from_pretrained(path)
    hf = transformers.DeepseekV3Config.from_pretrained(path)
    assert (ours.model_type, ours.scoring_func, ours.topk_method) == (
        "deepseek_v3",
        "sigmoid",
        "noaux_tc",
    )
    for key in ROUTING_KEYS + ("n_routed_experts", "q_lora_rank"):
        assert getattr(ours, key) == getattr(hf, key), key
    assert ours.rope.rope_type == hf.rope_parameters["rope_type"]
    assert [ours.is_moe_layer(i) for i in range(ours.num_hidden_layers)] == [
        i >= hf.first_k_dense_replace for i in range(hf.num_hidden_layers)
    ]
    if name == "grouped-defaults":
        assert (ours.n_group, ours.topk_group, ours.num_experts_per_tok) == (8, 4, 8)
        assert ours.routed_scaling_factor == 2.5 and ours.norm_topk_prob


def test_route_matches_transformers_router(hf_case):
    """route() on hidden states that spread the router scores, against transformers' router
    module of the first MoE layer: the same experts with the same weights; and the bias and the
    group limit each change the choice for some tokens, so both are exercised."""
    name, path, model, _ = hf_case
    cfg = ModelConfig.from_pretrained(path)
    layer = cfg.first_k_dense_replace
    gate = model.model.layers[layer].mlp.gate
    x = torch.randn(512, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, hf_w, hf_ids = gate(x)
    bias = gate.e_score_correction_bias.detach()
    w, ids = route(x, gate.weight.detach(), cfg, bias)

    def by_expert(w: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = ids.argsort(dim=-1)
        return ids.gather(1, order), w.gather(1, order)

    (a_ids, a_w), (b_ids, b_w) = by_expert(w, ids), by_expert(hf_w, hf_ids)
    assert torch.equal(a_ids, b_ids), name
    print(f"v3 {name} route: max |Δweight| {max_diff(a_w, b_w):.2e}")
    assert max_diff(a_w, b_w) <= 1e-6
    no_bias = by_expert(*route(x, gate.weight.detach(), cfg, None))[0]
    assert not torch.equal(no_bias, a_ids), "the bias never changed a choice: test too weak"
    if cfg.n_group and cfg.n_group > 1:
        flat = cfg.replace(n_group=1, topk_group=1)
        ungrouped = by_expert(*route(x, gate.weight.detach(), flat, bias))[0]
        assert not torch.equal(ungrouped, a_ids), "the group limit never bit: test too weak"


# --- TP/DCP equivalence, as test_dcp_equivalence does for the built-in V2 model -----------------

EQ_PROMPT = list(range(40, 77))
EQ_BLOCK = 4


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory) -> Path:
    path: Path = tmp_path_factory.mktemp("v3-eq")
    _write_v3("grouped-raw-weights", path)
    return path


def _eq_run(path: Path, tp: int, dcp: int, dtype: str = "float32", forced=None):
    return generate_result(path, EQ_PROMPT, STEPS + 1, tp=tp, dcp=dcp, dtype=dtype,
                           block_size=EQ_BLOCK, keep_logits=True, forced_ids=forced)


@pytest.fixture(scope="module")
def eq_ref_fp32(v3_dir):
    return _eq_run(v3_dir, 1, 1)


@pytest.mark.parametrize("tp,dcp", LAYOUTS, ids=[f"tp{t}-dcp{d}" for t, d in LAYOUTS])
def test_fp32_layout_matches_single_rank(v3_dir, eq_ref_fp32, tp, dcp):
    res = _eq_run(v3_dir, tp, dcp)
    diff = float(result_diffs(res, eq_ref_fp32).max())
    print(f"v3 fp32 tp{tp} dcp{dcp}: max |logit diff| {diff:.2e}")
    assert res.token_ids == eq_ref_fp32.token_ids
    assert diff <= FP32_TOL
    assert len(set(eq_ref_fp32.token_ids)) > 1


class RouteSpy:
    """Records each route() call's chosen experts per thread (one thread per rank)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import pdd_sidecar.model.moe as moe_mod

        self.calls: dict[str, list[torch.Tensor]] = {}
        real = moe_mod.route

        def spy(x, router, cfg, bias=None):
            w, ids = real(x, router, cfg, bias)
            name = threading.current_thread().name
            self.calls.setdefault(name, []).append(ids.sort(dim=-1).values)
            return w, ids

        monkeypatch.setattr(moe_mod, "route", spy)

    def rank0(self) -> list[torch.Tensor]:
        runs = list(self.calls.values())
        for other in runs[1:]:  # the router is replicated: every rank picks the same experts
            assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))
        return runs[0]


@pytest.mark.parametrize("tp,dcp", LAYOUTS, ids=[f"tp{t}-dcp{d}" for t, d in LAYOUTS])
def test_bf16_layout_close_to_single_rank(v3_dir, tp, dcp, monkeypatch):
    """As for V2, but V3's sigmoid scores crowd more near-ties (and group sums add a second
    level of them), so here the bound is checked against the routing itself: every token whose
    logits move by more than ``BF16_MAX_TOL`` must be one whose experts changed somewhere."""
    spy = RouteSpy(monkeypatch)
    ref = _eq_run(v3_dir, 1, 1, "bfloat16")
    ref_calls, spy.calls = spy.rank0(), {}
    res = _eq_run(v3_dir, tp, dcp, "bfloat16", forced=ref.token_ids)
    calls = spy.rank0()
    assert len(calls) == len(ref_calls)
    flipped = sum(int((a != b).any(dim=-1).sum()) for a, b in zip(calls, ref_calls, strict=True))
    d = result_diffs(res, ref)
    per_token = (res.prompt_logits - ref.prompt_logits).abs().amax(dim=-1).tolist() + [
        float((a - b).abs().max()) for a, b in zip(res.step_logits, ref.step_logits, strict=True)
    ]
    moved = sum(x > BF16_MAX_TOL for x in per_token)
    q90, worst = float(torch.quantile(d, 0.9)), float(d.max())
    print(f"v3 bf16 tp{tp} dcp{dcp}: |logit diff| q90 {q90:.3f} max {worst:.3f}; "
          f"{moved} tokens over {BF16_MAX_TOL}, {flipped} routing flips")
    assert q90 <= BF16_Q90_TOL
    assert moved <= flipped


# --- FP8 block-quantized checkpoints ---------------------------------------------------------

QUANTIZED = re.compile(
    r"\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|eh_proj|gate_proj|up_proj"
    r"|down_proj)\.weight$"
)
E4M3_MAX = 448.0


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's recipe: per block, ``scale = amax / 448`` and ``q = e4m3(w / scale)``; the
    scale is stored as ``weight_scale_inv`` (what dequantization multiplies by)."""
    bm, bn = block
    rows, cols = w.shape
    padded = F.pad(w.float(), (0, -cols % bn, 0, -rows % bm))
    blocks = padded.unflatten(1, (-1, bn)).unflatten(0, (-1, bm))  # [R, bm, C, bn]
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = q.shape
    s = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return q.float() * s


def _mtp_layer(cfg: dict[str, Any], layer: int) -> dict[str, torch.Tensor]:
    """Tensors shaped like a V3 multi-token-prediction module (never read)."""
    h, p = cfg["hidden_size"], f"model.layers.{layer}."
    g = torch.Generator().manual_seed(layer)
    return {
        p + "enorm.weight": torch.ones(h),
        p + "hnorm.weight": torch.ones(h),
        p + "eh_proj.weight": torch.randn(h, 2 * h, generator=g),
        p + "shared_head.norm.weight": torch.ones(h),
        p + "embed_tokens.weight": torch.randn(cfg["vocab_size"], h, generator=g),
    }


FP8_BLOCKS = [(128, 128), (40, 24)]  # DeepSeek's; and blocks that TP shard edges cut through


@pytest.fixture(scope="module", params=FP8_BLOCKS, ids=[f"block{m}x{n}" for m, n in FP8_BLOCKS])
def fp8_case(request, tmp_path_factory):
    """``(fp8 dir, dequantized fp32 dir, transformers on the dequantized weights, transformers on
    the originals)``."""
    block: tuple[int, int] = request.param
    base = tmp_path_factory.mktemp("v3-fp32")
    _write_v3("grouped-raw-weights", base)
    cfg = json.loads((base / "config.json").read_text())
    state = load_file(str(base / "model.safetensors"))
    state.update(_mtp_layer(cfg, cfg["num_hidden_layers"]))
    fp8: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if QUANTIZED.search(name):
            q, s = quantize_blocks(w, block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = dequantize_blocks(q, s, block)
        else:
            fp8[name] = deq[name] = w
    fp8_dir = tmp_path_factory.mktemp("v3-fp8")
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": list(block)}
    (fp8_dir / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    save_file(fp8, str(fp8_dir / "model.safetensors"))
    deq_dir = tmp_path_factory.mktemp("v3-dequantized")
    (deq_dir / "config.json").write_text(json.dumps(cfg))
    save_file(deq, str(deq_dir / "model.safetensors"))
    ref_deq = hf_reference(_load_hf(deq_dir), PROMPT, STEPS)
    ref_orig = hf_reference(_load_hf(base), PROMPT, STEPS)
    return fp8_dir, deq_dir, ref_deq, ref_orig


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_fp8_checkpoint_matches_transformers_on_dequantized(fp8_case, tp, dcp):
    """Dequantizing at load reproduces transformers on the dequantized weights to fp32 rounding;
    against the original weights the logits move by what the round trip alone moves
    transformers' own, and no more."""
    fp8_dir, _, ref_deq, ref_orig = fp8_case
    res = generate_result(fp8_dir, PROMPT, STEPS + 1, tp=tp, dcp=dcp, block_size=8,
                          keep_logits=True)
    assert res.token_ids == ref_deq[2]
    diff_prompt, diff_steps = reference_diffs(res, ref_deq)
    assert res.prompt_logits is not None
    round_trip = max_diff(ref_deq[0], ref_orig[0])
    vs_orig = max_diff(res.prompt_logits, ref_orig[0])
    print(f"v3 fp8 {fp8_dir.name} tp{tp} dcp{dcp}: vs dequantized prompt {diff_prompt:.2e} "
          f"decode {diff_steps:.2e}; vs original {vs_orig:.3f} (round trip {round_trip:.3f})")
    assert diff_prompt <= FP32_TOL and diff_steps <= FP32_TOL
    assert round_trip > 100 * FP32_TOL  # the weights really were quantized
    assert vs_orig <= round_trip + FP32_TOL


def test_fp8_mtp_layers_skipped_with_log(fp8_case, caplog):
    fp8_dir = fp8_case[0]
    with caplog.at_level(logging.INFO, logger="pdd_sidecar.model.weights"):
        m = load_rank_model(fp8_dir, dtype="bfloat16")
    assert "skipping 1 multi-token-prediction layer(s) (model.layers.4)" in caplog.text
    assert len(m.weights.layers) == 4
    assert m.weights.layers[0].attn.kv_a_proj.dtype == torch.bfloat16


def test_fp8_bf16_serving_equals_dequantized_checkpoint(fp8_case):
    """Serving in bf16 rounds the fp32 dequantized weights once, exactly as serving a
    dequantized fp32 checkpoint in bf16 does: the two runs agree bit for bit."""
    fp8_dir, deq_dir, _, _ = fp8_case
    a, b = (
        generate_result(d, PROMPT, STEPS + 1, tp=2, dcp=2, dtype="bfloat16", block_size=8,
                        keep_logits=True)
        for d in (fp8_dir, deq_dir)
    )
    assert a.token_ids == b.token_ids
    assert float(result_diffs(a, b).max()) == 0.0


# --- checkpoints this model does not implement -----------------------------------------------

# DeepSeek-V3's published config.json (remote-code era), abridged to the keys that matter.
DEEPSEEK_V3_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_deepseek_v3_release_config_accepted():
    cfg = ModelConfig.from_hf_dict(DEEPSEEK_V3_CONFIG)
    assert (cfg.model_type, cfg.scoring_func, cfg.topk_method) == ("deepseek_v3", "sigmoid",
                                                                   "noaux_tc")
    assert cfg.quantization is not None and cfg.quantization.block == (128, 128)
    assert cfg.num_nextn_predict_layers == 1
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 40
    assert cfg.latent_dim == 576
    assert [cfg.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]


def test_plan_catalog_matches_v3_config():
    """`pdd plan` sizes V3's KV from its catalog entry (pdd_api has no torch): the entry must be
    what this model caches per token."""
    cfg = ModelConfig.from_hf_dict(DEEPSEEK_V3_CONFIG)
    for name in ("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-R1"):
        shape = KNOWN_MODELS[name]
        assert (shape.num_layers, shape.latent_dim) == (cfg.num_hidden_layers, cfg.latent_dim)


def _with(**changes: Any) -> dict[str, Any]:
    d = {**DEEPSEEK_V3_CONFIG, **changes}
    return {k: v for k, v in d.items() if v is not DROP}


DROP = object()
QUANT = DEEPSEEK_V3_CONFIG["quantization_config"]
REFUSED = {
    "other-model-type": (_with(model_type="llama"), "model_type 'llama'"),
    "kimi-on-v3-arch": (_with(model_type="kimi_k2"), "model_type 'kimi_k2'"),
    "other-arch": (_with(architectures=["MixtralForCausalLM"]), "architectures ['Mixtral"),
    "arch-without-type": (_with(model_type=DROP, architectures=["Qwen2ForCausalLM"]),
                          "architectures ['Qwen2ForCausalLM']"),
    "v2-type-v3-arch": (_with(model_type="deepseek_v2"), "architectures ['DeepseekV3ForCausalLM']"),
    "softmax-v3": (_with(scoring_func="softmax"), "scoring_func 'softmax'"),
    "greedy-v3": (_with(topk_method="greedy"), "topk_method 'greedy'"),
    "moe-freq": (_with(moe_layer_freq=2), "moe_layer_freq 2"),
    "rope-halves": (_with(rope_interleave=False), "rope_interleave False"),
    "groups-uneven": (_with(n_group=7), "n_group 7"),
    "group-null": (_with(n_group=None), "n_group None"),
    "topk-group": (_with(topk_group=9), "topk_group 9"),
    "too-many-experts": (_with(topk_group=1, num_experts_per_tok=40), "num_experts_per_tok 40"),
    "sigmoid-v2": (_with(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"]),
                   "scoring_func 'sigmoid'"),
    "awq": (_with(quantization_config={"quant_method": "awq", "bits": 4}),
            "quantization_config.quant_method 'awq'"),
    "compressed": (_with(quantization_config={"quant_method": "compressed-tensors"}),
                   "quantization_config.quant_method 'compressed-tensors'"),
    "e5m2": (_with(quantization_config={**QUANT, "fmt": "e5m2"}), "quantization_config.fmt 'e5m2'"),
    "static-act": (_with(quantization_config={**QUANT, "activation_scheme": "static"}),
                   "quantization_config.activation_scheme 'static'"),
    "per-tensor": (_with(quantization_config={**QUANT, "weight_block_size": None}),
                   "quantization_config.weight_block_size None"),
    "gqa": (_with(num_key_value_heads=16), "num_key_value_heads 16"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_config_refused_naming_key(name):
    d, message = REFUSED[name]
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_hf_dict(d)


def test_unsupported_checkpoint_refused_at_start(tmp_path):
    """The whole path a user takes: generation on the directory stops before serving."""
    (tmp_path / "config.json").write_text(json.dumps(_with(model_type="qwen3_moe")))
    with pytest.raises(ConfigError, match="model_type 'qwen3_moe' is not supported"):
        generate_result(tmp_path, [1, 2, 3], 2)


def test_fp8_tensors_without_quantization_config_refused(fp8_case, tmp_path):
    fp8_dir = fp8_case[0]
    cfg = json.loads((fp8_dir / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(fp8_dir / "model.safetensors")
    with pytest.raises(ConfigError, match=r"has dtype float8_e4m3fn, which config.json's"):
        load_rank_model(tmp_path)
