"""The CRD, generated from the models and rules so schema, defaults and CEL never drift."""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from pdd_api.models import (
    API_GROUP,
    API_VERSION,
    KIND,
    PLURAL,
    ROLE_SCALE_KIND,
    ROLE_SCALE_PLURAL,
    ROLE_SCALE_SHORT_NAME,
    ROLES,
    SHORT_NAME,
    PDDeploymentSpec,
    PDDeploymentStatus,
    PDDRoleScaleSpec,
    PDDRoleScaleStatus,
)
from pdd_api.names import (
    MAX_NAME_LENGTH,
    MAX_NAME_LENGTH_LWS,
    NAME_PATTERN,
    lws_name_message,
)
from pdd_api.rules import ROLE_SCALE_REPLICAS, RULES

_SCALARS = {int: "integer", str: "string", bool: "boolean", float: "number"}


def _strip_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
        return Union[tuple(args)]  # noqa: UP007
    return annotation


def type_schema(annotation: Any) -> dict[str, Any]:
    annotation = _strip_optional(annotation)
    origin = get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return object_schema(annotation)
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    if origin is Literal:
        values = list(get_args(annotation))
        return {"type": _SCALARS[type(values[0])], "enum": values}
    if origin is list:
        return {"type": "array", "items": type_schema(get_args(annotation)[0])}
    if origin is dict:
        return {"type": "object", "additionalProperties": type_schema(get_args(annotation)[1])}
    if origin in (Union, types.UnionType) and set(get_args(annotation)) == {int, str}:
        return {"x-kubernetes-int-or-string": True}
    raise TypeError(f"no CRD schema for {annotation!r}")


def _field_schema(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if extra.get("x-kubernetes-preserve-unknown-fields"):
        schema: dict[str, Any] = {"type": "object", **extra}
    else:
        schema = type_schema(field.annotation)
        schema.update(extra)
    if field.description:
        schema = {"description": field.description, **schema}
    default = None if field.is_required() else field.get_default(call_default_factory=True)
    if isinstance(default, BaseModel):
        schema["default"] = {}
    elif default is not None:
        schema["default"] = default
    return schema


def object_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": {}}
    required = []
    for name, field in model.model_fields.items():
        schema["properties"][name] = _field_schema(field)
        if field.is_required():
            required.append(name)
    if required:
        schema["required"] = required
    return schema


def spec_schema() -> dict[str, Any]:
    schema = object_schema(PDDeploymentSpec)
    schema["description"] = (
        "Desired prefill/decode deployment. Validated by CEL here, by the operator's webhook "
        "and by `pdd validate`, with the same messages."
    )
    schema["x-kubernetes-validations"] = [rule.cel() for rule in RULES]
    return schema


def name_rule() -> dict[str, str]:
    """metadata.name leaves room for `-prefill-<i>` in a DNS label: checked by the API server
    itself, so no webhook is needed for it (same words as `pdd validate`)."""
    name = "self.metadata.name"
    return {
        "rule": f"{name}.size() <= {MAX_NAME_LENGTH} && {name}.matches('{NAME_PATTERN}')",
        "messageExpression": (
            "\"metadata.name: must be a lowercase DNS label (a-z, 0-9, '-') of at most "
            f"{MAX_NAME_LENGTH} characters, got '%s'\".format([{name}])"),
        "reason": "FieldValueInvalid",
    }


def name_lws_rule() -> dict[str, str]:
    """The tighter name limit of a spec whose roles span pods (validation.spans_pods)."""
    name = "self.metadata.name"
    spans = " || ".join(
        f"(has(self.spec.{r}) && has(self.spec.{r}.gpusPerPod) && "
        f"has(self.spec.{r}.tensorParallelSize) && "
        f"self.spec.{r}.gpusPerPod < self.spec.{r}.tensorParallelSize)" for r in ROLES)
    head, _, _ = lws_name_message("%s").rpartition("'%s'")
    return {
        "rule": f"!has(self.spec) || {name}.size() <= {MAX_NAME_LENGTH_LWS} || !({spans})",
        "messageExpression": f"\"{head}'%s'\".format([{name}])",
        "reason": "FieldValueInvalid",
    }


def _ready_column(name: str, ctype: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "string",
        "jsonPath": f'.status.conditions[?(@.type=="{ctype}")].status',
    }


def crd() -> dict[str, Any]:
    status = object_schema(PDDeploymentStatus)
    status["description"] = "Observed state, written by the operator."
    columns = [
        {"name": "P-TP", "type": "integer", "jsonPath": ".spec.prefill.tensorParallelSize"},
        {"name": "P-DCP", "type": "integer",
         "jsonPath": ".spec.prefill.decodeContextParallelSize"},
        {"name": "D-TP", "type": "integer", "jsonPath": ".spec.decode.tensorParallelSize"},
        {"name": "D-DCP", "type": "integer", "jsonPath": ".spec.decode.decodeContextParallelSize"},
        {"name": "Case", "type": "string", "jsonPath": ".status.routingCase"},
        _ready_column("Ready", "Ready"),
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return _definition(
        KIND, PLURAL, {"shortNames": [SHORT_NAME], "categories": ["all"]},
        # The scale subresource drives decode replicas (kubectl scale, HPA, KEDA): decode is
        # what grows with concurrent sequences; prefill's is a PDDRoleScale's.
        {"specReplicasPath": ".spec.decode.replicas",
         "statusReplicasPath": ".status.decode.replicas",
         "labelSelectorPath": ".status.decode.selector"},
        columns,
        "PDDeployment runs prefill/decode disaggregated inference of an MLA model with decode "
        "context parallelism, handing KV from prefill to decode over NIXL.",
        spec_schema(), status, {"x-kubernetes-validations": [name_rule(), name_lws_rule()]})


def _definition(kind: str, plural: str, names: dict[str, Any], scale: dict[str, str],
                columns: list[dict[str, Any]], description: str, spec: dict[str, Any],
                status: dict[str, Any], root_extra: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """A namespaced CRD of one served version with status and scale subresources."""
    root = {
        "type": "object",
        "description": description,
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "required": ["spec"],
        **(root_extra or {}),
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural,
                      "singular": kind.lower(), **names},
            "scope": "Namespaced",
            "versions": [{
                "name": API_VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}, "scale": scale},
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": root},
            }],
        },
    }


