"""bench/engine.py's CPU smoke configuration runs end to end and reports every section."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from bench_fixtures import load_bench

pytestmark = pytest.mark.dataplane


def test_small_config_reports_every_section(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    mod = load_bench("engine.py", monkeypatch)
    out = tmp_path / "engine.json"
    argv = ["--device", "cpu", "--small", "--batches", "1,2", "--contexts", "40", "--prefill"]
    argv += ["24", "--attn-contexts", "64", "--moe-tokens", "1", "--reps", "1", "--json", str(out)]
    argv += ["--chunked", "40,24", "--chunk", "16", "--batched", "3x8,2x20"]
    assert mod.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["config"] == "small"
    assert res["ceilings"]["hbm_read_Bps"] > 0 and res["ceilings"]["matmul_flops"] > 0
    assert [r["tokens"] for r in res["prefill"]] == [24]
    pre = res["prefill"][0]  # its bound: the longer of FLOPs at the matmul rate and bytes
    flops_s = pre["of_matmul"] * pre["ms"] / 1e3
    assert pre["bound_ms"] / 1e3 >= flops_s * (1 - 1e-9)
    assert math.isclose(pre["of_bound"] * pre["ms"], pre["bound_ms"], rel_tol=1e-9)
    assert math.isnan(pre["graph_ms"])  # the serving path's prefill graph: CUDA only
    assert [(r["batch"], r["context"]) for r in res["decode"]] == [(1, 40), (2, 40)]
    for r in res["decode"]:
        assert r["eager_ms"] > 0 and math.isnan(r["graph_ms"])  # no graphs on the CPU
        assert r["bytes_parts"]["kv"] == r["batch"] * 41 * 3 * (64 + 32) * 2
        assert 1 <= r["experts_used_mean"] <= 2 * r["batch"]
    assert [(r["batch"], r["context"]) for r in res["attention"]] == [(1, 64), (2, 64)]
    assert res["moe"][0]["tokens"] == 1 and res["moe"][0]["loop_us"] > 0
    # chunked rows: ragged chunks, one step each, beside the one-pass row of the same prompt
    # (measured anew for 40, reused for 24), against the same FLOP count
    assert [(r["tokens"], r["chunk"], r["steps"]) for r in res["prefill_chunked"]] == [
        (40, 16, 3), (24, 16, 2)]
    for r in res["prefill_chunked"]:
        assert r["s"] > 0 and r["one_pass_s"] > 0 and r["of_matmul"] > 0
        flops = r["of_matmul"] * r["s"]
        assert math.isclose(flops, r["one_pass_of_matmul"] * r["one_pass_s"], rel_tol=1e-9)
    assert res["prefill_chunked"][1]["one_pass_s"] == res["prefill"][0]["ms"] / 1e3
    # fresh prompts in one step, both ways (the CPU runs the per-prompt path for both)
    assert [(r["prompts"], r["tokens"]) for r in res["prefill_batched"]] == [(3, 8), (2, 20)]
    for r in res["prefill_batched"]:
        assert r["ms"] > 0 and r["per_prompt_attention_ms"] > 0 and not r["batched_attention"]


def test_prefill_flops_count_causal_attention_over_the_whole_prompt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The quadratic term is causal attention over every earlier token and the token itself:
    per layer and head, qk dims for the scores and v dims for the weighted sum, 2 FLOPs each."""
    mod = load_bench("engine.py", monkeypatch)
    cfg = mod.v2_lite_config()
    f = mod.prefill_flops
    t = 1000
    second_diff = f(cfg, t + 1) - 2 * f(cfg, t) + f(cfg, t - 1)
    per_pair = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * (
        cfg.qk_head_dim + cfg.v_head_dim)
    assert math.isclose(second_diff, per_pair, rel_tol=1e-6)


