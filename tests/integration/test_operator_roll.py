"""Plan-changing rolls against the local control plane: every pod event of the deployment, as
the API server streams it, is checked for the roll's ordering (no sampling gaps).

Each test gets a fake node of its own (tainted, so no other test's pods land there; the roles
tolerate the taint and select the node), sized so that a surge pod per role fits or does not:
the operator counts free GPUs only on nodes the pods may use."""

from __future__ import annotations

import copy
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config, watch
from localcluster import Cluster, _node_body
from operator_fixtures import (  # noqa: F401  (fixtures)
    Kubectl,
    NodeHeartbeat,
    Operator,
    events_of,
    kube,
    op_namespace,
    operator,
    pods_of,
    wait_for,
    wait_ready,
)

from pdd_api import keys

pytestmark = pytest.mark.integration
TAINT_KEY = "pdd.dev/roll-test"


def spec_for(node: str) -> dict[str, Any]:
    pin = {"nodeSelector": {TAINT_KEY: node},
           "tolerations": [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]}
    return {
        "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"},
        "image": "pdd:0.1.0",
        "blockSize": 64,
        "rollout": {"maxUnavailable": 1},
        "prefill": {"replicas": 2, "tensorParallelSize": 1, "decodeContextParallelSize": 1,
                    **copy.deepcopy(pin)},
        "decode": {"replicas": 2, "tensorParallelSize": 1, "decodeContextParallelSize": 1,
                   **copy.deepcopy(pin)},
    }


