"""Pure builders for multi-node instances: a role whose TP spans pods (gpusPerPod below
tensorParallelSize) becomes one LeaderWorkerSet, one group per instance (docs/lws.md).

The group's pods come from the same pod builder as a one-pod instance, so everything a sidecar
is told (env, mounts, probes, security, the user's template) stays one definition; this module
only turns that pod into LWS templates and reads an LWS's status back as a role's counts.
"""

from __future__ import annotations

import copy

from pdd_api import keys
from pdd_api.models import GPU_RESOURCE, PDDeploymentSpec, RoleSpec, gpus_per_pod, pods_per_instance
from pdd_api.plan import RoutingPlan
from pdd_operator.builders import (
    Desired,
    Obj,
    Owner,
    Role,
    build_pod,
    labels,
    service_name,
)
from pdd_operator.hashing import content_hash
from pdd_operator.rollout import PodInfo, RolePlan, effective_max_unavailable, pod_info

LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_API_VERSION = f"{LWS_GROUP}/{LWS_VERSION}"
LWS_KIND = "LeaderWorkerSet"
LWS_PLURAL = "leaderworkersets"
LWS_CRD = f"{LWS_PLURAL}.{LWS_GROUP}"
# Labels the LWS controller puts on every pod of a group.
LWS_LABEL_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_LABEL_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_LABEL_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"

ENV_RANKS_PER_POD = keys.ENV_RANKS_PER_POD
ENV_DIST_PORT = keys.ENV_DIST_PORT
DIST_PORT = keys.DIST_PORT
LWS_ENV = frozenset({ENV_RANKS_PER_POD, ENV_DIST_PORT, keys.ENV_LWS_LEADER_ADDRESS,
                     keys.ENV_LWS_GROUP_SIZE, keys.ENV_LWS_WORKER_INDEX})


def uses_lws(role: RoleSpec) -> bool:
    return pods_per_instance(role) > 1


def lws_name(owner_name: str, role: str) -> str:
    """The role's Service name too: LWS names the leader of group i `<lws>-<i>` and gives every
    pod the subdomain `<lws>`, so leaders keep the DNS names of one-pod instances."""
    return service_name(owner_name, role)


def is_lws_pod(pod: Obj) -> bool:
    return LWS_LABEL_NAME in ((pod.get("metadata") or {}).get("labels") or {})


def _group_env(container: Obj, role: RoleSpec) -> None:
    """The replica index is the group's (one template serves every group), and the sidecar is
    told how the instance is cut; a user's env of the same names is dropped (contract wins)."""
    env = []
    for e in container.get("env") or []:
        if e.get("name") in LWS_ENV:
            continue
        if e.get("name") == keys.ENV_REPLICA:
            e = {"name": keys.ENV_REPLICA, "valueFrom": {"fieldRef": {
                "apiVersion": "v1", "fieldPath": f"metadata.labels['{LWS_LABEL_GROUP_INDEX}']"}}}
        env.append(e)
    env += [{"name": ENV_RANKS_PER_POD, "value": str(gpus_per_pod(role))},
            {"name": ENV_DIST_PORT, "value": str(DIST_PORT)}]
    container["env"] = env


def _template(pod: Obj, role: RoleSpec, leader: bool) -> Obj:
    meta = copy.deepcopy(pod["metadata"])
    spec = copy.deepcopy(pod["spec"])
    lbls = {k: v for k, v in meta.get("labels", {}).items() if k != keys.LABEL_REPLICA}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items()
                   if k != keys.ANNOTATION_SPEC_HASH}
    # StatefulSets of the LWS set hostname and subdomain (`<lws>`) themselves.
    spec.pop("hostname", None)
    spec.pop("subdomain", None)
    main = spec["containers"][0]
    _group_env(main, role)
    gpus = str(gpus_per_pod(role))
    res = main.setdefault("resources", {})
    for kind in ("limits", "requests"):
        res.setdefault(kind, {})[GPU_RESOURCE] = gpus
    if leader:
        main["ports"] = [*main.get("ports", []),
                         {"name": "dist", "containerPort": DIST_PORT, "protocol": "TCP"}]
    out: Obj = {"metadata": {"labels": lbls}, "spec": spec}
    if annotations:
        out["metadata"]["annotations"] = annotations
    return out


def build_lws(owner: Owner, spec: PDDeploymentSpec, plan: RoutingPlan, role: Role) -> Obj:
    r: RoleSpec = getattr(spec, role)
    pod = build_pod(owner, spec, plan, role, 0)
    name = lws_name(owner.name, role)
    lws: Obj = {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": {
            "name": name,
            "namespace": owner.namespace,
            "labels": {**labels(owner, role), keys.LABEL_PLAN_HASH:
                       pod["metadata"]["labels"][keys.LABEL_PLAN_HASH]},
            "ownerReferences": [owner.reference()],
        },
        "spec": {
            "replicas": r.replicas,
            "startupPolicy": "LeaderCreated",
            # Group by group, keeping one group serving, as one-pod instances roll.
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {
                "maxUnavailable": effective_max_unavailable(r.replicas,
                                                            spec.rollout.maxUnavailable),
                "maxSurge": 0}},
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": pods_per_instance(r),
                # Ranks of an instance share collectives: one pod's restart breaks them all.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _template(pod, r, leader=True),
                "workerTemplate": _template(pod, r, leader=False),
            },
        },
    }
    # The pods' hash: what a group runs, without the counts (a scale must not roll groups).
    template = lws["spec"]["leaderWorkerTemplate"]
    digest = content_hash(template, plan.to_json())
    for part in ("leaderTemplate", "workerTemplate"):
        meta = template[part]["metadata"]
        meta["annotations"] = {**meta.get("annotations", {}), keys.ANNOTATION_SPEC_HASH: digest}
    lws["metadata"]["annotations"] = {keys.ANNOTATION_SPEC_HASH: digest}
    return lws


