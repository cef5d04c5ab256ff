"""Autoscaling on the local control plane: the planner's decision appears in status with the
Autoscaling condition and an Event, the operator builds it, a re-apply of the same manifest
leaves it in place (spec untouched, no new generation), and missing metrics hold.

The metrics come from a fake Prometheus in this process (spec.autoscaling.prometheusURL, the
documented second source): kwok's pods serve no /metrics. The load ramp with real instances is
the e2e tier's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from operator_fixtures import (  # noqa: F401  (fixtures)
    Kubectl,
    Operator,
    conditions,
    events_of,
    kube,
    op_namespace,
    operator,
    pdd,
    pods_of,
    wait_for,
)
from prometheus_stub import PrometheusStub

pytestmark = pytest.mark.integration


class FakePrometheus(PrometheusStub):
    """Answers the planner's instant queries from `values` (query prefix -> number); with
    `values` empty every answer is an empty vector (no data)."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        super().__init__()

    def answer(self, query: str) -> float | None:
        return next((v for k, v in self.values.items() if query.startswith(k)), None)


@pytest.fixture(scope="module")
def prometheus() -> Iterator[FakePrometheus]:
    p = FakePrometheus()
    yield p
    p.close()


def manifest(name: str, url: str) -> dict[str, Any]:
    return {
        "apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"}, "image": "pdd:0.1.0",
            "prefill": {"replicas": 1, "tensorParallelSize": 1},
            "decode": {"replicas": 1, "tensorParallelSize": 1},
            "autoscaling": {
                "intervalSeconds": 1, "scaleDownStabilizationSeconds": 600,
                "prometheusURL": url,
                "decode": {"minReplicas": 1, "maxReplicas": 4,
                           "tpot": {"percentile": 90, "seconds": 0.05},
                           "kvCacheUtilization": 0.8},
            },
        },
    }


# One decode instance of 1000 blocks holds 2300 in use: ceil(2300 / 800) = 3 instances.
OVERLOADED = {"count(": 1, "histogram_quantile": 0.03, "sum(pdd_running": 50,
              "sum(pdd_waiting": 4, "sum(pdd_kv_blocks_total{namespace": 1000}


def decode_auto(k: Kubectl, ns: str, name: str) -> dict[str, Any]:
    return ((pdd(k, ns, name).get("status") or {}).get("autoscaling") or {}).get("decode") or {}


def test_decision_in_status_survives_a_reapply_and_holds_without_metrics(
        kube: Kubectl, operator: Operator, op_namespace: str,
        prometheus: FakePrometheus) -> None:
    ns, name = op_namespace, "scaled"
    doc = manifest(name, prometheus.url)
    used = f"sum(pdd_kv_blocks_total{{namespace=\"{ns}\",pod=~\"{name}-decode-.*\",rank=\"0\"}}) -"
    prometheus.values = {used: 2300, **OVERLOADED}
    path = operator.log_dir / "scaled.yaml"
    path.write_text(yaml.safe_dump(doc))
    kube("apply", "-n", ns, "-f", str(path))

    wait_for("decode scaled to 3 in status",
             lambda: decode_auto(kube, ns, name).get("desiredReplicas") == 3, timeout=60)
    wait_for("3 decode pods", lambda: len(pods_of(kube, ns, name, "decode")) == 3, timeout=60)
    obj = pdd(kube, ns, name)
    generation = obj["metadata"]["generation"]
    assert obj["spec"]["decode"]["replicas"] == 1  # spec is git's, untouched
    auto = obj["status"]["autoscaling"]["decode"]
    assert auto["lastScaleTime"] and auto["metrics"]["kvCacheUtilization"] == pytest.approx(2.3)
    cond = conditions(obj)["Autoscaling"]
    assert cond["status"] == "True" and cond["reason"] in ("ScaledUp", "Stable")
    assert "prefill" not in obj["status"]["autoscaling"]  # not autoscaled: spec's 1
    assert len(pods_of(kube, ns, name, "prefill")) == 1
    wait_for("a ScaledUp event with the metric values", lambda: any(
        e.get("reason") == "ScaledUp" and "decode 1→3" in (e.get("message") or "")
        and "KV 2.30 > 0.8" in (e.get("message") or "")
        for e in events_of(kube, ns, name)), timeout=30)
    assert 'pdd_operator_autoscale_desired_replicas{name="scaled",namespace="' in (
        operator.metrics())

    # The same manifest again, as `kubectl apply` or a GitOps sync sends it: nothing changes.
    out = kube("apply", "-n", ns, "-f", str(path)).stdout
    assert "unchanged" in out
    time.sleep(4)  # several intervals and passes
    obj = pdd(kube, ns, name)
    assert obj["metadata"]["generation"] == generation
    assert obj["status"]["autoscaling"]["decode"]["desiredReplicas"] == 3
    assert len(pods_of(kube, ns, name, "decode")) == 3
    diff = kube("diff", "-n", ns, "-f", str(path), check=False)
    assert diff.returncode == 0, diff.stdout  # no drift a GitOps tool would flag

    # No metrics: hold at 3 and say so.
    prometheus.values = {}
    wait_for("Autoscaling=False MetricsUnavailable", lambda: (
        conditions(pdd(kube, ns, name)).get("Autoscaling") or {}).get("reason")
        == "MetricsUnavailable", timeout=30)
    obj = pdd(kube, ns, name)
    assert conditions(obj)["Autoscaling"]["status"] == "False"
    assert obj["status"]["autoscaling"]["decode"]["desiredReplicas"] == 3
    assert len(pods_of(kube, ns, name, "decode")) == 3

    # Autoscaling off for decode: spec's replicas rule again, the planner's part is cleared.
    doc["spec"]["autoscaling"]["decode"]["enabled"] = False
    path.write_text(yaml.safe_dump(doc))
    kube("apply", "-n", ns, "-f", str(path))
    wait_for("back to spec's 1 decode pod",
             lambda: len(pods_of(kube, ns, name, "decode")) == 1, timeout=60)
    wait_for("status.autoscaling cleared", lambda: not (
        pdd(kube, ns, name).get("status") or {}).get("autoscaling"), timeout=30)
    assert "Autoscaling" not in conditions(pdd(kube, ns, name))
