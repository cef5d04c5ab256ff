"""Issue 46's traces, end to end: a PDDeployment with spec.tracing pointing at a real Jaeger
(v1.75.0, `make jaeger`), one request with a client's W3C traceparent, and the whole trace read
back through Jaeger's query API.

Real: the control plane and the operator (spec.tracing validated, rendered into each role's
pods and the router's Deployment as the standard OTEL_* variables), Jaeger (OTLP over gRPC as the
spec says, its storage and query API), and the data plane: a prefill, a decode and the router as
the processes pods run (`python -m pdd_sidecar serve|router`, the CPU model, a real hand-off),
each started with the OTEL_* environment the operator rendered for its role. Not real: the pods
themselves are kwok's (as in test_operator_autoscale_ramp.py: the e2e tier runs real pods, minutes
per PDDeployment on this machine), so the rendered environment is carried over to the local
processes instead of a kubelet starting them.

The sampling ratio is 0: only a request whose client asks for it (traceparent flags 01) is
traced, which is the parent-based sampler honouring the client; a request without one leaves no
trace, and both requests' trace ids are in the router's access log; the sampled one is the
exemplar of the router's TTFT histogram (what the dashboard links a slow request's point by).
"""

from __future__ import annotations

import json
import re
import secrets
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from jaeger import Jaeger, jaeger  # noqa: F401  (fixture)
from operator_fixtures import (  # noqa: F401  (fixtures)
    Kubectl,
    Operator,
    env_of,
    kube,
    op_namespace,
    operator,
    pods_of,
    wait_for,
)

from pdd_sidecar.serve.local_stack import LocalStack, StackConfig, log_tail

pytestmark = pytest.mark.integration

NAME = "traced"
MODEL = "builtin"  # the stack's built-in tiny model, by the name it serves
PROMPT = [(7 * i + 3) % 200 + 5 for i in range(40)]
MAX_TOKENS = 4
BLOCK = 16


def manifest(endpoint: str) -> dict[str, Any]:
    return {
        "apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"name": MODEL}, "image": "pdd:test", "blockSize": BLOCK,
            "prefill": {"tensorParallelSize": 1}, "decode": {"tensorParallelSize": 1},
            "tracing": {"endpoint": endpoint, "protocol": "grpc", "samplingRatio": 0},
        },
    }


def otel_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("OTEL_")}


@pytest.fixture(scope="module")
def rendered(kube: Kubectl, operator: Operator, op_namespace: str,
             jaeger: Jaeger) -> dict[str, dict[str, str]]:  # noqa: F811
    """Each component's OTEL_* environment as the operator rendered spec.tracing."""
    ns = op_namespace
    kube.apply(manifest(jaeger.otlp_grpc), "-n", ns)
    pods = wait_for("the prefill and decode pods", lambda: (
        lambda ps: ps if {p["metadata"]["labels"]["app.kubernetes.io/component"]
                          for p in ps} == {"prefill", "decode"} else None)(
        pods_of(kube, ns, NAME)), timeout=60)
    router = wait_for("the router Deployment", lambda: kube.maybe(
        "get", "deployment", NAME, "-n", ns), timeout=30)
    out = {p["metadata"]["labels"]["app.kubernetes.io/component"]:
           otel_env(p["spec"]["containers"][0]) for p in pods}
    out["router"] = otel_env(router["spec"]["template"]["spec"]["containers"][0])
    assert env_of(pods[0])["PDD_ROLE"] in ("prefill", "decode")
    return out


