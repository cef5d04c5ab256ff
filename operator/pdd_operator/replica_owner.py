"""Who drives a role's replicas: exactly one of pdd's planner, a PDDRoleScale, the spec.

The owner is derived from the world on every pass, never remembered: the planner where
spec.autoscaling.<role> is enabled; else the PDDRoleScale that drives the role
(role_scale.driver); else spec.<role>.replicas. Whatever else writes the role's replicas is not
followed (the pods keep the owner's count) and is reported, naming the other writer as the
API server's managedFields record it, so two writers never take turns on every pass.

A PDDRoleScale writes its value into the PDDeployment's spec once per change of its own
spec.replicas and records it once the API server accepted it (status.appliedReplicas): that is
the count built, so a value the PDDeployment's webhook or CEL refuses is never built. A spec that
differs from a value already applied was written by someone else: a conflict, not a cue to
write again.

Pure: the reconciler and the PDDRoleScale sync (handlers.py) read and write.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdd_api import keys
from pdd_api.autoscale import effective_replicas, role_autoscaling
from pdd_api.models import KIND, ROLE_SCALE_KIND, ROLES, PDDeploymentSpec
from pdd_operator.conditions import PLANNER_DRIVES_ROLE, SCALE_IGNORED, SPEC_REPLICAS_WRITTEN

Obj = dict[str, Any]
PLANNER, ROLE_SCALE, SPEC = "planner", ROLE_SCALE_KIND, "spec"


@dataclass(frozen=True)
class Writer:
    """The manager that last set spec.<role>.replicas (metadata.managedFields), and whether
    it wrote through the scale subresource (an HPA, KEDA, `kubectl scale`)."""

    manager: str
    subresource: str = ""

    def __str__(self) -> str:
        return self.manager + (" (through the scale subresource)"
                               if self.subresource == "scale" else "")


@dataclass(frozen=True)
class Ownership:
    """One role's owner and the replicas the builders use; `declared`: spec.<role>.replicas;
    `scale`, `wanted`, `applied`: the PDDRoleScale naming the role, its spec.replicas and its
    status.appliedReplicas, if any."""

    role: str
    owner: str
    replicas: int
    declared: int
    scale: str | None = None
    wanted: int | None = None
    applied: int | None = None


def replicas_writers(body: Mapping[str, Any]) -> dict[str, Writer]:
    """Per role, the manager owning spec.<role>.replicas in managedFields (the last to change
    it: an update takes a field from the managers that held it)."""
    out: dict[str, Writer] = {}
    for entry in (body.get("metadata") or {}).get("managedFields") or []:
        spec = ((entry.get("fieldsV1") or {}).get("f:spec") or {})
        for role in ROLES:
            if "f:replicas" in (spec.get(f"f:{role}") or {}):
                out[role] = Writer(str(entry.get("manager") or "unknown"),
                                   str(entry.get("subresource") or ""))
    return out


def owner_of(spec: PDDeploymentSpec, role: str, scale: Obj | None) -> str:
    """The planner wins over a PDDRoleScale, which wins over the spec."""
    if role_autoscaling(spec, role) is not None:
        return PLANNER
    return ROLE_SCALE if scale is not None else SPEC


def _outsider(writer: Writer | None) -> str:
    if writer is None or writer.manager == keys.FIELD_MANAGER:
        return "a writer outside pdd"
    return str(writer)


def ownership(spec: PDDeploymentSpec, role: str, status: Mapping[str, Any] | None,
              scale: Obj | None) -> Ownership:
    """`scale`: the PDDRoleScale driving the role (role_scale.driver), if any; `status`: the
    PDDeployment's (the planner's decisions)."""
    owner = owner_of(spec, role, scale)
    declared = getattr(spec, role).replicas
    name = str((scale or {}).get("metadata", {}).get("name") or "") or None
    wanted, applied = _int((scale or {}).get("spec", {}).get("replicas")), _int(
        (scale or {}).get("status", {}).get("appliedReplicas"))
    if owner == PLANNER:
        replicas = effective_replicas(spec, status)[role]
    else:
        replicas = declared if applied is None or owner == SPEC else applied
    return Ownership(role, owner, replicas, declared, name, wanted, applied)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def conflict(owned: Ownership, writer: Writer | None,
             deployment: str) -> tuple[str, str] | None:
    """(reason, message naming both writers) where a writer other than the owner set the
    role's replicas, else None. `writer`: the last writer of spec.<role>.replicas of
    PDDeployment `deployment`."""
    role = owned.role
    if owned.owner == PLANNER:
        why = (f"the planner drives {role} (spec.autoscaling.{role} of {KIND} {deployment} is "
               f"enabled: {owned.replicas} replicas)")
        if owned.scale is not None:
            return PLANNER_DRIVES_ROLE, (
                f"{ROLE_SCALE_KIND} {owned.scale} sets {role} replicas, but {why}: its "
                "spec.replicas is not applied")
        if writer is not None and writer.subresource == "scale":
            return SCALE_IGNORED, (
                f"{writer} set spec.{role}.replicas to {owned.declared}, but {why}: that value "
                f"has no effect (remove the HorizontalPodAutoscaler or ScaledObject targeting "
                f"{KIND} {deployment}, or turn the planner off for {role})")
        return None
    if owned.owner == ROLE_SCALE and owned.wanted is not None and (
            owned.applied == owned.wanted != owned.declared):
        return SPEC_REPLICAS_WRITTEN, (
            f"{_outsider(writer)} set spec.{role}.replicas of {KIND} {deployment} to "
            f"{owned.declared}, but {ROLE_SCALE_KIND} {owned.scale} drives {role} "
            f"({owned.wanted} replicas): not followed, and not written back (scale "
            f"{ROLE_SCALE_KIND} {owned.scale} instead, or delete it to hand {role} back to the "
            "spec)")
    return None
