"""The operator's pure builders and rollout policy: spec -> objects, observed -> actions."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_env import operator_config

from pdd_api import keys
from pdd_api.models import PDDeploymentSpec
from pdd_api.validation import InvalidSpecError, parse_spec
from pdd_operator.builders import Owner, Scraper, build, is_subset, plan_of
from pdd_operator.rollout import effective_max_unavailable, plan_role, pod_info

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
OWNER = Owner("demo", "ns1", "uid-1")


def example(path: Path) -> dict[str, Any]:
    return next(d for d in yaml.safe_load_all(path.read_text()) if d)


def spec_of(doc: dict[str, Any]) -> PDDeploymentSpec:
    return parse_spec(doc["spec"])


@pytest.fixture
def doc() -> dict[str, Any]:
    return copy.deepcopy(example(ROOT / "manifests/examples/p-tp4-dcp4-to-d-tp4-dcp4.yaml"))


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in
            pod["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_routing_configmap_is_pdd_plan_json(path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pdd_cli.main", "plan", "-f", str(path),
                          "-o", "json"], capture_output=True, text=True, check=True)
    desired = build(OWNER, spec_of(example(path)))
    assert desired.configmap["data"][keys.ROUTING_CONFIGMAP_KEY] == out.stdout.strip()
    from pdd_operator.builders import plan_hash

    h = plan_hash(desired.plan)
    assert desired.configmap["metadata"]["name"] == f"demo-routing-{h}"
    assert desired.configmap["immutable"] is True
    assert desired.configmap["metadata"]["labels"][keys.LABEL_PLAN_HASH] == h


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_pods_per_role_and_replica_with_contract_env(path: Path) -> None:
    doc = example(path)
    spec = spec_of(doc)
    desired = build(OWNER, spec)
    for role in ("prefill", "decode"):
        rs = getattr(spec, role)
        pods = desired.pods[role]
        assert sorted(pods) == list(range(rs.replicas))
        for i, pod in pods.items():
            assert pod["metadata"]["name"] == f"demo-{role}-{i}"
            lbl = pod["metadata"]["labels"]
            assert lbl[keys.LABEL_NAME] == "pdd" and lbl[keys.LABEL_INSTANCE] == "demo"
            assert lbl[keys.LABEL_COMPONENT] == role and lbl[keys.LABEL_REPLICA] == str(i)
            env = env_of(pod)
            assert env[keys.ENV_ROLE] == role
            assert env[keys.ENV_REPLICA] == str(i)
            assert env[keys.ENV_TP_SIZE] == str(rs.tensorParallelSize)
            assert env[keys.ENV_DCP_SIZE] == str(rs.decodeContextParallelSize)
            assert env[keys.ENV_BLOCK_SIZE] == str(spec.blockSize)
            assert env[keys.ENV_ROUTING_FILE] == "/etc/pdd/routing.json"
            assert env[keys.ENV_SIDE_CHANNEL_PORT] == str(spec.kvTransfer.sideChannelPort)
            assert env[keys.ENV_POD_IP] == {"fieldRef": {"apiVersion": "v1",
                                                         "fieldPath": "status.podIP"}}
            c = pod["spec"]["containers"][0]
            gpus = str(rs.tensorParallelSize)
            assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
            assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus
            assert c["command"] == ["python", "-m", "pdd_sidecar", "serve"]
            assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
            assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
            assert pod["spec"]["volumes"][0]["configMap"]["name"] == (
                desired.configmap["metadata"]["name"])
            assert pod["spec"]["subdomain"] == f"demo-{role}"
            assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
            assert pod["metadata"]["ownerReferences"][0]["controller"] is True


def test_headless_services_and_router(doc: dict[str, Any]) -> None:
    doc["spec"]["decode"]["replicas"] = 2
    desired = build(OWNER, spec_of(doc))
    svcs = {s["metadata"]["name"]: s for s in desired.services}
    assert set(svcs) == {"demo-prefill", "demo-decode"}
    for role in ("prefill", "decode"):
        s = svcs[f"demo-{role}"]["spec"]
        assert s["clusterIP"] == "None" and s["publishNotReadyAddresses"] is True
        assert s["selector"][keys.LABEL_COMPONENT] == role
        assert [p["port"] for p in s["ports"]] == [8000, 5600, 5601, 5602, 5603]
    dep = desired.router_deployment
    assert dep is not None and dep["metadata"]["name"] == "demo"
    env = env_of(dep["spec"]["template"])
    # The replicas, then the role's surge pod (it exists only during a plan-changing roll).
    assert env[keys.ENV_DECODE_URLS] == (
        "http://demo-decode-0.demo-decode.ns1.svc:8000,"
        "http://demo-decode-1.demo-decode.ns1.svc:8000,"
        "http://demo-decode-surge.demo-decode.ns1.svc:8000")
    assert env[keys.ENV_PREFILL_URLS] == (
        "http://demo-prefill-0.demo-prefill.ns1.svc:8000,"
        "http://demo-prefill-surge.demo-prefill.ns1.svc:8000")
    assert env[keys.ENV_PREFILL_SERVICE] == "demo-prefill.ns1.svc"
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["python", "-m", "pdd_sidecar", "router"]
    assert desired.router_service is not None
    assert desired.router_service["spec"]["ports"][0]["port"] == 8000


def test_router_disabled_and_sized(doc: dict[str, Any]) -> None:
    doc["spec"]["router"] = {"enabled": False}
    assert build(OWNER, spec_of(doc)).router_deployment is None
    doc["spec"]["router"] = {"replicas": 3, "resources": {"limits": {"cpu": 2}}}
    dep = build(OWNER, spec_of(doc)).router_deployment
    assert dep is not None and dep["spec"]["replicas"] == 3
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "limits": {"cpu": "2"}}


def test_gpus_default_to_tp_and_user_env_cannot_shadow_contract(doc: dict[str, Any]) -> None:
    doc["spec"]["prefill"].pop("resources")
    doc["spec"]["prefill"]["env"] = [{"name": "PDD_TP_SIZE", "value": "99"},
                                     {"name": "EXTRA", "value": "x"}]
    pod = build(OWNER, spec_of(doc)).pods["prefill"][0]
    env = env_of(pod)
    assert env["PDD_TP_SIZE"] == "4" and env["EXTRA"] == "x"
    assert [e["name"] for e in pod["spec"]["containers"][0]["env"]].count("PDD_TP_SIZE") == 1
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "4"}


def test_tracing_renders_the_standard_otel_env_per_role(doc: dict[str, Any]) -> None:
    """spec.tracing becomes the OTEL_* variables of every role (service name per role, the
    parent-based ratio sampler); a role's env or template cannot shadow them; absent, none is
    rendered and the pods keep their hash."""
    before = _hash(doc)
    assert not any(k.startswith("OTEL_") for k in env_of(build(OWNER, spec_of(doc)).pods[
        "decode"][0]))
    doc["spec"]["tracing"] = {"endpoint": "http://jaeger.obs:4317", "protocol": "grpc",
                              "samplingRatio": 0.01}
    doc["spec"]["decode"]["env"] = [{"name": "OTEL_TRACES_SAMPLER_ARG", "value": "1"},
                                    {"name": "OTEL_BSP_MAX_QUEUE_SIZE", "value": "4096"}]
    doc["spec"]["router"] = {"template": {"spec": {"containers": [
        {"name": "router", "env": [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT",
                                    "value": "http://elsewhere:4317"}]}]}}}
    desired = build(OWNER, spec_of(doc))
    assert desired.router_deployment is not None
    router = desired.router_deployment["spec"]["template"]
    for component, pod in (("prefill", desired.pods["prefill"][0]),
                           ("decode", desired.pods["decode"][0]), ("router", router)):
        names = [e["name"] for e in pod["spec"]["containers"][0]["env"]]
        env = env_of(pod)
        assert {k: v for k, v in env.items() if k in keys.TRACING_ENV} == {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger.obs:4317",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.01",
            "OTEL_SERVICE_NAME": f"pdd-{component}",
            "OTEL_RESOURCE_ATTRIBUTES": "k8s.namespace.name=ns1,pdd.deployment=demo",
        }, component
        assert all(names.count(k) == 1 for k in keys.TRACING_ENV), component
    # Other OTEL_* (the batch processor's, headers, ...) stay the user's.
    assert env_of(desired.pods["decode"][0])["OTEL_BSP_MAX_QUEUE_SIZE"] == "4096"
    assert _hash(doc) != before
    doc["spec"]["tracing"] = {"endpoint": "http://jaeger.obs:4318"}
    env = env_of(build(OWNER, spec_of(doc)).pods["prefill"][0])
    assert (env["OTEL_EXPORTER_OTLP_PROTOCOL"], env["OTEL_TRACES_SAMPLER_ARG"]) == (
        "http/protobuf", "1")


def test_without_tracing_a_role_may_set_otel_env_itself(doc: dict[str, Any]) -> None:
    doc["spec"]["decode"]["env"] = [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT",
                                     "value": "http://mine:4318"}]
    assert env_of(build(OWNER, spec_of(doc)).pods["decode"][0])[
        "OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://mine:4318"


def test_builders_are_deterministic(doc: dict[str, Any]) -> None:
    a, b = build(OWNER, spec_of(doc)), build(OWNER, spec_of(copy.deepcopy(doc)))
    assert json.dumps(a.pods, sort_keys=True) == json.dumps(b.pods, sort_keys=True)


def _hash(doc: dict[str, Any], role: str = "decode") -> str:
    pod = build(OWNER, spec_of(doc)).pods[role][0]
    return str(pod["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH])


@pytest.mark.parametrize("path,value", [
    ("image", "pdd:0.2.0"),
    ("blockSize", 128),
    ("model.name", "other/model"),
    ("decode.decodeContextParallelSize", 1),
    ("decode.extraArgs", ["--x"]),
    ("decode.prefixCache", False),
    ("decode.gpuMemoryUtilization", 0.8),
    ("decode.kvCacheBlocks", 4096),
    ("decode.hostKVCacheGiB", 8),
])
def test_spec_hash_changes_with_what_needs_a_restart(doc: dict[str, Any], path: str,
                                                     value: Any) -> None:
    before = _hash(doc)
    node = doc["spec"]
    *parents, leaf = path.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    assert _hash(doc) != before


def test_spec_hash_ignores_scale_and_router(doc: dict[str, Any]) -> None:
    before = _hash(doc)
    doc["spec"]["decode"]["replicas"] = 3
    doc["spec"]["router"] = {"replicas": 2, "policy": "round-robin"}
    doc["spec"]["rollout"] = {"maxUnavailable": 2}
    assert _hash(doc) == before


def test_plan_change_rolls_the_other_role_too(doc: dict[str, Any]) -> None:
    before = _hash(doc, "prefill")
    doc["spec"]["decode"].update({"tensorParallelSize": 2, "decodeContextParallelSize": 2})
    doc["spec"]["decode"].pop("resources")
    assert plan_of(spec_of(doc)).summary() == "D0 <- P0,P2; D1 <- P1,P3"
    assert _hash(doc, "prefill") != before


def test_is_subset_tolerates_server_defaults() -> None:
    want = {"spec": {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}]}],
                     "tolerations": [{"key": "k"}], "n": 1}}
    have = {"spec": {"containers": [{"name": "a", "imagePullPolicy": "Always",
                                     "env": [{"name": "X", "value": "1"}]},
                                    {"name": "injected"}],
                     "tolerations": [{"key": "node.kubernetes.io/not-ready"}, {"key": "k"}],
                     "n": "1", "extra": True}}
    assert is_subset(want, have)
    have["spec"]["containers"][0]["env"][0]["value"] = "2"
    assert not is_subset(want, have)
    assert not is_subset({"a": True}, {"a": "True"})


# ----------------------------------------------------------------------------- rollout


def observed(pod: dict[str, Any], *, ready: bool = True, terminating: bool = False,
             hash_: str | None = None, uid: str | None = None) -> dict[str, Any]:
    out = copy.deepcopy(pod)
    meta = out["metadata"]
    meta["uid"] = uid or f"pod-{meta['name']}"
    meta["resourceVersion"] = "1"
    if hash_ is not None:
        meta["annotations"][keys.ANNOTATION_SPEC_HASH] = hash_
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    out["status"] = {"phase": "Running", "conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "True" if ready else "False"}]}
    return out


def role_pods(doc: dict[str, Any], replicas: int, role: str = "decode") -> dict[int, Any]:
    doc["spec"][role]["replicas"] = replicas
    return build(OWNER, spec_of(doc)).pods[role]  # type: ignore[return-value]


def test_rollout_creates_missing_and_scales_down_highest(doc: dict[str, Any]) -> None:
    three = role_pods(doc, 3)
    rp = plan_role(three, [observed(three[0])], "uid-1", 1)
    assert [p["metadata"]["name"] for p in rp.create] == ["demo-decode-1", "demo-decode-2"]
    one = role_pods(doc, 1)
    rp = plan_role(one, [observed(p) for p in three.values()], "uid-1", 1)
    assert sorted(d.name for d in rp.delete) == ["demo-decode-1", "demo-decode-2"]
    assert {d.reason for d in rp.delete} == {"ScaleDown"}
    assert not rp.create and rp.ready == 1


def test_rollout_replaces_within_budget_and_keeps_one_serving(doc: dict[str, Any]) -> None:
    pods = role_pods(doc, 3)
    old = [observed(p, hash_="old") for p in pods.values()]
    rp = plan_role(pods, old, "uid-1", 1)
    assert [d.name for d in rp.delete] == ["demo-decode-0"] and rp.outdated == 3
    rp = plan_role(pods, old, "uid-1", 10)
    assert len(rp.delete) == 2, "a role of several replicas keeps one pod"
    # one already terminating uses the budget of 1
    old[0] = observed(pods[0], hash_="old", terminating=True)
    assert plan_role(pods, old, "uid-1", 1).delete == []
    # a recreated pod still starting also counts as unavailable
    old[0] = observed(pods[0], ready=False)
    assert plan_role(pods, old, "uid-1", 1).delete == []
    old[0] = observed(pods[0])
    assert [d.name for d in plan_role(pods, old, "uid-1", 1).delete] == ["demo-decode-1"]


def test_rollout_replaces_unready_outdated_pods_for_free(doc: dict[str, Any]) -> None:
    pods = role_pods(doc, 2)
    obs = [observed(pods[0], hash_="old", ready=False), observed(pods[1], hash_="old")]
    rp = plan_role(pods, obs, "uid-1", 1)
    assert [d.name for d in rp.delete] == ["demo-decode-0"]


def test_rollout_single_replica_is_replaced(doc: dict[str, Any]) -> None:
    pods = role_pods(doc, 1)
    assert effective_max_unavailable(1, 1) == 1
    rp = plan_role(pods, [observed(pods[0], hash_="old")], "uid-1", 1)
    assert [d.reason for d in rp.delete] == ["Replace"]


def test_rollout_restores_drift_and_ignores_foreign_pods(doc: dict[str, Any]) -> None:
    pods = role_pods(doc, 1)
    drifted = observed(pods[0])
    drifted["metadata"]["labels"].pop(keys.LABEL_MANAGED_BY)
    foreign = observed(pods[0])
    foreign["metadata"]["name"] = "someone-elses"
    foreign["metadata"]["ownerReferences"] = []
    rp = plan_role(pods, [drifted, foreign], "uid-1", 1)
    assert [p["metadata"]["name"] for p in rp.restore] == ["demo-decode-0"]
    assert rp.delete == [] and rp.excess == 0


def test_rollout_replaces_pod_of_a_previous_owner(doc: dict[str, Any]) -> None:
    pods = role_pods(doc, 1)
    stale = observed(pods[0])
    stale["metadata"]["ownerReferences"][0]["uid"] = "old-owner"
    assert [d.reason for d in plan_role(pods, [stale], "uid-1", 1).delete] == ["Replace"]


def test_pod_info_diagnoses_pending_and_crashloop(doc: dict[str, Any]) -> None:
    pod = observed(role_pods(doc, 1)[0], ready=False)
    pod["status"] = {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]}
    info = pod_info(pod)
    assert info.problem_reason == "Unschedulable"
    assert info.problem == ("demo-decode-0 is Pending (Unschedulable): 0/4 nodes are available: "
                            "4 Insufficient nvidia.com/gpu.")
    pod["status"] = {"phase": "Running", "conditions": [], "containerStatuses": [{
        "name": "sidecar", "restartCount": 5,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}]}
    info = pod_info(pod)
    assert info.problem_reason == "CrashLooping"
    assert info.problem == ("demo-decode-0 is crash-looping: container sidecar restarted 5 times;"
                            " last exit code 1 (Error)")


# ----------------------------------------------------------------------------- admission


def test_admission_uses_pdd_validate_rules_and_admits_spec_neutral_updates(
        doc: dict[str, Any]) -> None:
    from pdd_api.validation import validate_document
    from pdd_operator.webhook import admission_problems

    bad = copy.deepcopy(doc)
    bad["spec"]["decode"]["decodeContextParallelSize"] = 3
    bad["metadata"]["name"] = "x" * 48
    assert admission_problems(bad, None) == validate_document(bad)
    assert any(p.startswith("metadata.name:") for p in admission_problems(bad, None))
    finalizer_only = copy.deepcopy(bad)
    finalizer_only["metadata"]["finalizers"] = []
    assert admission_problems(finalizer_only, bad) == [], "deletion of a bad object not blocked"
    assert admission_problems(bad, doc) != []


def test_webhook_configuration_and_certificate() -> None:
    import ssl
    import tempfile

    from cryptography import x509

    from pdd_operator.certs import make_bundle
    from pdd_operator.config import Config
    from pdd_operator.webhook import webhook_configuration, webhook_hosts

    cfg = Config(namespaces=["a"], webhook_port=9443, webhook_service="pdd-system/hook")
    vwc = webhook_configuration(cfg, b"CA")
    hook = vwc["webhooks"][0]
    assert hook["clientConfig"]["service"] == {"namespace": "pdd-system", "name": "hook",
                                               "port": 9443, "path": "/validate"}
    assert hook["failurePolicy"] == "Fail"
    assert hook["namespaceSelector"]["matchExpressions"][0]["values"] == ["a"]
    assert hook["rules"][0]["resources"] == ["pddeployments"]
    bundle = make_bundle(webhook_hosts(cfg))
    cert = x509.load_pem_x509_certificate(bundle.cert_pem)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "hook.pdd-system.svc" in sans.get_values_for_type(x509.DNSName)
    with tempfile.TemporaryDirectory() as tmp:
        certfile, keyfile = bundle.write(Path(tmp))
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(certfile, keyfile)  # the pair kopf's server will load
        verify = ssl.create_default_context(cadata=bundle.ca_pem.decode())
        assert verify.cert_store_stats()["x509_ca"] == 1
    url_cfg = Config(webhook_port=19443, webhook_host="127.0.0.1")
    client = webhook_configuration(url_cfg, b"CA")["webhooks"][0]["clientConfig"]
    assert client["url"] == "https://127.0.0.1:19443/validate"
    assert "namespaceSelector" not in webhook_configuration(url_cfg, b"CA")["webhooks"][0]


def test_priority_gate_lets_pods_pass_first() -> None:
    import asyncio

    from pdd_operator.kube import (
        PRIORITY_EVENT,
        PRIORITY_OBJECT,
        PRIORITY_POD,
        PRIORITY_STATUS,
        PriorityGate,
    )

    async def scenario() -> list[str]:
        gate = PriorityGate(1)
        order: list[str] = []
        await gate.acquire(0)  # the only slot is taken

        async def job(name: str, prio: int) -> None:
            await gate.acquire(prio)
            order.append(name)
            gate.release(prio)

        tasks = [asyncio.create_task(job(n, p)) for n, p in
                 (("event", PRIORITY_EVENT), ("status", PRIORITY_STATUS),
                  ("pod", PRIORITY_POD), ("service", PRIORITY_OBJECT))]
        await asyncio.sleep(0)
        cancelled = asyncio.create_task(job("cancelled", 0))
        await asyncio.sleep(0)
        cancelled.cancel()
        gate.release(0)
        await asyncio.gather(*tasks)
        assert gate.free == 1, "no slot leaked by the cancelled waiter"
        return order

    assert asyncio.run(scenario()) == ["pod", "status", "service", "event"]


def test_priority_gate_serves_a_priority_pass_by_pass() -> None:
    """Two passes' writes queued interleaved: the pass that started first is served whole
    first (so it can write its status), then the next; a higher priority still goes first."""
    import asyncio
    import contextvars

    from pdd_operator.kube import PRIORITY_OBJECT, PRIORITY_STATUS, PriorityGate, start_pass

    async def scenario() -> list[str]:
        gate = PriorityGate(1)
        order: list[str] = []
        await gate.acquire(0)
        passes = []
        for _ in range(2):
            ctx = contextvars.copy_context()
            ctx.run(start_pass)
            passes.append(ctx)

        async def job(name: str, prio: int) -> None:
            await gate.acquire(prio)
            order.append(name)
            gate.release(prio)

        tasks = []
        for i in range(3):
            for p, ctx in enumerate(passes):
                tasks.append(asyncio.create_task(job(f"pass{p}-obj{i}", PRIORITY_OBJECT),
                                                 context=ctx))
        tasks.append(asyncio.create_task(job("pass1-status", PRIORITY_STATUS),
                                         context=passes[1]))
        await asyncio.sleep(0)
        gate.release(0)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["pass1-status", "pass0-obj0", "pass0-obj1",
                                       "pass0-obj2", "pass1-obj0", "pass1-obj1", "pass1-obj2"]


def test_priority_gate_keeps_other_requests_few_while_pods_are_pending() -> None:
    """A pod in flight: other requests get `beside_pods` slots though more are free, a pod
    arriving meanwhile goes at once, and the held ones go when no pod is left."""
    import asyncio

    from pdd_operator.kube import PRIORITY_OBJECT, PRIORITY_POD, PriorityGate

    async def scenario() -> tuple[list[str], list[str], list[str], int]:
        gate = PriorityGate(4, beside_pods=1)
        await gate.acquire(PRIORITY_POD)
        granted: list[str] = []

        async def job(name: str, prio: int) -> None:
            await gate.acquire(prio)
            granted.append(name)

        tasks = [asyncio.create_task(job(f"svc{i}", PRIORITY_OBJECT)) for i in range(3)]
        await asyncio.sleep(0)
        beside = list(granted)
        pod = asyncio.create_task(job("pod", PRIORITY_POD))
        await asyncio.sleep(0)
        with_pod = list(granted)
        gate.release(PRIORITY_POD)
        gate.release(PRIORITY_POD)
        await asyncio.gather(*tasks, pod)
        return beside, with_pod, granted, gate.free

    beside, with_pod, granted, free = asyncio.run(scenario())
    assert beside == ["svc0"]
    assert with_pod == ["svc0", "pod"]
    assert granted == ["svc0", "pod", "svc1", "svc2"]
    assert free == 1  # svc0-2 still hold theirs


# ----------------------------------------------------------------------------- issue 12/14


def test_rollout_replaces_ended_pods_at_once(doc: dict[str, Any]) -> None:
    pods = role_pods(doc, 3)
    obs = [observed(p) for p in pods.values()]
    for i, phase in ((0, "Failed"), (1, "Succeeded")):
        obs[i]["status"] = {"phase": phase, "reason": "Evicted", "message": "node low on memory"}
    rp = plan_role(pods, obs, "uid-1", 1, "demo")
    assert sorted((d.name, d.uid, d.reason) for d in rp.delete) == [
        ("demo-decode-0", "pod-demo-decode-0", "Ended"),
        ("demo-decode-1", "pod-demo-decode-1", "Ended")]
    assert not rp.settled and rp.ready == 1
    assert pod_info(obs[0]).problem == "demo-decode-0 Failed: Evicted node low on memory"
    # once deleted (terminating), it is not deleted again, and afterwards recreated
    obs[0]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert "demo-decode-0" not in [d.name for d in plan_role(pods, obs, "uid-1", 1).delete]
    rp = plan_role(pods, obs[1:], "uid-1", 1, "demo")
    assert [p["metadata"]["name"] for p in rp.create] == ["demo-decode-0"]


def test_rollout_leaves_a_pod_with_our_name_but_not_ours_alone(doc: dict[str, Any]) -> None:
    pods = role_pods(doc, 2)
    theirs = observed(pods[0], hash_="old")
    theirs["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                              "name": "x", "uid": "rs", "controller": True}]
    orphan = observed(pods[1])
    orphan["metadata"]["ownerReferences"] = []
    rp = plan_role(pods, [theirs, orphan], "uid-1", 1, "demo")
    assert rp.delete == [] and rp.create == [] and rp.restore == []
    assert rp.conflicts == ["demo-decode-0", "demo-decode-1"]
    # a pod of an earlier PDDeployment of the same name is ours to replace
    one = role_pods(doc, 1)
    earlier = observed(one[0])
    earlier["metadata"]["ownerReferences"][0]["uid"] = "old-owner"
    rp = plan_role(one, [earlier], "uid-1", 1, "demo")
    assert rp.conflicts == [] and [d.reason for d in rp.delete] == ["Replace"]


def test_grant_key_mounted_in_prefill_decode_and_router(doc: dict[str, Any]) -> None:
    from pdd_operator.builders import build_grant_secret, grant_secret_name

    desired = build(OWNER, spec_of(doc))
    assert desired.router_deployment is not None
    pod_specs = [desired.pods[r][0]["spec"] for r in ("prefill", "decode")]
    pod_specs.append(desired.router_deployment["spec"]["template"]["spec"])
    for ps in pod_specs:
        vols = {v["name"]: v for v in ps["volumes"]}
        mounts = [m for m in ps["containers"][0]["volumeMounts"]
                  if m["mountPath"] == keys.GRANT_MOUNT_DIR]
        assert len(mounts) == 1 and mounts[0]["readOnly"] is True
        assert vols[mounts[0]["name"]]["secret"]["secretName"] == "demo-grant-key"
        env = {e["name"]: e.get("value") for e in ps["containers"][0]["env"]}
        assert env[keys.ENV_GRANT_KEY_FILE] == "/etc/pdd-grant/grant.key"
    secret = build_grant_secret(OWNER, b"k" * 32)
    assert secret["metadata"]["name"] == grant_secret_name("demo") == "demo-grant-key"
    assert secret["type"] == "Opaque" and secret["immutable"] is True
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    import base64
    assert base64.b64decode(secret["data"]["grant.key"]) == b"k" * 32


@pytest.mark.parametrize("key", [None, "tokens"])
def test_api_keys_mounted_as_a_folder_in_the_router_alone(doc: dict[str, Any],
                                                          key: str | None) -> None:
    plain = build(OWNER, spec_of(doc)).router_deployment
    assert plain is not None
    pod = plain["spec"]["template"]["spec"]
    assert keys.ENV_API_KEY_FILE not in env_of({"spec": pod})
    doc["spec"].setdefault("router", {})["apiKeySecretRef"] = {
        "name": "llm-keys", **({"key": key} if key else {})}
    desired = build(OWNER, spec_of(doc))
    assert desired.router_deployment is not None
    ps = desired.router_deployment["spec"]["template"]["spec"]
    assert env_of({"spec": ps})[keys.ENV_API_KEY_FILE] == keys.API_KEY_MOUNT_DIR
    (mount,) = [m for m in ps["containers"][0]["volumeMounts"]
                if m["mountPath"] == keys.API_KEY_MOUNT_DIR]
    assert mount["readOnly"] is True and "subPath" not in mount  # rotates in place
    secret = {v["name"]: v for v in ps["volumes"]}[mount["name"]]["secret"]
    assert secret["secretName"] == "llm-keys"
    assert secret.get("items") == ([{"key": key, "path": "keys"}] if key else None)
    for role in ("prefill", "decode"):
        assert keys.ENV_API_KEY_FILE not in env_of(desired.pods[role][0])


def test_network_policies_isolate_dataplane_and_open_router(doc: dict[str, Any]) -> None:
    desired = build(OWNER, spec_of(doc))
    by_name = {p["metadata"]["name"]: p for p in desired.network_policies}
    assert set(by_name) == {"demo-dataplane", "demo-router"}
    assert all(p in desired.owned_non_pods() for p in by_name.values())
    dp = by_name["demo-dataplane"]["spec"]
    sel = dp["podSelector"]
    assert sel["matchLabels"] == {keys.LABEL_NAME: "pdd", keys.LABEL_INSTANCE: "demo"}
    assert sel["matchExpressions"] == [{"key": keys.LABEL_COMPONENT, "operator": "In",
                                        "values": ["prefill", "decode"]}]
    assert dp["policyTypes"] == ["Ingress"]
    [rule] = dp["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": sel["matchLabels"]}}]
    assert rule["ports"] == [{"protocol": "TCP"}], "any TCP port: UCX picks its ports"
    # every pod of this instance (router included) matches the `from`, the pods match the target
    for role in ("prefill", "decode"):
        lbls = desired.pods[role][0]["metadata"]["labels"]
        assert is_subset(sel["matchLabels"], lbls) and lbls[keys.LABEL_COMPONENT] in (
            "prefill", "decode")
    assert desired.router_deployment is not None
    router_lbls = desired.router_deployment["spec"]["template"]["metadata"]["labels"]
    assert is_subset(rule["from"][0]["podSelector"]["matchLabels"], router_lbls)
    rt = by_name["demo-router"]["spec"]
    assert is_subset(rt["podSelector"]["matchLabels"], router_lbls)
    assert rt["ingress"] == [{"ports": [{"protocol": "TCP", "port": keys.HTTP_PORT}]}]
    doc["spec"]["networkPolicy"] = {"enabled": False}
    assert build(OWNER, spec_of(doc)).network_policies == []


def _operator_deployment() -> dict[str, Any]:
    docs = yaml.safe_load_all((ROOT / "manifests/base/operator.yaml").read_text())
    return next(d for d in docs if d and d.get("kind") == "Deployment")


@pytest.mark.parametrize(("autoscaling", "scraped"), [
    ({"decode": {"maxReplicas": 4}}, True),
    ({"decode": {"maxReplicas": 4}, "prometheusURL": "http://prom:9090"}, False),
    ({"decode": {"maxReplicas": 4, "enabled": False}}, False),
])
def test_the_planners_scrapes_pass_the_dataplane_policy_from_the_operators_namespace_only(
        doc: dict[str, Any], autoscaling: dict[str, Any], scraped: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator as the kustomize base runs it: its configuration (from the Deployment's
    env, the namespace through the downward API) yields a rule that admits its own pods in its
    own namespace, and nothing else: not the same label in another namespace."""
    deployment = _operator_deployment()
    cfg = operator_config(deployment, monkeypatch)
    assert cfg.operator_namespace == "pdd-system" and cfg.operator_name == "pdd-operator"
    scraper = Scraper(cfg.operator_namespace, cfg.operator_name)
    doc["spec"]["autoscaling"] = autoscaling
    dp = next(p for p in build(OWNER, spec_of(doc), scraper).network_policies
              if p["metadata"]["name"] == "demo-dataplane")["spec"]
    assert len(dp["ingress"]) == 1 + scraped
    for rule in dp["ingress"]:
        for peer in rule["from"]:
            assert peer.get("namespaceSelector", {"matchLabels": {}}) != {}, (
                "an empty namespaceSelector admits every namespace")
    if not scraped:
        return
    rule = dp["ingress"][1]
    assert rule["ports"] == [{"protocol": "TCP", "port": keys.HTTP_PORT}]
    [peer] = rule["from"]
    operator_pod = deployment["spec"]["template"]["metadata"]["labels"]
    operator_ns = {keys.LABEL_NAMESPACE_NAME: deployment["metadata"]["namespace"]}
    assert admits(peer, operator_ns, operator_pod)
    assert not admits(peer, {keys.LABEL_NAMESPACE_NAME: "tenant-a"}, operator_pod)
    assert not admits(peer, {keys.LABEL_NAMESPACE_NAME: OWNER.namespace}, operator_pod)
    assert not admits(peer, operator_ns, {keys.LABEL_NAME: "pdd"})


