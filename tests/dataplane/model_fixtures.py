"""Helpers shared by the model oracle tests: O(1) weights for transformers models, transformers'
own greedy reference, and logit comparisons between two runs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

FP32_TOL = 1e-4
LAYOUTS = [(2, 1), (2, 2), (4, 1), (4, 4), (8, 8)]  # (tp, dcp) checked against one rank
# bf16 keeps 8 mantissa bits: at logits of magnitude ~4 one ulp is 1/32. TP/DCP change the
# summation order of every reduction, so nearly all logits stay within 2 ulps; where a hidden
# state lands on a near-tie of the MoE router a token may pick another expert, which moves its
# logits by a few tenths. Hence two bounds: the 90th percentile and the maximum.
BF16_Q90_TOL = 1 / 16
BF16_MAX_TOL = 0.5


def reinit(model: torch.nn.Module, seed: int) -> None:
    """O(1) scales: transformers' 0.02 init would make attention nearly uniform and hide
    mistakes in rope, scaling or routing."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def hf_reference(
    model: torch.nn.Module, prompt: list[int], steps: int
) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """``(prompt logits, per-step logits, greedy tokens)`` from transformers with its KV cache."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        prompt_logits = out.logits[0].float()
        past = out.past_key_values
        tok = int(prompt_logits[-1].argmax())
        tokens, step_logits = [tok], []
        for _ in range(steps):
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            step_logits.append(logits)
            tok = int(logits.argmax())
            tokens.append(tok)
    return prompt_logits, step_logits, tokens


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def result_diffs(a: Any, b: Any) -> torch.Tensor:
    """All ``|Δlogit|`` between two generation results (prompt and every decode step)."""
    steps = zip(a.step_logits, b.step_logits, strict=True)
    parts = [(a.prompt_logits - b.prompt_logits).flatten()] + [(x - y) for x, y in steps]
    return torch.cat(parts).abs()


def reference_diffs(res: Any, ref: tuple[torch.Tensor, list[torch.Tensor], list[int]]) -> tuple[
    float, float
]:
    """``(prompt, decode)`` max ``|Δlogit|`` of a generation result against ``hf_reference``."""
    ref_prompt, ref_steps, _ = ref
    assert res.prompt_logits is not None
    diff_prompt = max_diff(res.prompt_logits, ref_prompt)
    diff_steps = max(max_diff(a, b) for a, b in zip(res.step_logits, ref_steps, strict=True))
    return diff_prompt, diff_steps


# --- small DeepSeek-V3 checkpoints written by transformers --------------------------------------

V3_BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=8,
    num_key_value_heads=8,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
)
V3_YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
# Group-limited routing: 4 layers (2 dense), 12 experts in 4 groups of 3, the best 2 groups,
# 3 experts a token with raw (unnormalised) weights times 1.5, 2 shared experts, q LoRA, YaRN.
V3_GROUPED: dict[str, Any] = dict(
    num_hidden_layers=4,
    q_lora_rank=40,
    n_routed_experts=12,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    norm_topk_prob=False,
    routed_scaling_factor=1.5,
    n_shared_experts=2,
    first_k_dense_replace=2,
    rope_parameters={
        **V3_YARN,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "factor": 8.0,
        "original_max_position_embeddings": 64,
    },
)


def write_v3_checkpoint(
    path: Path, config: dict[str, Any], seed: int, drop_keys: tuple[str, ...] = ()
) -> None:
    """transformers' DeepseekV3 with ``V3_BASE | config``, O(1) weights and a score-correction
    bias large enough to change which experts win, saved to ``path``; ``drop_keys`` are then left
    out of its config.json (so they take transformers' defaults)."""
    import transformers

    cfg = transformers.DeepseekV3Config(**V3_BASE, **config)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    reinit(model, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))
    model.save_pretrained(path)
    if drop_keys:
        cfg_path = path / "config.json"
        d = json.loads(cfg_path.read_text())
        cfg_path.write_text(json.dumps({k: v for k, v in d.items() if k not in drop_keys}))
