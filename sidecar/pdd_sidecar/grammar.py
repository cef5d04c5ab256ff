"""Structured output's grammar specs: what a request asks its answer to match, turned into an
llguidance grammar once per distinct spec.

A spec is the one key ``"structured"`` of the instance API's ``sampling`` object:
``{"kind": KIND, "value": ...}`` with ``kind`` one of ``KINDS``:

- ``json_schema``: ``value`` a JSON schema (an object; properties come out in its order),
- ``json_object``: any JSON object (``value`` null),
- ``regex``: ``value`` a regular expression the whole answer matches (Rust regex syntax),
- ``choice``: ``value`` a non-empty list of strings, the answer exactly one of them,
- ``lark``: ``value`` a grammar, Lark as llguidance reads it, or GBNF (llama.cpp's EBNF).

The router builds it from the OpenAI / vLLM fields (serve/openai/structured_request.py) and checks
it here before any instance works on it; both instances parse it again (an instance API client may
send one directly). Why llguidance and not xgrammar: docs/openai-api.md.

Compiling is what costs (a JSON schema to a grammar, the grammar to a lexer: milliseconds to
hundreds of them), so a grammar is compiled once per canonical text and kept in an LRU cache;
each sequence gets a copy of the compiled matcher (``Compiled.matcher``). Nothing here imports
torch: the router uses it too.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
STRUCTURED = "structured"  # the key in the instance API's sampling object
CACHE_SIZE = 256
# A grammar longer than this is refused before compiling (vLLM has no bound; a 64 MiB body
# could otherwise hold the compiler for seconds).
MAX_GRAMMAR_CHARS = 1 << 20


# JSON comes out compact (", " and ": " between items, no other whitespace), a schema's
# "x-guidance" may say otherwise: a small model given free whitespace may spend every token on it.
JSON_LAYOUT: Any = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions


class GrammarError(ValueError):
    """A spec that is malformed or that the engine cannot compile; the message says which."""


@dataclass(frozen=True)
class Spec:
    kind: str
    text: str  # canonical: equal specs have equal texts, the cache's key

    def to_json(self) -> dict[str, Any]:
        """The ``structured`` object an instance request carries."""
        value: Any = None
        if self.kind in ("json_schema", "choice"):
            value = json.loads(self.text)
        elif self.kind in ("regex", "lark"):
            value = self.text
        return {"kind": self.kind, "value": value}


def parse_spec(raw: Any, where: str = STRUCTURED) -> Spec | None:
    """A ``{"kind", "value"}`` object (or None: unconstrained) as a canonical ``Spec``; bad
    shapes raise GrammarError naming ``where``. The JSON schema keeps its key order (it is the
    order the properties come out in), so the canonical text is compact JSON, unsorted."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise GrammarError(f"{where}: must be an object {{kind, value}}, got "
                           f"{type(raw).__name__}")
    kind = raw.get("kind")
    value = raw.get("value")
    if kind not in KINDS:
        raise GrammarError(f"{where}.kind: must be one of {', '.join(KINDS)}, got "
                           f"{str(kind)[:40]!r}")
    if kind == "json_object":
        return Spec(kind, "")
    if kind == "json_schema":
        if isinstance(value, bool):  # true / false are schemas too; true means any JSON
            value = {} if value else {"not": {}}
        if not isinstance(value, Mapping):
            raise GrammarError(f"{where}: the JSON schema must be an object, got "
                               f"{type(value).__name__}")
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    elif kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) for c in value)):
            raise GrammarError(f"{where}: the choices must be a non-empty list of strings")
        text = json.dumps(value, ensure_ascii=False)
    else:
        if not isinstance(value, str) or not value:
            raise GrammarError(f"{where}: the {kind} must be a non-empty string")
        text = value
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{where}: the {kind} is {len(text)} characters, more than the "
                           f"{MAX_GRAMMAR_CHARS} accepted")
    return Spec(kind, text)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:
        raise GrammarError(f"structured output needs the llguidance package, not installed "
                           f"here ({exc}); install pdd's sidecar extra") from None
    return llguidance


def grammar_text(spec: Spec) -> str:
    """llguidance's grammar for ``spec`` (not yet checked; ``GrammarCache`` does)."""
    llguidance = _llguidance()

    try:
        if spec.kind in ("json_object", "json_schema"):
            schema = spec.text if spec.kind == "json_schema" else '{"type": "object"}'
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if spec.kind == "regex":
            return llguidance.grammar_from("regex", spec.text)
        if spec.kind == "choice":
            choices = json.loads(spec.text)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices))
        return llguidance.grammar_from("grammar", spec.text)  # Lark or GBNF
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the {spec.kind} does not compile: {exc}") from None


class GrammarCache:
    """Canonical spec -> its compiled form, least recently used out first. One per process
    (and per tokenizer): the router's checks without a tokenizer, an instance's matchers with
    its checkpoint's. Thread-safe: the router's workers and an instance's HTTP threads share it.
    A spec that failed is cached too (its error), so a client repeating it costs nothing."""

    def __init__(self, tokenizer: Any = None, size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer  # an llguidance.LLTokenizer, or None (the router: check only)
        self.size = size
        self._lock = threading.Lock()
        self._items: OrderedDict[Spec, Compiled | GrammarError] = OrderedDict()
        self.compiled = 0  # compilations run (tests: once per distinct spec)

    def get(self, spec: Spec) -> Compiled:
        with self._lock:
            hit = self._items.get(spec)
            if hit is not None:
                self._items.move_to_end(spec)
        if hit is None:
            hit = self._compile(spec)
            with self._lock:
                self._items[spec] = hit
                self._items.move_to_end(spec)
                while len(self._items) > self.size:
                    self._items.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise hit
        return hit

    def __len__(self) -> int:
        return len(self._items)

    def _compile(self, spec: Spec) -> Compiled | GrammarError:
        self.compiled += 1
        try:
            llguidance = _llguidance()
            grammar = grammar_text(spec)
        except GrammarError as exc:
            return exc
        if self.tokenizer is None:
            error = llguidance.LLMatcher.validate_grammar(grammar)
            if error and not error.startswith("WARNING"):
                return GrammarError(f"the {spec.kind} does not compile: {error}")
            return Compiled(spec, grammar, None)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return GrammarError(f"the {spec.kind} does not compile: {matcher.get_error()}")
        return Compiled(spec, grammar, matcher)


@dataclass(frozen=True)
class Compiled:
    spec: Spec
    grammar: str
    prototype: Any  # llguidance.LLMatcher at the start, never advanced; None on the router

    def matcher(self) -> Any:
        """A fresh matcher for one sequence (a copy: the grammar is not compiled again)."""
        assert self.prototype is not None, "compiled without a tokenizer"
        return self.prototype.deep_copy()


_ROUTER_CACHE = GrammarCache()


def check(spec: Spec) -> None:
    """Raise GrammarError when ``spec`` does not compile (the router's check, cached)."""
    _ROUTER_CACHE.get(spec)
