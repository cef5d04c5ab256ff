"""The operator's behaviours, one test each, against the local control plane: scaling, a
controlled roll, self-healing of deleted pods and edited objects, the router switch, an
unschedulable role explained in status, and garbage collection on delete."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
from kubernetes import client, config, watch
from localcluster import Cluster
from operator_fixtures import (  # noqa: F401  (fixtures)
    Kubectl,
    Operator,
    conditions,
    env_of,
    events_of,
    kube,
    op_namespace,
    operator,
    pdd,
    pods_of,
    routing_cm,
    wait_for,
    wait_ready,
)

from pdd_api import keys

pytestmark = pytest.mark.integration
HASH = keys.ANNOTATION_SPEC_HASH

BASE: dict[str, Any] = {
    "apiVersion": "serving.pdd.dev/v1alpha1",
    "kind": "PDDeployment",
    "spec": {
        "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"},
        "image": "pdd:0.1.0",
        "blockSize": 64,
        "prefill": {"replicas": 1, "tensorParallelSize": 2, "decodeContextParallelSize": 2},
        "decode": {"replicas": 1, "tensorParallelSize": 1, "decodeContextParallelSize": 1},
    },
}


def make(name: str, **spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    doc["metadata"] = {"name": name}
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(doc["spec"].get(key), dict):
            doc["spec"][key].update(value)
        else:
            doc["spec"][key] = value
    return doc


def patch_spec(k: Kubectl, ns: str, name: str, spec: dict[str, Any]) -> None:
    import json

    k("patch", "pddeployment", name, "-n", ns, "--type=merge", "-p",
      json.dumps({"spec": spec}))


def uids(pods: list[dict[str, Any]]) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}


def delete_and_wait(k: Kubectl, ns: str, name: str) -> None:
    k("delete", "pddeployment", name, "-n", ns, "--timeout=50s")
    wait_for(f"{name}'s pods gone", lambda: not pods_of(k, ns, name), timeout=60)


def test_scale_up_then_down_removes_highest_indices(kube: Kubectl, operator: Operator,
                                                    op_namespace: str) -> None:
    ns, name = op_namespace, "scale"
    kube.apply(make(name), "-n", ns)
    wait_ready(kube, ns, name, operator)
    first = uids(pods_of(kube, ns, name, "decode"))
    patch_spec(kube, ns, name, {"decode": {"replicas": 3}})
    obj = wait_ready(kube, ns, name, operator)
    pods = pods_of(kube, ns, name, "decode")
    assert [p["metadata"]["name"] for p in pods] == [f"{name}-decode-{i}" for i in range(3)]
    assert uids(pods)[f"{name}-decode-0"] == first[f"{name}-decode-0"], "scale-up kept pod 0"
    assert obj["status"]["decode"]["readyReplicas"] == 3
    router = kube.json("get", "deployment", name, "-n", ns)
    assert env_of(router["spec"]["template"])["PDD_DECODE_URLS"].count("http://") == 3 + 1

    patch_spec(kube, ns, name, {"decode": {"replicas": 1}})
    wait_ready(kube, ns, name, operator)
    wait_for("decode-1 and decode-2 gone",
             lambda: [p["metadata"]["name"] for p in pods_of(kube, ns, name, "decode")] == [
                 f"{name}-decode-0"])
    assert uids(pods_of(kube, ns, name, "decode")) == first, "scale-down kept pod 0"
    deleted = [e["message"] for e in events_of(kube, ns, name) if e["reason"] == "Deleted"]
    assert any(f"Pod {name}-decode-2" in m for m in deleted), deleted
    delete_and_wait(kube, ns, name)


class RoleWatch:
    """Every change of a role's pods, as the API server streams them, to check an invariant
    at each step of a roll (no sampling gaps)."""

    def __init__(self, cluster: Cluster, ns: str, name: str, role: str, replicas: int) -> None:
        self.api = client.CoreV1Api(config.new_client_from_config(str(cluster.kubeconfig)))
        self.ns, self.replicas = ns, replicas
        self.selector = (f"app.kubernetes.io/instance={name},"
                         f"app.kubernetes.io/component={role}")
        self.names = {f"{name}-{role}-{i}" for i in range(replicas)}
        self.state: dict[str, bool] = {}
        self.serving: list[int] = []
        self.stop = threading.Event()
        self.w = watch.Watch()
        listed = self.api.list_namespaced_pod(ns, label_selector=self.selector)
        for p in listed.items:
            self._see(p)
        self.serving = self.serving[-1:]  # the count once every listed pod is known
        self.thread = threading.Thread(
            target=self._run, args=(listed.metadata.resource_version,), daemon=True)
        self.thread.start()

    def _see(self, pod: Any, deleted: bool = False) -> None:
        name = pod.metadata.name
        ready = any(c.type == "Ready" and c.status == "True"
                    for c in (pod.status.conditions or []))
        self.state[name] = ready and not deleted and pod.metadata.deletion_timestamp is None
        self.serving.append(sum(1 for n in self.names if self.state.get(n)))

    def _run(self, rv: str) -> None:
        try:
            self._stream(rv)
        except Exception:  # noqa: BLE001 - close() ends the stream mid-read
            if not self.stop.is_set():
                raise

    def _stream(self, rv: str) -> None:
        for ev in self.w.stream(self.api.list_namespaced_pod, self.ns,
                                label_selector=self.selector, resource_version=rv,
                                timeout_seconds=120):
            self._see(ev["object"], deleted=ev["type"] == "DELETED")
            if self.stop.is_set():
                break

    def close(self) -> None:
        self.stop.set()
        self.w.stop()


def test_parallelism_change_rolls_within_max_unavailable(cluster: Cluster, kube: Kubectl,
                                                        operator: Operator,
                                                        op_namespace: str) -> None:
    ns, name = op_namespace, "roll"
    kube.apply(make(name, decode={"replicas": 3}, rollout={"maxUnavailable": 1}), "-n", ns)
    wait_ready(kube, ns, name, operator)
    before = {p["metadata"]["name"]: p["metadata"]["annotations"][HASH]
              for p in pods_of(kube, ns, name)}
    watcher = RoleWatch(cluster, ns, name, "decode", 3)
    try:
        patch_spec(kube, ns, name, {"decode": {"tensorParallelSize": 2,
                                               "decodeContextParallelSize": 2}})
        obj = wait_ready(kube, ns, name, operator, timeout=180)
    finally:
        watcher.close()
    after = pods_of(kube, ns, name)
    assert sorted(p["metadata"]["name"] for p in after) == sorted(before)
    for p in after:
        assert p["metadata"]["annotations"][HASH] != before[p["metadata"]["name"]], (
            "every pod runs the new plan")
        if p["metadata"]["labels"]["app.kubernetes.io/component"] == "decode":
            assert env_of(p)["PDD_TP_SIZE"] == "2"
    assert obj["status"]["routingSummary"] == "D0 <- P0; D1 <- P1"
    # maxUnavailable 1 of 3: at every step at least 2 decode pods were Ready.
    assert watcher.serving and min(watcher.serving) >= 2, watcher.serving
    assert any(e["reason"] == "Replacing" for e in events_of(kube, ns, name))
    delete_and_wait(kube, ns, name)


def test_deleted_pod_is_recreated(kube: Kubectl, operator: Operator, op_namespace: str) -> None:
    ns, name = op_namespace, "heal"
    kube.apply(make(name), "-n", ns)
    wait_ready(kube, ns, name, operator)
    old = uids(pods_of(kube, ns, name, "prefill"))[f"{name}-prefill-0"]
    kube("delete", "pod", f"{name}-prefill-0", "-n", ns, "--wait=false")
    wait_for("prefill-0 recreated with a new uid",
             lambda: uids(pods_of(kube, ns, name, "prefill")).get(f"{name}-prefill-0")
             not in (None, old))
    wait_ready(kube, ns, name, operator)
    assert len(pods_of(kube, ns, name)) == 2
    delete_and_wait(kube, ns, name)


def test_manual_edits_of_owned_objects_are_restored(kube: Kubectl, operator: Operator,
                                                   op_namespace: str) -> None:
    ns, name = op_namespace, "edits"
    kube.apply(make(name), "-n", ns)
    wait_ready(kube, ns, name, operator)
    cm = routing_cm(kube, ns, name)
    cm_name, plan = cm["metadata"]["name"], cm["data"]["routing.json"]
    assert cm["immutable"] is True
    edit = kube("patch", "configmap", cm_name, "-n", ns, "--type=merge",
                "-p", '{"data":{"routing.json":"{}"}}', check=False)
    assert edit.returncode != 0 and "immutable" in edit.stderr, edit.stderr
    kube("delete", "configmap", cm_name, "-n", ns)
    kube("patch", "service", f"{name}-decode", "-n", ns, "--type=merge",
         "-p", '{"spec":{"publishNotReadyAddresses":false}}')
    kube("scale", "deployment", name, "-n", ns, "--replicas=3")
    kube("label", "pod", f"{name}-decode-0", "-n", ns, "app.kubernetes.io/managed-by-")
    wait_for("routing ConfigMap recreated", lambda: (
        (c := kube.maybe("get", "configmap", cm_name, "-n", ns)) is not None
        and c["data"]["routing.json"] == plan))
    # An API server drops a false field: absent until the operator has restored it.
    wait_for("service restored", lambda: kube.json(
        "get", "service", f"{name}-decode", "-n", ns)["spec"].get("publishNotReadyAddresses"))
    wait_for("router replicas restored", lambda: kube.json(
        "get", "deployment", name, "-n", ns)["spec"]["replicas"] == 1)
    wait_for("pod label restored", lambda: kube.json(
        "get", "pod", f"{name}-decode-0", "-n", ns)["metadata"]["labels"].get(
        "app.kubernetes.io/managed-by") == "pdd-operator", timeout=60)
    assert any(e["reason"] == "Restored" for e in events_of(kube, ns, name))
    delete_and_wait(kube, ns, name)


def test_router_can_be_disabled_and_sized(kube: Kubectl, operator: Operator,
                                          op_namespace: str) -> None:
    ns, name = op_namespace, "router"
    kube.apply(make(name, router={"enabled": False}), "-n", ns)
    wait_ready(kube, ns, name, operator)
    assert kube.maybe("get", "deployment", name, "-n", ns) is None
    assert kube.maybe("get", "service", name, "-n", ns) is None
    patch_spec(kube, ns, name, {"router": {"enabled": True, "replicas": 2}})
    wait_ready(kube, ns, name, operator)
    dep = kube.json("get", "deployment", name, "-n", ns)
    assert dep["spec"]["replicas"] == 2 and dep["status"]["availableReplicas"] == 2
    svc = kube.json("get", "service", name, "-n", ns)
    assert svc["spec"]["ports"][0]["port"] == 8000
    patch_spec(kube, ns, name, {"router": {"enabled": False}})
    wait_for("router removed", lambda: kube.maybe("get", "deployment", name, "-n", ns) is None
             and kube.maybe("get", "service", name, "-n", ns) is None)
    delete_and_wait(kube, ns, name)


def test_unschedulable_role_is_explained(kube: Kubectl, operator: Operator,
                                         op_namespace: str) -> None:
    ns, name = op_namespace, "toobig"
    kube.apply(make(name, decode={"tensorParallelSize": 16}), "-n", ns)

    def explained() -> dict[str, Any] | None:
        c = conditions(pdd(kube, ns, name)).get("DecodeAvailable")
        return c if c and c["reason"] == "Unschedulable" else None

    cond = wait_for("DecodeAvailable=False (Unschedulable)", explained, timeout=90)
    assert cond["status"] == "False"
    assert f"{name}-decode-0 is Pending (Unschedulable)" in cond["message"]
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    # The schedulable role is not held back by the other: its pod gets Ready on its own time
    # (later than the decode's refusal on a loaded machine), while the whole stays not Ready.
    wait_for("PrefillAvailable=True", lambda: conditions(pdd(kube, ns, name)).get(
        "PrefillAvailable", {}).get("status") == "True", timeout=90)
    obj = pdd(kube, ns, name)
    assert conditions(obj)["Ready"]["status"] == "False"
    assert conditions(obj)["DecodeAvailable"]["reason"] == "Unschedulable"
    describe = kube("describe", "pdd", name, "-n", ns).stdout
    assert f"{name}-decode-0 is Pending (Unschedulable)" in describe
    events = describe.split("Events:")[1]
    assert any(line.split()[:2] == ["Warning", "Unschedulable"]
               for line in events.splitlines() if line.strip()), describe
    delete_and_wait(kube, ns, name)


def test_delete_garbage_collects_everything(kube: Kubectl, operator: Operator,
                                            op_namespace: str) -> None:
    ns, name = op_namespace, "gc"
    kube.apply(make(name, decode={"replicas": 2}), "-n", ns)
    wait_ready(kube, ns, name, operator)
    kube("delete", "pddeployment", name, "-n", ns, "--timeout=50s")
    sel = f"app.kubernetes.io/instance={name}"

    def leftovers() -> list[str]:
        out = kube.json("get", "pods,services,configmaps,deployments,replicasets", "-n", ns,
                        "-l", sel)["items"]
        return [f"{o['kind']}/{o['metadata']['name']}" for o in out]

    wait_for("owned objects garbage-collected", lambda: leftovers() == [] or None, timeout=90)


def test_kubectl_scale_changes_decode_pods(kube: Kubectl, operator: Operator,
                                           op_namespace: str) -> None:
    ns, name = op_namespace, "kscale"
    kube.apply(make(name), "-n", ns)
    wait_ready(kube, ns, name, operator)
    kube("scale", f"pdd/{name}", "-n", ns, "--replicas=3")
    obj = wait_ready(kube, ns, name, operator)
    assert obj["spec"]["decode"]["replicas"] == 3
    assert [p["metadata"]["name"] for p in pods_of(kube, ns, name, "decode")] == [
        f"{name}-decode-{i}" for i in range(3)]
    assert len(pods_of(kube, ns, name, "prefill")) == 1, "scale drives decode only"
    import json

    scale = json.loads(kube("get", "--raw", f"/apis/serving.pdd.dev/v1alpha1/namespaces/{ns}/"
                            f"pddeployments/{name}/scale").stdout)
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    sel = scale["status"]["selector"]
    assert f"app.kubernetes.io/instance={name}" in sel
    assert "app.kubernetes.io/component=decode" in sel
    listed = kube.json("get", "pods", "-n", ns, "-l", sel)["items"]
    assert sorted(p["metadata"]["name"] for p in listed) == [
        f"{name}-decode-{i}" for i in range(3)]
    kube("scale", f"pdd/{name}", "-n", ns, "--replicas=1")
    wait_for("decode scaled back to 1", lambda: [
        p["metadata"]["name"] for p in pods_of(kube, ns, name, "decode")] == [f"{name}-decode-0"])
    delete_and_wait(kube, ns, name)


def test_plan_change_publishes_a_new_routing_configmap_and_prunes_the_old(
        kube: Kubectl, operator: Operator, op_namespace: str) -> None:
    ns, name = op_namespace, "plans"
    kube.apply(make(name), "-n", ns)
    obj = wait_ready(kube, ns, name, operator)
    old = routing_cm(kube, ns, name)
    # v1alpha1's unhashed ConfigMap, as an older operator left it: pruned, no pod mounts it
    kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": f"{name}-routing", "namespace": ns,
        "labels": {"app.kubernetes.io/name": "pdd", "app.kubernetes.io/instance": name,
                   "app.kubernetes.io/managed-by": "pdd-operator"},
        "ownerReferences": [{"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
                             "name": name, "uid": obj["metadata"]["uid"],
                             "controller": True}]},
        "data": {"routing.json": "{}"}})
    patch_spec(kube, ns, name, {"decode": {"tensorParallelSize": 2,
                                           "decodeContextParallelSize": 2}})
    wait_ready(kube, ns, name, operator)
    new = routing_cm(kube, ns, name)
    assert new["metadata"]["name"] != old["metadata"]["name"]
    assert new["metadata"]["labels"][keys.LABEL_PLAN_HASH] in new["metadata"]["name"]
    for p in pods_of(kube, ns, name):
        vols = {v["name"]: v for v in p["spec"]["volumes"]}
        assert vols["routing"]["configMap"]["name"] == new["metadata"]["name"]
        assert p["metadata"]["labels"][keys.LABEL_PLAN_HASH] == new["metadata"]["labels"][
            keys.LABEL_PLAN_HASH]

    def routing_cms() -> list[str]:
        items = kube.json("get", "configmaps", "-n", ns, "-l",
                          f"app.kubernetes.io/instance={name}")["items"]
        return sorted(c["metadata"]["name"] for c in items)

    wait_for("old and legacy routing ConfigMaps pruned",
             lambda: routing_cms() == [new["metadata"]["name"]], timeout=60)
    delete_and_wait(kube, ns, name)