class Node:
    """A kwok node of `gpus` GPUs only the test's pods can use, with its heartbeat."""

    def __init__(self, cluster: Cluster, kube: Kubectl, gpus: int) -> None:
        self.kube = kube
        self.name = f"roll-{uuid.uuid4().hex[:6]}"
        body = _node_body(self.name, gpus)
        body["metadata"]["labels"][TAINT_KEY] = self.name
        body["spec"] = {"taints": [{"key": TAINT_KEY, "value": self.name,
                                    "effect": "NoSchedule"}]}
        kube("create", "-f", "-", input=json.dumps(body))
        wait_for(f"node {self.name} Ready", self.ready, timeout=60)
        self.beat = NodeHeartbeat(str(cluster.kubeconfig))

    def ready(self) -> bool:
        node = self.kube.maybe("get", "node", self.name)
        conds = ((node or {}).get("status") or {}).get("conditions") or []
        alloc = ((node or {}).get("status") or {}).get("allocatable") or {}
        return "nvidia.com/gpu" in alloc and any(
            c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def delete(self) -> None:
        self.beat.stop.set()
        self.kube("delete", "node", self.name, "--wait=false", check=False)


@pytest.fixture
def node_factory(cluster: Cluster, kube: Kubectl) -> Iterator[Any]:
    made: list[Node] = []

    def make(gpus: int) -> Node:
        made.append(Node(cluster, kube, gpus))
        return made[-1]

    yield make
    for n in made:
        n.delete()


class PodLog:
    """Every event of the deployment's pods, with the state of all of them after it."""

    def __init__(self, cluster: Cluster, ns: str, name: str) -> None:
        self.api = client.CoreV1Api(config.new_client_from_config(str(cluster.kubeconfig)))
        self.ns = ns
        self.selector = f"app.kubernetes.io/instance={name}"
        self.pods: dict[str, dict[str, Any]] = {}
        self.steps: list[tuple[str, str, dict[str, dict[str, Any]]]] = []
        self.stop = threading.Event()
        self.w = watch.Watch()
        listed = self.api.list_namespaced_pod(ns, label_selector=self.selector)
        for p in listed.items:
            self._see("LISTED", p)
        self.steps = self.steps[-1:]  # the state once every listed pod is known
        self.thread = threading.Thread(
            target=self._run, args=(listed.metadata.resource_version,), daemon=True)
        self.thread.start()

    def _see(self, etype: str, pod: Any) -> None:
        labels = pod.metadata.labels or {}
        if labels.get("app.kubernetes.io/component") not in ("prefill", "decode"):
            return
        name = pod.metadata.name
        if etype == "DELETED":
            self.pods.pop(name, None)
        else:
            ready = any(c.type == "Ready" and c.status == "True"
                        for c in (pod.status.conditions or []))
            before = self.pods.get(name)
            served = ready or bool(before and before["uid"] == pod.metadata.uid
                                   and before["served"])
            self.pods[name] = {
                "uid": pod.metadata.uid,
                "served": served,  # this pod was Ready once: it may hold KV of its requests
                "role": labels["app.kubernetes.io/component"],
                "plan": labels.get(keys.LABEL_PLAN_HASH),
                "surge": labels.get(keys.LABEL_SURGE) == "true",
                "ready": ready and pod.metadata.deletion_timestamp is None,
                "terminating": pod.metadata.deletion_timestamp is not None,
            }
        self.steps.append((etype, name, copy.deepcopy(self.pods)))

    def _run(self, rv: str) -> None:
        try:
            for ev in self.w.stream(self.api.list_namespaced_pod, self.ns,
                                    label_selector=self.selector, resource_version=rv,
                                    timeout_seconds=300):
                self._see(ev["type"], ev["object"])
                if self.stop.is_set():
                    break
        except Exception:  # noqa: BLE001 - close() ends the stream mid-read
            if not self.stop.is_set():
                raise

    def close(self) -> None:
        self.stop.set()
        self.w.stop()


def ready_pairs(state: dict[str, dict[str, Any]]) -> set[str]:
    ready = {r: {p["plan"] for p in state.values() if p["role"] == r and p["ready"]}
             for r in ("prefill", "decode")}
    return ready["prefill"] & ready["decode"]


def describe(steps: list[tuple[str, str, dict[str, dict[str, Any]]]]) -> str:
    return "\n".join(
        f"{etype:8} {name:28} " + " ".join(
            f"{p['role'][0].upper()}{n.rsplit('-', 1)[-1]}:{p['plan'][:4]}"
            f"{'R' if p['ready'] else ''}"
            f"{'T' if p['terminating'] else ''}" for n, p in sorted(state.items()))
        for etype, name, state in steps)


def roll(cluster: Cluster, kube: Kubectl, operator: Operator, ns: str, name: str,
         node: Node) -> tuple[str, str, list[tuple[str, str, dict[str, dict[str, Any]]]]]:
    kube.apply({"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
                "metadata": {"name": name}, "spec": spec_for(node.name)}, "-n", ns)
    wait_ready(kube, ns, name, operator, timeout=120)
    old_plan = pods_of(kube, ns, name)[0]["metadata"]["labels"][keys.LABEL_PLAN_HASH]
    log = PodLog(cluster, ns, name)
    try:
        kube("patch", "pddeployment", name, "-n", ns, "--type=merge", "-p",
             json.dumps({"spec": {"blockSize": 32}}))  # a new routing plan, same pods' GPUs
        wait_ready(kube, ns, name, operator, timeout=180)
        wait_for("only the replicas left", lambda: sorted(
            p["metadata"]["name"] for p in pods_of(kube, ns, name)) == sorted(
            f"{name}-{r}-{i}" for r in ("prefill", "decode") for i in range(2)), timeout=60)
    finally:
        log.close()
    new_plan = pods_of(kube, ns, name)[0]["metadata"]["labels"][keys.LABEL_PLAN_HASH]
    assert new_plan != old_plan
    assert {p["metadata"]["labels"][keys.LABEL_PLAN_HASH] for p in pods_of(kube, ns, name)} == {
        new_plan}
    steps = log.steps

    def story() -> str:
        """The pod events, the deployment's events and what the operator logged: why a pod
        went is in the last two."""
        events = "\n".join(f"{e.get('lastTimestamp')} {e['reason']}: {e['message']}"
                           for e in events_of(kube, ns, name))
        others = []
        for component in ("controller-manager", "scheduler", "kwok"):
            path = cluster.state_dir / f"{component}.log"
            lines = path.read_text(errors="replace").splitlines() if path.exists() else []
            others += [f"[{component}] {line[:400]}" for line in lines
                       if f"{name}-prefill" in line or f"{name}-decode" in line][-40:]
        return (f"{describe(steps)}\n--- events\n{events}\n--- operator log\n"
                + "\n".join(operator.log_path.read_text(errors="replace").splitlines()[-150:])
                + "\n--- cluster logs\n" + "\n".join(others))

    # Never a moment without a Ready pair of one plan (there was one before the change).
    assert ready_pairs(steps[0][2]) == {old_plan}, story()
    for i, (_, _, state) in enumerate(steps):
        assert ready_pairs(state), f"no Ready pair at step {i}:\n{story()}"
        # A terminating prefill that served still hands its last KV to a decode of its plan
        # (one never Ready took no request). kwok removes a terminating pod by name, without a
        # uid precondition, and at times twice: the second removal can hit the replacement the
        # operator just created under that name, before it was Ready (it is created again).
        draining = {p["plan"] for p in state.values() if p["role"] == "prefill"
                    and p["terminating"] and p["served"]}
        serving = {p["plan"] for p in state.values() if p["role"] == "decode" and p["ready"]}
        assert draining <= serving, f"step {i}:\n{story()}"
    return old_plan, new_plan, steps


def first(steps: list[tuple[str, str, dict[str, dict[str, Any]]]], pred: Any) -> int:
    return next((i for i, (e, n, s) in enumerate(steps) if pred(e, n, s)), len(steps))


def test_plan_change_with_room_surges_a_new_pair_first(
        cluster: Cluster, kube: Kubectl, operator: Operator, op_namespace: str,
        node_factory: Any) -> None:
    ns, name = op_namespace, "surge"
    node = node_factory(6)  # 4 used by the replicas, 2 free: one more pod per role
    old, new, steps = roll(cluster, kube, operator, ns, name, node)

    def old_going(e: str, n: str, s: dict[str, dict[str, Any]]) -> bool:
        return any(p["terminating"] and p["plan"] == old for p in s.values())

    first_delete = first(steps, old_going)
    surge_seen = first(steps, lambda e, n, s: any(p["surge"] for p in s.values()))
    new_pair = first(steps, lambda e, n, s: new in ready_pairs(s))
    assert surge_seen < new_pair <= first_delete < len(steps), describe(steps)
    surge_names = {n for _, _, s in steps for n, p in s.items() if p["surge"]}
    assert surge_names == {f"{name}-prefill-surge", f"{name}-decode-surge"}
    reasons = [e["message"] for e in events_of(kube, ns, name) if e["reason"] == "PlanRoll"]
    assert any("surge" in m for m in reasons), reasons


def test_plan_change_without_room_replaces_role_by_role(
        cluster: Cluster, kube: Kubectl, operator: Operator, op_namespace: str,
        node_factory: Any) -> None:
    ns, name = op_namespace, "nosurge"
    node = node_factory(4)  # the replicas use all of it
    old, new, steps = roll(cluster, kube, operator, ns, name, node)
    assert not any(p["surge"] for _, _, s in steps for p in s.values()), describe(steps)

    def decode_going(e: str, n: str, s: dict[str, dict[str, Any]]) -> bool:
        return any(p["terminating"] and p["role"] == "decode" and p["plan"] == old
                   for p in s.values())

    def new_prefill_ready(e: str, n: str, s: dict[str, dict[str, Any]]) -> bool:
        return any(p["ready"] and p["role"] == "prefill" and p["plan"] == new
                   for p in s.values())

    assert first(steps, new_prefill_ready) < first(steps, decode_going) < len(steps), (
        describe(steps))
    reasons = [e["message"] for e in events_of(kube, ns, name) if e["reason"] == "PlanRoll"]
    assert any("role by role" in m and "no room" in m for m in reasons), reasons
