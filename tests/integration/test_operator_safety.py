"""What the operator does when the cluster says no, or a pod ends, and what it adds for the data
plane's safety: API errors reach status (a ResourceQuota, a PodSecurity `restricted`
namespace), names it does not own are never taken over, ended pods are replaced, each
PDDeployment gets its transfer-grant key Secret and its NetworkPolicies."""

from __future__ import annotations

import base64
import copy
import json
import time
from typing import Any

import pytest
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
    routing_cm_name,
    wait_for,
    wait_ready,
)

from pdd_api import keys

pytestmark = pytest.mark.integration

BASE: dict[str, Any] = {
    "apiVersion": "serving.pdd.dev/v1alpha1",
    "kind": "PDDeployment",
    "spec": {
        "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"},
        "image": "pdd:0.1.0",
        "prefill": {"replicas": 1, "tensorParallelSize": 2, "decodeContextParallelSize": 2},
        "decode": {"replicas": 1, "tensorParallelSize": 1},
    },
}


def make(name: str, **spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    doc["metadata"] = {"name": name}
    doc["spec"].update(spec)
    return doc


def delete_and_wait(k: Kubectl, ns: str, name: str) -> None:
    k("delete", "pddeployment", name, "-n", ns, "--timeout=50s")
    wait_for(f"{name}'s pods gone", lambda: not pods_of(k, ns, name), timeout=60)


def stalled_for_current_generation(k: Kubectl, ns: str, name: str,
                                   reason: str) -> dict[str, Any] | None:
    obj = pdd(k, ns, name)
    c = conditions(obj)
    gen = obj["metadata"]["generation"]
    ok = (obj.get("status", {}).get("observedGeneration") == gen
          and c.get("Ready", {}).get("reason") == reason
          and c.get("Stalled", {}).get("status") == "True")
    return obj if ok else None


def argo_health(obj: dict[str, Any]) -> str | None:
    """The Argo CD health check's verdict on the live object (None without lupa)."""
    try:
        import lupa
    except ImportError:
        return None
    from pathlib import Path

    lua = (Path(__file__).resolve().parents[2] / "manifests/argocd/health.lua").read_text()
    rt = lupa.LuaRuntime(unpack_returned_tuples=True)

    def to_lua(v: Any) -> Any:
        if isinstance(v, dict):
            return rt.table_from({kk: to_lua(vv) for kk, vv in v.items()})
        if isinstance(v, list):
            return rt.table_from([to_lua(x) for x in v])
        return v

    rt.globals()["obj"] = to_lua(obj)
    return str(dict(rt.execute(lua).items())["status"])


def test_quota_refusal_reaches_status_and_clears(kube: Kubectl, operator: Operator,
                                                 op_namespace: str) -> None:
    ns, name = op_namespace, "quota"
    kube.apply({"apiVersion": "v1", "kind": "ResourceQuota",
                "metadata": {"name": "gpus", "namespace": ns},
                "spec": {"hard": {"requests.nvidia.com/gpu": "1"}}})
    wait_for("quota status", lambda: kube.json("get", "resourcequota", "gpus", "-n", ns)
             .get("status", {}).get("hard"))
    try:
        kube.apply(make(name), "-n", ns)
        obj = wait_for("Ready=False ReconcileError + Stalled",
                       lambda: stalled_for_current_generation(kube, ns, name,
                                                              "ReconcileError"), timeout=60)
        ready = conditions(obj)["Ready"]
        assert ready["status"] == "False"
        assert f"Pod {ns}/{name}-prefill-0" in ready["message"], ready
        assert "exceeded quota: gpus" in ready["message"], ready
        assert conditions(obj)["Stalled"]["message"] == ready["message"]
        prefill = conditions(obj)["PrefillAvailable"]
        assert prefill["reason"] == "ReconcileError" and "exceeded quota" in prefill["message"]
        health = argo_health(obj)
        assert health in (None, "Degraded"), health
        # the rest of the pass went on: decode pod (1 GPU, within quota) and the router exist
        assert [p["metadata"]["name"] for p in pods_of(kube, ns, name, "decode")] == [
            f"{name}-decode-0"]
        assert kube.maybe("get", "deployment", name, "-n", ns) is not None
        assert any(e["reason"] == "ReconcileFailed" and "exceeded quota" in e["message"]
                   for e in events_of(kube, ns, name))
    finally:
        kube("delete", "resourcequota", "gpus", "-n", ns, "--ignore-not-found")
    obj = wait_ready(kube, ns, name, operator, timeout=90)
    assert "Stalled" not in conditions(obj)
    delete_and_wait(kube, ns, name)


def test_podsecurity_restricted_namespace(kube: Kubectl, operator: Operator,
                                         op_namespace: str) -> None:
    """The default pods meet `restricted`; a template that breaks it is refused by the API
    server, and that refusal reaches status."""
    ns, name, bad = op_namespace, "psa", "psabad"
    label = "pod-security.kubernetes.io/enforce"
    kube("label", "namespace", ns, f"{label}=restricted", "--overwrite")
    try:
        kube.apply(make(name), "-n", ns)
        wait_ready(kube, ns, name, operator)
        assert len(pods_of(kube, ns, name)) == 2
        kube.apply(make(bad, decode={"replicas": 1, "tensorParallelSize": 1, "template": {
            "spec": {"securityContext": {"runAsNonRoot": False}}}}), "-n", ns)
        obj = wait_for("Ready=False ReconcileError + Stalled",
                       lambda: stalled_for_current_generation(kube, ns, bad,
                                                              "ReconcileError"), timeout=60)
        msg = conditions(obj)["Ready"]["message"]
        assert 'violates PodSecurity "restricted' in msg, msg
        assert f"Pod {ns}/{bad}-decode-0" in msg, msg
        assert "runAsNonRoot" in msg, msg
        assert argo_health(obj) in (None, "Degraded")
        assert [p["metadata"]["name"] for p in pods_of(kube, ns, bad)] == [f"{bad}-prefill-0"]
    finally:
        kube("label", "namespace", ns, f"{label}-")
    delete_and_wait(kube, ns, name)
    delete_and_wait(kube, ns, bad)


def test_objects_with_our_names_are_never_taken_over(kube: Kubectl, operator: Operator,
                                                     op_namespace: str) -> None:
    ns, name = op_namespace, "conf"
    cm_name = routing_cm_name(make(name)["spec"], name)
    theirs = [
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": cm_name, "namespace": ns}, "data": {"mine": "yes"}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
         "spec": {"ports": [{"port": 9999}], "selector": {"app": "theirs"}}},
        {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
         "metadata": {"name": f"{name}{keys.GRANT_KEY_SECRET_SUFFIX}", "namespace": ns},
         "data": {"other": base64.b64encode(b"not yours").decode()}},
    ]
    kube.apply(theirs)
    kube.apply(make(name), "-n", ns)
    obj = wait_for("Ready=False NameConflict",
                   lambda: stalled_for_current_generation(kube, ns, name, "NameConflict"),
                   timeout=60)
    msg = conditions(obj)["Ready"]["message"]
    for ref in (f"ConfigMap {ns}/{cm_name}", f"Service {ns}/{name}",
                f"Secret {ns}/{name}-grant-key"):
        assert ref in msg, msg
    assert "is not controlled by this PDDeployment" in msg
    assert any(e["reason"] == "NameConflict" for e in events_of(kube, ns, name))
    time.sleep(3)  # a few more passes (pod events, the 5 s resync) must not change them
    for want in theirs:
        have = kube.json("get", want["kind"].lower(), want["metadata"]["name"], "-n", ns)
        assert not have["metadata"].get("ownerReferences"), have["metadata"]
        managers = {m["manager"] for m in have["metadata"].get("managedFields") or []}
        assert keys.FIELD_MANAGER not in managers, managers
        for field in ("data", "spec"):
            if field in want:
                assert all(have[field].get(k) == v for k, v in want[field].items()
                           if k != "ports"), have[field]
    assert kube.json("get", "service", name, "-n", ns)["spec"]["ports"][0]["port"] == 9999
    for want in theirs:
        kube("delete", want["kind"].lower(), want["metadata"]["name"], "-n", ns)
    obj = wait_ready(kube, ns, name, operator, timeout=90)
    assert "Stalled" not in conditions(obj)
    delete_and_wait(kube, ns, name)


