"""PDDRoleScale: one role's replicas behind a scale subresource of its own.

A CRD has one scale subresource and PDDeployment's is decode's, so an HPA or KEDA cannot reach
prefill through it. A PDDRoleScale carries one role's replicas: the operator copies its
spec.replicas into the PDDeployment's spec.<role>.replicas (what `kubectl scale pdd` does for
decode), once per change of its own, and the role's pods, ready pods and selector back into its
status. While it drives the role the reconciler builds its replicas, whatever else writes the
PDDeployment's field; such a write is reported as a ReplicasConflict (replica_owner.py).

Pure: the handler (handlers.py) fetches and writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pdd_api.models import KIND, ROLE_SCALE_KIND, PDDRoleScaleStatus
from pdd_api.validation import InvalidSpecError, parse_spec
from pdd_operator.conditions import ANOTHER_ROLE_SCALE, REPLICAS_CONFLICT, condition
from pdd_operator.replica_owner import PLANNER, Writer, conflict, ownership

Obj = dict[str, Any]
STATUS_KEYS = tuple(PDDRoleScaleStatus.model_fields)


@dataclass(frozen=True)
class RoleScaleSync:
    """What to write: a merge patch of the PDDeployment (or none), spec.replicas to fill in on
    the PDDRoleScale (or none), and its status."""

    deployment_patch: Obj | None
    fill_replicas: int | None
    status: Obj


def _order(obj: Obj) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("creationTimestamp") or ""), str(meta.get("name") or "")


def driver(scales: Iterable[Obj], deployment: str, role: str) -> Obj | None:
    """The PDDRoleScale that drives one role of one PDDeployment: the oldest of those naming
    it (creation time, then name), so a second one never fights the first."""
    named = [s for s in scales if (s.get("spec") or {}).get("deployment") == deployment
             and (s.get("spec") or {}).get("role") == role
             and not (s.get("metadata") or {}).get("deletionTimestamp")]
    return min(named, key=_order) if named else None


def sync(scale: Obj, deployment: Obj | None, scales: Iterable[Obj],
         writer: Writer | None = None, now: str = "") -> RoleScaleSync:
    """The writes that make `deployment`'s spec.<role>.replicas follow `scale` and `scale`'s
    status follow the deployment. `scales`: the namespace's PDDRoleScales (`scale` among
    them); `writer`: the last writer of the deployment's spec.<role>.replicas. The spec is
    written once per change of spec.replicas (status.appliedReplicas records it): a spec
    changed afterwards by someone else is reported, not written back (replica_owner.py)."""
    spec = scale.get("spec") or {}
    name, role = spec.get("deployment", ""), spec.get("role", "")
    wanted = spec.get("replicas")
    old = scale.get("status") or {}
    status: Obj = {"replicas": 0, "readyReplicas": 0, "selector": None, "applied": False,
                   "appliedReplicas": old.get("appliedReplicas"),
                   "observedGeneration": (scale.get("metadata") or {}).get("generation")}
    generation = int(status["observedGeneration"] or 0)
    previous = next((c for c in old.get("conditions") or []
                     if c.get("type") == REPLICAS_CONFLICT), None)

    def done(message: str, patch: Obj | None = None, fill: int | None = None,
             applied: bool = False, conflict: tuple[str, str] | None = None) -> RoleScaleSync:
        conds = [] if conflict is None else [condition(
            REPLICAS_CONFLICT, True, conflict[0], conflict[1], generation, previous, now)]
        return RoleScaleSync(patch, fill, {**status, "applied": applied, "message": message,
                                           "conditions": conds})

    if deployment is None:
        return done(f"{KIND} {name} not found in this namespace")
    role_status = ((deployment.get("status") or {}).get(role) or {})
    status.update(replicas=int(role_status.get("replicas") or 0),
                  readyReplicas=int(role_status.get("readyReplicas") or 0),
                  selector=role_status.get("selector"))
    first = driver(scales, name, role)
    mine = (scale.get("metadata") or {}).get("name")
    if first is not None and (first.get("metadata") or {}).get("name") != mine:
        message = (f"{ROLE_SCALE_KIND} {first['metadata']['name']} drives {role} of {KIND} "
                   f"{name} already: this one is not applied")
        return done(message, conflict=(ANOTHER_ROLE_SCALE, message))
    try:
        parsed = parse_spec(deployment.get("spec"))
    except InvalidSpecError:
        return done(f"{KIND} {name} is not valid (its Validated condition says why): "
                    "nothing applied")
    owned = ownership(parsed, role, deployment.get("status"), scale)
    clash = conflict(owned, writer, name)
    if owned.owner == PLANNER:
        return done(f"spec.autoscaling.{role} of {KIND} {name} is enabled: pdd's planner "
                    f"drives {role}, so spec.replicas is not applied (turn the planner off for "
                    f"{role} to scale it from here)", conflict=clash)
    current = owned.declared
    if wanted is None:
        status["appliedReplicas"] = current
        return done(f"spec.replicas filled in from {KIND} {name} (spec.{role}.replicas "
                    f"{current})", fill=current, applied=True)
    if clash is not None:
        return done(clash[1], applied=True, conflict=clash)
    status["appliedReplicas"] = wanted
    if wanted != current:
        return done(f"spec.{role}.replicas of {KIND} {name} set to {wanted} (was {current})",
                    patch={"spec": {role: {"replicas": wanted}}}, applied=True)
    return done(f"drives spec.{role}.replicas of {KIND} {name}: {wanted}", applied=True)


def refused(result: RoleScaleSync, name: str, role: str, replicas: Any, reason: str,
            previous_applied: Any = None) -> Obj:
    """The status when the API server refused the PDDeployment's patch (the webhook or CEL
    named the problem): the value is not recorded as applied, so the next pass tries again."""
    return {**result.status, "applied": False,
            "appliedReplicas": previous_applied,
            "message": f"{KIND} {name} refused spec.{role}.replicas {replicas}: {reason}"}


def status_changed(scale: Obj, status: Obj) -> bool:
    old = scale.get("status") or {}
    return any((old.get(k) or None) != (status.get(k) or None) for k in STATUS_KEYS)
