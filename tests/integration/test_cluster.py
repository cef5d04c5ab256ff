"""The local control plane behaves like a cluster the operator can rely on: GPU nodes,
real scheduling by extended resources, pods turning Running, and garbage collection."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from localcluster import Cluster
from polling import wait_for

pytestmark = pytest.mark.integration




@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"it-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    # Pods are refused until the service-account controller creates "default" here.
    wait_for(
        f"service account {name}/default",
        lambda: cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def gpu_pod(name: str, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    # kwok never pulls images; the name only has to be valid.
                    "image": "registry.invalid/pdd/sleep:1",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ]
        },
    }


def get_pod(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    return cluster.kubectl_json("get", "pod", name, "-n", ns)


def test_server_reports_real_version(cluster: Cluster) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]
    assert version["gitVersion"].startswith("v1.")
    assert version["gitVersion"] != "v0.0.0-master+$Format:%H$"
    assert version["major"] == "1" and version["minor"] == version["gitVersion"].split(".")[1]


def test_nodes_are_ready_with_gpus(cluster: Cluster) -> None:
    nodes = cluster.kubectl_json("get", "nodes", "-l", "type=kwok")["items"]
    assert len(nodes) >= 1
    for node in nodes:
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
        assert int(node["status"]["allocatable"]["nvidia.com/gpu"]) >= 4
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", node["status"]["conditions"]


def test_gpu_pod_is_scheduled_and_runs(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(gpu_pod("fits", 4)))

    def running() -> dict[str, Any] | None:
        pod = get_pod(cluster, namespace, "fits")
        return pod if pod["status"].get("phase") == "Running" else None

    pod = wait_for("pod fits to be Running", running)
    node = cluster.kubectl_json("get", "node", pod["spec"]["nodeName"])
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    assert all(s["ready"] for s in pod["status"]["containerStatuses"])


def test_pod_asking_more_gpus_than_any_node_stays_pending(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(gpu_pod("huge", 16)))

    def unschedulable() -> dict[str, Any] | None:
        pod = get_pod(cluster, namespace, "huge")
        for cond in pod["status"].get("conditions", []):
            if cond["type"] == "PodScheduled" and cond["status"] == "False":
                return cond
        return None

    cond = wait_for("the scheduler to give up on pod huge", unschedulable)
    assert cond["reason"] == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    pod = get_pod(cluster, namespace, "huge")
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")

    def failed_scheduling_event() -> bool:
        events = cluster.kubectl_json(
            "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=huge"
        )["items"]
        return any(e["reason"] == "FailedScheduling" for e in events)

    # Events are written asynchronously, shortly after the condition.
    wait_for("a FailedScheduling event for pod huge", failed_scheduling_event, 30)


def test_deleting_owner_deletes_owned_objects(cluster: Cluster, namespace: str) -> None:
    """The operator relies on owner references for cleanup; only kube-controller-manager's
    garbage collector makes that work."""
    owner = cluster.kubectl_json(
        "create", "configmap", "owner", "-n", namespace, "--from-literal=k=v"
    )
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    owned_cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "owned", "ownerReferences": [ref]},
        "data": {"k": "v"},
    }
    owned_pod = gpu_pod("owned-pod", 1)
    owned_pod["metadata"]["ownerReferences"] = [ref]
    for obj in (owned_cm, owned_pod):
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))
    # A dependent with an unrelated owner must survive: the collector follows UIDs, not names.
    survivor = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "survivor"},
        "data": {},
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(survivor))

    cluster.kubectl("delete", "configmap", "owner", "-n", namespace, "--cascade=background")

    def gone() -> bool:
        cm = cluster.kubectl("get", "configmap", "owned", "-n", namespace, check=False)
        pod = cluster.kubectl("get", "pod", "owned-pod", "-n", namespace, check=False)
        return "NotFound" in cm.stderr and "NotFound" in pod.stderr

    wait_for("the garbage collector to delete the owned ConfigMap and Pod", gone)
    cluster.kubectl("get", "configmap", "survivor", "-n", namespace)


def test_deployment_controller_chain(cluster: Cluster, namespace: str) -> None:
    """Deployment -> ReplicaSet -> Pods Running, and deleting the Deployment removes both
    generations below it (the router is a Deployment)."""
    cluster.kubectl(
        "create",
        "deployment",
        "router",
        "-n",
        namespace,
        "--image=registry.invalid/pdd/router:1",
        "--replicas=2",
    )
    wait_for(
        "deployment router to have 2 available replicas",
        lambda: (
            cluster.kubectl_json("get", "deployment", "router", "-n", namespace)["status"].get(
                "availableReplicas"
            )
            == 2
        ),
    )
    cluster.kubectl("delete", "deployment", "router", "-n", namespace, "--cascade=background")

    def emptied() -> bool:
        rs = cluster.kubectl_json("get", "replicasets", "-n", namespace)["items"]
        pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", "app=router")["items"]
        return not rs and not pods

    wait_for("ReplicaSet and Pods of the deleted Deployment to be collected", emptied, 90)
