"""The grammar that makes an answer a DeepSeek tool-call block: `tool_choice` `required` (one or
more calls of the offered tools) and a named function (one call of it).

A Lark grammar as llguidance reads it (the structured-output spec of kind "lark",
pdd_sidecar/grammar.py): the markers by token id (`<[id]>`, they are special tokens no text
spells), the function names and fences as text, each function's arguments as its `parameters`
JSON schema (`%json`), compact (a small model given free whitespace may spend every token on
it). The block ends with `<｜tool▁calls▁end｜>`, where the grammar is complete and the instance
ends the sequence; serve/openai/tool_parser.py then reads it like any other.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pdd_sidecar.serve.openai.tool_parser import Markers

COMPACT = {"whitespace_flexible": False}


def _schema(tool: dict[str, Any]) -> str:
    params = tool["function"].get("parameters")
    schema = dict(params) if isinstance(params, dict) else {"type": "object"}
    schema.setdefault("x-guidance", COMPACT)
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def tool_call_grammar(tools: Sequence[dict[str, Any]], markers: Markers,
                      named: str | None = None, parallel: bool = True,
                      optional: bool = False) -> str:
    """``named``: only that function, once; else any of ``tools``, once or (``parallel``)
    more times, one per line as DeepSeek's template writes them. ``optional`` (tool_choice
    auto with a strict tool): free text first, then the block or nothing; the text cannot
    spell a marker (they are special tokens), so a call always goes through the block's rules."""
    chosen = [t for t in tools if named is None or t["function"]["name"] == named]
    if not chosen:
        raise ValueError(f"tool_call_grammar: no tool named {named!r}")
    more = ' ("\\n" call)*' if parallel and named is None else ""
    calls = f"<[{markers.calls_begin}]> call{more} <[{markers.calls_end}]>"
    rules = (["start: TEXT? calls?", "TEXT: /(.|\\n)+/", f"calls: {calls}"] if optional
             else [f"start: {calls}"])
    rules += [f"call: <[{markers.call_begin}]> \"function\" <[{markers.sep}]> fn",
              "fn: " + " | ".join(f"f{i}" for i in range(len(chosen)))]
    for i, tool in enumerate(chosen):
        header = json.dumps(tool["function"]["name"] + "\n```json\n")
        rules.append(f"f{i}: {header} a{i} \"\\n```\" <[{markers.call_end}]>")
        rules.append(f"a{i}: %json {_schema(tool)}")
    return "\n".join(rules) + "\n"
