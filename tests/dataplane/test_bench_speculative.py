"""bench/speculative.py's CPU smoke configuration runs end to end and reports every figure."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.dataplane

BENCH = Path(__file__).resolve().parents[2] / "bench" / "speculative.py"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_speculative", BENCH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_expected_tokens_per_verify_step() -> None:
    mod = _bench()
    assert mod.expected_tokens(0.0, 3) == 1.0
    assert mod.expected_tokens(1.0, 3) == 4.0
    assert mod.expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert mod.expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_small_config_reports_every_figure(tmp_path: Path) -> None:
    mod = _bench()
    out = tmp_path / "spec.json"
    argv = ["--device", "cpu", "--small", "--batches", "1,2", "--ks", "1,2", "--context", "8",
            "--tokens", "3", "--block-size", "4", "--json", str(out)]
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
            m = f["modelled_speedup"]
            assert set(m) == {f"{a / 10:.2f}" for a in range(11)} | {"0.81"}
            assert m["0.00"] < m["0.50"] < m["1.00"]
            assert m["1.00"] == pytest.approx(m["0.00"] * (int(k) + 1))
    assert set(res["breakeven_batch"]) == {"1", "2"}
