"""Structured output on an instance: the checkpoint's tokenizer as llguidance sees it, one matcher
per constrained sequence, and the batch's token mask for the rows that have one.

Each sequence under a grammar holds its own matcher (a copy of the spec's compiled one,
pdd_sidecar/grammar.py). Before a step's tokens are drawn, the matchers of the constrained rows
fill one bitmask on the host (llguidance, in Rust, over a thread pool: tens of microseconds a
row), which goes to the device in one copy and sets the disallowed logits of those rows to -inf
(engine/sampling.py ``apply_allowed``); rows without a grammar are not touched and a batch
without any does nothing at all. The model's forward, graphed or not, is the same either way:
the mask comes after the logits. Each drawn token then advances its matcher; a matcher that
accepts nothing more (the grammar is complete, only EOS could follow) ends its sequence with
finish_reason "stop".

The prefill draws a completion's first token, the decode the rest: both hold a matcher, and the
decode's first advances it by the prefill's token.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple

import torch

from pdd_sidecar.grammar import GrammarCache, GrammarError, Spec

log = logging.getLogger(__name__)

_BITS = 32


class _ByteTokens:
    """The built-in model's tokenizer (token = byte, no EOS of its own) for llguidance: one more
    id past the vocabulary stands for EOS, which the model can never draw, so a grammar that
    is complete ends its sequence through the matcher's stop."""

    def __init__(self, vocab: int) -> None:
        self.tokens = [bytes([i]) for i in range(vocab)] + [b"<eos>"]
        self.eos_token_id = vocab
        self.bos_token_id = None
        self.special_token_ids = [vocab]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def build_tokenizer(model_source: str, vocab_size: int, eos_ids: frozenset[int]) -> Any:
    """An ``llguidance.LLTokenizer`` of the checkpoint: its tokenizer.json (the ids the model
    was trained on), padded to the model's vocabulary; the built-in model's bytes."""
    import llguidance

    if model_source == "builtin":
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(vocab_size)))
    path = Path(model_source) / "tokenizer.json"
    if not path.is_file():
        raise GrammarError(f"structured output needs the checkpoint's tokenizer; "
                           f"{path} not found")
    text = path.read_text()
    size = len(json.loads(text).get("model", {}).get("vocab", ())) or vocab_size
    eos: list[int] | None = sorted(eos_ids) or None
    return llguidance.LLTokenizer(text, n_vocab=max(vocab_size, size), eos_token=eos)


class Grammars:
    """An instance's compiled grammars and its tokenizer, built once on a thread at start (for
    a vocabulary of 100k tokens, seconds of CPU) so no request waits for it unless it comes
    within those seconds; the instance's readiness does not wait for it."""

    def __init__(self, model_source: str, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        self._ready: Future[GrammarCache] = Future()
        threading.Thread(target=self._build, args=(model_source, vocab_size, eos_ids),
                         name="grammar-tokenizer", daemon=True).start()

    def _build(self, model_source: str, vocab_size: int, eos_ids: frozenset[int]) -> None:
        try:
            tokenizer = build_tokenizer(model_source, vocab_size, eos_ids)
            cache = GrammarCache(tokenizer)
            # The first mask of a tokenizer splits its vocabulary for llguidance's later masks
            # (seconds for 100k tokens, once) and the executor starts its threads: both here,
            # not in the first constrained request's step.
            words = (int(tokenizer.vocab_size) + _BITS - 1) // _BITS
            fill_bitmask([Constrained(cache.get(Spec("json_object", "")).matcher(), words)],
                         pin=False)
            self._ready.set_result(cache)
        except Exception as exc:  # said on each structured request, not fatal to the instance
            log.info("structured output unavailable: %s", exc)
            self._ready.set_exception(exc)

    @property
    def cache(self) -> GrammarCache:
        try:
            return self._ready.result()
        except GrammarError:
            raise
        except Exception as exc:
            raise GrammarError(f"structured output unavailable: {exc}") from None

    def start(self, spec: Spec, first_token: int | None = None) -> Constrained:
        """A fresh matcher for a sequence under ``spec``; on a decode advanced by the prefill's
        ``first_token``. GrammarError when the spec does not compile or the token does not fit."""
        cache = self.cache
        m = cache.get(spec).matcher()
        if first_token is not None and not m.consume_token(first_token):
            raise GrammarError(f"first_token: {first_token} is not allowed by the grammar "
                               f"({m.get_error()})")
        words = (int(cache.tokenizer.vocab_size) + _BITS - 1) // _BITS
        return Constrained(m, words)


class Constrained(NamedTuple):
    """A sequence's grammar: its matcher and the width of its mask row in 32-bit words."""

    matcher: Any
    words: int


_EXECUTOR: Any = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> Any:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            import llguidance

            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR


def fill_bitmask(rows: Sequence[Constrained], pin: bool) -> torch.Tensor:
    """``[len(rows), words]`` int32 on the host: bit ``t`` of row ``r`` set when token ``t``
    may come next under ``rows[r]``'s matcher. One call into llguidance for the batch."""
    words = max(c.words for c in rows)
    mask = torch.zeros((len(rows), words), dtype=torch.int32, pin_memory=pin)
    # What llguidance.torch.fill_next_token_bitmask_par does; that module is not imported: it
    # decorates a function with torch.compile at import, seconds of CPU for nothing used here.
    _executor().unsafe_compute_mask_ptr([(c.matcher, r) for r, c in enumerate(rows)],
                                        mask.data_ptr(), words * 4, len(rows))
    return mask


def advance(matcher: Any, token: int) -> bool:
    """Advance by a drawn token; True when the sequence must stop here (the grammar is
    complete, or the token broke it, which the mask rules out: logged)."""
    if not matcher.consume_token(token):
        log.warning("structured output: token %d refused by the grammar: %s", token,
                    matcher.get_error())
        return True
    return bool(matcher.is_stopped())
