"""The transformers oracle on the GPU in fp32 (run by hand once per change of the kernels; skipped
without CUDA or transformers): our model on CUDA — Triton paged decode, GEMV experts, fused
prefill attention, decode steps replayed from a CUDA graph — against transformers' DeepseekV2 and
DeepseekV3 on the same GPU, on the small random checkpoints the CPU oracle tests write
(tests/dataplane/test_model_oracle.py, model_fixtures.py).

    PYTHONPATH=sidecar python -m pytest tests/gpu/test_oracle.py -q -s
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "dataplane"))

from model_fixtures import V3_GROUPED, reinit, write_v3_checkpoint  # noqa: E402
from test_model_oracle import BASE, PROMPT, STEPS, VARIANTS  # noqa: E402

from pdd_sidecar.engine.comm import SingleComm  # noqa: E402
from pdd_sidecar.engine.rank_engine import RankEngine, allocate_request, new_cache  # noqa: E402
from pdd_sidecar.model.rank_model import load_rank_model  # noqa: E402

DEV = torch.device("cuda")
# The CPU oracle holds 1e-4; on the GPU both sides sum in other orders (cuBLAS, Triton splits).
TOL = 5e-4
Run = tuple[torch.Tensor, list[torch.Tensor], list[int]]


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def hf_on_gpu(model: torch.nn.Module, steps: int) -> Run:
    model = model.to(DEV)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([PROMPT], device=DEV), use_cache=True)
        prompt_logits = out.logits[0].float().cpu()
        past = out.past_key_values
        tok = int(prompt_logits[-1].argmax())
        tokens, step_logits = [tok], []
        for _ in range(steps):
            out = model(input_ids=torch.tensor([[tok]], device=DEV), past_key_values=past,
                        use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float().cpu()
            step_logits.append(logits)
            tok = int(logits.argmax())
            tokens.append(tok)
    return prompt_logits, step_logits, tokens


def ours_on_gpu(path: Path, steps: int, mode: str) -> tuple[Run, int]:
    model = load_rank_model(path, 0, 1, "float32", DEV)
    cache = new_cache(model, 64, 8)
    eng = RankEngine(model, cache, SingleComm(), decode_mode=mode)
    table = allocate_request(cache, len(PROMPT) + steps, 1)
    logits = eng.prefill(PROMPT, table, all_logits=True)
    prompt_logits = logits.cpu()
    tok = int(prompt_logits[-1].argmax())
    tokens, step_logits = [tok], []
    for i in range(steps):
        row = eng.decode_step(tok, len(PROMPT) + i, table).cpu()
        step_logits.append(row)
        tok = int(row.argmax())
        tokens.append(tok)
    return (prompt_logits, step_logits, tokens), eng.graph_captures


def _compare(name: str, ours: Run, ref: Run) -> None:
    assert ours[2] == ref[2], name
    d_prompt = float((ours[0] - ref[0]).abs().max())
    d_steps = max(float((a - b).abs().max()) for a, b in zip(ours[1], ref[1], strict=True))
    print(f"{name}: prompt {d_prompt:.2e} decode {d_steps:.2e} (logit std "
          f"{float(ref[0].std()):.2f})")
    assert d_prompt <= TOL and d_steps <= TOL, name
    assert float(ref[0].std()) > 1000 * TOL  # logits spread well beyond the tolerance


@pytest.mark.parametrize("mode", ["graph", "eager"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_v2_matches_transformers_on_gpu_fp32(variant: str, mode: str, tmp_path: Path) -> None:
    cfg = transformers.DeepseekV2Config(**BASE, **VARIANTS[variant])
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(cfg).eval()
    reinit(model, seed=len(variant))
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(tmp_path)
    ref = hf_on_gpu(model, STEPS)
    ours, captures = ours_on_gpu(tmp_path, STEPS, mode)
    _compare(f"V2 {variant} {mode}", ours, ref)
    assert captures == (1 if mode == "graph" else 0)


@pytest.mark.skipif(not hasattr(transformers, "DeepseekV3ForCausalLM"), reason="no DeepseekV3")
def test_v3_matches_transformers_on_gpu_fp32(tmp_path: Path) -> None:
    write_v3_checkpoint(tmp_path, V3_GROUPED, seed=7)
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ref = hf_on_gpu(model.eval(), STEPS)
    ours, captures = ours_on_gpu(tmp_path, STEPS, "graph")
    _compare("V3 grouped graph", ours, ref)
    assert captures == 1
