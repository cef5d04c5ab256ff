"""The operator's side of autoscaling: metrics read from real /metrics text, the fetchers with
injected I/O, the status and condition a decision writes, the builders building the planner's
replicas, and one loop step with an injected fetcher and a fake API server."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest
from spec_cases import BASE, autoscaled

from pdd_api import keys
from pdd_api.autoscale import Sample, effective_replicas, with_replicas
from pdd_api.validation import parse_spec
from pdd_operator import metrics as op_metrics
from pdd_operator.autoscale_metrics import (
    TTFT,
    DirectFetcher,
    PrometheusFetcher,
    add_buckets,
    bucket_delta,
    enough_answered,
    histogram_quantile,
    parse_histogram,
    parse_instance,
    prometheus_queries,
)
from pdd_operator.autoscaler import Autoscaler, events_for, status_update
from pdd_operator.builders import Owner, build
from pdd_operator.conditions import AUTOSCALING, carry_autoscaling
from pdd_sidecar.metrics import InstanceMetrics, RouterMetrics

OWNER = Owner("demo", "ns1", "uid-1")


def instance_text(running: int, waiting: int, free: int, total: int, queued: int,
                  tp: int = 2) -> str:
    m = InstanceMetrics("decode")
    m.running.set(running)
    m.waiting.set(waiting)
    m.queued_prompt_tokens.set(queued)
    for rank in range(tp):
        m.blocks_free.labels(rank=str(rank)).set(free)
        m.blocks_total.labels(rank=str(rank)).set(total)
    return m.expose().decode()


def test_instance_gauges_from_a_real_exposition() -> None:
    g = parse_instance(instance_text(running=7, waiting=3, free=250, total=1000, queued=4096))
    assert (g.running, g.waiting, g.queued_prompt_tokens) == (7, 3, 4096)
    assert (g.blocks_used, g.blocks_total) == (750, 1000)  # per instance, not per rank


def test_vllm_instances_give_their_kv_share() -> None:
    text = ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{m=\"x\"} 4\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{m=\"x\"} 0.5\n")
    g = parse_instance(text)
    assert g.running == 4 and (g.blocks_used, g.blocks_total) == (0.5, 1.0)


def test_ttft_percentile_from_the_difference_of_two_scrapes() -> None:
    router = RouterMetrics()
    for _ in range(100):
        router.ttft_seconds.observe(0.02)  # before the interval: must not count
    before = parse_histogram(router.expose().decode(), TTFT)
    for i in range(100):
        router.ttft_seconds.observe(0.3 if i < 80 else 3.0)
    now = parse_histogram(router.expose().decode(), TTFT)
    delta = bucket_delta(now, before)
    p50, p90 = histogram_quantile(0.5, delta), histogram_quantile(0.9, delta)
    assert p50 is not None and 0.25 < p50 <= 0.5  # the (0.25, 0.5] bucket
    assert p90 is not None and 2.5 < p90 <= 5  # the (2.5, 5] bucket
    assert histogram_quantile(0.9, bucket_delta(now, now)) is None  # nothing in the interval
    assert bucket_delta(now, None) == {}  # no baseline yet


def test_a_counter_reset_counts_from_zero() -> None:
    before = {0.1: 50.0, 1.0: 90.0, float("inf"): 100.0}
    now = {0.1: 1.0, 1.0: 2.0, float("inf"): 2.0}
    assert bucket_delta(now, before) == now
    assert add_buckets([now, now])[1.0] == 4.0
    assert histogram_quantile(0.99, {1.0: 0.0, float("inf"): 5.0}) == 1.0  # in +Inf


def pod(name: str, component: str, ip: str, ready: bool = True) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {keys.LABEL_COMPONENT: component}},
            "status": {"podIP": ip, "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}}


def lws_worker(name: str, component: str, ip: str) -> dict[str, Any]:
    """A LeaderWorkerSet worker pod: ranks only, no HTTP (the planner must not scrape it)."""
    p = pod(name, component, ip)
    p["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] = "1"
    return p


BODY = {"metadata": {"namespace": "ns1", "name": "demo", "uid": "uid-1", "generation": 3},
        "spec": autoscaled()}
SPEC = parse_spec(BODY["spec"])


def test_direct_fetcher_sums_ready_instances_and_reads_router_deltas() -> None:
    router = RouterMetrics()
    pods = [pod("demo-prefill-0", "prefill", "10.0.0.1"),
            pod("demo-decode-0", "decode", "10.0.0.2"),
            pod("demo-decode-1", "decode", "10.0.0.3"),
            pod("demo-decode-2", "decode", "10.0.0.4", ready=False),
            pod("demo-abc", "router", "10.0.0.9"),
            lws_worker("demo-decode-0-1", "decode", "10.0.0.5")]
    texts = {"10.0.0.1": instance_text(2, 5, 900, 1000, 8000),
             "10.0.0.2": instance_text(10, 0, 200, 1000, 0),
             "10.0.0.3": instance_text(12, 1, 300, 1000, 0)}

    async def list_pods(ns: str, selector: str) -> list[dict[str, Any]]:
        assert (ns, selector) == ("ns1", f"{keys.LABEL_INSTANCE}=demo")
        return pods

    async def get(url: str) -> str:
        ip = url.split("//")[1].split(":")[0]
        return router.expose().decode() if ip == "10.0.0.9" else texts[ip]

    fetch = DirectFetcher(list_pods, get)
    first = asyncio.run(fetch(BODY, SPEC, ["prefill", "decode"], 100.0))
    assert first["decode"].latency is None  # no baseline yet
    for _ in range(10):
        router.tpot_seconds.observe(0.07)
        router.ttft_seconds.observe(0.4)
    out = asyncio.run(fetch(BODY, SPEC, ["prefill", "decode"], 110.0))
    d, p = out["decode"], out["prefill"]
    assert d.replicas == 2 and d.running_sequences == 22  # the unready pod is not measured
    assert (d.kv_blocks_used, d.kv_blocks_total) == (1500, 2000)
    assert d.latency is not None and 0.05 < d.latency <= 0.1
    assert p.replicas == 1 and p.queued_prompt_tokens == 8000 and p.kv_blocks_used is None
    texts.pop("10.0.0.3")  # one of two does not answer: a sample of the other, scaled to two
    out = asyncio.run(fetch(BODY, SPEC, ["prefill", "decode"], 120.0))
    d = out["decode"]
    assert d.partial and (d.replicas, d.answered) == (2, 1)
    assert d.running_sequences == 20 and (d.kv_blocks_used, d.kv_blocks_total) == (1600, 2000)
    texts.pop("10.0.0.2")  # none answers: no decode sample at all
    out = asyncio.run(fetch(BODY, SPEC, ["prefill", "decode"], 130.0))
    assert "decode" not in out and "prefill" in out and not out["prefill"].partial


def test_prefill_prompt_tokens_per_second_from_the_counters_and_the_queue() -> None:
    metrics = {ip: InstanceMetrics("prefill") for ip in ("10.0.0.1", "10.0.0.2", "10.0.0.3")}
    pods = [pod("demo-prefill-0", "prefill", "10.0.0.1"),
            pod("demo-prefill-1", "prefill", "10.0.0.2"), pod("demo-abc", "router", "10.0.0.9")]

    async def list_pods(ns: str, selector: str) -> list[dict[str, Any]]:
        return pods

    async def get(url: str) -> str:
        ip = url.split("//")[1].split(":")[0]
        return RouterMetrics().expose().decode() if ip == "10.0.0.9" else (
            metrics[ip].expose().decode())

    spec = SPEC
    fetch = DirectFetcher(list_pods, get)
    metrics["10.0.0.1"].prefill_computed_tokens.inc(1_000_000)  # before the first scrape
    first = asyncio.run(fetch(BODY, spec, ["prefill"], 100.0))["prefill"]
    assert first.prompt_tokens_per_second is None  # no baseline yet
    metrics["10.0.0.1"].prefill_computed_tokens.inc(50_000)
    metrics["10.0.0.2"].prefill_computed_tokens.inc(30_000)
    metrics["10.0.0.2"].queued_prompt_tokens.set(10_000)  # arrived, not run yet
    p = asyncio.run(fetch(BODY, spec, ["prefill"], 110.0))["prefill"]
    assert p.prompt_tokens_per_second == pytest.approx((50_000 + 30_000 + 10_000) / 10)
    # A pod new since the last scrape adds nothing until it has a baseline; a queue that
    # drains while its tokens run is not new load.
    pods.append(pod("demo-prefill-2", "prefill", "10.0.0.3"))
    metrics["10.0.0.3"].prefill_computed_tokens.inc(5_000_000)
    metrics["10.0.0.1"].prefill_computed_tokens.inc(20_000)
    metrics["10.0.0.2"].prefill_computed_tokens.inc(10_000)
    metrics["10.0.0.2"].queued_prompt_tokens.set(0)
    p = asyncio.run(fetch(BODY, spec, ["prefill"], 120.0))["prefill"]
    assert p.replicas == 3
    assert p.prompt_tokens_per_second == pytest.approx((20_000 + 10_000 - 10_000) / 10)
    metrics["10.0.0.3"].prefill_computed_tokens.inc(7_000)
    p = asyncio.run(fetch(BODY, spec, ["prefill"], 130.0))["prefill"]
    assert p.prompt_tokens_per_second == pytest.approx(7_000 / 10)


class Prefills:
    """Prefill pods with their own InstanceMetrics, served to a DirectFetcher by IP."""

    def __init__(self, n: int) -> None:
        self.metrics = [InstanceMetrics("prefill") for _ in range(n)]
        self.pods = [pod(f"demo-prefill-{i}", "prefill", f"10.0.1.{i}") for i in range(n)]
        for i, p in enumerate(self.pods):
            p["metadata"]["uid"] = f"uid-{i}"
        self.down: set[int] = set()  # answer nothing
        self.fetch = DirectFetcher(self.list_pods, self.get)

    async def list_pods(self, ns: str, selector: str) -> list[dict[str, Any]]:
        return [*self.pods, pod("demo-abc", "router", "10.0.0.9")]

    async def get(self, url: str) -> str:
        ip = url.split("//")[1].split(":")[0]
        if ip == "10.0.0.9":
            return RouterMetrics().expose().decode()
        i = int(ip.rsplit(".", 1)[1])
        if i in self.down:
            raise TimeoutError(url)
        return self.metrics[i].expose().decode()

    def ready(self, i: int, ready: bool) -> None:
        self.pods[i]["status"]["conditions"][0]["status"] = "True" if ready else "False"

    def sample(self, now: float) -> Sample:
        return asyncio.run(self.fetch(BODY, SPEC, ["prefill"], now))["prefill"]


def test_a_pod_that_leaves_ready_and_comes_back_keeps_its_baseline() -> None:
    # A pod with a long life behind it misses readiness for one interval: back, it adds what it
    # ran since its own last scrape over the time since, not its lifetime's tokens.
    ps = Prefills(2)
    ps.metrics[0].prefill_computed_tokens.inc(300_000_000)
    ps.metrics[1].prefill_computed_tokens.inc(200_000_000)
    assert ps.sample(100.0).prompt_tokens_per_second is None  # the first scrape
    ps.ready(0, False)
    ps.metrics[0].prefill_computed_tokens.inc(40_000)
    ps.metrics[1].prefill_computed_tokens.inc(10_000)
    assert ps.sample(110.0).prompt_tokens_per_second == pytest.approx(1_000)
    ps.ready(0, True)
    ps.metrics[0].prefill_computed_tokens.inc(20_000)
    ps.metrics[1].prefill_computed_tokens.inc(10_000)
    s = ps.sample(120.0)
    assert s.replicas == 2 and not s.partial
    assert s.prompt_tokens_per_second == pytest.approx(60_000 / 20 + 10_000 / 10)
    # Its process restarted (the counter went back): what it ran since, never negative.
    ps.metrics[0] = InstanceMetrics("prefill")
    ps.metrics[0].prefill_computed_tokens.inc(5_000)
    ps.metrics[1].prefill_computed_tokens.inc(10_000)
    assert ps.sample(130.0).prompt_tokens_per_second == pytest.approx(500 + 1_000)
    # Recreated under the same name (a new uid): no baseline, nothing added that interval.
    ps.pods[0]["metadata"]["uid"] = "uid-0-new"
    ps.metrics[0].prefill_computed_tokens.inc(900_000_000)
    ps.metrics[1].prefill_computed_tokens.inc(10_000)
    assert ps.sample(140.0).prompt_tokens_per_second == pytest.approx(1_000)


def test_a_role_with_some_instances_unanswered_is_sampled_from_those_that_answered() -> None:
    ps = Prefills(4)
    for m in ps.metrics:
        m.prefill_computed_tokens.inc(1_000)
        m.queued_prompt_tokens.set(2_000)
    ps.sample(100.0)
    for m in ps.metrics:
        m.prefill_computed_tokens.inc(30_000)
    ps.down = {3}
    s = ps.sample(110.0)
    assert s.partial and (s.replicas, s.answered) == (4, 3)
    assert s.queued_prompt_tokens == pytest.approx(8_000)  # 3 x 2000, scaled to 4
    assert s.prompt_tokens_per_second == pytest.approx(4 * 3_000)
    ps.down = {2, 3}  # half answered: still a sample
    for m in ps.metrics:
        m.prefill_computed_tokens.inc(30_000)
    s = ps.sample(120.0)
    assert (s.replicas, s.answered) == (4, 2)
    assert s.prompt_tokens_per_second == pytest.approx(4 * 3_000)
    ps.down = {0, 2, 3}  # fewer than half: no sample
    assert "prefill" not in asyncio.run(ps.fetch(BODY, SPEC, ["prefill"], 130.0))
    ps.down = set()  # back: each read over the time since its last sample (120, 120, 110, 100)
    for m in ps.metrics:
        m.prefill_computed_tokens.inc(30_000)
    s = ps.sample(140.0)
    assert not s.partial and s.answered is None
    assert s.prompt_tokens_per_second == pytest.approx(
        30_000 / 20 + 30_000 / 20 + 60_000 / 30 + 90_000 / 40)


@pytest.mark.parametrize(("answered", "ready", "enough"), [
    (0, 0, False), (1, 1, True), (0, 1, False), (1, 2, True), (1, 3, False), (2, 3, True),
    (149, 300, False), (150, 300, True)])
def test_enough_answered_is_at_least_half_and_one(answered: int, ready: int,
                                                  enough: bool) -> None:
    assert enough_answered(answered, ready) is enough


def test_prometheus_fetcher_asks_per_role() -> None:
    asked: list[str] = []
    answers = {"count(": "3", "histogram_quantile": "0.061", "sum(pdd_running": "40",
               "sum(pdd_waiting": "2", "sum(pdd_kv_blocks_total{namespace=\"ns1\",pod=~\"demo-"
               "decode-.*\",rank=\"0\"}) -": "2490", "sum(pdd_kv_blocks_total": "3000",
               "sum(pdd_queued": "100", "sum(rate(pdd_prefill_computed": "2500"}

    async def get_json(url: str) -> Mapping[str, Any]:
        from urllib.parse import parse_qs, urlsplit
        q = parse_qs(urlsplit(url).query)["query"][0]
        asked.append(q)
        value = next(v for k, v in answers.items() if q.startswith(k))
        return {"status": "success", "data": {"resultType": "vector",
                                              "result": [{"metric": {}, "value": [0, value]}]}}

    spec = parse_spec(autoscaled(prometheusURL="http://prom:9090/"))
    out = asyncio.run(PrometheusFetcher(get_json)(BODY, spec, ["decode"], 5.0))
    d = out["decode"]
    assert (d.replicas, d.latency, d.kv_blocks_used, d.kv_blocks_total) == (3, 0.061, 2490, 3000)
    assert any("histogram_quantile(0.9," in q and "pdd_router_tpot_seconds_bucket" in q
               for q in asked)
    q = prometheus_queries("ns1", "demo", "prefill", 0.5, 30)
    assert "pdd_queued_prompt_tokens" in q["queued"] and "[30s]" in q["latency"]
    assert "rate(pdd_prefill_computed_tokens_total{" in q["promptRate"]
    assert "deriv(pdd_queued_prompt_tokens{" in q["promptRate"]
    p = asyncio.run(PrometheusFetcher(get_json)(BODY, spec, ["prefill"], 5.0))["prefill"]
    assert p.prompt_tokens_per_second == 2500 and p.queued_prompt_tokens == 100


def decision_status(desired: int, reason: str) -> dict[str, Any]:
    return {"autoscaling": {"decode": {"desiredReplicas": desired, "reason": reason}}}


def test_builders_build_the_planners_replicas_not_the_specs() -> None:
    spec = parse_spec(autoscaled(decode={"minReplicas": 2, "maxReplicas": 6}))
    assert spec.decode.replicas == 1
    assert effective_replicas(spec, None) == {"prefill": 1, "decode": 2}  # seed, clamped
    replicas = effective_replicas(spec, decision_status(5, "ScaledUp"))
    assert replicas == {"prefill": 1, "decode": 5}
    five = build(OWNER, with_replicas(spec, replicas))
    assert sorted(five.pods["decode"]) == [0, 1, 2, 3, 4]
    assert effective_replicas(spec, decision_status(9, "ScaledUp"))["decode"] == 6
    three = build(OWNER, with_replicas(spec, {"prefill": 1, "decode": 3}))
    # A scale never replaces the pods that stay.
    assert five.pods["decode"][0] == three.pods["decode"][0]
    off = parse_spec({**BASE, "decode": {**BASE["decode"], "replicas": 3},
                      "autoscaling": {"decode": {"enabled": False, "maxReplicas": 8}}})
    assert effective_replicas(off, decision_status(5, "ScaledUp"))["decode"] == 3


def test_status_update_records_the_decision_and_condition() -> None:
    from pdd_api.autoscale import Decision
    d = Decision("decode", 2, 3, "ScaledUp", "decode 2→3: KV 0.9 > 0.8",
                 {"kvCacheUtilization": 0.9})
    prev = {"conditions": [{"type": "Ready", "status": "True"}]}
    patch = status_update({"decode": d}, prev, 4, 1_800_000_000.0)
    auto = patch["autoscaling"]["decode"]
    assert auto["desiredReplicas"] == 3 and auto["reason"] == "ScaledUp"
    assert auto["lastScaleTime"] == "2027-01-15T08:00:00Z"
    cond = next(c for c in patch["conditions"] if c["type"] == AUTOSCALING)
    assert (cond["status"], cond["reason"], cond["observedGeneration"]) == ("True", "ScaledUp", 4)
    assert any(c["type"] == "Ready" for c in patch["conditions"])
    assert events_for({"decode": d}, prev) == [("Normal", "ScaledUp", d.message, "decode")]
    held = Decision("decode", 3, 3, "MetricsUnavailable", "decode 3: holding", {})
    after = {**prev, **patch}
    patch2 = status_update({"decode": held}, after, 4, 1_800_000_100.0)
    assert patch2["autoscaling"]["decode"]["lastScaleTime"] == auto["lastScaleTime"]
    cond = next(c for c in patch2["conditions"] if c["type"] == AUTOSCALING)
    assert (cond["status"], cond["reason"]) == ("False", "MetricsUnavailable")
    assert events_for({"decode": held}, after) == [("Warning", "MetricsUnavailable",
                                                    held.message, "decode")]
    assert events_for({"decode": held}, {**after, **patch2}) == []  # said once


def test_a_decision_on_a_partial_sample_marks_the_condition() -> None:
    from pdd_api.autoscale import decide
    assert SPEC.autoscaling is not None and SPEC.autoscaling.decode is not None
    s = Sample(time=10.0, replicas=4, latency=0.03, kv_blocks_used=1200, kv_blocks_total=4000,
               running_sequences=20, answered=3)
    d = decide("decode", SPEC.autoscaling.decode, 4, [s], 10.0, interval=10, stabilization=60)
    assert d.partial and d.reason == "Stable" and d.metrics["answeredReplicas"] == 3
    assert d.message.endswith("(metrics from 3 of 4 instances)")
    patch = status_update({"decode": d}, None, 2, 1_800_000_000.0)
    cond = next(c for c in patch["conditions"] if c["type"] == AUTOSCALING)
    assert (cond["status"], cond["reason"]) == ("True", "MetricsPartial")
    assert d.message in cond["message"] and patch["autoscaling"]["decode"]["reason"] == "Stable"
    whole = decide("decode", SPEC.autoscaling.decode, 4, [replace(s, answered=None)], 10.0,
                   interval=10, stabilization=60)
    assert not whole.partial and "answeredReplicas" not in whole.metrics
    cond = next(c for c in status_update({"decode": whole}, None, 2, 1e9)["conditions"]
                if c["type"] == AUTOSCALING)
    assert cond["reason"] == "Stable"


def test_a_reconcile_pass_keeps_the_planners_part_of_status() -> None:
    prev = {"conditions": [{"type": AUTOSCALING, "status": "True", "reason": "Stable"}],
            **decision_status(4, "Stable")}
    new = {"conditions": [{"type": "Ready", "status": "True"}], "observedGeneration": 2}
    kept = carry_autoscaling(new, prev, autoscaled=True)
    assert [c["type"] for c in kept["conditions"]] == ["Ready", AUTOSCALING]
    assert kept["autoscaling"] == prev["autoscaling"]
    dropped = carry_autoscaling(new, prev, autoscaled=False)
    assert dropped["autoscaling"] is None and len(dropped["conditions"]) == 1


class FakeKube:
    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []
        self.events: list[tuple[str, str, str]] = []

    async def patch_status(self, kind: str, ns: str, name: str, status: dict[str, Any]
                           ) -> dict[str, Any]:
        self.patches.append(status)
        body = copy.deepcopy(REC.pdds[(ns, name)])
        merged = dict(body.get("status") or {})
        for k, v in status.items():
            if v is None:
                merged.pop(k, None)
            else:
                merged[k] = v
        body["status"] = merged
        return body

    async def post_event(self, body: Any, kind: str, reason: str, message: str,
                         series: str = "") -> None:
        self.events.append((kind, reason, message))


class FakeRec:
    def __init__(self) -> None:
        self.pdds: dict[tuple[str, str], dict[str, Any]] = {}
        self.kicks: list[tuple[str, str]] = []
        self._lock = asyncio.Lock()
        self.paused = False

    def lock(self, key: tuple[str, str]) -> asyncio.Lock:
        return self._lock

    def observe_pdd(self, body: dict[str, Any]) -> None:
        self.pdds[(body["metadata"]["namespace"], body["metadata"]["name"])] = body

    def kick(self, ns: str, name: str, delay: float | None = None) -> None:
        self.kicks.append((ns, name))


REC = FakeRec()


def test_one_loop_step_per_interval_with_an_injected_fetcher() -> None:
    REC.pdds.clear()
    body = copy.deepcopy(BODY)
    body["spec"] = autoscaled(decode={"maxReplicas": 4}, intervalSeconds=10,
                              prefill={"enabled": False, "ttft": None})
    REC.pdds[("ns1", "demo")] = body
    kube = FakeKube()
    feed: list[float] = [0.06, 0.065]  # TPOT: a latency breach waits for a second sample

    async def fetch(body: Any, spec: Any, roles: Sequence[str], now: float) -> dict[str, Sample]:
        assert list(roles) == ["decode"]
        if not feed:
            return {}
        tpot = feed.pop(0)
        return {"decode": Sample(time=now, replicas=1, latency=tpot, kv_blocks_used=500,
                                 kv_blocks_total=1000, running_sequences=30)}

    scaler = Autoscaler(REC, kube, fetch=fetch)  # type: ignore[arg-type]

    async def run() -> None:
        await scaler.step_all(100.0)  # first sample: over target once, not sustained
        await scaler.step_all(105.0)  # not due yet
        await scaler.step_all(110.0)  # second: scale up by what the latency asks
    asyncio.run(run())
    status = REC.pdds[("ns1", "demo")]["status"]
    assert status["autoscaling"]["decode"]["desiredReplicas"] == 2
    assert status["autoscaling"]["decode"]["reason"] == "ScaledUp"
    assert [e[1] for e in kube.events] == ["Stable", "ScaledUp"]
    assert "TPOT p90 0.065 s > 0.05 s" in kube.events[-1][2]
    assert REC.kicks == [("ns1", "demo")] and len(kube.patches) == 2
    assert "prefill" not in status["autoscaling"]
    assert op_metrics.AUTOSCALE_DESIRED.labels("ns1", "demo", "decode")._value.get() == 2
    assert body["spec"]["decode"].get("replicas") is None  # spec untouched

    asyncio.run(scaler.step_all(145.0))  # nothing for over 3 intervals: hold, and say why
    status = REC.pdds[("ns1", "demo")]["status"]
    assert status["autoscaling"]["decode"]["desiredReplicas"] == 2
    cond = next(c for c in status["conditions"] if c["type"] == AUTOSCALING)
    assert cond["reason"] == "MetricsUnavailable" and cond["status"] == "False"


@pytest.mark.parametrize("spec", [BASE, autoscaled(decode={"enabled": False},
                                                   prefill={"enabled": False})])
def test_no_autoscaling_no_step(spec: dict[str, Any]) -> None:
    REC.pdds.clear()
    REC.pdds[("ns1", "x")] = {"metadata": {"namespace": "ns1", "name": "x", "uid": "u",
                                           "generation": 1}, "spec": spec}

    async def fetch(*_: Any) -> dict[str, Sample]:
        raise AssertionError("no fetch without an autoscaled role")

    asyncio.run(Autoscaler(REC, FakeKube(), fetch=fetch).step_all(0.0))  # type: ignore[arg-type]


def test_the_example_validates_and_builds_its_seeds() -> None:
    import yaml

    from pdd_cli.main import main

    path = "manifests/examples/autoscaling/deepseek-v2-lite-autoscaled.yaml"
    assert main(["validate", "-f", path]) == 0
    doc = yaml.safe_load(open(path).read())
    spec = parse_spec(doc["spec"])
    replicas = effective_replicas(spec, None)
    assert replicas == {"prefill": 1, "decode": 2}
    desired = build(OWNER, with_replicas(spec, replicas))
    assert len(desired.pods["decode"]) == 2


@pytest.mark.parametrize(("reasons", "reason", "status"), [
    (["Stable", "MetricsUnavailable"], "MetricsUnavailable", "False"),
    (["AtMinimum", "ScaledUp"], "ScaledUp", "True"),
    (["Stable", "AtMaximum"], "AtMaximum", "True"),
    (["Stable"], "Stable", "True"),
    (["ScaledUp", "MetricsPartial"], "MetricsPartial", "True"),
    (["MetricsPartial", "MetricsUnavailable"], "MetricsUnavailable", "False"),
])
def test_the_condition_tells_the_most_telling_role(reasons: list[str], reason: str,
                                                   status: str) -> None:
    from pdd_operator.conditions import autoscaling_condition
    c = autoscaling_condition([(r, f"role {i}: {r}") for i, r in enumerate(reasons)], 7, None,
                              "2026-12-04T00:00:00Z")
    assert (c["type"], c["reason"], c["status"], c["observedGeneration"]) == (
        AUTOSCALING, reason, status, 7)
    assert c["message"] == "; ".join(f"role {i}: {r}" for i, r in enumerate(reasons))


def test_a_decision_kicks_its_pass_before_the_events_are_posted() -> None:
    """Events go last at the API server's gate: the pass that builds the new replicas must not
    wait for them (nothing else starts it: the status write's echo starts no pass)."""
    REC.pdds.clear()
    REC.kicks.clear()
    body = copy.deepcopy(BODY)
    body["spec"] = autoscaled(decode={"maxReplicas": 4}, intervalSeconds=10,
                              prefill={"enabled": False, "ttft": None})
    REC.pdds[("ns1", "demo")] = body
    kicked_at_event: list[int] = []

    class Kube(FakeKube):
        async def post_event(self, body: Any, kind: str, reason: str, message: str,
                             series: str = "") -> None:
            kicked_at_event.append(len(REC.kicks))
            await super().post_event(body, kind, reason, message, series)

    kube = Kube()
    feed = [0.06, 0.065]

    async def fetch(body: Any, spec: Any, roles: Sequence[str], now: float) -> dict[str, Sample]:
        return {"decode": Sample(time=now, replicas=1, latency=feed.pop(0), kv_blocks_used=500,
                                 kv_blocks_total=1000, running_sequences=30)}

    scaler = Autoscaler(REC, kube, fetch=fetch)  # type: ignore[arg-type]

    async def run() -> None:
        await scaler.step_all(100.0)
        await scaler.step_all(110.0)
    asyncio.run(run())
    assert [e[1] for e in kube.events] == ["Stable", "ScaledUp"]
    assert kicked_at_event == [0, 1]  # ScaledUp's event posted after the kick
