"""bench/speculative.py's CPU smoke configuration runs end to end and reports every figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_fixtures import load_bench

pytestmark = pytest.mark.dataplane


def test_expected_tokens_per_verify_step(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = load_bench("speculative.py", monkeypatch)
    assert mod.expected_tokens(0.0, 3) == 1.0
    assert mod.expected_tokens(1.0, 3) == 4.0
    assert mod.expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert mod.expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_speedups_with_the_module_only_at_the_checkpoints_depth(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mod = load_bench("speculative.py", monkeypatch)
    assert mod.with_module_speedups("v3", 61, small=False)
    assert not mod.with_module_speedups("v3", 1, small=False)
    assert not mod.with_module_speedups("v2lite", 26, small=False)
    assert mod.with_module_speedups("v2lite", 27, small=False)
    assert mod.with_module_speedups("v2lite", 2, small=True)


def test_small_config_reports_every_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = load_bench("speculative.py", monkeypatch)
    out = tmp_path / "spec.json"
    argv = ["--device", "cpu", "--small", "--batches", "1,2", "--ks", "1,2", "--context", "8",
            "--tokens", "3", "--floor-tokens", "6", "--block-size", "4", "--json", str(out)]
    assert mod.main(argv) == 0
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res["rows"]] == [1, 2]
    for r in res["rows"]:
        assert r["plain_tpot_ms"] > 0 and set(r["k"]) == {"1", "2"}
        for k, f in r["k"].items():
            # replayed drafts are all kept (fp32: the verify rows pick the plain tokens), and
            # every run emits plain decoding's tokens whatever its drafts
            assert f["ceiling_acceptance"] == 1.0 and f["ceiling_draw_agreement"] == 1.0
            assert f["same_tokens"]
            assert f["ceiling_tpot_ms"] > 0 and f["floor_tpot_ms"] > 0
            assert f["floor_self_disabled_tpot_ms"] > 0 and f["verify_step_ms"] > 0
            # the MTP module's time is added to each step: never faster than without it
            assert f["mtp_draft_ms"] > 0
            assert "mtp_draft_device_ms" in f  # NaN on the CPU: no device to profile
            assert f["mtp_layers_of_step"] > 0
            assert f["mtp_ceiling_speedup"] < f["ceiling_speedup"]
            assert all(f["mtp_modelled_speedup"][a] < m
                       for a, m in f["modelled_speedup"].items())
            # always-wrong drafts: two verify steps, then paused (6 tokens, no probe yet)
            assert f["floor_self_disabled_tokens"] == 6
            assert f["floor_self_disabled_verify_steps"] == 2
            m = f["modelled_speedup"]
            assert set(m) == {f"{a / 10:.2f}" for a in range(11)} | {"0.81"}
            assert m["0.00"] < m["0.50"] < m["1.00"]
            assert m["1.00"] == pytest.approx(m["0.00"] * (int(k) + 1))
    assert set(res["breakeven_batch"]) == {"1", "2"}
