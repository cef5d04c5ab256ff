"""Pure rollout policy: observed pods of one role + desired pods -> create / delete / restore.

Policy (docs/operator.md):
- scale down removes the highest indices (index >= replicas) at once: they are not wanted;
- a missing index is created at once (a deleted pod comes back);
- an outdated pod (spec-hash differs) is deleted, then recreated at its index by a later pass;
  at most `rollout.maxUnavailable` indices of the role may be unavailable at a time, and a role
  of several replicas always keeps at least one pod (the effective budget is replicas - 1);
  outdated pods that are not Ready go first and cost nothing, since they serve nothing;
- a pod whose hash matches but which drifted (a manual edit) is re-applied in place;
- a pod that ended (phase Failed or Succeeded: evicted, its node shut down, the process exited
  under restartPolicy Never) never serves again: it is deleted (uid precondition) and recreated
  by the next pass. It is unavailable already, so this spends no rollout budget;
- a pod with one of our names that is not ours (no controller reference to this PDDeployment or
  to an earlier one of the same name) is never touched: its index is reported as a conflict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdd_api import keys
from pdd_operator.builders import Obj, is_subset

SEVERITY = ("Unschedulable", "CrashLooping", "ImagePullFailed", "ContainerCreateFailed",
            "PodFailed", "PodPending", "NotReady")
ENDED_PHASES = ("Failed", "Succeeded")
_IMAGE_REASONS = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"}
_CREATE_REASONS = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}


@dataclass(frozen=True)
class PodInfo:
    """What the operator needs to know of an observed pod, parsed once."""

    name: str
    index: int | None
    uid: str
    hash: str | None
    ready: bool
    terminating: bool
    owner_uid: str | None
    problem_reason: str | None = None
    problem: str | None = None
    phase: str = "Pending"
    owner_ref: tuple[str, str] | None = None  # (kind, name) of the controller
    plan: str | None = None  # serving.pdd.dev/plan-hash: the routing plan it started with
    surge: bool = False

    @property
    def ended(self) -> bool:
        return self.phase in ENDED_PHASES and not self.terminating


def _index(pod: Obj) -> int | None:
    raw = (pod.get("metadata", {}).get("labels") or {}).get(keys.LABEL_REPLICA)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def _controller(pod: Obj) -> Obj | None:
    for ref in pod.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def _controller_uid(pod: Obj) -> str | None:
    ref = _controller(pod)
    return str(ref.get("uid")) if ref is not None else None


def foreign(obj: Obj, owner_uid: str, owner_name: str, owner_kind: str) -> bool:
    """Not ours to change: its controller is neither this PDDeployment nor an earlier one of
    the same name (whose objects garbage collection is about to remove)."""
    ref = _controller(obj)
    if ref is None:
        return True
    if ref.get("uid") == owner_uid:
        return False
    return not (ref.get("kind") == owner_kind and ref.get("name") == owner_name)


def _condition(pod: Obj, ctype: str) -> Obj | None:
    for c in pod.get("status", {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c
    return None


def diagnose(pod: Obj) -> tuple[str | None, str | None]:
    """(reason, message) a user needs when the pod is not serving, e.g. the scheduler's words."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    sched = _condition(pod, "PodScheduled")
    if sched is not None and sched.get("status") == "False":
        reason = sched.get("reason") or "Unschedulable"
        msg = sched.get("message") or "not scheduled"
        return "Unschedulable", f"{name} is Pending ({reason}): {msg}"
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        wreason = waiting.get("reason")
        if wreason == "CrashLoopBackOff":
            last = (cs.get("lastState") or {}).get("terminated") or {}
            exit_info = (
                f"; last exit code {last.get('exitCode')} ({last.get('reason', 'Error')})"
                if last else ""
            )
            return "CrashLooping", (
                f"{name} is crash-looping: container {cs.get('name')} restarted "
                f"{cs.get('restartCount', 0)} times{exit_info}"
            )
        if wreason in _IMAGE_REASONS:
            return "ImagePullFailed", f"{name}: {wreason}: {waiting.get('message', '')}".rstrip()
        if wreason in _CREATE_REASONS:
            return "ContainerCreateFailed", (
                f"{name}: {wreason}: {waiting.get('message', '')}".rstrip()
            )
    if phase in ENDED_PHASES:
        why = " ".join(x for x in (status.get("reason"), status.get("message")) if x)
        return "PodFailed", f"{name} {phase}" + (f": {why}" if why else "")
    if phase == "Pending":
        return "PodPending", f"{name} is Pending"
    ready = _condition(pod, "Ready")
    if phase == "Running" and not (ready and ready.get("status") == "True"):
        return "NotReady", f"{name} is Running but not Ready"
    return None, None


