"""bench/train_tiny.py trains transformers' DeepSeek models on the standard library's bytes and
saves them for the engine: the FP8 KV accuracy bench's trained rows are only as good as that
checkpoint being the model that was trained. A few steps on a tiny config must lower the loss,
and the saved bf16 checkpoint, loaded by the engine in float32, must give the log-probabilities
transformers gives with the same (bf16-rounded) weights: a weight saved under the wrong name,
transposed, or with gate and up swapped moves them by far more than the tolerance."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.dataplane

ROOT = Path(__file__).resolve().parents[2]


def bench_module(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


kv = bench_module("kv_dtype_accuracy")
tt = bench_module("train_tiny")


def tiny_config(kind: str) -> Any:
    from pdd_sidecar.model.config import V2, V3, ModelConfig, RopeConfig

    common: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256,
        rope=RopeConfig(rope_type="default", theta=10000.0))
    if kind == "v2":
        return ModelConfig(q_lora_rank=None, model_type=V2, **common)
    return ModelConfig(q_lora_rank=32, model_type=V3, scoring_func="sigmoid",
                       topk_method="noaux_tc", n_group=2, topk_group=1, norm_topk_prob=True,
                       routed_scaling_factor=2.5, **common)


SETTINGS = tt.TrainSettings(steps=10, batch=4, seq_len=64, long_steps=2, long_len=128, lr=5e-3,
                            warmup=3)


@pytest.mark.parametrize("kind", ["v2", "v3"])
def test_trained_checkpoint_is_the_model_transformers_trained(tmp_path: Path, kind: str) -> None:
    torch.set_num_threads(2)
    cfg = tiny_config(kind)
    model, result = tt.train(cfg, SETTINGS, log=lambda _: None)
    assert result.first_loss > 5.0 and result.last_loss < result.first_loss - 1.0, result
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change the winners
                buf.add_(0.2 * torch.randn(buf.shape, generator=g))
    tt.save(model, cfg, tmp_path)
    with torch.no_grad():  # what the engine reads back: the same weights rounded to bf16
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and not name.endswith("inv_freq"):
                t.copy_(t.to(torch.bfloat16).float())
        tokens = tt.held_out_sequences(1, 96)[0]
        ref = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), -1)
    got = kv.teacher_forced(str(tmp_path), tokens, "auto", "float32", chunk=40, block_size=16)
    assert float(ref.std()) > 0.5  # a spread the tolerance below is tiny against
    assert float((got - ref).abs().max()) < 1e-4


def test_held_out_text_is_never_trained_on() -> None:
    train, held = tt.corpus_files()
    assert held and not set(train) & set(held)
    seqs = tt.held_out_sequences(3, 1000)
    assert [len(s) for s in seqs] == [1000] * 3 and max(max(s) for s in seqs) < 256
    assert tt.byte_ids(held)[:3000].tolist() == seqs[0] + seqs[1] + seqs[2]


def test_a_second_run_reuses_the_cached_checkpoint(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_config("v3")
    calls: list[int] = []

    def fake_train(cfg: Any, s: Any, log: Any = None) -> tuple[Any, Any]:
        calls.append(s.steps)
        return tt.hf_model(cfg, s.seed), tt.TrainResult(5.5, 2.0, 2.1, 1.0, 10)

    monkeypatch.setattr(tt, "train", fake_train)
    a, info = tt.trained_checkpoint(cfg, SETTINGS, tmp_path, log=lambda _: None)
    b, _ = tt.trained_checkpoint(cfg, SETTINGS, tmp_path, log=lambda _: None)
    c, _ = tt.trained_checkpoint(cfg, tt.TrainSettings(steps=13), tmp_path, log=lambda _: None)
    assert a == b != c and calls == [10, 13]
    assert info["last_loss"] == 2.0 and (a / "model.safetensors").is_file()