def test_failed_pod_is_replaced(kube: Kubectl, operator: Operator, op_namespace: str) -> None:
    ns, name = op_namespace, "ended"
    kube.apply(make(name, decode={"replicas": 2, "tensorParallelSize": 1}), "-n", ns)
    wait_ready(kube, ns, name, operator)
    pod = f"{name}-decode-1"
    old = kube.json("get", "pod", pod, "-n", ns)["metadata"]["uid"]
    keep = kube.json("get", "pod", f"{name}-decode-0", "-n", ns)["metadata"]["uid"]
    start = time.monotonic()
    kube("patch", "pod", pod, "-n", ns, "--subresource=status", "--type=merge", "-p",
         json.dumps({"status": {"phase": "Failed", "reason": "Evicted",
                                "message": "The node was low on resource: memory."}}))

    def replaced_and_ready() -> bool:
        p = kube.maybe("get", "pod", pod, "-n", ns)
        if p is None or p["metadata"]["uid"] == old:
            return False
        return any(c["type"] == "Ready" and c["status"] == "True"
                   for c in p.get("status", {}).get("conditions") or [])

    wait_for("failed pod replaced by a Ready one", replaced_and_ready, timeout=60)
    elapsed = time.monotonic() - start
    print(f"\nFIGURE time to replace a Failed pod (patch -> new pod Ready): {elapsed:.2f} s")
    wait_ready(kube, ns, name, operator)
    assert kube.json("get", "pod", f"{name}-decode-0", "-n", ns)["metadata"]["uid"] == keep
    ended = [e for e in events_of(kube, ns, name) if e["reason"] == "ReplacingEnded"]
    assert ended and f"Pod {pod}" in ended[0]["message"], ended
    delete_and_wait(kube, ns, name)


