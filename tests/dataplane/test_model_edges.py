"""Edge cases of the paged cache under TP/DCP, checkpoint layouts, and the cache-full path."""

from __future__ import annotations

import json

import pytest
import torch

from pdd_sidecar.engine.comm import SingleComm  # noqa: E402
from pdd_sidecar.engine.generate import generate, generate_result, main  # noqa: E402
from pdd_sidecar.engine.rank_engine import RankEngine, new_cache  # noqa: E402
from pdd_sidecar.kv.cache import KVCacheFullError  # noqa: E402
from pdd_sidecar.model.config import BUILTIN_SEED, builtin_config  # noqa: E402
from pdd_sidecar.model.rank_model import load_rank_model  # noqa: E402
from pdd_sidecar.model.weights import builtin_state_dict, write_checkpoint  # noqa: E402

pytestmark = pytest.mark.dataplane

STEPS = 12


@pytest.fixture(scope="module")
def reference():
    """Block size 1 over one rank: no paging effects at all, the baseline every edge must hit."""
    cache: dict[tuple[int, ...], object] = {}

    def get(prompt: list[int]):
        key = tuple(prompt)
        if key not in cache:
            cache[key] = generate_result("builtin", prompt, STEPS, block_size=1, keep_logits=True)
        return cache[key]

    return get


def _check(reference, prompt, tp, dcp, bs):
    ref = reference(prompt)
    res = generate_result("builtin", prompt, STEPS, tp=tp, dcp=dcp, block_size=bs, keep_logits=True)
    assert res.token_ids == ref.token_ids
    assert torch.allclose(res.prompt_logits, ref.prompt_logits, atol=1e-4)
    for a, b in zip(res.step_logits, ref.step_logits, strict=True):
        assert torch.allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("tp,dcp", [(1, 1), (4, 4)])
def test_prompt_shorter_than_a_block(reference, tp, dcp):
    # 3 tokens, block 16: under dcp 4 ranks 1-3 hold no chunk for the whole prefill and the
    # first 13 decode steps, then rank 1 gets chunk 1 (decode crosses into a new block).
    _check(reference, [7, 100, 42], tp, dcp, 16)


@pytest.mark.parametrize("tp,dcp", [(2, 2), (2, 1)])
def test_prompt_exact_multiple_of_block(reference, tp, dcp):
    # 16 tokens, block 8: the first decode token opens chunk 2, owned by rank 0 again.
    _check(reference, list(range(60, 76)), tp, dcp, 8)


def test_decode_crosses_many_block_boundaries(reference):
    # block 2: every other decode step starts a new chunk, rotating over 4 ranks
    _check(reference, [9, 8, 7, 6, 5], 4, 4, 2)


def test_rank_without_chunks_when_decode_starts():
    """8 ranks, block 4, 5 tokens: ranks 2-7 hold nothing at prefill; the (single-rank)
    reference must still be met at every step."""
    prompt = [11, 22, 33, 44, 55]
    a = generate("builtin", prompt, STEPS, tp=8, dcp=8, block_size=4)
    assert a == generate("builtin", prompt, STEPS, block_size=4)


def test_cache_full_is_a_clear_error_not_a_crash(capsys):
    prompt = list(range(1, 101))
    with pytest.raises(KVCacheFullError, match=r"requested 26 blocks of 4 tokens, 8 free of 8"):
        generate("builtin", prompt, 4, block_size=4, num_blocks=8)
    # under dcp each rank needs a quarter of the table: 26 chunks -> 7 blocks per rank
    assert generate("builtin", prompt, 4, tp=4, dcp=4, block_size=4, num_blocks=7)
    with pytest.raises(KVCacheFullError, match="requested 7 blocks"):
        generate("builtin", prompt, 4, tp=4, dcp=4, block_size=4, num_blocks=6)
    rc = main(
        ["--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "4"]
        + ["--block-size", "4", "--num-blocks", "8", "-o", "json"]
    )
    assert rc == 1
    err = capsys.readouterr().err
    assert "KV cache full" in err and "Traceback" not in err


def test_short_block_table_is_rejected():
    model = load_rank_model("builtin")
    cache = new_cache(model, 4, 4)
    engine = RankEngine(model, cache, SingleComm(), 1)
    with pytest.raises(ValueError, match="block table has 1 blocks, 6 tokens need 2"):
        engine.prefill([1, 2, 3, 4, 5, 6], [0])
    with pytest.raises(ValueError, match=r"out of range \[0, 256\): \[256\]"):
        engine.prefill([1, 256], [0])
    logits = engine.prefill([1, 2, 3, 4], [0])
    with pytest.raises(ValueError, match="5 tokens need 2"):
        engine.decode_step(int(logits.argmax()), 4, [0])


@pytest.fixture(scope="module")
def builtin_state():
    return builtin_config(), builtin_state_dict(builtin_config(), BUILTIN_SEED)


def test_sharded_checkpoint_with_index(tmp_path, builtin_state):
    cfg, state = builtin_state
    d = write_checkpoint(tmp_path / "sharded", cfg, state, max_shard_tensors=7)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert generate(d, prompt, 6, tp=2, dcp=2) == generate("builtin", prompt, 6, tp=2, dcp=2)


def test_fused_expert_layout_and_bf16_checkpoint(tmp_path, builtin_state):
    """transformers v5 in-memory names (experts.gate_up_proj / experts.down_proj as 3-D tensors),
    stored in bf16, load to the same model as the per-expert layout stored in bf16."""
    cfg, state = builtin_state
    bf = {k: v.to(torch.bfloat16) for k, v in state.items()}
    fused = dict(bf)
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(i):
            continue
        p = f"model.layers.{i}.mlp.experts."
        assert cfg.n_routed_experts
        es = range(cfg.n_routed_experts)
        gate = [fused.pop(p + f"{e}.gate_proj.weight") for e in es]
        up = [fused.pop(p + f"{e}.up_proj.weight") for e in es]
        down = [fused.pop(p + f"{e}.down_proj.weight") for e in es]
        fused[p + "gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)]
        )
        fused[p + "down_proj"] = torch.stack(down)
    a = write_checkpoint(tmp_path / "fused", cfg, fused)
    b = write_checkpoint(tmp_path / "per_expert", cfg, bf)
    prompt = [10, 20, 30, 40, 50]
    ra = generate_result(a, prompt, 5, tp=2, keep_logits=True)
    rb = generate_result(b, prompt, 5, tp=2, keep_logits=True)
    assert ra.token_ids == rb.token_ids
    assert torch.equal(ra.prompt_logits, rb.prompt_logits)
