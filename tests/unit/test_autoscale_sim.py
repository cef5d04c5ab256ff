"""bench/autoscale_sim.py's accounting, on tiny traces (no data plane)."""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
from dataclasses import replace
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


@pytest.fixture(scope="module")
def day(fig: sim.Figures) -> sim.Day:
    """Half an hour rising 10x, two bursts, Poisson arrivals."""
    trace = sim.make_trace(1800, 150.0, spikes=2, seed=1)
    return sim.Day(trace, sim.poisson_arrivals(trace, 1), fig, sim.Slo(), 15,
                   sim.static_for_peak(trace, fig, 0.8))


@pytest.fixture(scope="module")
def planner_run(day: sim.Day) -> sim.Result:
    spec = sim.planner_spec(day.max_replicas, day.slo, day.interval, prompt_tps_per_replica=int(
        0.6 * day.fig.prefill_tokens_per_s), sequences_per_replica=int(0.7 * 256))
    return day.run(sim.planner(spec, day.fig), day.start, "planner")


def test_the_planner_beats_itself_frozen(day: sim.Day, planner_run: sim.Result,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench drives the real decision function: with plan() never moving a count, the
    same day misses far more."""
    real = sim.plan
    monkeypatch.setattr(sim, "plan", lambda *a, **k: {
        role: replace(d, desired=d.current) for role, d in real(*a, **k).items()})
    spec = sim.planner_spec(day.max_replicas, day.slo, day.interval)
    frozen = day.run(sim.planner(spec, day.fig), day.start, "frozen")
    assert frozen.gpu_hours < planner_run.gpu_hours
    assert frozen.attainment < planner_run.attainment - 0.2


def test_poisson_counts_have_the_rate_as_mean_and_variance() -> None:
    rng = random.Random(7)
    for lam, n in ((0.7, 20000), (6.0, 20000), (40.0, 20000), (1050.0, 20000)):
        xs = [sim.poisson(rng, lam) for _ in range(n)]
        assert all(isinstance(x, int) and x >= 0 for x in xs)
        # Within 4 standard errors (of the mean: sqrt(lam / n); of the variance: about
        # lam * sqrt(2 / n) plus the excess kurtosis term lam / n).
        assert abs(statistics.fmean(xs) - lam) < 4 * math.sqrt(lam / n)
        assert abs(statistics.variance(xs) - lam) < 4 * math.sqrt((2 * lam * lam + lam) / n)
    trace = sim.Trace(3600, 20.0, 20.0, ())
    counts = sim.poisson_arrivals(trace, 3)
    assert counts == sim.poisson_arrivals(trace, 3) != sim.poisson_arrivals(trace, 4)
    for ci, c in enumerate(sim.CLASSES):
        xs = [row[ci] for row in counts]
        lam = 20.0 * c.share
        assert abs(statistics.fmean(xs) - lam) < 4 * math.sqrt(lam / len(xs))
        assert abs(statistics.variance(xs) - lam) < 4 * math.sqrt((2 * lam * lam + lam) / len(xs))


def test_static_is_brought_down_to_the_fewest_reaching_the_target(
        day: sim.Day, planner_run: sim.Result) -> None:
    target = sim.per_role(planner_run)
    counts, below, _ = sim.static_at_target(day, target, lambda m: None)
    assert counts[0] > 1 and counts[1] > 1
    assert below == (counts[0] - 1, counts[1] - 1)
    got = day.run(sim.static(counts), counts, "static")
    assert got.ttft_attainment >= target[0] and got.tpot_attainment >= target[1]
    fewer_p = (counts[0] - 1, counts[1])
    fewer_d = (counts[0], counts[1] - 1)
    assert day.run(sim.static(fewer_p), fewer_p, "p").ttft_attainment < target[0]
    assert day.run(sim.static(fewer_d), fewer_d, "d").tpot_attainment < target[1]


def test_the_request_rule_is_tuned_per_role_to_the_planners_attainment(
        day: sim.Day, planner_run: sim.Result) -> None:
    target = sim.per_role(planner_run)
    (fp, fd), (ap, ad), reached, _ = sim.requests_at_target(day, target, lambda m: None)
    assert reached == (True, True)
    nat = sim.natural_targets(day.fig)

    def run(f: tuple[float, float]) -> sim.Result:
        return day.run(sim.requests_hpa(nat[0] * f[0], nat[1] * f[1], day.max_replicas,
                                        day.interval), day.start, "requests")
    got = sim.per_role(run((fp, fd)))
    assert got[0] >= target[0] and got[1] >= target[1]
    # Each role's threshold is at an edge: at most STEP higher, the role misses.
    assert fp < ap <= fp * (1 + sim.STEP) and fd < ad <= fd * (1 + sim.STEP)
    assert sim.per_role(run((ap, fd)))[0] < target[0]
    assert sim.per_role(run((fp, ad)))[1] < target[1]


def test_quick_run_writes_the_comparison(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    assert sim.main(["--quick", "--ready-s", "70,600", "--jobs", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [s["ready_s"] for s in data["startups"]] == [70.0, 600.0]
    for s in data["startups"]:
        pol = s["policies"]
        assert set(pol) == {"planner", "static", "static (peak at 0.8)", "requests",
                            "requests (equal GPU-hours)"}
        # Static and the request rule are held to the planner's attainment, role by role.
        for name in ("static", "requests"):
            assert pol[name]["ttft_attainment"] >= pol["planner"]["ttft_attainment"]
            assert pol[name]["tpot_attainment"] >= pol["planner"]["tpot_attainment"]
        (d,) = s["days"]
        assert d["static_one_fewer"] == {k: v - 1 for k, v in d["static_replicas"].items()}
    assert data["figures"]["sources"]["ready"].startswith("docs/kv_tiers_h200_a_d.json")
