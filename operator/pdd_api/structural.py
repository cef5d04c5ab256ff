"""What the API server does to a spec before any rule sees it, so `pdd validate`, the webhook and
a server-side dry run reach the same verdict on the same document.

The API server walks the CRD's structural schema: an explicit null where the schema declares the
field (or the map's values) is dropped, and the default, if any, applies; a JSON number with a
fraction that is (within 1e-9, relatively) a whole number between -(2^53-1) and 2^53-1 is an
integer to the schema, but a CEL rule that reads it fails ("expected int, got float64"); an
integer beyond 64 bits is not an integer at all. Inside a free-form overlay (a PodSpec) only the
declared properties are checked (type, required, maxItems, maxLength), and pydantic never sees
them, so this walk reports those problems itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cache
from typing import Any

from pdd_api.crd import spec_schema
from pdd_api.rules import RULES, conditional_reads

Path = tuple[str | int, ...]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_MAX_JSON_FLOAT = float(2**53 - 1)
_EPSILON = 1e-9
_TYPE_WORDS = {
    "integer": "an integer",
    "string": "a string",
    "boolean": "a boolean",
    "object": "an object",
    "array": "a list",
}


def describe(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def dotted(prefix: str, path: Path) -> str:
    out = prefix
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def json_integer(f: float) -> bool:
    """The API server's (go-openapi swag) test of whether a float counts as an integer,
    including its relative tolerance and its treatment of negative fractions."""
    if not math.isfinite(f) or abs(f) > _MAX_JSON_FLOAT:
        return False
    if f == math.trunc(f):
        return True
    if f < 0:
        return False  # Go's uint64(f) wraps, so the relative error is about 1
    g = float(math.trunc(f))
    if g == 0:
        return False
    return (f - g) / (f + g) < _EPSILON


@cache
def _schema() -> dict[str, Any]:
    return spec_schema()


@cache
def _cel_integers() -> frozenset[Path]:
    return frozenset(p for rule in RULES for p in rule.reads)


def normalize(spec: Mapping[str, Any], prefix: str = "spec") -> tuple[dict[str, Any], list[str]]:
    """The spec as the API server would validate it, and the schema problems pydantic cannot
    see (bounds of a free-form overlay, integers beyond 64 bits)."""
    problems: list[str] = []
    reads = _cel_integers() | conditional_reads(spec)
    out = _walk(spec, _schema(), (), prefix, problems, reads, free=False)
    return out, problems


def _walk(
    value: Any, schema: Mapping[str, Any], path: Path, prefix: str, problems: list[str],
    reads: frozenset[Path], *, free: bool,
) -> Any:
    kind = schema.get("type")
    if schema.get("x-kubernetes-int-or-string") or kind == "integer":
        return _number(value, path, prefix, problems, reads)
    if kind == "object" and isinstance(value, Mapping):
        return _object(value, schema, path, prefix, problems, reads, free=free)
    if kind == "array" and isinstance(value, list):
        items = schema.get("items", {})
        child_free = free or bool(items.get("x-kubernetes-preserve-unknown-fields"))
        out = [_walk(v, items, (*path, i), prefix, problems, reads, free=child_free)
               for i, v in enumerate(value)]
        limit = schema.get("maxItems")
        if limit is not None and len(out) > limit:
            problems.append(f"{dotted(prefix, path)}: must have at most {limit} items, "
                            f"got {len(out)}")
        return out
    if free and kind in _TYPE_WORDS and not _is(kind, value):
        problems.append(f"{dotted(prefix, path)}: must be {_TYPE_WORDS[kind]}, "
                        f"got {describe(value)}")
        return value
    limit = schema.get("maxLength")
    if isinstance(value, str) and limit is not None and len(value) > limit:
        problems.append(f"{dotted(prefix, path)}: must be at most {limit} characters, "
                        f"got {value!r}")
    return value


def _is(kind: str, value: Any) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "array":
        return isinstance(value, list)
    return isinstance(value, Mapping)


def _number(value: Any, path: Path, prefix: str, problems: list[str],
            reads: frozenset[Path]) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, float) and json_integer(value) and path not in reads:
        return round(value)
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        problems.append(f"{dotted(prefix, path)}: must be an integer between {INT64_MIN} and "
                        f"{INT64_MAX}, got {value}")
    return value


def _object(
    value: Mapping[str, Any], schema: Mapping[str, Any], path: Path, prefix: str,
    problems: list[str], reads: frozenset[Path], *, free: bool,
) -> dict[str, Any]:
    props: Mapping[str, Any] = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    child_free = free or bool(schema.get("x-kubernetes-preserve-unknown-fields"))
    out: dict[str, Any] = {}
    for key, v in value.items():
        sub = props.get(key, extra if isinstance(extra, Mapping) else None)
        if sub is None:
            out[key] = v  # unknown: pydantic refuses it, or a free-form overlay keeps it
        elif v is not None or sub.get("nullable"):
            out[key] = _walk(v, sub, (*path, key), prefix, problems, reads, free=child_free)
    if free:
        problems += [f"{dotted(prefix, (*path, r))}: required"
                     for r in schema.get("required", ()) if r not in out]
    limit = schema.get("maxProperties")
    if limit is not None and len(out) > limit:
        problems.append(f"{dotted(prefix, path)}: must have at most {limit} entries, "
                        f"got {len(out)}")
    return out
