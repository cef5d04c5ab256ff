"""Multi-node instances: a role whose TP spans pods renders a LeaderWorkerSet built from the
one-pod builder, and its status is read back in groups (docs/lws.md)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdd_api import keys
from pdd_api.validation import parse_spec, validate_document
from pdd_operator import builders_lws as bl
from pdd_operator.builders import Owner, build
from pdd_operator.conditions import role_condition

OWNER = Owner("v3", "ns1", "uid-1")
EXAMPLE = Path(__file__).resolve().parents[2] / "manifests/examples/multinode/deepseek-v3-2x8.yaml"
SPEC: dict[str, Any] = {
    "model": {"name": "deepseek-ai/DeepSeek-V3"},
    "image": "pdd:0.1.0",
    "prefill": {"replicas": 2, "tensorParallelSize": 4, "decodeContextParallelSize": 4,
                "gpusPerPod": 2, "env": [{"name": bl.ENV_RANKS_PER_POD, "value": "9"},
                                         {"name": "LOG", "value": "debug"}]},
    "decode": {"replicas": 1, "tensorParallelSize": 2, "decodeContextParallelSize": 2},
}


def desired(spec: dict[str, Any] | None = None) -> Any:
    parsed = parse_spec(copy.deepcopy(spec or SPEC))
    return bl.apply_lws(OWNER, parsed, build(OWNER, parsed))


def env(template: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom"))
            for e in template["spec"]["containers"][0]["env"]}


def test_spanning_role_becomes_one_lws_and_the_other_keeps_its_pods() -> None:
    d = desired()
    assert d.pods["prefill"] == {}
    assert sorted(d.pods["decode"]) == [0]
    [lws] = bl.lws_objects(d)
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert lws["metadata"]["name"] == "v3-prefill"
    assert lws["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert lws["metadata"]["labels"][keys.LABEL_COMPONENT] == "prefill"
    spec = lws["spec"]
    assert spec["replicas"] == 2
    assert spec["leaderWorkerTemplate"]["size"] == 2
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxUnavailable": 1,
                                                                    "maxSurge": 0}
    assert bl.lws_roles(d) == {"prefill"}


def test_templates_come_from_the_pod_builder_cut_per_pod() -> None:
    d = desired()
    [lws] = bl.lws_objects(d)
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    pod = build(OWNER, parse_spec(copy.deepcopy(SPEC))).pods["prefill"][0]
    for part in ("leaderTemplate", "workerTemplate"):
        t = tmpl[part]
        assert "hostname" not in t["spec"] and "subdomain" not in t["spec"]
        assert keys.LABEL_REPLICA not in t["metadata"]["labels"]
        assert t["metadata"]["labels"][keys.LABEL_PLAN_HASH] == pod["metadata"]["labels"][
            keys.LABEL_PLAN_HASH]
        main = t["spec"]["containers"][0]
        assert main["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert main["resources"]["requests"]["nvidia.com/gpu"] == "2"
        assert main["image"] == pod["spec"]["containers"][0]["image"]
        assert main["readinessProbe"] == pod["spec"]["containers"][0]["readinessProbe"]
        e = env(t)
        assert e[keys.ENV_TP_SIZE] == "4"
        assert e[bl.ENV_RANKS_PER_POD] == "2"  # the user's "9" is dropped: contract wins
        assert e["LOG"] == "debug"
        assert e[bl.ENV_DIST_PORT] == str(bl.DIST_PORT)
        assert e[keys.ENV_REPLICA] == {"fieldRef": {
            "apiVersion": "v1", "fieldPath": f"metadata.labels['{bl.LWS_LABEL_GROUP_INDEX}']"}}
        names = [x["name"] for x in main["env"]]
        assert len(names) == len(set(names))
        assert t["spec"]["volumes"] == pod["spec"]["volumes"]
        assert t["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH] == lws["metadata"][
            "annotations"][keys.ANNOTATION_SPEC_HASH]
    ports = {p["name"] for p in tmpl["leaderTemplate"]["spec"]["containers"][0]["ports"]}
    wports = {p["name"] for p in tmpl["workerTemplate"]["spec"]["containers"][0]["ports"]}
    assert ports - wports == {"dist"}
    assert {"http", "side-0", "side-3"} <= wports


def test_hash_follows_what_a_group_runs_not_the_counts() -> None:
    def digest(spec: dict[str, Any]) -> str:
        return str(bl.lws_objects(desired(spec))[0]["metadata"]["annotations"][
            keys.ANNOTATION_SPEC_HASH])

    base = digest(SPEC)
    scaled = copy.deepcopy(SPEC)
    scaled["prefill"]["replicas"] = 5
    scaled["rollout"] = {"maxUnavailable": 3}
    assert digest(scaled) == base
    assert bl.lws_objects(desired(scaled))[0]["spec"]["rolloutStrategy"][
        "rollingUpdateConfiguration"]["maxUnavailable"] == 3
    image = copy.deepcopy(SPEC)
    image["image"] = "pdd:0.2.0"
    assert digest(image) != base
    cut = copy.deepcopy(SPEC)
    cut["prefill"]["gpusPerPod"] = 1
    assert digest(cut) != base
    assert bl.lws_objects(desired(cut))[0]["spec"]["leaderWorkerTemplate"]["size"] == 4


def test_kv_memory_reaches_every_pod_of_a_group_and_the_host_tier_counts_its_ranks() -> None:
    spec = copy.deepcopy(SPEC)
    spec["prefill"].update({"gpuMemoryUtilization": 0.8, "kvCacheBlocks": 2048,
                            "hostKVCacheGiB": 4, "resources": {"limits": {"memory": "64Gi"}}})
    [lws] = bl.lws_objects(desired(spec))
    for part in ("leaderTemplate", "workerTemplate"):
        t = lws["spec"]["leaderWorkerTemplate"][part]
        e = env(t)
        assert (e[keys.ENV_GPU_MEMORY_UTILIZATION], e[keys.ENV_NUM_BLOCKS],
                e[keys.ENV_HOST_KV_CACHE_GIB]) == ("0.8", "2048", "4")
        # Two ranks per pod of the TP4 instance: 2 x 4 GiB on top of the 64Gi given.
        assert t["spec"]["containers"][0]["resources"]["limits"] == {
            "memory": "72Gi", "nvidia.com/gpu": "2"}
    before = lws["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH]
    spec["prefill"]["hostKVCacheGiB"] = 8
    [lws] = bl.lws_objects(desired(spec))
    assert lws["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH] != before  # groups roll


def test_a_group_pods_memory_limit_is_checked_against_its_own_ranks() -> None:
    doc = {"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
           "metadata": {"name": "v3"}, "spec": copy.deepcopy(SPEC)}
    doc["spec"]["prefill"].update({"hostKVCacheGiB": 4,
                                   "resources": {"limits": {"memory": "8Gi"}}})
    assert validate_document(doc) == []  # 2 ranks per pod: 8Gi holds 2 x 4 GiB
    doc["spec"]["prefill"]["resources"]["limits"]["memory"] = "7Gi"
    assert validate_document(doc) == [
        "spec.prefill.resources.limits.memory: 7Gi is less than the host KV cache needs "
        "(hostKVCacheGiB 4 × 2 ranks per pod = 8Gi)"]


@pytest.mark.parametrize("per_pod", [None, 4])
def test_one_pod_per_instance_renders_no_lws(per_pod: int | None) -> None:
    spec = copy.deepcopy(SPEC)
    spec["prefill"].pop("gpusPerPod")
    spec["prefill"].pop("env")
    if per_pod is not None:
        spec["prefill"]["gpusPerPod"] = per_pod
    d = desired(spec)
    assert bl.lws_objects(d) == []
    assert sorted(d.pods["prefill"]) == [0, 1]
    pod = d.pods["prefill"][0]
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert bl.ENV_RANKS_PER_POD not in env(pod)
    assert pod == build(OWNER, parse_spec(spec)).pods["prefill"][0]


def lws_pod(group: int, worker: int, digest: str, state: str = "ready") -> dict[str, Any]:
    name = f"v3-prefill-{group}" + (f"-{worker}" if worker else "")
    conditions = [{"type": "Ready", "status": "True" if state == "ready" else "False"}]
    if state == "unschedulable":
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                           "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."})
    return {"metadata": {"name": name, "uid": name, "labels": {
        bl.LWS_LABEL_NAME: "v3-prefill", bl.LWS_LABEL_GROUP_INDEX: str(group),
        bl.LWS_LABEL_WORKER_INDEX: str(worker)},
        "annotations": {keys.ANNOTATION_SPEC_HASH: digest}},
        "status": {"phase": "Running" if state != "unschedulable" else "Pending",
                   "conditions": conditions}}


def test_role_plan_counts_groups_and_names_the_pod_that_holds_one_back() -> None:
    [want] = bl.lws_objects(desired())
    digest = want["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH]
    have = {**want, "status": {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}}
    pods = [lws_pod(0, 0, digest), lws_pod(0, 1, digest), lws_pod(1, 0, digest),
            lws_pod(1, 1, digest, "unschedulable")]
    plan = bl.role_plan(want, have, pods)
    assert (plan.replicas, plan.ready, plan.updated, plan.outdated, plan.excess) == (2, 1, 2, 0, 0)
    ok, reason, message = role_condition("prefill", plan, 2, 1)
    assert ok and reason == "MinimumReplicasAvailable"
    assert "v3-prefill-1-1 is Pending (Unschedulable): 0/4 nodes" in message
    ok, reason, _ = role_condition("prefill", bl.role_plan(want, have, pods), 2, 2)
    assert ok


def test_role_plan_is_not_settled_while_a_leader_runs_an_older_template() -> None:
    [want] = bl.lws_objects(desired())
    digest = want["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH]
    # The LWS status may still describe the previous template: the leaders say otherwise.
    have = {**want, "status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}}
    pods = [lws_pod(0, 0, digest), lws_pod(0, 1, digest), lws_pod(1, 0, "old"),
            lws_pod(1, 1, "old")]
    plan = bl.role_plan(want, have, pods)
    assert (plan.ready, plan.updated, plan.outdated) == (2, 1, 1)
    assert not plan.settled
    ok, reason, message = role_condition("prefill", plan, 2, 1)
    assert ok and reason == "MinimumReplicasAvailable" and "1 outdated" in message


def test_role_plan_before_the_lws_exists_and_with_a_stale_status() -> None:
    [want] = bl.lws_objects(desired())
    plan = bl.role_plan(want, None, [])
    assert (plan.replicas, plan.ready, plan.create) == (0, 0, [])  # LWS creates, not us
    ok, reason, message = role_condition("prefill", plan, 2, 1)
    assert not ok and reason == "PodsStarting"
    assert "LeaderWorkerSet v3-prefill is being created" in message
    digest = want["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH]
    plan = bl.role_plan(want, {**want, "status": {}}, [lws_pod(0, 0, digest, "starting")])
    assert plan.create == []
    ok, reason, message = role_condition("prefill", plan, 2, 1)
    assert not ok and reason == "PodsStarting" and "group 1 (v3-prefill-1) is not created yet" \
        in message
    # readyReplicas says 2, only one leader is Ready now: the pods win.
    have = {**want, "status": {"replicas": 2, "readyReplicas": 2}}
    pods = [lws_pod(0, 0, digest), lws_pod(1, 0, digest, "starting")]
    assert bl.role_plan(want, have, pods).ready == 1
    # A group beyond the replicas (scale down in progress) is excess, not ready capacity.
    pods = [lws_pod(i, 0, digest) for i in range(3)]
    plan = bl.role_plan(want, {**want, "status": {"readyReplicas": 3}}, pods)
    assert (plan.replicas, plan.ready, plan.excess) == (3, 2, 1)


def test_missing_crd_names_the_crd_in_reason_and_message() -> None:
    status = {"conditions": [
        {"type": "Ready", "status": "False", "reason": "ReconcileError",
         "message": f"LeaderWorkerSet ns1/v3-prefill: {bl.missing_crd_message()}"},
        {"type": "Stalled", "status": "True", "reason": "ReconcileError",
         "message": f"LeaderWorkerSet ns1/v3-prefill: {bl.missing_crd_message()}"},
        {"type": "PrefillAvailable", "status": "False", "reason": "ReconcileError",
         "message": "x"}]}
    out = bl.mark_missing_crd(status)
    reasons = {c["type"]: c["reason"] for c in out["conditions"]}
    assert reasons == {"Ready": bl.MISSING_CRD_REASON, "Stalled": bl.MISSING_CRD_REASON,
                       "PrefillAvailable": "ReconcileError"}
    assert "leaderworkersets.leaderworkerset.x-k8s.io" in bl.missing_crd_message()


def test_deepseek_v3_example_is_two_lws_of_two_8_gpu_pods_per_instance() -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    assert validate_document(doc) == []
    d = desired(doc["spec"])
    assert d.pods == {"prefill": {}, "decode": {}}
    groups = {o["metadata"]["labels"][keys.LABEL_COMPONENT]: o for o in bl.lws_objects(d)}
    assert sorted(groups) == ["decode", "prefill"]
    for lws in groups.values():
        tmpl = lws["spec"]["leaderWorkerTemplate"]
        assert tmpl["size"] == 2
        for part in ("leaderTemplate", "workerTemplate"):
            main = tmpl[part]["spec"]["containers"][0]
            # 400Gi for the sidecar and its host KV tier on top: 8 GiB x 8 ranks of the pod.
            assert main["resources"] == {"limits": {"nvidia.com/gpu": "8", "memory": "464Gi"},
                                         "requests": {"nvidia.com/gpu": "8", "cpu": "32",
                                                      "memory": "464Gi"}}
            assert env(tmpl[part])[keys.ENV_HOST_KV_CACHE_GIB] == "8"
            assert env(tmpl[part])[keys.ENV_TP_SIZE] == "16"
            assert {"name": "models", "mountPath": "/models", "readOnly": True} in main[
                "volumeMounts"]
    assert d.plan.case == "sharded-to-sharded"


def test_scale_selector_of_an_lws_role_names_the_leaders() -> None:
    d = desired()
    sel = "app.kubernetes.io/name=pdd,app.kubernetes.io/instance=v3,app.kubernetes.io/component="
    status = {"prefill": {"selector": sel + "prefill"}, "decode": {"selector": sel + "decode"}}
    out = bl.leaders_only(status, d)
    assert out["prefill"]["selector"] == sel + f"prefill,{bl.LWS_LABEL_WORKER_INDEX}=0"
    assert out["decode"]["selector"] == sel + "decode"
