"""The structured-output fields of an OpenAI / vLLM request, read into the one spec the instances
take (pdd_sidecar/grammar.py): ``sampling["structured"] = {"kind", "value"}``.

The forms clients send: OpenAI's ``response_format`` (``json_object``; ``json_schema`` with
``{"name", "schema", "strict"}``), vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` and its newer ``structured_outputs`` (one of ``json``,
``regex``, ``choice``, ``grammar``, ``json_object``). At most one of them per request: two
would have to be intersected, which no engine does. The spec is compiled (cached) here, so a
schema the engine cannot compile is a 400 naming the field before any instance works on it.

``structured_spec`` is the one entry point; tool calling (``tool_choice`` required / named)
builds its own ``lark`` spec (tool_grammar.py: the tool-call block, each call's arguments
under its tool's schema) with ``grammar.Spec`` and puts ``spec.to_json()`` under the same key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pdd_sidecar.grammar import STRUCTURED, GrammarError, Spec, check, parse_spec

FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "structured_outputs")
_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                 "grammar": "lark", "json_object": "json_object"}


class StructuredError(ValueError):
    """A 400 naming ``param``, the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _schema(value: Any, where: str) -> Any:
    """A JSON schema sent as an object, or as a string holding one (vLLM takes both)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise GrammarError(f"{where}: a string schema must be JSON: {exc}") from None
    return value


def _response_format(v: Any) -> dict[str, Any] | None:
    if not isinstance(v, Mapping):
        raise GrammarError("response_format: must be an object with a type")
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_object", "value": None}
    if kind == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, Mapping):
            raise GrammarError('response_format.json_schema: must be an object {"name", '
                               '"schema", "strict"}')
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise GrammarError("response_format.json_schema.name: must be a string")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarError("response_format.json_schema.strict: must be true or false")
        schema = js.get("schema")
        if schema is None:
            raise GrammarError("response_format.json_schema.schema: required (the JSON schema "
                               "the answer must match)")
        return {"kind": "json_schema", "value": _schema(schema, "response_format")}
    raise GrammarError(f"response_format.type: must be text, json_object or json_schema, got "
                       f"{str(kind)[:40]!r}")


def _structured_outputs(v: Any) -> dict[str, Any] | None:
    if not isinstance(v, Mapping):
        raise GrammarError("structured_outputs: must be an object with one of "
                           f"{', '.join(_OUTPUTS_KEYS)}")
    unknown = sorted(k for k in v if k not in _OUTPUTS_KEYS and v[k] is not None)
    if unknown:
        raise GrammarError(f"structured_outputs.{unknown[0][:40]}: not supported (pdd takes "
                           f"{', '.join(_OUTPUTS_KEYS)})")
    given = [k for k in _OUTPUTS_KEYS if v.get(k) is not None and v.get(k) is not False]
    if len(given) > 1:
        raise GrammarError(f"structured_outputs: give one of {', '.join(_OUTPUTS_KEYS)}, got "
                           f"{' and '.join(given)}")
    if not given:
        return None
    key = given[0]
    if key == "json_object":
        if v[key] is not True:
            raise GrammarError("structured_outputs.json_object: must be true")
        return {"kind": "json_object", "value": None}
    value = _schema(v[key], "structured_outputs.json") if key == "json" else v[key]
    return {"kind": _OUTPUTS_KEYS[key], "value": value}


def _raw(name: str, v: Any) -> dict[str, Any] | None:
    if name == "response_format":
        return _response_format(v)
    if name == "structured_outputs":
        return _structured_outputs(v)
    if name == "guided_json":
        return {"kind": "json_schema", "value": _schema(v, name)}
    kind = {"guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "lark"}[name]
    return {"kind": kind, "value": v}


def structured_spec(body: Mapping[str, Any], compile_check: bool = True) -> Spec | None:
    """The request's one structured-output spec, or None; ``StructuredError`` (a 400 naming the
    field) for a malformed one, two of them, or one the engine cannot compile. Put
    ``spec.to_json()`` under ``sampling[STRUCTURED]``."""
    found: list[tuple[str, Spec]] = []
    for name in FIELDS:
        v = body.get(name)
        if v is None:
            continue
        try:
            spec = parse_spec(_raw(name, v), name)
            if spec is not None and compile_check:
                check(spec)
        except GrammarError as exc:
            message = str(exc)
            if not message.startswith(name):
                message = f"{name}: {message}"
            raise StructuredError(message, name) from None
        if spec is not None:
            found.append((name, spec))
    if len(found) > 1:
        names = [n for n, _ in found]
        raise StructuredError(f"{names[1]}: only one structured-output field per request, got "
                              f"{' and '.join(names)}", names[1])
    return found[0][1] if found else None


def structured_outputs(structured: Mapping[str, Any]) -> dict[str, Any]:
    """An instance API ``sampling["structured"]`` object as vLLM's ``structured_outputs``
    field: what the router sends upstreams that speak vLLM's protocol, which read no
    ``structured`` key."""
    key = next(k for k, kind in _OUTPUTS_KEYS.items() if kind == structured["kind"])
    return {key: True if key == "json_object" else structured["value"]}


__all__ = ["FIELDS", "STRUCTURED", "StructuredError", "structured_outputs", "structured_spec"]