def pod_info(pod: Obj) -> PodInfo:
    meta = pod.get("metadata", {})
    ready_c = _condition(pod, "Ready")
    ready = bool(ready_c and ready_c.get("status") == "True")
    terminating = meta.get("deletionTimestamp") is not None
    reason, problem = (None, None) if ready or terminating else diagnose(pod)
    ref = _controller(pod)
    return PodInfo(
        name=meta.get("name", ""),
        index=_index(pod),
        uid=meta.get("uid", ""),
        hash=(meta.get("annotations") or {}).get(keys.ANNOTATION_SPEC_HASH),
        ready=ready and not terminating,
        terminating=terminating,
        owner_uid=_controller_uid(pod),
        problem_reason=reason,
        problem=problem,
        phase=str((pod.get("status") or {}).get("phase") or "Pending"),
        owner_ref=(str(ref.get("kind")), str(ref.get("name"))) if ref is not None else None,
        plan=(meta.get("labels") or {}).get(keys.LABEL_PLAN_HASH),
        surge=(meta.get("labels") or {}).get(keys.LABEL_SURGE) == "true",
    )


@dataclass(frozen=True)
class Delete:
    name: str
    uid: str
    reason: str  # ScaleDown | Replace | Ended | Surge


@dataclass
class RolePlan:
    """What to do for one role now, and the counts its status reports."""

    create: list[Obj] = field(default_factory=list)
    delete: list[Delete] = field(default_factory=list)
    restore: list[Obj] = field(default_factory=list)
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    outdated: int = 0
    excess: int = 0
    waiting_on: list[PodInfo] = field(default_factory=list)  # indices < replicas not serving
    conflicts: list[str] = field(default_factory=list)  # our pod names held by someone else

    @property
    def settled(self) -> bool:
        return not (self.create or self.delete or self.outdated or self.excess)


def effective_max_unavailable(replicas: int, max_unavailable: int) -> int:
    return 1 if replicas <= 1 else max(1, min(max_unavailable, replicas - 1))