def test_breakdown_groups_kernels_by_name_per_layer_against_the_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels of one name are summed (templates and parameters stripped from the name), per
    step and per layer, as a share of the step's wall time, most time first."""
    mod = load_bench("engine.py", monkeypatch)
    times = [
        ("void at::native::vectorized_elementwise_kernel<4, AddFunctor<float>>(int, float)", 2e-6),
        ("_gemv_gate_up", 40e-6),
        ("void at::native::vectorized_elementwise_kernel<4, MulFunctor<float>>(int, float)", 4e-6),
        ("_gemv_gate_up", 20e-6),
    ]
    rows = mod.group_kernels(times, layers=2, step_s=100e-6)
    assert [r["kernel"] for r in rows] == ["_gemv_gate_up", "vectorized_elementwise_kernel"]
    top, ew = rows
    assert top["calls"] == 2 and math.isclose(top["us_per_step"], 60.0)
    assert math.isclose(top["us_per_layer"], 30.0) and math.isclose(top["of_step"], 0.6)
    assert ew["calls"] == 2 and math.isclose(ew["us_per_call"], 3.0)
    text, summary = mod.breakdown(lambda: mod.torch.ones(4) + 1, mod.torch.device("cpu"), 1, 1e-3)
    assert summary["kernels"] >= 1 and "between kernels" in text


def test_kv_budget_from_free_memory_or_as_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = load_bench("engine.py", monkeypatch)
    cpu = mod.torch.device("cpu")
    assert mod.kv_budget_gib(cpu, 3.5, 12.0, small=False) == 3.5
    assert mod.kv_budget_gib(cpu, None, 12.0, small=False) == 1.0
    with pytest.raises(SystemExit, match="--kv-gib must be positive, got -1"):
        mod.kv_budget_gib(cpu, -1.0, 12.0, small=False)


def test_fusion_variant_sets_the_per_expert_gemv_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """``+grouped=A-B`` is the range, ``+grouped=N`` runs from 2; both end with the block."""
    mod = load_bench("engine.py", monkeypatch)
    from pdd_sidecar.model import fusion

    for name, want in (("on+grouped=5-21", (5, 21)), ("on+grouped=9", (2, 9)),
                       ("on+shared=2+grouped=0", (2, 0))):
        with mod.fusion_variant(name):
            assert fusion.grouped_gemv_tokens() == want
        assert fusion.grouped_gemv_tokens() == fusion.GROUPED_GEMV_TOKENS
    with mod.fusion_variant("on+shared=3"):
        assert fusion.shared_in_gemv_tokens() == 3
    for bad in ("on+grouped=a-3", "on+grouped=3-", "on+grouped=-3"):
        with pytest.raises(ValueError, match="grouped"), mod.fusion_variant(bad):
            pass


def test_fusion_variant_switches_pdl_for_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDD_PDL", raising=False)
    mod = load_bench("engine.py", monkeypatch)
    from pdd_sidecar.model import fusion

    for name, want in (("on+pdl", True), ("on+pdl=1+shared=2", True), ("on+pdl=0", False),
                       ("on", fusion.PDL_DEFAULT)):
        with mod.fusion_variant(name):
            assert fusion.pdl() is want
        assert fusion.pdl() is fusion.PDL_DEFAULT
    with pytest.raises(ValueError, match="pdl"), mod.fusion_variant("on+pdl=yes"):
        pass


def test_prefill_bound_is_the_longer_of_flops_and_weight_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes: every weight the prompt uses once, the routed experts its tokens can reach (all of
    them past a few tokens per expert)."""
    mod = load_bench("engine.py", monkeypatch)
    cfg = mod.small_config()
    w = mod.random_weights(cfg, torch.float32, torch.device("cpu"))
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    t = 64
    all_bytes = sum(mod.step_bytes(cfg, w, [cfg.n_routed_experts] * n_moe, t, t).values())
    flops = mod.prefill_flops(cfg, t)
    by_bytes = mod.prefill_bound_s(cfg, w, t, {"matmul_flops": 1e30, "hbm_read_Bps": 1e9})
    assert math.isclose(by_bytes, all_bytes / 1e9, rel_tol=1e-9)
    by_flops = mod.prefill_bound_s(cfg, w, t, {"matmul_flops": 1e9, "hbm_read_Bps": 1e30})
    assert math.isclose(by_flops, flops / 1e9, rel_tol=1e-9)
    one = mod.prefill_bound_s(cfg, w, 1, {"matmul_flops": 1e30, "hbm_read_Bps": 1e9})
    assert one < by_bytes  # one token reaches only its own experts
