"""One validation for every entry point: structure from the models, values from rules.py.

Every problem of a document is reported at once, each as `<field path>: <what> , got <value>`,
because a user fixing a GitOps commit wants the whole list, not one error per push.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from pdd_api.models import (
    API_GROUP,
    API_VERSION,
    KIND,
    ROLE_SCALE_KIND,
    ROLES,
    PDDeploymentSpec,
    PDDRoleScaleSpec,
)
from pdd_api.names import MAX_NAME_LENGTH, MAX_NAME_LENGTH_LWS, NAME_PATTERN, lws_name_message
from pdd_api.rules import ROLE_SCALE_REPLICAS, check_rules, lookup
from pdd_api.structural import describe as _describe
from pdd_api.structural import normalize

API_VERSION_FULL = f"{API_GROUP}/{API_VERSION}"
_DNS_LABEL = re.compile(NAME_PATTERN)


class InvalidSpecError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class UnusableInputError(ValueError):
    """Input that is not YAML or not a set of objects at all (exit 2, not 1)."""


def _structural(spec: Any, prefix: str) -> list[str]:
    try:
        PDDeploymentSpec.model_validate(spec)
    except ValidationError as exc:
        return [_message(err, prefix) for err in exc.errors()]
    return []


_UNION_TAGS = {"int", "str"}  # pydantic names the member of `int | str` that failed
_TYPE_WORDS = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "a boolean",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "list_type": "a list",
}


def _message(err: Mapping[str, Any], prefix: str) -> str:
    loc = [str(p) for p in err["loc"] if str(p) not in _UNION_TAGS]
    path = ".".join([prefix, *_join_indices(loc)])
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"{path}: unknown field"
    if kind == "missing":
        return f"{path}: required"
    if kind in _TYPE_WORDS:
        return f"{path}: must be {_TYPE_WORDS[kind]}, got {_describe(err['input'])}"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"{path}: must be one of {expected}, got {_describe(err['input'])}"
    return f"{path}: {err['msg']}, got {_describe(err['input'])}"


def _join_indices(loc: list[str]) -> list[str]:
    """['tolerations', '0', 'key'] -> ['tolerations[0]', 'key']."""
    out: list[str] = []
    for part in loc:
        if part.isdigit() and out:
            out[-1] += f"[{part}]"
        else:
            out.append(part)
    return out


def _dedupe(problems: list[str]) -> list[str]:
    """Union members report the same field twice (int | str); keep each message once."""
    seen: dict[str, None] = {}
    for p in problems:
        seen.setdefault(p, None)
    return list(seen)


def validate_spec(spec: Any, prefix: str = "spec") -> list[str]:
    """Problems of a spec as the API server sees it: explicit nulls dropped (defaults apply),
    integral floats read as integers where no CEL rule reads them (structural.py)."""
    if not isinstance(spec, Mapping):
        return [f"{prefix}: must be an object, got {_describe(spec)}"]
    spec, schema_problems = normalize(spec, prefix)
    return _dedupe(_structural(spec, prefix) + schema_problems + check_rules(spec))


def spans_pods(spec: Any) -> bool:
    """Whether a role of the spec runs as a LeaderWorkerSet (gpusPerPod below its TP)."""
    if not isinstance(spec, Mapping):
        return False
    for role in ROLES:
        g, tp = lookup(spec, f"{role}.gpusPerPod"), lookup(spec, f"{role}.tensorParallelSize")
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (g, tp)) and g < tp:
            return True
    return False


def validate_name(name: Any, spec: Any = None) -> list[str]:
    """The name alone, and with `spec` the tighter limit of a spec whose roles span pods."""
    if not isinstance(name, str) or not name:
        return ["metadata.name: required"]
    if len(name) > MAX_NAME_LENGTH or not _DNS_LABEL.match(name):
        return [
            f"metadata.name: must be a lowercase DNS label (a-z, 0-9, '-') of at most "
            f"{MAX_NAME_LENGTH} characters, got {name!r}"
        ]
    if len(name) > MAX_NAME_LENGTH_LWS and spans_pods(spec):
        return [lws_name_message(name)]
    return []


def validate_role_scale_spec(spec: Any) -> list[str]:
    """Problems of a PDDRoleScale's spec, by the same schema its CRD carries (crd.py)."""
    if not isinstance(spec, Mapping):
        return [f"spec: must be an object, got {_describe(spec)}"]
    problems: list[str] = []
    try:
        PDDRoleScaleSpec.model_validate(spec)
    except ValidationError as exc:
        problems += [_message(err, "spec") for err in exc.errors()]
    name = spec.get("deployment")
    if isinstance(name, str) and (not name or len(name) > MAX_NAME_LENGTH
                                  or not _DNS_LABEL.match(name)):
        problems.append(f"spec.deployment: must be a PDDeployment's name (a lowercase DNS "
                        f"label of at most {MAX_NAME_LENGTH} characters), got {name!r}")
    out_of_range = ROLE_SCALE_REPLICAS.check(spec)
    if out_of_range is not None:
        problems.append(out_of_range)
    return _dedupe(problems)


def validate_document(doc: Any) -> list[str]:
    """Problems of one PDDeployment (or PDDRoleScale) object; empty when valid."""
    if not isinstance(doc, Mapping):
        return [f"<document>: must be an object, got {_describe(doc)}"]
    problems: list[str] = []
    if doc.get("kind") == ROLE_SCALE_KIND and doc.get("apiVersion") == API_VERSION_FULL:
        meta = doc.get("metadata")
        if not isinstance(meta, Mapping) or not meta.get("name"):
            problems.append("metadata.name: required")
        return problems + (validate_role_scale_spec(doc["spec"]) if "spec" in doc
                           else ["spec: required"])
    if doc.get("apiVersion") != API_VERSION_FULL:
        problems.append(
            f"apiVersion: must be {API_VERSION_FULL}, got {_describe(doc.get('apiVersion'))}"
        )
    if doc.get("kind") != KIND:
        problems.append(f"kind: must be {KIND}, got {_describe(doc.get('kind'))}")
    meta = doc.get("metadata")
    problems += validate_name(meta.get("name") if isinstance(meta, Mapping) else None,
                              doc.get("spec"))
    if "spec" not in doc:
        problems.append("spec: required")
    else:
        problems += validate_spec(doc["spec"])
    return problems


def parse_spec(spec: Any) -> PDDeploymentSpec:
    """A validated, defaulted spec; InvalidSpecError lists every problem."""
    problems = validate_spec(spec)
    if problems:
        raise InvalidSpecError(problems)
    return PDDeploymentSpec.model_validate(normalize(spec)[0])


def load_documents(text: str) -> list[Any]:
    """Non-empty YAML documents of a file (kubectl accepts several per file)."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise UnusableInputError(f"not valid YAML{where}: {problem}") from None
    if not docs:
        raise UnusableInputError("no YAML documents found")
    return docs


def describe_document(index: int, doc: Any) -> str:
    """`document 2 (my-pdd)`: says which document of a multi-document file is meant."""
    name = None
    if isinstance(doc, Mapping) and isinstance(doc.get("metadata"), Mapping):
        name = doc["metadata"].get("name")
    return f"document {index + 1}" + (f" ({name})" if name else "")