def lws_objects(desired: Desired) -> list[Obj]:
    return [o for o in desired.extra if o.get("kind") == LWS_KIND]


def apply_lws(owner: Owner, spec: PDDeploymentSpec, desired: Desired) -> Desired:
    """Moves every role that spans pods from `desired.pods` to an LWS in `desired.extra`
    (no pods of its own, no surge pod: LWS rolls its groups itself)."""
    for role in ("prefill", "decode"):
        if not uses_lws(getattr(spec, role)):
            continue
        desired.pods[role] = {}
        surge = getattr(desired, "surge_pods", None)
        if isinstance(surge, dict):
            surge.pop(role, None)
        desired.extra.append(build_lws(owner, spec, desired.plan, role))
    return desired


def lws_roles(desired: Desired) -> set[str]:
    return {o["metadata"]["labels"][keys.LABEL_COMPONENT] for o in lws_objects(desired)}


def _label(pod: Obj, key: str) -> str | None:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(key)


def _group_index(pod: Obj) -> int:
    try:
        return int(_label(pod, LWS_LABEL_GROUP_INDEX) or -1)
    except ValueError:
        return -1


def role_plan(want: Obj, have: Obj | None, pods: list[Obj]) -> RolePlan:
    """A role's counts in groups (instances), as a one-pod role counts pods. A group is one
    leader pod: it is updated when the leader runs the current template (its spec-hash
    annotation; the LWS status says nothing of which generation it describes), ready by the
    LWS status (leader and workers Ready) but never beyond the Ready leaders seen. The pods
    that keep a group from serving give the condition its message."""
    plan = RolePlan()
    replicas = int(want["spec"]["replicas"])
    if have is None:
        plan.waiting_on = [PodInfo(
            name=want["metadata"]["name"], index=None, uid="", hash=None, ready=False,
            terminating=False, owner_uid=None, problem_reason="PodPending",
            problem=f"LeaderWorkerSet {want['metadata']['name']} is being created")]
        return plan
    digest = want["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH]
    infos = {id(p): pod_info(p) for p in pods}
    leaders = [p for p in pods if _label(p, LWS_LABEL_WORKER_INDEX) == "0"
               and not infos[id(p)].terminating]
    wanted = [p for p in leaders if 0 <= _group_index(p) < replicas]
    plan.replicas = len(leaders)
    plan.excess = len(leaders) - len(wanted)
    plan.updated = sum(1 for p in wanted if infos[id(p)].hash == digest)
    plan.outdated = len(wanted) - plan.updated
    ready_leaders = sum(1 for p in wanted if infos[id(p)].ready)
    status_ready = int(((have or {}).get("status") or {}).get("readyReplicas") or 0)
    plan.ready = min(status_ready, ready_leaders, replicas)
    plan.waiting_on = sorted((i for i in infos.values() if not i.ready and not i.terminating),
                             key=lambda i: i.name)
    # Groups LWS has not created yet. Never in `plan.create`: the reconciler creates what is
    # there, and LWS creates groups, not the operator.
    present = {_group_index(p) for p in wanted}
    plan.waiting_on += [
        PodInfo(name=f"{want['metadata']['name']}-{i}", index=i, uid="", hash=None, ready=False,
                terminating=False, owner_uid=None, problem_reason="PodPending",
                problem=f"group {i} ({want['metadata']['name']}-{i}) is not created yet")
        for i in range(replicas) if i not in present]
    return plan


def missing_crd_message() -> str:
    return (f"the LeaderWorkerSet CRD ({LWS_CRD}) is not installed; a role with gpusPerPod "
            "below tensorParallelSize runs as a LeaderWorkerSet: install LeaderWorkerSet "
            "v0.7.0 or later (docs/lws.md)")


def lws_pods_of(pods: list[Obj], owner_name: str, role: str) -> list[Obj]:
    name = lws_name(owner_name, role)
    return [p for p in pods if _label(p, LWS_LABEL_NAME) == name]


def leaders_only(status: Obj, desired: Desired) -> Obj:
    """The scale subresource's selector (an HPA counts and averages over it) names one pod per
    instance, as for one-pod roles: the group leaders, as LWS's own hpaPodSelector does."""
    for role in lws_roles(desired):
        node = status.get(role)
        if isinstance(node, dict) and node.get("selector"):
            node["selector"] += f",{LWS_LABEL_WORKER_INDEX}=0"
    return status


MISSING_CRD_REASON = "LeaderWorkerSetCRDMissing"


def mark_missing_crd(status: Obj) -> Obj:
    """Ready and Stalled name the missing CRD in their reason too, not only in the message: a
    cluster without LeaderWorkerSet is a setup problem, not a failed write to retry."""
    for c in status.get("conditions") or []:
        if c.get("type") in ("Ready", "Stalled") and LWS_CRD in str(c.get("message")):
            c["reason"] = MISSING_CRD_REASON
    return status
