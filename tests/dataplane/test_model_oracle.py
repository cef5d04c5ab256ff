"""Our DeepSeek-V2 against transformers' own implementation on checkpoints transformers writes,
with weights re-initialised at O(1) scales (``model_fixtures.reinit``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers
from model_fixtures import FP32_TOL, hf_reference, reference_diffs, reinit

assert hasattr(transformers, "DeepseekV2ForCausalLM"), "the oracle needs transformers' DeepSeek-V2"

from pdd_sidecar.engine.generate import generate_result  # noqa: E402
from pdd_sidecar.model.config import ModelConfig  # noqa: E402

pytestmark = [
    pytest.mark.dataplane,
    pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
]

STEPS = 16
PROMPT = [5, 77, 12, 200, 31, 9, 150, 64, 3, 99, 18, 240, 7, 45, 128, 66, 90, 21, 180, 2, 33]

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=8,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}

VARIANTS = {
    "dense-qlora": dict(q_lora_rank=48, first_k_dense_replace=3),
    "moe-no-qlora": dict(q_lora_rank=None, first_k_dense_replace=1, routed_scaling_factor=1.7),
    "moe-qlora-yarn": dict(
        q_lora_rank=48, first_k_dense_replace=1, routed_scaling_factor=2.5, rope_parameters=YARN
    ),
    "moe-yarn-attnfactor-grouped-tied": dict(
        q_lora_rank=40,
        first_k_dense_replace=1,
        rope_parameters={
            **YARN,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "factor": 8.0,
            "original_max_position_embeddings": 64,
        },
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        tie_word_embeddings=True,
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf_case(request, tmp_path_factory):
    cfg = transformers.DeepseekV2Config(**BASE, **VARIANTS[request.param])
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(cfg).eval()
    reinit(model, seed=len(request.param))
    if cfg.tie_word_embeddings:
        model.tie_weights()
    path: Path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, path, hf_reference(model, PROMPT, STEPS)


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_matches_transformers_fp32(hf_case, tp, dcp):
    name, path, ref = hf_case
    res = generate_result(path, PROMPT, STEPS + 1, tp=tp, dcp=dcp, block_size=8, keep_logits=True)
    assert res.token_ids == ref[2], name
    diff_prompt, diff_steps = reference_diffs(res, ref)
    print(f"{name} tp{tp} dcp{dcp}: prompt {diff_prompt:.2e} decode {diff_steps:.2e}")
    assert diff_prompt <= FP32_TOL, name
    assert diff_steps <= FP32_TOL, name
    # the comparison is meaningful: logits spread well beyond the tolerance
    assert float(ref[0].std()) > 1000 * FP32_TOL


def test_config_reads_transformers_fields(hf_case):
    name, path, _ = hf_case
    ours = ModelConfig.from_pretrained(path)
    hf = transformers.DeepseekV2Config.from_pretrained(path)
    assert ours.q_lora_rank == hf.q_lora_rank
    assert ours.rope.rope_type == hf.rope_parameters["rope_type"]
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert [ours.is_moe_layer(i) for i in range(ours.num_hidden_layers)] == [
        i >= hf.first_k_dense_replace for i in range(hf.num_hidden_layers)
    ]


def test_legacy_rope_scaling_layout():
    """DeepSeek's own config.json (remote-code era) spells YaRN as rope_theta + rope_scaling."""
    legacy = {
        **{k: v for k, v in BASE.items() if k not in ("eos_token_id", "bos_token_id")},
        "q_lora_rank": None,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    }
    cfg = ModelConfig.from_hf_dict(legacy)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 40
    m = 0.1 * 0.707 * math.log(40) + 1
    assert cfg.softmax_scale == pytest.approx((16 + 8) ** -0.5 * m * m)
