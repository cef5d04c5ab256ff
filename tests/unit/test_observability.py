"""manifests/observability: every series the Grafana dashboard queries is one the sidecars or
the operator expose (with the labels it filters and groups by), and the monitors select the
pods, ports and Services the operator and the kustomize base really create."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

import pdd_operator.metrics as operator_metrics
from pdd_api import keys
from pdd_api.validation import parse_spec
from pdd_operator import builders
from pdd_sidecar.metrics import InstanceMetrics, RouterMetrics

from .conftest import EXAMPLES, ROOT

OBS = ROOT / "manifests" / "observability"
# Labels Prometheus adds to every series: Kubernetes discovery and the PodMonitor's relabelings.
TARGET_LABELS = {"namespace", "pod", "container", "job", "instance", "endpoint", "service",
                 "pdd_deployment", "pdd_component", "pdd_replica"}
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created"), "summary": ("_sum", "_count")}


def _collectors() -> Iterator[MetricWrapperBase]:
    for owner in (InstanceMetrics("decode"), RouterMetrics(), operator_metrics):
        for value in vars(owner).values():
            if isinstance(value, MetricWrapperBase):
                yield value


def exposed() -> dict[str, set[str]]:
    """Series name -> the labels it carries (histogram buckets also carry `le`)."""
    out: dict[str, set[str]] = {}
    for c in _collectors():
        for family in c.collect():
            labels = set(c._labelnames)  # what every child of the metric is labelled with
            for suffix in SUFFIXES[family.type]:
                out[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


def dashboard() -> dict[str, Any]:
    return json.loads((OBS / "grafana-dashboard.json").read_text())  # type: ignore[no-any-return]


def exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def test_exposed_names_are_read_from_the_code() -> None:
    series = exposed()
    assert "pdd_kv_blocks_free" in series and "pdd_router_request_seconds_bucket" in series
    assert "pdd_operator_reconciles_total" in series and "rank" in series["pdd_kv_blocks_free"]
    assert len(exprs()) >= 20


SELECTOR = re.compile(r"\b(pdd_\w+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


@pytest.mark.parametrize("expr", exprs())
def test_every_queried_series_and_label_exists(expr: str) -> None:
    series = exposed()
    used: set[str] = set()
    for name, matchers in SELECTOR.findall(expr):
        assert name in series, f"{name} is exposed by no metric in the code ({expr})"
        used |= series[name]
        for label in MATCHER.findall(matchers or ""):
            assert label in series[name] | TARGET_LABELS, f"{name} has no label {label!r}"
    for group in GROUPING.findall(expr):
        for label in (g.strip() for g in group.split(",") if g.strip()):
            assert label in used | TARGET_LABELS, f"no series of {expr!r} has label {label!r}"


def test_dashboard_is_well_formed() -> None:
    d = dashboard()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(refs) == len(set(refs)), p["title"]
    variables = {v["name"] for v in d["templating"]["list"]}
    for e in exprs():
        assert set(re.findall(r"\$(\w+)", e)) - {"__rate_interval"} <= variables, e


def _pods() -> list[dict[str, Any]]:
    doc = yaml.safe_load(EXAMPLES[0].read_text())
    desired = builders.build(builders.Owner("demo", "ns1", "uid"), parse_spec(doc["spec"]))
    pods = [p for role in desired.pods.values() for p in role.values()]
    assert desired.router_deployment is not None
    router = desired.router_deployment["spec"]["template"]
    return pods + [{"metadata": router["metadata"], "spec": router["spec"]}]


def _label_meta(key: str) -> str:
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def test_podmonitor_selects_every_serving_pod_and_its_metrics_port() -> None:
    mon = yaml.safe_load((OBS / "podmonitor-sidecars.yaml").read_text())
    sel = mon["spec"]["selector"]
    (expr,) = sel["matchExpressions"]
    components = set()
    for pod in _pods():
        labels = pod["metadata"]["labels"]
        assert sel["matchLabels"].items() <= labels.items()
        assert labels[expr["key"]] in expr["values"]
        components.add(labels[keys.LABEL_COMPONENT])
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        for ep in mon["spec"]["podMetricsEndpoints"]:
            assert ep["port"] in ports
    assert components == set(expr["values"])
    sources = {s for ep in mon["spec"]["podMetricsEndpoints"] for r in ep["relabelings"]
               for s in r["sourceLabels"]}
    assert sources <= {_label_meta(k) for k in (keys.LABEL_INSTANCE, keys.LABEL_COMPONENT,
                                                  keys.LABEL_REPLICA)}
    targets = {r["targetLabel"] for ep in mon["spec"]["podMetricsEndpoints"]
               for r in ep["relabelings"]}
    assert {"pdd_deployment", "pdd_component"} <= targets <= TARGET_LABELS


def test_servicemonitor_selects_the_operator_metrics_service() -> None:
    mon = yaml.safe_load((OBS / "servicemonitor-operator.yaml").read_text())
    base = list(yaml.safe_load_all((ROOT / "manifests/base/operator.yaml").read_text()))
    services = [d for d in base if d["kind"] == "Service"
                and mon["spec"]["selector"]["matchLabels"].items()
                <= (d["metadata"].get("labels") or {}).items()
                and d["metadata"]["namespace"] in mon["spec"]["namespaceSelector"]["matchNames"]]
    assert [s["metadata"]["name"] for s in services] == ["pdd-operator-metrics"]
    ports = {p["name"] for p in services[0]["spec"]["ports"]}
    assert {e["port"] for e in mon["spec"]["endpoints"]} <= ports


def test_handoff_failures_by_cause_and_links_to_traces() -> None:
    """Issue 46: failures by cause on both roles, and from a slow request to its traces."""
    d = dashboard()
    assert any("pdd_kv_handoff_failures_total" in e and "by (role, cause)" in e for e in exprs())
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["traces_url"]["type"] == "textbox"
    links = [link["url"] for p in d["panels"]
             for link in p.get("fieldConfig", {}).get("defaults", {}).get("links", [])]
    links += [link["url"] for link in d.get("links", [])]
    traced = [u for u in links if u.startswith("${traces_url}/search?service=pdd-router")]
    assert any("minDuration=${__value.raw}s" in u for u in traced), links
    assert all("start=${__from}000&end=${__to}000" in u for u in traced), traced


def test_request_paths_and_the_local_prefill_threshold_are_shown() -> None:
    e = exprs()
    assert any("pdd_router_request_paths_total" in x and "by (path)" in x for x in e)
    assert any("pdd_router_local_prefill_tokens" in x for x in e)
