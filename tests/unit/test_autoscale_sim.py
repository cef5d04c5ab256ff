"""bench/autoscale_sim.py's accounting, on tiny traces (no data plane)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import autoscale_sim as sim  # noqa: E402


@pytest.fixture(scope="module")
def fig() -> sim.Figures:
    return sim.load_figures()


def test_figures_come_from_the_measured_files(fig: sim.Figures) -> None:
    eng = json.loads(sim.ENGINE_JSON.read_text())
    big = max(eng["prefill"], key=lambda r: r["tokens"])
    assert fig.prefill_step_s(big["tokens"]) == pytest.approx(big["ms"] / 1000)
    d = next(x for x in eng["decode"] if x.get("graph_ms"))
    assert fig.decode_step_s(d["batch"], d["context"]) == pytest.approx(d["graph_ms"] / 1000)
    assert fig.ready_s == json.loads(sim.KV_TIERS_JSON.read_text())["stacks"]["defaults"][
        "ready_s"]
    assert set(fig.sources) >= {"prefill", "decode", "kv_pool", "ready"}
    # Interpolated step times grow with batch and with context.
    assert fig.decode_step_s(100, 4096) < fig.decode_step_s(200, 4096)
    assert fig.decode_step_s(64, 2048) < fig.decode_step_s(64, 16384)


def test_static_gpu_hours_are_replicas_times_duration(fig: sim.Figures) -> None:
    trace = sim.make_trace(600, 40.0, spikes=0, seed=3)
    res = sim.simulate(trace, fig, sim.static((3, 2)), (3, 2), sim.Slo(), "static")
    assert res.gpu_hours == pytest.approx(5 * fig.gpus_per_instance * 600 / 3600)
    assert 0.0 <= res.attainment <= 1.0
    assert res.attainment <= min(res.ttft_attainment, res.tpot_attainment)
    arrived = sum(sum(trace.rates(float(t))) for t in range(600))
    assert res.requests == pytest.approx(arrived, rel=1e-6)


def test_a_policy_that_never_scales_misses_under_a_burst(fig: sim.Figures) -> None:
    calm = sim.Trace(900, 30.0, 30.0, ())
    burst = sim.Trace(900, 30.0, 30.0, (sim.Spike(300.0, 60.0, "rate", 4.0),))
    size = sim.static_for_peak(calm, fig, 0.8)
    ok = sim.simulate(calm, fig, sim.static(size), size, sim.Slo(), "calm")
    hit = sim.simulate(burst, fig, sim.static(size), size, sim.Slo(), "burst")
    assert ok.attainment > 0.999
    assert hit.attainment < ok.attainment
    sized = sim.static_for_peak(burst, fig, 0.8)
    assert sized[0] > size[0]
    assert sim.simulate(burst, fig, sim.static(sized), sized, sim.Slo(), "x").attainment > (
        hit.attainment)


def test_scaling_up_costs_from_the_decision_and_serves_after_ready(fig: sim.Figures) -> None:
    trace = sim.Trace(300, 1.0, 1.0, ())
    res = sim.simulate(trace, fig, lambda o: (2, 1), (1, 1), sim.Slo(), "up", interval=15)
    billed = (300 + (300 - 15)) + 300  # the second prefill from the first decision
    assert res.gpu_hours == pytest.approx(billed / 3600, rel=0.01)


def test_quick_run_writes_the_comparison(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    assert sim.main(["--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"static", "planner", "requests", "requests (natural)"}
    for r in data["policies"].values():
        assert 0.0 <= r["attainment"] <= 1.0 and r["gpu_hours"] > 0
    assert data["policies"]["static"]["gpu_hours_vs_static"] == 1.0
    assert data["figures"]["sources"]["ready"].startswith("docs/kv_tiers_h200_a_d.json")
