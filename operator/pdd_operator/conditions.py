"""Pure status computation: what was observed -> the PDDeployment's status block.

Conditions follow the Kubernetes/kstatus conventions (type, status, reason, message,
lastTransitionTime, observedGeneration; `Ready` is the summary) so `kubectl wait
--for=condition=Ready`, Flux and the Argo CD health check read them without knowing pdd.
Messages carry what a user needs without the operator's logs: which pod is Pending and the
scheduler's words, which pod is crash-looping, which decode rank reads which prefill ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdd_api.autoscale import (
    AT_MAXIMUM,
    AT_MINIMUM,
    METRICS_PARTIAL,
    METRICS_UNAVAILABLE,
    SCALED_DOWN,
    SCALED_UP,
    STABLE,
)
from pdd_api.plan import RoutingPlan
from pdd_operator.rollout import SEVERITY, RolePlan, effective_max_unavailable

VALIDATED, ROUTING_READY, READY = "Validated", "RoutingReady", "Ready"
# kstatus: an abnormal-true condition, present (True) only while the operator cannot make
# progress without a change from someone (a quota, a PodSecurity level, a name held by another
# object, an invalid spec); kstatus-based tools (Flux, kpt, cli-utils) then report Failed.
STALLED = "Stalled"
AVAILABLE = {"prefill": "PrefillAvailable", "decode": "DecodeAvailable"}
# Whether requests can be prefilled on a prefill pod: False (reason NoPrefillReady) while no
# prefill pod is ready, when the router serves them on the decode pods or refuses them
# (spec.router.noPrefill). A P/D deployment that silently serves decode-only is what this shows.
DISAGGREGATED = "Disaggregated"
NO_PREFILL_READY, PREFILL_READY = "NoPrefillReady", "PrefillReady"
CONDITION_TYPES = (VALIDATED, ROUTING_READY, AVAILABLE["prefill"], AVAILABLE["decode"],
                   DISAGGREGATED, READY)
# Reasons the Argo CD health check calls Degraded: they do not resolve by waiting.
STUCK_REASONS = ("Unschedulable", "CrashLooping", "ImagePullFailed", "ContainerCreateFailed",
                 "PodFailed", "InvalidSpec")
RECONCILE_ERROR, NAME_CONFLICT = "ReconcileError", "NameConflict"
# Present (True) on a PDDeployment and on a PDDRoleScale while a writer other than the owner of
# a role's replicas (replica_owner.py) wrote them; the reason names which kind of writer.
REPLICAS_CONFLICT = "ReplicasConflict"
SPEC_REPLICAS_WRITTEN = "SpecReplicasWritten"  # the spec, while a PDDRoleScale drives the role
PLANNER_DRIVES_ROLE = "PlannerDrivesRole"  # a PDDRoleScale, while the planner drives the role
SCALE_IGNORED = "ScaleSubresourceIgnored"  # an HPA/KEDA/kubectl scale, ditto
ANOTHER_ROLE_SCALE = "AnotherRoleScale"  # a second PDDRoleScale of one role
# API answers that waiting (and the operator's retries) may fix; anything else needs a person.
TRANSIENT_STATUSES = frozenset({0, 409, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class ObjectError:
    """One object the pass could not write: `ref` like `Pod ns/name`, the API's status and
    message."""

    ref: str
    status: int
    message: str

    @property
    def transient(self) -> bool:
        return self.status in TRANSIENT_STATUSES
MAX_PROBLEMS = 3


@dataclass(frozen=True)
class RouterState:
    enabled: bool
    replicas: int = 0
    ready: int = 0
    updated: bool = True


def router_state(enabled: bool, desired: Mapping[str, Any] | None,
                 observed: Mapping[str, Any] | None) -> RouterState:
    if not enabled or desired is None:
        return RouterState(enabled=False)
    want = int(desired["spec"]["replicas"])
    if observed is None:
        return RouterState(enabled=True, replicas=want, ready=0, updated=False)
    st = observed.get("status") or {}
    meta = observed.get("metadata") or {}
    current = st.get("observedGeneration", 0) >= meta.get("generation", 0)
    updated = current and st.get("updatedReplicas", 0) >= want
    return RouterState(enabled=True, replicas=want, ready=int(st.get("availableReplicas") or 0),
                       updated=bool(updated and st.get("replicas", 0) == want))


def condition(ctype: str, ok: bool | None, reason: str, message: str, generation: int,
              previous: Mapping[str, Any] | None, now: str) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    since = now
    if previous is not None and previous.get("status") == status:
        since = previous.get("lastTransitionTime") or now
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def _previous(status: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    return {c["type"]: c for c in (status or {}).get("conditions") or [] if "type" in c}


def _worst(reasons: Sequence[str | None]) -> str | None:
    found = [r for r in reasons if r is not None]
    return min(found, key=lambda r: SEVERITY.index(r) if r in SEVERITY else len(SEVERITY),
               default=None)


def role_condition(role: str, rp: RolePlan, want: int, max_unavailable: int) -> tuple[bool, str,
                                                                                         str]:
    """(available, reason, message). Available means the role can serve: at least
    max(1, replicas - maxUnavailable) pods Ready, the floor the rollout policy guarantees."""
    floor = max(1, want - effective_max_unavailable(want, max_unavailable))
    head = f"{rp.ready}/{want} {role} pods ready"
    problems = [p.problem for p in rp.waiting_on if p.problem]
    missing = len(rp.create)
    detail = []
    if rp.outdated:
        detail.append(f"{rp.outdated} outdated, being replaced")
    if missing:
        detail.append(f"{missing} being created")
    if rp.excess:
        detail.append(f"{rp.excess} being removed")
    extra = problems[:MAX_PROBLEMS] + (
        [f"and {len(problems) - MAX_PROBLEMS} more"] if len(problems) > MAX_PROBLEMS else []
    )
    message = "; ".join([head + (f" ({', '.join(detail)})" if detail else ""), *extra])
    worst = _worst([p.problem_reason for p in rp.waiting_on])
    if rp.ready >= floor:
        full = rp.ready == want and rp.settled
        return True, "AllReplicasReady" if full else "MinimumReplicasAvailable", message
    if worst is not None and worst not in ("PodPending", "NotReady"):
        return False, worst, message
    if rp.outdated or any(p.terminating for p in rp.waiting_on):
        return False, "Rolling", message
    if missing or worst == "PodPending":
        return False, "PodsStarting", message
    return False, "PodsNotReady", message


def disaggregated_condition(prefill_ready: int, decode_ready: int, no_prefill: str
                            ) -> tuple[bool, str, str]:
    """(ok, reason, message) of the Disaggregated condition."""
    if prefill_ready > 0:
        return True, PREFILL_READY, (f"{prefill_ready} prefill pod"
                                     f"{'s' if prefill_ready > 1 else ''} ready")
    if no_prefill == "refuse":
        serves = "the router refuses requests with 503 (spec.router.noPrefill: refuse)"
    elif decode_ready > 0:
        serves = ("the router prefills requests on the decode pods (spec.router.noPrefill: "
                  "fallback; counted as pdd_router_request_paths_total{path=\"fallback\"})")
    else:
        serves = "and no decode pod is ready either"
    return False, NO_PREFILL_READY, f"no prefill pod is ready: {serves}"


def compute_status(
    *,
    generation: int,
    problems: Sequence[str],
    plan: RoutingPlan | None,
    routing_published: bool,
    roles: Mapping[str, RolePlan],
    wanted: Mapping[str, int],
    max_unavailable: int,
    router: RouterState,
    previous: Mapping[str, Any] | None,
    now: str,
    roll_note: str = "",
    no_prefill: str = "fallback",
) -> dict[str, Any]:
    """`roll_note`: a routing-plan roll is still under way (old or surge pods remain), so the
    deployment is not Ready even where every replica is."""
    prev = _previous(previous)

    def cond(ctype: str, ok: bool | None, reason: str, message: str) -> dict[str, Any]:
        return condition(ctype, ok, reason, message, generation, prev.get(ctype), now)

    if problems:
        # Nothing was created or changed: the other conditions keep describing the objects
        # that exist (from the last valid generation).
        msg = "; ".join(problems)
        by_type = {c["type"]: dict(c) for c in (previous or {}).get("conditions") or []}
        by_type[VALIDATED] = cond(VALIDATED, False, "InvalidSpec", msg)
        by_type[READY] = cond(READY, False, "InvalidSpec",
                            f"generation {generation} is invalid, existing objects are left "
                            f"unchanged: {msg}")
        by_type[STALLED] = cond(STALLED, True, "InvalidSpec", msg)
        out = dict(previous or {})
        out["observedGeneration"] = generation
        out["conditions"] = [by_type[t] for t in (*CONDITION_TYPES, STALLED) if t in by_type]
        return out

    assert plan is not None
    conds = [cond(VALIDATED, True, "Valid", "spec is valid")]
    summary = plan.summary()
    if routing_published:
        conds.append(cond(ROUTING_READY, True, "PlanPublished", f"{plan.case}: {summary}"))
    else:
        conds.append(cond(ROUTING_READY, False, "PlanPending",
                          f"routing ConfigMap not yet written ({plan.case}: {summary})"))
    role_ok: dict[str, bool] = {}
    role_msgs: dict[str, str] = {}
    for role in ("prefill", "decode"):
        ok, reason, message = role_condition(role, roles[role], wanted[role], max_unavailable)
        role_ok[role] = ok
        role_msgs[role] = message
        conds.append(cond(AVAILABLE[role], ok, reason, message))
    conds.append(cond(DISAGGREGATED, *disaggregated_condition(
        roles["prefill"].ready, roles["decode"].ready, no_prefill)))

    settled = all(roles[r].settled and roles[r].ready == wanted[r] for r in roles)
    router_ok = not router.enabled or (router.ready >= router.replicas and router.updated)
    router_msg = f"router {router.ready}/{router.replicas} ready" if router.enabled else ""
    if settled and routing_published and router_ok and not roll_note:
        ready = cond(READY, True, "Ready", "; ".join(
            x for x in (f"prefill {wanted['prefill']}/{wanted['prefill']} ready",
                        f"decode {wanted['decode']}/{wanted['decode']} ready", router_msg,
                        summary) if x))
    else:
        if any(roles[r].outdated for r in roles) or roll_note:
            reason = "Rolling"
        elif not role_ok["prefill"]:
            reason = "PrefillUnavailable"
        elif not role_ok["decode"]:
            reason = "DecodeUnavailable"
        elif not settled:
            reason = "Progressing"
        elif not routing_published:
            reason = "RoutingPending"
        else:
            reason = "RouterUnavailable"
        parts = [role_msgs[r] for r in ("prefill", "decode")
                 if not (roles[r].settled and roles[r].ready == wanted[r])]
        if router.enabled and not router_ok:
            parts.append(router_msg + ("" if router.updated else " (updating)"))
        if roll_note:
            parts.append(roll_note)
        ready = cond(READY, False, reason, "; ".join(parts) or "waiting for the routing plan")
    conds.append(ready)
    return {
        "observedGeneration": generation,
        "conditions": conds,
        "prefill": _role_status(roles["prefill"]),
        "decode": _role_status(roles["decode"]),
        "routingCase": plan.case,
        "routingSummary": summary,
    }


def with_errors(status: dict[str, Any], *, errors: Sequence[ObjectError],
                conflicts: Sequence[str], generation: int,
                previous: Mapping[str, Any] | None, now: str,
                role_refs: Mapping[str, set[str]] | None = None) -> dict[str, Any]:
    """A pass that could not write some objects still reports: Ready=False with the API's own
    words (reason NameConflict when one of our names is held by an object we do not control,
    else ReconcileError), and Stalled=True unless every error is one that retries may fix."""
    if not errors and not conflicts:
        return status
    prev = _previous(previous)
    parts = [f"{ref} exists and is not controlled by this PDDeployment: left alone "
             "(delete or rename it)" for ref in conflicts]
    parts += [f"{e.ref}: {e.message}" for e in errors]
    shown = parts[:MAX_PROBLEMS] + (
        [f"and {len(parts) - MAX_PROBLEMS} more"] if len(parts) > MAX_PROBLEMS else [])
    message = "; ".join(shown)
    reason = NAME_CONFLICT if conflicts else RECONCILE_ERROR
    out = dict(status)
    conds = [c for c in status.get("conditions") or [] if c["type"] not in (READY, STALLED)]
    # A role short of pods because the API refused them says so, not "being created".
    for role, refs in (role_refs or {}).items():
        mine = [e for e in errors if e.ref in refs]
        for i, c in enumerate(conds):
            if mine and c["type"] == AVAILABLE[role] and c["status"] == "False":
                msg = "; ".join(f"{e.ref}: {e.message}" for e in mine[:MAX_PROBLEMS])
                conds[i] = condition(c["type"], False, RECONCILE_ERROR, msg, generation,
                                     prev.get(c["type"]), now)
    conds.append(condition(READY, False, reason, message, generation, prev.get(READY), now))
    if conflicts or any(not e.transient for e in errors):
        stalled_reason = NAME_CONFLICT if conflicts else RECONCILE_ERROR
        conds.append(condition(STALLED, True, stalled_reason, message, generation,
                               prev.get(STALLED), now))
    out["conditions"] = conds
    return out


def with_replicas_conflict(status: dict[str, Any], conflicts: Sequence[tuple[str, str]],
                           generation: int, previous: Mapping[str, Any] | None,
                           now: str) -> dict[str, Any]:
    """Adds ReplicasConflict (True) while some role's replicas were written by a writer that
    does not own them (replica_owner.conflict's (reason, message) per role)."""
    if not conflicts:
        return status
    out = dict(status)
    out["conditions"] = [*(status.get("conditions") or []), condition(
        REPLICAS_CONFLICT, True, conflicts[0][0], "; ".join(m for _, m in conflicts),
        generation, _previous(previous).get(REPLICAS_CONFLICT), now)]
    return out


def _role_status(rp: RolePlan) -> dict[str, int]:
    return {"replicas": rp.replicas, "readyReplicas": rp.ready, "updatedReplicas": rp.updated}


def same_status(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    return dict(a or {}) == dict(b or {})


# The planner's condition (spec.autoscaling): True while it decides on fresh metrics (all of
# a role's instances, or enough of them: MetricsPartial), False while it holds for want of them.
# The reason is the most telling of the roles' decisions.
AUTOSCALING = "Autoscaling"
_AUTOSCALING_ORDER = (METRICS_UNAVAILABLE, METRICS_PARTIAL, SCALED_UP, SCALED_DOWN, AT_MAXIMUM,
                      AT_MINIMUM, STABLE)


def autoscaling_condition(decisions: Sequence[tuple[str, str]], generation: int,
                          previous: Mapping[str, Any] | None, now: str) -> dict[str, Any]:
    """`decisions`: (reason, message) per autoscaled role, in role order."""
    reasons = [r for r, _ in decisions]
    reason = min(reasons, key=lambda r: _AUTOSCALING_ORDER.index(r)
                 if r in _AUTOSCALING_ORDER else len(_AUTOSCALING_ORDER))
    return condition(AUTOSCALING, reason != METRICS_UNAVAILABLE, reason,
                     "; ".join(m for _, m in decisions), generation, previous, now)


def carry_autoscaling(status: dict[str, Any], previous: Mapping[str, Any] | None,
                      autoscaled: bool) -> dict[str, Any]:
    """A reconcile pass rewrites the conditions list (a merge patch replaces lists) but not the
    planner's part: keep its condition and status.autoscaling while autoscaling is on, drop
    them (null deletes in a merge patch) once it is off."""
    prev = previous or {}
    out = dict(status)
    conds = [c for c in out.get("conditions") or [] if c.get("type") != AUTOSCALING]
    kept = next((c for c in prev.get("conditions") or [] if c.get("type") == AUTOSCALING), None)
    if autoscaled and kept is not None:
        conds.append(dict(kept))
    out["conditions"] = conds
    if autoscaled and prev.get("autoscaling") is not None:
        out["autoscaling"] = prev["autoscaling"]
    elif prev.get("autoscaling") is not None:
        out["autoscaling"] = None
    return out
