"""Multi-node instances on the local control plane (docs/lws.md): a role whose TP spans pods
runs as a LeaderWorkerSet, whose controller (started here on the shared cluster when it is not
running yet) creates the leader and worker pods, kwok runs them, LWS's pod webhook gives them
its env, and the PDDeployment's status follows group readiness. Without the CRD (hidden by a
proxy) the PDDeployment says which CRD is missing."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hiding_proxy import HidingProxy
from localcluster import DEFAULT_BIN_DIR, Cluster, _env_path, ensure_lws
from operator_fixtures import (  # noqa: F401  (fixtures)
    REPO_ROOT,
    Kubectl,
    Operator,
    conditions,
    env_of,
    kube,
    make_namespace,
    op_namespace,
    operator,
    pdd,
    teardown_namespace,
    wait_for,
    wait_ready,
)

from pdd_operator import builders_lws as bl

pytestmark = pytest.mark.integration

EXAMPLE = REPO_ROOT / "manifests/examples/multinode/deepseek-v3-2x8.yaml"
NAME = "mn"
DOC: dict[str, Any] = {
    "apiVersion": "serving.pdd.dev/v1alpha1",
    "kind": "PDDeployment",
    "metadata": {"name": NAME},
    "spec": {
        "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"},
        "image": "pdd:0.1.0",
        "prefill": {"replicas": 1, "tensorParallelSize": 4, "decodeContextParallelSize": 4,
                    "gpusPerPod": 2},
        "decode": {"replicas": 1, "tensorParallelSize": 2, "decodeContextParallelSize": 2},
    },
}
TEST_POOL = "pdd.dev/lws-test"


@pytest.fixture(scope="module")
def lws(cluster: Cluster) -> Cluster:
    """The LeaderWorkerSet controller on the session's cluster (started once, left running:
    other modules may share the cluster and `down` stops it with the rest)."""
    return ensure_lws(cluster.state_dir, _env_path("PDD_CLUSTER_BIN", DEFAULT_BIN_DIR),
                      log=lambda _m: None)


def lws_pods(kube: Kubectl, ns: str, lws_name: str) -> list[dict[str, Any]]:
    items = kube.json("get", "pods", "-n", ns, "-l", f"{bl.LWS_LABEL_NAME}={lws_name}")["items"]
    return sorted(items, key=lambda p: p["metadata"]["name"])


def running(pods: list[dict[str, Any]], count: int) -> list[dict[str, Any]] | None:
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    ok = len(live) == count and all(p["status"].get("phase") == "Running" for p in live)
    return live if ok else None


def test_spanning_role_runs_as_one_lws_group_with_lws_env(
        lws: Cluster, kube: Kubectl, operator: Operator, op_namespace: str) -> None:
    ns = op_namespace
    kube.apply(DOC, "-n", ns)
    obj = wait_ready(kube, ns, NAME, operator, timeout=120)

    group = kube.json("get", "leaderworkerset", f"{NAME}-prefill", "-n", ns)
    owner = group["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "PDDeployment", NAME, obj["metadata"]["uid"], True)
    assert group["spec"]["replicas"] == 1
    assert group["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert group["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert kube("get", "leaderworkerset", f"{NAME}-decode", "-n", ns,
                check=False).returncode != 0  # one pod per decode instance: no LWS

    pods = running(lws_pods(kube, ns, f"{NAME}-prefill"), 2)
    assert pods is not None, json.dumps(lws_pods(kube, ns, f"{NAME}-prefill"), indent=1)[:3000]
    leader, worker = pods
    assert [leader["metadata"]["name"], worker["metadata"]["name"]] == [
        f"{NAME}-prefill-0", f"{NAME}-prefill-0-1"]
    for index, pod in enumerate(pods):
        assert pod["spec"]["subdomain"] == f"{NAME}-prefill"
        assert pod["spec"]["hostname"] == pod["metadata"]["name"]
        labels = pod["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == "prefill"
        assert labels[bl.LWS_LABEL_WORKER_INDEX] == str(index)
        assert "serving.pdd.dev/replica" not in labels
        c = pod["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "2"
        env = env_of(pod)
        # Injected by LWS's pod webhook (registered by URL on 127.0.0.1).
        assert env["LWS_LEADER_ADDRESS"] == f"{NAME}-prefill-0.{NAME}-prefill.{ns}"
        assert env["LWS_GROUP_SIZE"] == "2"
        assert env["LWS_WORKER_INDEX"] == str(index)
        assert env["PDD_RANKS_PER_POD"] == "2"
        assert env["PDD_TP_SIZE"] == "4"
        assert env["PDD_DIST_PORT"] == str(bl.DIST_PORT)
        assert env["PDD_REPLICA"] == {"fieldRef": {
            "apiVersion": "v1", "fieldPath": f"metadata.labels['{bl.LWS_LABEL_GROUP_INDEX}']"}}
    assert "dist" in {p["name"] for p in leader["spec"]["containers"][0]["ports"]}

    # The role Service is the operator's and publishes every pod of the group (DNS names of
    # workers' side channels); the router addresses the leader by the one-pod name.
    svc = kube.json("get", "service", f"{NAME}-prefill", "-n", ns)
    assert svc["metadata"]["ownerReferences"][0]["kind"] == "PDDeployment"

    def published() -> set[str]:
        slices = kube.json("get", "endpointslices", "-n", ns, "-l",
                           f"kubernetes.io/service-name={NAME}-prefill")["items"]
        return {ip for s in slices for e in s.get("endpoints") or []
                for ip in e.get("addresses") or []}

    wait_for("both prefill pods behind the role Service",
             lambda: published() >= {p["status"]["podIP"] for p in pods})
    router = kube.json("get", "deployment", NAME, "-n", ns)
    renv = env_of({"spec": router["spec"]["template"]["spec"]})
    assert f"http://{NAME}-prefill-0.{NAME}-prefill.{ns}.svc:8000" in renv["PDD_PREFILL_URLS"]

    status = obj["status"]
    assert {k: status["prefill"][k] for k in ("replicas", "readyReplicas", "updatedReplicas")} \
        == {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
    # The scale selector names one pod per instance (the leaders), as for one-pod roles.
    selected = kube.json("get", "pods", "-n", ns, "-l", status["prefill"]["selector"])["items"]
    assert [p["metadata"]["name"] for p in selected] == [f"{NAME}-prefill-0"]
    conds = conditions(obj)
    assert conds["PrefillAvailable"]["status"] == "True", conds
    assert conds["PrefillAvailable"]["reason"] == "AllReplicasReady", conds
    table = kube("get", "pdd", NAME, "-n", ns).stdout.splitlines()
    assert table[0].split() == ["NAME", "P-TP", "P-DCP", "D-TP", "D-DCP", "CASE", "READY", "AGE"]
    assert table[1].split()[:7] == [NAME, "4", "4", "2", "2", "sharded-to-sharded", "True"]


def test_a_deleted_worker_pod_recreates_its_whole_group(
        lws: Cluster, kube: Kubectl, operator: Operator, op_namespace: str) -> None:
    """RecreateGroupOnPodRestart: the ranks of an instance share collectives, so LWS replaces
    the leader too when a worker goes; the PDDeployment is Ready again on the new group. The
    controller is paused for 2 s across the delete, as a busy one lags: LWS acts on a worker it
    sees terminating, so the fake node must keep it a while, as a kubelet does
    (localcluster.LWS_POD_TERMINATION_MS); deleted at once, the group was never recreated."""
    ns = op_namespace
    before = {p["metadata"]["name"]: p["metadata"]["uid"]
              for p in lws_pods(kube, ns, f"{NAME}-prefill")}
    assert sorted(before) == [f"{NAME}-prefill-0", f"{NAME}-prefill-0-1"]
    controller = lws.processes["lws"].pid
    os.kill(controller, signal.SIGSTOP)
    try:
        kube("delete", "pod", f"{NAME}-prefill-0-1", "-n", ns, "--wait=false")
        time.sleep(2)
    finally:
        os.kill(controller, signal.SIGCONT)
    seen: list[tuple[str, str, str, bool]] = []

    def regrouped() -> list[dict[str, Any]] | None:
        pods = lws_pods(kube, ns, f"{NAME}-prefill")
        seen[:] = [(p["metadata"]["name"], p["status"].get("phase", ""),
                    "same uid" if p["metadata"]["uid"] in before.values() else "new uid",
                    bool(p["metadata"].get("deletionTimestamp"))) for p in pods]
        live = running(pods, 2)
        return live if live and all(p["metadata"]["uid"] not in before.values()
                                    for p in live) else None

    try:
        pods = wait_for("a new leader and worker Running", regrouped, timeout=90)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\npods (name, phase, uid, terminating): {seen}") from None
    assert [p["metadata"]["name"] for p in pods] == sorted(before)
    events = kube.json("get", "events", "-n", ns, "--field-selector",
                       f"involvedObject.kind=LeaderWorkerSet,involvedObject.name={NAME}-prefill"
                       )["items"]
    assert any(e["reason"] == "RecreateGroupOnPodRestart" for e in events), [
        e["reason"] for e in events]
    obj = wait_ready(kube, ns, NAME, operator, timeout=90)
    assert obj["status"]["prefill"]["readyReplicas"] == 1


def test_groups_scale_and_roll_with_the_spec(lws: Cluster, kube: Kubectl, operator: Operator,
                                            op_namespace: str) -> None:
    ns = op_namespace
    kube("patch", "pddeployment", NAME, "-n", ns, "--type=merge",
         "-p", '{"spec": {"prefill": {"replicas": 2}, "image": "pdd:0.1.1"}}')
    obj = wait_ready(kube, ns, NAME, operator, timeout=150)
    assert {k: obj["status"]["prefill"][k] for k in ("replicas", "readyReplicas",
                                                     "updatedReplicas")} == {
        "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}
    group = kube.json("get", "leaderworkerset", f"{NAME}-prefill", "-n", ns)
    digest = group["metadata"]["annotations"]["serving.pdd.dev/spec-hash"]
    pods = wait_for("4 prefill pods on the new template", lambda: running(
        [p for p in lws_pods(kube, ns, f"{NAME}-prefill")
         if p["metadata"]["annotations"].get("serving.pdd.dev/spec-hash") == digest], 4),
        timeout=90)
    assert [p["metadata"]["name"] for p in pods] == [
        f"{NAME}-prefill-0", f"{NAME}-prefill-0-1", f"{NAME}-prefill-1", f"{NAME}-prefill-1-1"]
    assert {p["spec"]["containers"][0]["image"] for p in pods} == {"pdd:0.1.1"}
    assert env_of(pods[3])["LWS_LEADER_ADDRESS"] == f"{NAME}-prefill-1.{NAME}-prefill.{ns}"


def test_deleting_the_pddeployment_collects_the_lws_and_its_pods(
        lws: Cluster, kube: Kubectl, operator: Operator, op_namespace: str) -> None:
    ns = op_namespace
    assert kube("get", "leaderworkerset", f"{NAME}-prefill", "-n", ns,
                check=False).returncode == 0
    kube("delete", "pddeployment", NAME, "-n", ns, "--timeout=60s")
    wait_for("LeaderWorkerSet garbage-collected", lambda: kube(
        "get", "leaderworkerset", f"{NAME}-prefill", "-n", ns,
        check=False).returncode != 0, timeout=60)
    wait_for("its pods gone", lambda: lws_pods(kube, ns, f"{NAME}-prefill") == [], timeout=90)


def test_a_role_switches_between_one_pod_and_an_lws_both_ways(
        lws: Cluster, kube: Kubectl, operator: Operator, op_namespace: str) -> None:
    ns, name = op_namespace, "sw"
    doc = copy.deepcopy(DOC)
    doc["metadata"]["name"] = name
    doc["spec"]["prefill"] = {"replicas": 1, "tensorParallelSize": 2,
                              "decodeContextParallelSize": 2}
    kube.apply(doc, "-n", ns)
    wait_ready(kube, ns, name, operator, timeout=120)
    assert lws_pods(kube, ns, f"{name}-prefill") == []
    kube("patch", "pddeployment", name, "-n", ns, "--type=merge",
         "-p", '{"spec": {"prefill": {"gpusPerPod": 1}}}')
    wait_ready(kube, ns, name, operator, timeout=150)
    assert running(lws_pods(kube, ns, f"{name}-prefill"), 2) is not None
    kube("patch", "pddeployment", name, "-n", ns, "--type=json",
         "-p", '[{"op": "remove", "path": "/spec/prefill/gpusPerPod"}]')
    obj = wait_ready(kube, ns, name, operator, timeout=150)
    wait_for("the LWS gone", lambda: kube("get", "leaderworkerset", f"{name}-prefill", "-n", ns,
                                          check=False).returncode != 0, timeout=60)
    pod = kube.json("get", "pod", f"{name}-prefill-0", "-n", ns)
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "PDDeployment"
    assert pod["metadata"]["labels"]["serving.pdd.dev/replica"] == "0"
    assert obj["status"]["prefill"]["readyReplicas"] == 1
    kube("delete", "pddeployment", name, "-n", ns, "--timeout=60s")


def test_a_routing_plan_change_rolls_the_lws_and_the_one_pod_role(
        lws: Cluster, kube: Kubectl, operator: Operator, op_namespace: str) -> None:
    """blockSize changes the plan: the LWS groups roll through LWS, the decode pod through the
    operator, and the PDDeployment is Ready on the new plan (no surge pod for an LWS role)."""
    ns, name = op_namespace, "pc"
    doc = copy.deepcopy(DOC)
    doc["metadata"]["name"] = name
    kube.apply(doc, "-n", ns)
    wait_ready(kube, ns, name, operator, timeout=120)
    kube("patch", "pddeployment", name, "-n", ns, "--type=merge",
         "-p", '{"spec": {"blockSize": 128}}')
    wait_ready(kube, ns, name, operator, timeout=150)
    plan = kube.json("get", "leaderworkerset", f"{name}-prefill", "-n", ns)["metadata"][
        "labels"]["serving.pdd.dev/plan-hash"]
    pods = wait_for("groups and the decode pod on the new plan", lambda: running(
        [p for p in lws_pods(kube, ns, f"{name}-prefill")
         if p["metadata"]["labels"]["serving.pdd.dev/plan-hash"] == plan], 2), timeout=60)
    assert env_of(pods[0])["PDD_BLOCK_SIZE"] == "128"
    decode = kube.json("get", "pod", f"{name}-decode-0", "-n", ns)
    assert decode["metadata"]["labels"]["serving.pdd.dev/plan-hash"] == plan
    assert kube("get", "pod", f"{name}-prefill-surge", "-n", ns, check=False).returncode != 0
    assert "Traceback" not in operator.log(10_000), operator.log(200)
    kube("delete", "pddeployment", name, "-n", ns, "--timeout=60s")


def test_cel_and_pdd_validate_refuse_a_gpus_per_pod_that_does_not_divide_tp(
        lws: Cluster, kube: Kubectl, op_namespace: str, tmp_path: Path) -> None:
    bad = copy.deepcopy(DOC)
    bad["metadata"]["name"] = "mn-bad"
    bad["spec"]["prefill"]["gpusPerPod"] = 3
    message = "spec.prefill.gpusPerPod: must divide tensorParallelSize (4), got 3"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    pdd_cli = Path(sys.executable).with_name("pdd")
    cli = subprocess.run([str(pdd_cli), "validate", "-f", str(path)], capture_output=True,
                         text=True, check=False)
    assert cli.returncode == 1 and message in cli.stderr, cli.stderr
    server = kube("apply", "--dry-run=server", "-n", op_namespace, "-f", str(path), check=False)
    assert server.returncode != 0 and message in server.stderr, server.stderr

    # A name that fits one-pod instances but not an LWS's pod labels (42 characters).
    long = copy.deepcopy(DOC)
    long["metadata"]["name"] = "m" * 42
    message = (f"metadata.name: must be at most 41 characters when a role spans pods (gpusPerPod "
               "below tensorParallelSize: LeaderWorkerSet pods carry it in 63-character "
               f"labels), got '{'m' * 42}'")
    path.write_text(yaml.safe_dump(long))
    cli = subprocess.run([str(pdd_cli), "validate", "-f", str(path)], capture_output=True,
                         text=True, check=False)
    assert cli.returncode == 1 and message in cli.stderr, cli.stderr
    server = kube("apply", "--dry-run=server", "-n", op_namespace, "-f", str(path), check=False)
    assert server.returncode != 0 and message in server.stderr, server.stderr
    long["spec"]["prefill"].pop("gpusPerPod")
    path.write_text(yaml.safe_dump(long))
    assert kube("apply", "--dry-run=server", "-n", op_namespace, "-f", str(path),
                check=False).returncode == 0


def test_without_the_lws_crd_ready_is_false_naming_it(
        lws: Cluster, cluster: Cluster, kube: Kubectl, tmp_path: Path) -> None:
    proxy = HidingProxy(cluster.kubeconfig, {bl.LWS_GROUP}).start()
    ns = make_namespace(kube, "oplws")
    op = Operator(cluster, ns, tmp_path / "op", webhook=False,
                  env={"KUBECONFIG": str(proxy.kubeconfig(tmp_path / "kubeconfig"))})
    try:
        op.start()
        kube.apply(DOC, "-n", ns)

        def stalled() -> dict[str, Any] | None:
            conds = conditions(pdd(kube, ns, NAME))
            ready = conds.get("Ready")
            return conds if ready and ready["reason"] == bl.MISSING_CRD_REASON else None

        conds = wait_for("Ready=False naming the missing CRD", stalled, timeout=60)
        assert conds["Ready"]["status"] == "False"
        assert bl.LWS_CRD in conds["Ready"]["message"], conds["Ready"]
        assert conds["Stalled"]["status"] == "True", conds
        # The roles that need no LWS are still created.
        wait_for("the decode pod", lambda: kube("get", "pod", f"{NAME}-decode-0", "-n", ns,
                                                check=False).returncode == 0)
        assert "Traceback" not in op.log(10_000)
        # The CRD appears (the proxy stops hiding it): the operator finds it and goes on.
        proxy.hidden = set()
        wait_ready(kube, ns, NAME, op, timeout=150)
        assert running(lws_pods(kube, ns, f"{NAME}-prefill"), 2) is not None
    finally:
        teardown_namespace(kube, ns, op)
        proxy.stop()


@pytest.fixture
def test_pool(lws: Cluster, kube: Kubectl) -> Iterator[list[str]]:
    """Four 8-GPU fake nodes of the example's own, tainted so no other test's pods land there
    (the shared cluster's GPUs may be in use by them)."""
    from localcluster import _node_body

    names = [f"lws-gpu-{i}-{os.getpid()}" for i in range(4)]
    for n in names:
        body = _node_body(n, 8)
        body["metadata"]["labels"][TEST_POOL] = "true"
        body["metadata"]["labels"]["type"] = "kwok-lws-test"  # not counted as the cluster's
        body["spec"] = {"taints": [{"key": TEST_POOL, "value": "true", "effect": "NoSchedule"}]}
        kube.apply(body)
    yield names
    kube("delete", "node", *names, "--wait=false", check=False)


def test_deepseek_v3_2x8_example_runs_two_groups_of_two_8_gpu_pods(
        lws: Cluster, kube: Kubectl, test_pool: list[str], tmp_path: Path) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    for role in ("prefill", "decode"):
        doc["spec"][role]["nodeSelector"] = {TEST_POOL: "true"}
        doc["spec"][role]["tolerations"] = [{"key": TEST_POOL, "operator": "Exists",
                                             "effect": "NoSchedule"}]
    ns = make_namespace(kube, "oplwsx")
    op = Operator(kube.cluster, ns, tmp_path / "op", webhook=False)
    name = doc["metadata"]["name"]
    try:
        op.start()
        kube.apply(doc, "-n", ns)
        wait_ready(kube, ns, name, op, timeout=150)
        for role in ("prefill", "decode"):
            seen = lws_pods(kube, ns, f"{name}-{role}")
            pods = running(seen, 2)
            assert pods is not None, json.dumps([(p["metadata"]["name"], p["status"])
                                                 for p in seen], indent=1)[:4000]
            assert [p["metadata"]["name"] for p in pods] == [f"{name}-{role}-0",
                                                            f"{name}-{role}-0-1"]
            assert {p["spec"]["nodeName"] for p in pods} <= set(test_pool)
            for p in pods:
                c = p["spec"]["containers"][0]
                assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
                assert env_of(p)["PDD_TP_SIZE"] == "16"
                assert env_of(p)["LWS_GROUP_SIZE"] == "2"
                assert {"name": "models", "mountPath": "/models", "readOnly": True} in c[
                    "volumeMounts"]
        # 32 GPUs on four 8-GPU nodes: every pod has a node of its own.
        placed = [p["spec"]["nodeName"] for r in ("prefill", "decode")
                  for p in lws_pods(kube, ns, f"{name}-{r}")]
        assert sorted(placed) == sorted(test_pool)
    finally:
        teardown_namespace(kube, ns, op)