@pytest.fixture(scope="module")
def stack(rendered: dict[str, dict[str, str]],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # Through the prefill and the hand-off, whose spans are checked.
    cfg = StackConfig(port=0, log_level="INFO", block_size=BLOCK, local_prefill_tokens=0,
                      # The batch processors' standard delay (5 s) shortened for the test.
                      extra_env={"PDD_ACCESS_LOG": "1", "OTEL_BSP_SCHEDULE_DELAY": "200"},
                      role_env=rendered)
    with LocalStack(cfg, tmp_path_factory.mktemp("traced-stack")) as s:
        s.start(timeout_s=180)
        yield s


def complete(url: str, headers: dict[str, str]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"{url}/v1/completions", method="POST",
        data=json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                         "temperature": 0, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def by_name(trace: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for s in trace["spans"]:
        s["service"] = trace["processes"][s["processID"]]["serviceName"]
        s["tags_"] = {t["key"]: t["value"] for t in s["tags"]}
        parents = [r["spanID"] for r in s.get("references", []) if r["refType"] == "CHILD_OF"]
        s["parent"] = parents[0] if parents else None
        out[s["operationName"]] = s
    return out


EXPECTED = {  # span -> (service, parent span)
    f"text_completion {MODEL}": ("pdd-router", None),
    "pdd.route.prefill": ("pdd-router", f"text_completion {MODEL}"),
    "pdd.route.decode": ("pdd-router", f"text_completion {MODEL}"),
    "pdd.prefill": ("pdd-prefill", f"text_completion {MODEL}"),
    "pdd.prefill.queue": ("pdd-prefill", "pdd.prefill"),
    "pdd.prefill.compute": ("pdd-prefill", "pdd.prefill"),
    "pdd.decode": ("pdd-decode", f"text_completion {MODEL}"),
    "pdd.decode.queue": ("pdd-decode", "pdd.decode"),
    "pdd.kv_handoff": ("pdd-decode", "pdd.decode"),
    "pdd.decode.first_token": ("pdd-decode", "pdd.decode"),
}


def test_one_trace_per_request_from_the_client_through_router_prefill_handoff_decode(
        rendered: dict[str, dict[str, str]], stack: LocalStack, jaeger: Jaeger,  # noqa: F811
        op_namespace: str) -> None:
    # What the operator rendered: the standard variables, a service per component.
    for component, env in rendered.items():
        assert env == {
            "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_grpc,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0",
            "OTEL_SERVICE_NAME": f"pdd-{component}",
            "OTEL_RESOURCE_ATTRIBUTES": f"k8s.namespace.name={op_namespace},"
                                        f"pdd.deployment={NAME}",
        }, component

    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = complete(stack.url, {"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert len(body["choices"][0]["token_ids"]) == MAX_TOKENS
    untraced = complete(stack.url, {})
    assert len(untraced["choices"][0]["token_ids"]) == MAX_TOKENS

    def whole() -> dict[str, dict[str, Any]] | None:
        t = jaeger.trace(trace_id)
        spans = by_name(t) if t else {}
        return spans if set(EXPECTED) <= set(spans) else None

    try:
        spans = wait_for(f"trace {trace_id} with every span", whole, timeout=30)
    except AssertionError:
        t = jaeger.trace(trace_id)
        raise AssertionError(f"spans so far: {sorted(by_name(t)) if t else None}\n"
                             f"router log:\n{log_tail(stack.child('router').log_path)}") from None
    ids = {name: s["spanID"] for name, s in spans.items()}
    for name, (service, parent) in EXPECTED.items():
        s = spans[name]
        assert s["traceID"] == trace_id, name  # the client's trace id, kept on every hop
        assert s["service"] == service, (name, s["service"])
        assert s["parent"] == (ids[parent] if parent else client_span), name

    root = spans[f"text_completion {MODEL}"]["tags_"]
    assert root["gen_ai.operation.name"] == "text_completion"
    assert root["gen_ai.request.model"] == MODEL
    assert root["gen_ai.usage.input_tokens"] == len(PROMPT)
    assert root["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert root["gen_ai.response.id"] == body["id"]
    route = spans["pdd.route.prefill"]["tags_"]
    assert route["pdd.route.replica"] == stack.prefill_url
    assert route["pdd.route.policy"] == "cache-aware"
    assert route["pdd.route.reason"] in ("prefix_match", "least_loaded")
    assert "pdd.route.cache_hit_tokens" in route and "pdd.route.load.busy" in route
    assert spans["pdd.route.decode"]["tags_"]["pdd.route.replica"] == stack.decode_url
    pre = spans["pdd.prefill"]["tags_"]
    assert pre["gen_ai.usage.input_tokens"] == len(PROMPT)
    assert pre["pdd.prefill.computed_tokens"] + pre["pdd.prefill.cached_tokens"] == len(PROMPT)
    assert pre["pdd.prefill.chunks"] >= 1
    hand = spans["pdd.kv_handoff"]["tags_"]
    assert hand["pdd.kv.bytes"] > 0
    assert hand["pdd.kv.path"] in ("ucx", "cuda_ipc")
    assert hand["pdd.kv.retries"] == 0
    dec = spans["pdd.decode"]["tags_"]
    assert dec["gen_ai.usage.output_tokens"] == MAX_TOKENS - 1  # the first is the prefill's
    assert dec["pdd.decode.first_token_ms"] > 0

    # The access log names both requests' trace ids; the one sent without a traceparent was
    # not sampled (ratio 0), so Jaeger never got it.
    log = log_tail(stack.child("router").log_path, 200)
    logged = re.findall(r"POST /v1/completions 200 .*trace_id=([0-9a-f]{32})", log)
    assert logged[:2] == [trace_id, logged[1]] and logged[1] != trace_id, log
    time.sleep(1.5)  # two batch intervals of the exporters and of Jaeger
    assert jaeger.trace(logged[1]) is None

    # The slow-request link of the dashboard: the router's TTFT keeps the sampled request's
    # trace id as an exemplar (OpenMetrics), and only that one.
    req = urllib.request.Request(f"{stack.url}/metrics",
                                 headers={"Accept": "application/openmetrics-text"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    exemplars = re.findall(r'pdd_router_ttft_seconds_bucket\{[^}]*\} \S+ # '
                           r'\{trace_id="([0-9a-f]{32})"\}', text)
    assert exemplars == [trace_id], text
