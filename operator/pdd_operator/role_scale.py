"""PDDRoleScale: one role's replicas behind a scale subresource of its own.

A CRD has one scale subresource and PDDeployment's is decode's, so an HPA or KEDA cannot reach
prefill through it. A PDDRoleScale carries one role's replicas: the operator copies its
spec.replicas into the PDDeployment's spec.<role>.replicas (what `kubectl scale pdd` does for
decode) and the role's pods, ready pods and selector back into its status. The PDDeployment
stays the one object the reconciler builds from, so a PDDRoleScale adds no second source of
truth for the pods, only a second door to one field.

Pure: the handler (handlers.py) fetches and writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pdd_api.autoscale import role_autoscaling
from pdd_api.models import KIND, ROLE_SCALE_KIND, PDDRoleScaleStatus
from pdd_api.validation import InvalidSpecError, parse_spec

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


def sync(scale: Obj, deployment: Obj | None, scales: Iterable[Obj]) -> RoleScaleSync:
    """The writes that make `deployment`'s spec.<role>.replicas follow `scale` and `scale`'s
    status follow the deployment. `scales`: the namespace's PDDRoleScales (`scale` among
    them)."""
    spec = scale.get("spec") or {}
    name, role = spec.get("deployment", ""), spec.get("role", "")
    wanted = spec.get("replicas")
    status: Obj = {"replicas": 0, "readyReplicas": 0, "selector": None, "applied": False,
                   "observedGeneration": (scale.get("metadata") or {}).get("generation")}

    def done(message: str, patch: Obj | None = None, fill: int | None = None,
             applied: bool = False) -> RoleScaleSync:
        return RoleScaleSync(patch, fill, {**status, "applied": applied, "message": message})

    if deployment is None:
        return done(f"{KIND} {name} not found in this namespace")
    role_status = ((deployment.get("status") or {}).get(role) or {})
    status.update(replicas=int(role_status.get("replicas") or 0),
                  readyReplicas=int(role_status.get("readyReplicas") or 0),
                  selector=role_status.get("selector"))
    first = driver(scales, name, role)
    mine = (scale.get("metadata") or {}).get("name")
    if first is not None and (first.get("metadata") or {}).get("name") != mine:
        return done(f"{ROLE_SCALE_KIND} {first['metadata']['name']} drives {role} of {KIND} "
                    f"{name} already: this one is not applied")
    try:
        parsed = parse_spec(deployment.get("spec"))
    except InvalidSpecError:
        return done(f"{KIND} {name} is not valid (its Validated condition says why): "
                    "nothing applied")
    if role_autoscaling(parsed, role) is not None:
        return done(f"spec.autoscaling.{role} of {KIND} {name} is enabled: pdd's planner "
                    f"drives {role}, so spec.replicas is not applied (turn the planner off for "
                    f"{role} to scale it from here)")
    current = getattr(parsed, role).replicas
    if wanted is None:
        return done(f"spec.replicas filled in from {KIND} {name} (spec.{role}.replicas "
                    f"{current})", fill=current, applied=True)
    if wanted != current:
        return done(f"spec.{role}.replicas of {KIND} {name} set to {wanted} (was {current})",
                    patch={"spec": {role: {"replicas": wanted}}}, applied=True)
    return done(f"drives spec.{role}.replicas of {KIND} {name}: {wanted}", applied=True)


def refused(result: RoleScaleSync, name: str, role: str, replicas: Any, reason: str) -> Obj:
    """The status when the API server refused the PDDeployment's patch (the webhook or CEL
    named the problem)."""
    return {**result.status, "applied": False,
            "message": f"{KIND} {name} refused spec.{role}.replicas {replicas}: {reason}"}


def status_changed(scale: Obj, status: Obj) -> bool:
    old = scale.get("status") or {}
    return any(old.get(k) != status.get(k) for k in STATUS_KEYS)
