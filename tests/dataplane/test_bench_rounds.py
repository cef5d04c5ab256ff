"""The served benches' rounds: every mode's stack runs in each round, no mode always first, and
the figures reported are the medians over rounds (bench/serve_compare.py, bench/serving.py)."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest
from bench_fixtures import load_bench

pytestmark = pytest.mark.dataplane


def test_each_round_runs_every_mode_in_a_rotated_order(monkeypatch: pytest.MonkeyPatch) -> None:
    sc = load_bench("serve_compare.py", monkeypatch)
    order = sc.rotated_rounds(["remote", "local", "default"], 3)
    assert [m for r, m in order if r == 0] == ["remote", "local", "default"]
    assert [m for r, m in order if r == 1] == ["local", "default", "remote"]
    assert [m for r, m in order if r == 2] == ["default", "remote", "local"]
    firsts = [next(m for r, m in order if r == k) for k in range(3)]
    assert sorted(firsts) == ["default", "local", "remote"]
    sv = load_bench("serving.py", monkeypatch)
    runs = sv.rotated_rounds(["off", "0.01", "1"], 2)
    assert [m for _, m in runs] == ["off", "0.01", "1", "0.01", "1", "off"]


def _level(sp: object, ttft: float, tps: float) -> object:
    kw = {f.name: 0 for f in fields(sp.LevelResult)}  # type: ignore[attr-defined]
    kw.update(level="64:32:2", concurrency=64, prompt=32, max_tokens=2, requests=64,
              ttft_p50_ms=ttft, ttft_p99_ms=ttft + 1, second_p50_ms=ttft + 2, tpot_p50_ms=1.0,
              tokens_per_s=tps, wall_s=0.1, timing_p50_ms={}, read_bytes=0.0)
    return sp.LevelResult(**kw)  # type: ignore[attr-defined]


def test_a_mode_reports_the_median_of_its_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    sc = load_bench("serve_compare.py", monkeypatch)
    bounds = {"prefill_ms": {"64x32": 7.0}, "decode_step_ms": {"64@33": 2.0}}
    runs = [{"levels": [_level(sc.sp, t, 100 * t)], "pools": {}} for t in (30.0, 90.0, 40.0)]
    got = sc.median_of_rounds(runs, bounds)
    lv = got["levels"][0]
    assert lv.ttft_p50_ms == 40.0 and lv.tokens_per_s == 4000.0
    assert lv.second_p50_ms == 42.0
    assert lv.bounds["ttft_ratio"] == pytest.approx(40.0 / 9.0)
    assert [r[0]["ttft_p50_ms"] for r in got["rounds"]] == [30.0, 90.0, 40.0]


def test_tracing_cost_is_the_ratio_of_medians(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    sv = load_bench("serving.py", monkeypatch)

    def level(mode: str, tpot: float) -> object:
        kw = {f.name: 0 for f in fields(sv.Level)}
        kw.update(concurrency=1, tpot_p50_ms=tpot, tokens_per_s=1000 / tpot, requests=8)
        r = sv.Level(**kw)
        r.tracing, r.spans = mode, 8 if mode != "off" else 0
        return r

    results = [level("off", 1.0), level("1", 1.5), level("1", 1.01), level("off", 1.2),
               level("off", 1.1), level("1", 1.02)]
    assert sv.tracing_summary(argparse.Namespace(decode_tp=1, rounds=3, json=None), [1],
                              results) == 0
    out = capsys.readouterr().out
    assert "1.02 vs 1.10 ms = 0.927x" in out
    assert "24 spans for 24 requests" in out