def role_scale_crd() -> dict[str, Any]:
    spec = object_schema(PDDRoleScaleSpec)
    spec["description"] = "Which PDDeployment role this object scales, and to how many."
    spec["properties"]["deployment"].update(
        {"minLength": 1, "maxLength": MAX_NAME_LENGTH, "pattern": NAME_PATTERN})
    spec["properties"]["replicas"].update(
        {"minimum": ROLE_SCALE_REPLICAS.lo, "maximum": ROLE_SCALE_REPLICAS.hi})
    spec["x-kubernetes-validations"] = [{
        "rule": "self.deployment == oldSelf.deployment && self.role == oldSelf.role",
        "message": "spec.deployment and spec.role are immutable: create another PDDRoleScale "
                   "for another role",
    }]
    status = object_schema(PDDRoleScaleStatus)
    status["description"] = "Observed state, written by the operator."
    columns = [
        {"name": "Deployment", "type": "string", "jsonPath": ".spec.deployment"},
        {"name": "Role", "type": "string", "jsonPath": ".spec.role"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
        {"name": "Current", "type": "integer", "jsonPath": ".status.replicas"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Applied", "type": "boolean", "jsonPath": ".status.applied"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return _definition(
        ROLE_SCALE_KIND, ROLE_SCALE_PLURAL, {"shortNames": [ROLE_SCALE_SHORT_NAME]},
        {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
         "labelSelectorPath": ".status.selector"},
        columns,
        "PDDRoleScale is one PDDeployment role's replicas behind a scale subresource of its "
        "own, for an HPA, KEDA or `kubectl scale` to drive prefill (PDDeployment's own scale "
        "subresource is decode's).",
        spec, status)


def crd_yaml() -> str:
    return yaml.safe_dump(crd(), sort_keys=False, width=100)


def role_scale_crd_yaml() -> str:
    return yaml.safe_dump(role_scale_crd(), sort_keys=False, width=100)