def admits(peer: dict[str, Any], ns_labels: dict[str, str], pod_labels: dict[str, str]) -> bool:
    """A NetworkPolicy peer's selectors (matchLabels only, which is all the builders write)
    against a pod in a namespace; a peer without namespaceSelector means the policy's own."""
    ns_sel = peer.get("namespaceSelector")
    if ns_sel is None:
        ns_ok = ns_labels.get(keys.LABEL_NAMESPACE_NAME) == OWNER.namespace
    else:
        ns_ok = is_subset(ns_sel.get("matchLabels", {}), ns_labels)
    return ns_ok and is_subset(peer.get("podSelector", {}).get("matchLabels", {}), pod_labels)


def test_an_operator_that_does_not_know_its_namespace_admits_no_scraper(
        doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pdd_operator import config

    monkeypatch.delenv("PDD_OPERATOR_NAMESPACE", raising=False)
    monkeypatch.setattr(config, "SA_DIR", tmp_path)
    assert config.Config.from_env().operator_namespace is None
    (tmp_path / "namespace").write_text("ops\n")  # in a pod without the env: the account's
    assert config.Config.from_env().operator_namespace == "ops"
    doc["spec"]["autoscaling"] = {"decode": {"maxReplicas": 4}}
    dp = next(p for p in build(OWNER, spec_of(doc)).network_policies
              if p["metadata"]["name"] == "demo-dataplane")["spec"]
    assert len(dp["ingress"]) == 1


def test_pods_default_to_restricted_security_and_shm(doc: dict[str, Any]) -> None:
    desired = build(OWNER, spec_of(doc))
    assert desired.router_deployment is not None
    specs = [desired.pods[r][0]["spec"] for r in ("prefill", "decode")]
    specs.append(desired.router_deployment["spec"]["template"]["spec"])
    for ps in specs:
        assert ps["securityContext"] == {"runAsNonRoot": True,
                                         "seccompProfile": {"type": "RuntimeDefault"}}
        c = ps["containers"][0]["securityContext"]
        assert c == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        kinds = {k for v in ps["volumes"] for k in v if k != "name"}
        assert kinds <= {"configMap", "secret", "emptyDir"}, "volume types restricted allows"
    for ps in specs[:2]:
        shm = [v for v in ps["volumes"] if v.get("emptyDir") == {"medium": "Memory"}]
        assert len(shm) == 1
        assert {"name": shm[0]["name"], "mountPath": "/dev/shm"} in ps["containers"][0][
            "volumeMounts"]


def test_template_overlay_merges_over_the_built_pod(doc: dict[str, Any]) -> None:
    base = build(OWNER, spec_of(doc)).pods["decode"][0]
    doc["spec"]["decode"]["template"] = {
        "metadata": {"labels": {"team": "a"}, "annotations": {"example.com/x": "1"}},
        "spec": {
            "serviceAccountName": "model-reader",
            "imagePullSecrets": [{"name": "regcred"}],
            "volumes": [{"name": "model", "persistentVolumeClaim": {"claimName": "ds-v2"}}],
            "securityContext": {"fsGroup": 10001},
            "containers": [
                {"name": "sidecar", "volumeMounts": [{"name": "model", "mountPath": "/models",
                                                      "readOnly": True}],
                 "env": [{"name": "HF_HOME", "value": "/models/.hf"},
                         {"name": "PDD_ROLE", "value": "prefill"}]},
                {"name": "log-shipper", "image": "busybox"},
            ],
        },
    }
    doc["spec"]["decode"]["nodeSelector"] = {"gpu": "h200"}
    pod = build(OWNER, spec_of(doc)).pods["decode"][0]
    meta, ps = pod["metadata"], pod["spec"]
    assert meta["labels"]["team"] == "a" and meta["annotations"]["example.com/x"] == "1"
    assert meta["labels"][keys.LABEL_COMPONENT] == "decode"
    assert keys.ANNOTATION_SPEC_HASH in meta["annotations"]
    assert meta["annotations"][keys.ANNOTATION_SPEC_HASH] != base["metadata"]["annotations"][
        keys.ANNOTATION_SPEC_HASH]
    assert ps["serviceAccountName"] == "model-reader"
    assert ps["imagePullSecrets"] == [{"name": "regcred"}]
    assert ps["nodeSelector"] == {"gpu": "h200"}, "shorthands still apply"
    assert [v["name"] for v in ps["volumes"]] == [v["name"] for v in base["spec"]["volumes"]] + [
        "model"]
    assert ps["securityContext"] == {**base["spec"]["securityContext"], "fsGroup": 10001}
    main, extra = ps["containers"]
    assert extra == {"name": "log-shipper", "image": "busybox"}
    assert main["image"] == base["spec"]["containers"][0]["image"]
    assert main["volumeMounts"][-1]["mountPath"] == "/models"
    env = env_of(pod)
    assert env["HF_HOME"] == "/models/.hf" and env["PDD_ROLE"] == "decode"
    assert sum(1 for e in main["env"] if e["name"] == "PDD_ROLE") == 1
    assert main["securityContext"] == base["spec"]["containers"][0]["securityContext"]


def test_router_template_and_owned_fields_refused(doc: dict[str, Any]) -> None:
    from pdd_api.validation import validate_spec

    doc["spec"]["router"] = {"template": {"spec": {"serviceAccountName": "edge"}}}
    dep = build(OWNER, spec_of(doc)).router_deployment
    assert dep is not None and dep["spec"]["template"]["spec"]["serviceAccountName"] == "edge"
    bad = copy.deepcopy(doc["spec"])
    bad["prefill"]["template"] = {"spec": {"hostname": "x", "containers": [
        {"name": "sidecar", "image": "evil"}]}, "metadata": {"labels": {
            "app.kubernetes.io/instance": "other"}}}
    bad["router"] = {"template": {"spec": {"containers": [{"name": "router",
                                                            "command": ["sh"]}]}}}
    problems = validate_spec(bad)
    assert ("spec.prefill.template.spec: hostname, subdomain, restartPolicy are set by the "
            "operator and cannot be overridden") in problems
    assert ("spec.prefill.template.spec.containers[sidecar]: image, command, ports are set by "
            "the operator and cannot be overridden") in problems
    assert any(p.startswith("spec.prefill.template.metadata: labels") for p in problems)
    assert any(p.startswith("spec.router.template.spec.containers[router]") for p in problems)
    ok = copy.deepcopy(doc["spec"])
    ok["prefill"]["template"] = {"spec": {"containers": [{"name": "other", "image": "x"}]}}
    assert validate_spec(ok) == []


def test_pvc_sample_validates_and_mounts_the_model() -> None:
    from pdd_api.validation import validate_document

    doc = example(ROOT / "manifests/samples/model-on-pvc.yaml")
    assert validate_document(doc) == []
    desired = build(OWNER, spec_of(doc))
    for role in ("prefill", "decode"):
        pod = desired.pods[role][0]
        assert any(v.get("persistentVolumeClaim", {}).get("claimName") == "deepseek-checkpoints"
                   for v in pod["spec"]["volumes"])
        mounts = {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert "/models" in mounts
        assert env_of(pod)[keys.ENV_MODEL_SOURCE].startswith("/models/")
    for path in ("hpa-decode.yaml", "keda-decode.yaml"):
        target = example(ROOT / "manifests/samples" / path)["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("PDDeployment", doc["metadata"]["name"])


def test_router_reads_the_model_source_and_decodes_find_their_prefill_peers(
        doc: dict[str, Any]) -> None:
    desired = build(OWNER, spec_of(doc))
    assert desired.router_deployment is not None
    assert "PDD_MODEL_SOURCE" not in env_of(desired.router_deployment["spec"]["template"])
    doc["spec"]["model"]["source"] = "/models/v2-lite"
    desired = build(OWNER, spec_of(doc))
    assert desired.router_deployment is not None
    router_env = env_of(desired.router_deployment["spec"]["template"])
    assert router_env["PDD_MODEL_SOURCE"] == "/models/v2-lite"
    decode, prefill = desired.pods["decode"][0], desired.pods["prefill"][0]
    assert env_of(decode)["PDD_PREFILL_SERVICE"] == router_env["PDD_PREFILL_SERVICE"]
    assert "PDD_PREFILL_SERVICE" not in env_of(prefill)


def test_prefix_cache_per_role_and_the_router_policy_reach_their_pods(
        doc: dict[str, Any]) -> None:
    desired = build(OWNER, spec_of(doc))
    assert desired.router_deployment is not None
    # The defaults (cache on, cache-aware) are the sidecar's own: nothing is written for them.
    assert keys.ENV_ROUTER_POLICY not in env_of(desired.router_deployment["spec"]["template"])
    for role in ("prefill", "decode"):
        assert keys.ENV_PREFIX_CACHE not in env_of(desired.pods[role][0])
    doc["spec"]["decode"]["prefixCache"] = False
    doc["spec"]["decode"]["env"] = [{"name": keys.ENV_PREFIX_CACHE, "value": "1"}]
    doc["spec"]["router"] = {"policy": "least-loaded"}
    desired = build(OWNER, spec_of(doc))
    assert desired.router_deployment is not None
    assert env_of(desired.router_deployment["spec"]["template"])[
        keys.ENV_ROUTER_POLICY] == "least-loaded"
    assert keys.ENV_PREFIX_CACHE not in env_of(desired.pods["prefill"][0])
    decode_env = desired.pods["decode"][0]["spec"]["containers"][0]["env"]
    # The field wins over a user env of the same name, as for every contract key.
    assert [e["value"] for e in decode_env if e["name"] == keys.ENV_PREFIX_CACHE] == ["0"]


def test_kv_memory_fields_reach_their_role_only_and_defaults_write_nothing(
        doc: dict[str, Any]) -> None:
    memory_env = (keys.ENV_GPU_MEMORY_UTILIZATION, keys.ENV_NUM_BLOCKS,
                  keys.ENV_HOST_KV_CACHE_GIB)
    before = {role: _hash(doc, role) for role in ("prefill", "decode")}
    desired = build(OWNER, spec_of(doc))
    for role in ("prefill", "decode"):
        assert not set(memory_env) & set(env_of(desired.pods[role][0]))
    # The defaults written out are the defaults: same pods, same hash (no roll on upgrade).
    doc["spec"]["prefill"].update({"gpuMemoryUtilization": 0.9, "hostKVCacheGiB": 0})
    assert _hash(doc, "prefill") == before["prefill"]
    doc["spec"]["decode"].update({"gpuMemoryUtilization": 0.85, "kvCacheBlocks": 3000,
                                  "hostKVCacheGiB": 1.5})
    # A user env of the same names is dropped: the fields are the one way to set them.
    doc["spec"]["decode"]["env"] = [{"name": keys.ENV_NUM_BLOCKS, "value": "1"},
                                    {"name": keys.ENV_HOST_KV_CACHE_GIB, "value": "99"}]
    desired = build(OWNER, spec_of(doc))
    decode = desired.pods["decode"][0]["spec"]["containers"][0]["env"]
    assert [(e["name"], e["value"]) for e in decode if e["name"] in memory_env] == [
        (keys.ENV_GPU_MEMORY_UTILIZATION, "0.85"), (keys.ENV_NUM_BLOCKS, "3000"),
        (keys.ENV_HOST_KV_CACHE_GIB, "1.5")]
    assert not set(memory_env) & set(env_of(desired.pods["prefill"][0]))
    assert _hash(doc, "prefill") == before["prefill"]
    # Not part of the routing plan: only the decode pods roll.
    assert plan_of(spec_of(doc)).to_json() == desired.plan.to_json()
    assert desired.pods["prefill"][0]["metadata"]["labels"][keys.LABEL_PLAN_HASH] == \
        desired.pods["decode"][0]["metadata"]["labels"][keys.LABEL_PLAN_HASH]


def _resources(doc: dict[str, Any], role: str = "decode") -> dict[str, Any]:
    return build(OWNER, spec_of(doc)).pods[role][0]["spec"]["containers"][0]["resources"]


@pytest.mark.parametrize(("tp", "gib", "given", "want"), [
    # TP4, 8 GiB per rank: 32Gi of host tier on top of what the spec gives the sidecar.
    (4, 8, {"limits": {"memory": "64Gi"}, "requests": {"memory": "48Gi"}},
     {"limits": {"memory": "96Gi"}, "requests": {"memory": "80Gi"}}),
    # Only a limit: Kubernetes defaults the request to the (grown) limit.
    (4, 8, {"limits": {"memory": "64Gi"}}, {"limits": {"memory": "96Gi"}, "requests": {}}),
    # A request alone is the limit too: a namespace's default limit would be below it.
    (4, 8, {"requests": {"memory": "16Gi"}},
     {"limits": {"memory": "48Gi"}, "requests": {"memory": "48Gi"}}),
    # No memory at all: the tier and the sidecar's own 8Gi a rank, as request and limit.
    (4, 8, {}, {"limits": {"memory": "64Gi"}, "requests": {"memory": "64Gi"}}),
    (2, 1.5, {}, {"limits": {"memory": "19Gi"}, "requests": {"memory": "19Gi"}}),
    (1, 0.75, {"limits": {"memory": "1Gi"}}, {"limits": {"memory": "1792Mi"}, "requests": {}}),
    # Decimal units and plain bytes: summed exactly, in the largest unit that holds the sum.
    (1, 1, {"limits": {"memory": "100G"}}, {"limits": {"memory": "98704826Ki"}, "requests": {}}),
    (1, 1, {"requests": {"memory": 1000}},
     {"limits": {"memory": "1073742824"}, "requests": {"memory": "1073742824"}}),
    # Not a quantity, or beyond int64 bytes: left as written for the API server to judge.
    (1, 1, {"requests": {"memory": "lots"}},
     {"limits": {"memory": "lots"}, "requests": {"memory": "lots"}}),
    (1, 1, {"requests": {"memory": "9" * 5000}},
     {"limits": {"memory": "9" * 5000}, "requests": {"memory": "9" * 5000}}),
    # No host tier: the spec's memory as written.
    (4, 0, {"limits": {"memory": "64Gi"}}, {"limits": {"memory": "64Gi"}, "requests": {}}),
])
def test_host_tier_is_added_to_the_sidecars_memory(doc: dict[str, Any], tp: int, gib: float,
                                                    given: dict[str, Any],
                                                    want: dict[str, Any]) -> None:
    doc["spec"]["decode"] = {"tensorParallelSize": tp, "hostKVCacheGiB": gib,
                             "resources": copy.deepcopy(given)}
    got = _resources(doc)
    for kind in ("limits", "requests"):
        assert got[kind].pop("nvidia.com/gpu") == str(tp)
    assert got == want


def test_host_tier_counts_the_ranks_of_one_pod_not_of_the_instance(
        doc: dict[str, Any]) -> None:
    doc["spec"]["prefill"] = {"tensorParallelSize": 4, "decodeContextParallelSize": 4,
                              "gpusPerPod": 2, "hostKVCacheGiB": 10}
    # The LWS template is built from the pod builder: 2 ranks per pod, 20Gi and 2 x 8Gi own.
    got = _resources(doc, "prefill")
    assert got["requests"]["memory"] == got["limits"]["memory"] == "36Gi"


def test_a_memory_limit_the_host_tier_does_not_fit_in_is_refused(doc: dict[str, Any]) -> None:
    doc["spec"]["decode"] = {"tensorParallelSize": 4, "hostKVCacheGiB": 8,
                             "resources": {"limits": {"memory": "16Gi"}}}
    with pytest.raises(InvalidSpecError) as info:
        spec_of(doc)
    assert info.value.problems == [
        "spec.decode.resources.limits.memory: 16Gi is less than the host KV cache needs "
        "(hostKVCacheGiB 8 × 4 ranks per pod = 32Gi)"]
    doc["spec"]["decode"]["resources"]["limits"]["memory"] = "32Gi"
    assert _resources(doc)["limits"]["memory"] == "64Gi"


def test_router_workers_reach_the_router_pods_only_when_not_one(doc: dict[str, Any]) -> None:
    """One worker is the router's own default: nothing written, so existing routers keep their
    pod hash; more reach the router container as PDD_ROUTER_WORKERS."""
    desired = build(OWNER, spec_of(doc))
    assert desired.router_deployment is not None
    assert keys.ENV_ROUTER_WORKERS not in env_of(desired.router_deployment["spec"]["template"])
    doc["spec"]["router"] = {"workers": 4}
    desired = build(OWNER, spec_of(doc))
    assert desired.router_deployment is not None
    assert env_of(desired.router_deployment["spec"]["template"])[
        keys.ENV_ROUTER_WORKERS] == "4"


def test_webhook_certificate_renews_at_two_thirds() -> None:
    import datetime

    from cryptography import x509

    from pdd_operator.certs import make_bundle, renew_at

    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    for life in (datetime.timedelta(seconds=30), datetime.timedelta(days=365)):
        b = make_bundle(["127.0.0.1"], now=now, validity=life)
        cert = x509.load_pem_x509_certificate(b.cert_pem)
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
        assert end == now + life and start < now
        assert renew_at(b.cert_pem) == start + (end - start) * 2 / 3
        assert now < renew_at(b.cert_pem) < end


def test_pods_carry_their_plan_hash(doc: dict[str, Any]) -> None:
    from pdd_operator.builders import plan_hash

    def hashes(d: dict[str, Any]) -> set[str]:
        desired = build(OWNER, spec_of(d))
        out = set()
        for role in ("prefill", "decode"):
            for pod in desired.pods[role].values():
                label = pod["metadata"]["labels"][keys.LABEL_PLAN_HASH]
                assert env_of(pod)[keys.ENV_PLAN_HASH] == label
                out.add(label)
        assert out == {plan_hash(desired.plan)}, "both roles, every replica: one plan"
        return out

    first = hashes(doc)
    doc["spec"]["decode"]["replicas"] = 3
    doc["spec"]["image"] = "other:1"
    assert hashes(doc) == first, "a scale or an image change keeps the plan"
    doc["spec"]["decode"].update({"decodeContextParallelSize": 1})
    assert hashes(doc) != first