def plan_role(desired: dict[int, Obj], observed: list[Obj], owner_uid: str,
              max_unavailable: int, owner_name: str | None = None) -> RolePlan:
    n = len(desired)
    plan = RolePlan()
    by_index: dict[int, tuple[PodInfo, Obj]] = {}
    conflicted: set[int] = set()
    for pod in observed:
        info = pod_info(pod)
        want = desired.get(info.index) if info.index is not None else None
        if want is not None and info.name == want["metadata"]["name"]:
            if owner_name is not None and _is_foreign(info, owner_uid, owner_name):
                plan.conflicts.append(info.name)
                conflicted.add(info.index)  # type: ignore[arg-type]
                continue
            by_index[info.index] = (info, pod)  # type: ignore[index]
        elif info.owner_uid == owner_uid:
            if not info.terminating:
                plan.delete.append(Delete(info.name, info.uid, "ScaleDown"))
            plan.excess += 1
        # A pod with our labels that we neither named nor own is someone else's: left alone.

    unavailable = 0
    outdated: list[PodInfo] = []
    ended: list[PodInfo] = []
    for i in sorted(desired):
        want = desired[i]
        if i in conflicted:
            unavailable += 1
            continue
        if i not in by_index:
            plan.create.append(want)
            unavailable += 1
            continue
        info, pod = by_index[i]
        if not info.terminating:
            plan.replicas += 1
        if info.ready:
            plan.ready += 1
        else:
            unavailable += 1
            plan.waiting_on.append(info)
        want_hash = want["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH]
        if info.terminating:
            continue
        if info.ended:
            ended.append(info)
            continue
        if info.hash != want_hash or info.owner_uid != owner_uid:
            outdated.append(info)
        else:
            plan.updated += 1
            if drifted(want, pod):
                plan.restore.append(want)
    plan.outdated = len(outdated)
    plan.delete += [Delete(info.name, info.uid, "Ended") for info in ended]

    budget = effective_max_unavailable(n, max_unavailable) - unavailable
    for info in sorted(outdated, key=lambda p: (p.ready, p.index)):
        if not info.ready:
            plan.delete.append(Delete(info.name, info.uid, "Replace"))
        elif budget > 0:
            plan.delete.append(Delete(info.name, info.uid, "Replace"))
            budget -= 1
    return plan


def _is_foreign(info: PodInfo, owner_uid: str, owner_name: str) -> bool:
    if info.owner_uid == owner_uid:
        return False
    return info.owner_ref is None or info.owner_ref != ("PDDeployment", owner_name)


_DRIFT: dict[tuple[int, str, str], tuple[Obj, bool]] = {}


def drifted(want: Obj, have: Obj) -> bool:
    """`not is_subset(want, have)`, remembered per (desired object, observed uid and
    resourceVersion): most passes look at objects that have not changed since the last one."""
    meta = have.get("metadata", {})
    key = (id(want), str(meta.get("uid")), str(meta.get("resourceVersion")))
    hit = _DRIFT.get(key)
    if hit is not None and hit[0] is want:
        return hit[1]
    result = not is_subset(want, have)
    if len(_DRIFT) > 50_000:
        _DRIFT.clear()
    _DRIFT[key] = (want, result)  # holding `want` keeps its id from being reused
    return result


def needs_apply(want: Obj, have: Any) -> bool:
    return have is None or drifted(want, have)


# ------------------------------------------------------------------ plan-changing rolls
#
# Pods of different routing plans cannot be paired (the router pairs a prefill and a decode of
# one plan hash), so a change of the plan is rolled across both roles at once:
# - with room for one more pod of each role (free GPUs on nodes the pods may use), a surge pod
#   per role (`<name>-<role>-surge`) starts on the new plan while the old generation serves;
#   once a new pair is Ready, the replicas are replaced within maxUnavailable, and the surge
#   pods go once the replicas hold a Ready pair of their own;
# - without room, the replicas are replaced role by role: prefill first (keeping one old
#   Ready prefill while the role has several replicas and no new pair is Ready), decode once
#   a new prefill is Ready (keeping one old Ready decode while old prefills exist).
# Old prefills go before the last old decode: a prefill that is draining still hands the KV
# of its last requests to a decode of its own plan.

_ALL = 1 << 30


@dataclass
class Roll:
    """What a plan-changing roll adds to the role plans: surge pods, and the replacements of
    old Ready pods held back for now (by role)."""

    mode: str = ""  # "" (no plan roll) | Surge | RoleByRole
    create: list[Obj] = field(default_factory=list)
    delete: list[Delete] = field(default_factory=list)
    allowed: dict[str, list[Delete]] = field(default_factory=dict)
    held: list[str] = field(default_factory=list)
    new_pair: bool = False

    @property
    def active(self) -> bool:
        return bool(self.mode)


def _old(info: PodInfo, current: str) -> bool:
    return info.plan != current and not info.surge


def roll_starting(current: str, observed: dict[str, list[PodInfo]],
                  replicas: Mapping[str, int]) -> bool:
    """A pass that must decide between surge and role by role: every replica is an old pod
    still serving (none missing, none going) and no pod of the new plan exists. The decision
    is never taken again in the same roll, so GPUs that free up as old pods go do not switch
    it half way."""
    pods = [i for infos in observed.values() for i in infos]
    if any(i.plan == current or i.surge or i.terminating for i in pods):
        return False
    return all(sum(1 for i in observed.get(r, []) if _old(i, current)) >= n > 0
               for r, n in replicas.items())


def coordinate(current: str, replicas: dict[str, int], roles: dict[str, RolePlan],
               observed: dict[str, list[PodInfo]], surge_desired: Mapping[str, Obj],
               room: bool | None) -> Roll:
    """The plan-changing roll for this pass. `observed`: our pods of each role (replicas and
    surge pods, terminating ones included); `room`: whether a surge pod of each role fits in
    free GPUs (None: unknown, treated as no room), only consulted when `roll_starting`."""
    roll = Roll(allowed={r: list(rp.delete) for r, rp in roles.items()})
    if set(roles) != {"prefill", "decode"}:
        return roll
    live = {r: [i for i in observed[r] if not i.terminating] for r in roles}
    old_any = {r: [i for i in observed[r] if _old(i, current)] for r in roles}
    old_ready = {r: sum(1 for i in live[r] if _old(i, current) and i.ready) for r in roles}
    new_ready = {r: sum(1 for i in live[r] if i.plan == current and i.ready) for r in roles}
    index_new_ready = {r: sum(1 for i in live[r] if i.plan == current and i.ready
                              and not i.surge) for r in roles}
    surges = {r: [i for i in observed[r] if i.surge] for r in roles}
    rolling = any(not i.terminating for r in roles for i in old_any[r])
    live_surge = any(not i.terminating for r in roles for i in surges[r])
    if not rolling and not live_surge:
        return roll
    pair = all(new_ready.values())
    index_pair = all(index_new_ready.values())
    surging = live_surge or (rolling and room is True
                             and roll_starting(current, observed, replicas))
    roll.mode = "Surge" if surging else "RoleByRole"
    roll.new_pair = pair

    for r in roles:
        want = surge_desired[r]
        want_hash = want["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH]
        if index_pair or not surging:
            roll.delete += [Delete(i.name, i.uid, "Surge") for i in surges[r]
                            if not i.terminating]
            continue
        for i in surges[r]:
            if i.terminating:
                continue
            if i.ended:
                roll.delete.append(Delete(i.name, i.uid, "Ended"))
            elif i.hash != want_hash or i.name != want["metadata"]["name"]:
                roll.delete.append(Delete(i.name, i.uid, "Replace"))
        if not surges[r]:
            roll.create.append(want)

    if surging and not pair:
        keep = {"prefill": _ALL, "decode": _ALL}
    else:
        keep_p = 1 if not pair and replicas["prefill"] >= 2 else 0
        if not surging and new_ready["prefill"] == 0 and old_any["prefill"]:
            keep_d = _ALL  # role by role: decode waits for a new prefill
        elif old_any["prefill"] and (pair or replicas["decode"] >= 2):
            keep_d = 1
        else:
            keep_d = 0
        keep = {"prefill": keep_p, "decode": keep_d}
    for r, rp in roles.items():
        by_name = {i.name: i for i in observed[r]}
        budget = max(0, old_ready[r] - keep[r])
        allowed = []
        for d in rp.delete:
            info = by_name.get(d.name)
            if d.reason == "Replace" and info is not None and info.ready and _old(info,
                                                                                   current):
                if budget <= 0:
                    roll.held.append(d.name)
                    continue
                budget -= 1
            allowed.append(d)
        roll.allowed[r] = allowed
    return roll


# ------------------------------------------------------------------ room for a surge


def _quantity(raw: Any) -> float:
    text = str(raw)
    if text.endswith("m"):
        return float(text[:-1]) / 1000
    return float(text)


def pod_gpus(pod: Obj, resource: str) -> float:
    """What the scheduler counts for `resource`: the containers' requests (limits where no
    request is given), or the largest init container's when that is more."""
    def one(c: Obj) -> float:
        res = c.get("resources") or {}
        raw = (res.get("requests") or {}).get(resource, (res.get("limits") or {}).get(resource))
        return _quantity(raw) if raw is not None else 0.0

    spec = pod.get("spec") or {}
    main = sum(one(c) for c in spec.get("containers") or [])
    init = max((one(c) for c in spec.get("initContainers") or []), default=0.0)
    return max(main, init)


def _tolerates(tolerations: list[Obj], taint: Obj) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (
                taint.get("value") or ""):
            return True
    return False


def node_fits(node: Obj, pod: Obj) -> bool:
    """The node is schedulable, Ready, carries the pod's nodeSelector and has no taint the pod
    does not tolerate (affinity is not evaluated: a surge pod it keeps out waits Pending)."""
    spec, meta = node.get("spec") or {}, node.get("metadata") or {}
    if spec.get("unschedulable"):
        return False
    ready = next((c for c in (node.get("status") or {}).get("conditions") or []
                  if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        return False
    pspec = pod.get("spec") or {}
    labels = meta.get("labels") or {}
    if any(labels.get(k) != v for k, v in (pspec.get("nodeSelector") or {}).items()):
        return False
    tolerations = pspec.get("tolerations") or []
    return all(_tolerates(tolerations, t) for t in spec.get("taints") or []
               if t.get("effect") in ("NoSchedule", "NoExecute"))


def free_by_node(nodes: list[Obj], pods: list[Obj], resource: str) -> dict[str, float]:
    """Allocatable `resource` per node minus what the pods bound to it request (pods that
    ended hold nothing)."""
    free = {}
    for n in nodes:
        alloc = ((n.get("status") or {}).get("allocatable") or {}).get(resource)
        if alloc is not None:
            free[n["metadata"]["name"]] = _quantity(alloc)
    for p in pods:
        node = (p.get("spec") or {}).get("nodeName")
        if node in free and (p.get("status") or {}).get("phase") not in ENDED_PHASES:
            free[node] -= pod_gpus(p, resource)
    return free


def surge_fits(wanted: list[Obj], nodes: list[Obj], pods: list[Obj], resource: str) -> bool:
    """Whether every wanted pod finds a node with enough free `resource` (largest first, each
    on the first node that takes it)."""
    by_name = {n["metadata"]["name"]: n for n in nodes}
    free = free_by_node(nodes, pods, resource)
    for pod in sorted(wanted, key=lambda p: -pod_gpus(p, resource)):
        need = pod_gpus(pod, resource)
        spot = next((name for name, left in free.items()
                     if left >= need and node_fits(by_name[name], pod)), None)
        if spot is None:
            return False
        free[spot] -= need
    return True