def test_grant_key_secret_and_network_policies(kube: Kubectl, operator: Operator,
                                               op_namespace: str) -> None:
    ns, name = op_namespace, "sec"
    kube.apply(make(name), "-n", ns)
    obj = wait_ready(kube, ns, name, operator)
    uid = obj["metadata"]["uid"]
    secret = kube.json("get", "secret", f"{name}-grant-key", "-n", ns)
    assert secret["type"] == "Opaque" and secret.get("immutable") is True
    key = base64.b64decode(secret["data"][keys.GRANT_KEY_FILE_NAME])
    assert len(key) == 32 and len(set(key)) > 8
    [ref] = secret["metadata"]["ownerReferences"]
    assert ref["uid"] == uid and ref["controller"] is True

    def mounts_key(pod_spec: dict[str, Any]) -> bool:
        vols = {v["name"]: v for v in pod_spec.get("volumes") or []}
        c = pod_spec["containers"][0]
        env = {e["name"]: e.get("value") for e in c.get("env") or []}
        return env.get(keys.ENV_GRANT_KEY_FILE) == keys.GRANT_KEY_FILE and any(
            m["mountPath"] == keys.GRANT_MOUNT_DIR and m.get("readOnly")
            and vols[m["name"]].get("secret", {}).get("secretName") == f"{name}-grant-key"
            for m in c.get("volumeMounts") or [])

    for p in pods_of(kube, ns, name):
        assert mounts_key(p["spec"]), p["metadata"]["name"]
    router = kube.json("get", "deployment", name, "-n", ns)
    assert mounts_key(router["spec"]["template"]["spec"])
    router_pods = kube.json("get", "pods", "-n", ns, "-l",
                            f"app.kubernetes.io/instance={name},"
                            "app.kubernetes.io/component=router")["items"]
    assert router_pods and all(mounts_key(p["spec"]) for p in router_pods)

    policies = {p["metadata"]["name"]: p for p in kube.json(
        "get", "networkpolicies", "-n", ns, "-l", f"app.kubernetes.io/instance={name}")["items"]}
    assert set(policies) == {f"{name}-dataplane", f"{name}-router"}
    dp = policies[f"{name}-dataplane"]["spec"]
    assert dp["podSelector"]["matchExpressions"][0]["values"] == ["prefill", "decode"]
    assert dp["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        keys.LABEL_NAME: "pdd", keys.LABEL_INSTANCE: name}}}], "ports": [{"protocol": "TCP"}]}]
    assert policies[f"{name}-router"]["spec"]["ingress"] == [
        {"ports": [{"port": keys.HTTP_PORT, "protocol": "TCP"}]}]
    assert all(p["metadata"]["ownerReferences"][0]["uid"] == uid for p in policies.values())

    # a change that rolls every pod leaves the key alone (created once, never rotated)
    kube("patch", "pddeployment", name, "-n", ns, "--type=merge", "-p",
         json.dumps({"spec": {"image": "pdd:0.1.1", "networkPolicy": {"enabled": False}}}))
    wait_ready(kube, ns, name, operator)
    wait_for("network policies removed", lambda: not kube.json(
        "get", "networkpolicies", "-n", ns, "-l", f"app.kubernetes.io/instance={name}")["items"])
    again = kube.json("get", "secret", f"{name}-grant-key", "-n", ns)
    assert again["metadata"]["uid"] == secret["metadata"]["uid"]
    assert again["data"] == secret["data"]
    log = operator.log(100_000)
    assert secret["data"][keys.GRANT_KEY_FILE_NAME] not in log and key.hex() not in log
    delete_and_wait(kube, ns, name)
    wait_for("secret garbage-collected",
             lambda: kube.maybe("get", "secret", f"{name}-grant-key", "-n", ns) is None,
             timeout=60)
