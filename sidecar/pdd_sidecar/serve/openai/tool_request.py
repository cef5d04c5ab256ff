"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, and the tool turns of its
messages, checked before the chat template sees them.

Why here and not in the template: a template concatenates what it is given, so an argument that
is not a string or a tool without a name would come back as a template error (or worse, a
prompt the model was never trained on) instead of a 400 naming the field.

`tool_choice` `required` and a named function ask for an answer that must be a call: the
request carries a grammar that forces one (serve/openai/tool_grammar.py, through structured output).
Under `auto` a tool with `strict: true` asks that a call, if the model makes one, match its
schema: the grammar then lets the answer be text, a call block, or text then a block.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")


class ToolRequestError(ValueError):
    """Bad tool input; `param` is the top-level field to name in the 400."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    """The tools a chat request offers and what the router does with them."""

    tools: tuple[dict[str, Any], ...]  # rendered through the template (tool_choice != none)
    names: frozenset[str]
    parse: bool  # parse the model's tool-call block into tool_calls (not tool_choice none)
    parallel: bool  # parallel_tool_calls: false ends the answer after its first call
    forced: bool = False  # tool_choice required or named: the answer must be calls
    named: str | None = None  # tool_choice names this function: one call of it
    strict: bool = False  # tool_choice auto with a strict tool: calls follow the schemas


def _short(v: Any, limit: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "..."


@lru_cache(maxsize=256)
def _schema_problem(text: str) -> str:
    """What is wrong with a JSON schema, or "". Cached by its text: checking one costs
    milliseconds, and a client sends the same tools with every turn."""
    from jsonschema import SchemaError, validators

    schema = json.loads(text)
    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        return _short(exc.message, 120)
    except RecursionError:
        return "it is nested too deep"
    return ""


def _tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ToolRequestError(f"{where} must be an object "
                               '{"type": "function", "function": {...}}', "tools")
    if tool.get("type") != "function":
        raise ToolRequestError(f"{where}.type must be \"function\", got "
                               f"{_short(tool.get('type'))}", "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ToolRequestError(f"{where}.function must be an object with a name", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ToolRequestError(f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, "
                               f"got {_short(name)}", "tools")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ToolRequestError(f"{where}.function.description must be a string", "tools")
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ToolRequestError(f"{where}.function.parameters must be a JSON schema "
                                   f"object, got {_short(params)}", "tools")
        try:
            problem = _schema_problem(json.dumps(params, sort_keys=True))
        except (RecursionError, ValueError):
            problem = "it is nested too deep"
        if problem:
            raise ToolRequestError(f"{where}.function.parameters is not a valid JSON schema: "
                                   f"{problem}", "tools")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolRequestError(f"{where}.function.strict must be true or false", "tools")
    return tool


def tool_spec(body: Mapping[str, Any]) -> ToolSpec | None:
    """None when the request offers no tools (and asks for none)."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise ToolRequestError(f"tools must be a list of function tools, got {_short(raw)}",
                               "tools")
    tools = [_tool(i, t) for i, t in enumerate(raw or [])]
    names = [t["function"]["name"] for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ToolRequestError(f"tools: function names must be unique, {dup[0]!r} is given "
                               "more than once", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolRequestError(f"parallel_tool_calls must be true or false, got "
                               f"{_short(parallel)}", "parallel_tool_calls")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ToolRequestError(f"tool_choice must be one of {', '.join(CHOICES)} or "
                                   '{"type": "function", "function": {"name": ...}}, got '
                                   f"{_short(choice)}", "tool_choice")
        named = None
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        named = choice["function"]["name"]
        if named not in names:
            raise ToolRequestError(f"tool_choice names the function {_short(named)}, which is "
                                   "not among tools", "tool_choice")
    else:
        raise ToolRequestError('tool_choice must be "none", "auto", "required" or '
                               '{"type": "function", "function": {"name": ...}}, got '
                               f"{_short(choice)}", "tool_choice")
    if not tools:
        if choice != "none":
            raise ToolRequestError(f"tool_choice {_short(choice)} needs tools; none are given",
                                   "tool_choice")
        return None
    if choice == "none":
        return ToolSpec((), frozenset(names), parse=False, parallel=parallel is not False)
    forced = named is not None or choice == "required"
    return ToolSpec(tuple(tools), frozenset(names), parse=True, parallel=parallel is not False,
                    forced=forced, named=named,
                    strict=not forced and any(t["function"].get("strict") for t in tools))


def check_tool_turns(i: int, message: Mapping[str, Any]) -> None:
    """An assistant turn's `tool_calls` and a `tool` turn, as the templates concatenate them."""
    where = f"messages[{i}]"
    role = message.get("role")
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise ToolRequestError(f"{where}.tool_calls: only assistant messages carry tool "
                                   "calls", "messages")
        if not isinstance(calls, list):
            raise ToolRequestError(f"{where}.tool_calls must be a list", "messages")
        for j, call in enumerate(calls):
            at = f"{where}.tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if (not isinstance(call, dict) or call.get("type") != "function"
                    or not isinstance(fn, dict)):
                raise ToolRequestError(f"{at} must be {{\"type\": \"function\", \"function\": "
                                       "{\"name\", \"arguments\"}}", "messages")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ToolRequestError(f"{at}.function.name must be a non-empty string",
                                       "messages")
            if not isinstance(fn.get("arguments"), str):
                raise ToolRequestError(f"{at}.function.arguments must be a string (JSON "
                                       "text), got " + _short(fn.get("arguments")), "messages")
            if call.get("id") is not None and not isinstance(call["id"], str):
                raise ToolRequestError(f"{at}.id must be a string", "messages")
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise ToolRequestError(f"{where}.tool_call_id must be a string (the id of the "
                                   "call this answers)", "messages")
        if message.get("content") is None:
            raise ToolRequestError(f"{where}.content: a tool message needs the tool's result",
                                   "messages")
