"""bench/engine.py's CPU smoke configuration runs end to end and reports every section."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.dataplane

BENCH = Path(__file__).resolve().parents[2] / "bench" / "engine.py"


def test_small_config_reports_every_section(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_engine", BENCH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "engine.json"
    argv = ["--device", "cpu", "--small", "--batches", "1,2", "--contexts", "40", "--prefill"]
    argv += ["24", "--attn-contexts", "64", "--moe-tokens", "1", "--reps", "1", "--json", str(out)]
    assert mod.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["config"] == "small"
    assert res["ceilings"]["hbm_read_Bps"] > 0 and res["ceilings"]["matmul_flops"] > 0
    assert [r["tokens"] for r in res["prefill"]] == [24]
    assert [(r["batch"], r["context"]) for r in res["decode"]] == [(1, 40), (2, 40)]
    for r in res["decode"]:
        assert r["eager_ms"] > 0 and math.isnan(r["graph_ms"])  # no graphs on the CPU
        assert r["bytes_parts"]["kv"] == r["batch"] * 41 * 3 * (64 + 32) * 2
        assert 1 <= r["experts_used_mean"] <= 2 * r["batch"]
    assert [(r["batch"], r["context"]) for r in res["attention"]] == [(1, 64), (2, 64)]
    assert res["moe"][0]["tokens"] == 1 and res["moe"][0]["loop_us"] > 0
