"""Per decode step, which sequences draft and what: the driver's side of speculation, torch-free.

A sequence drafts up to ``k`` tokens continuing its text (prompt, first token, output); never
more than its KV reservation holds (admission reserved the positions of ``max_tokens`` tokens,
and a verify step writes the KV of every draft), and never past ``max_tokens`` (the step emits
at most ``drafts + 1`` tokens). A step drafts nothing when more sequences run than
``max_batch`` (verification would cost more than it saves), and a sequence drafts nothing for
a while once its acceptance EMA fell below ``min_acceptance`` (engine/speculative/config.py),
longer each time its probe after the pause misses too (engine/speculative/backoff.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdd_sidecar.engine.speculative.config import SpeculativeConfig
from pdd_sidecar.engine.speculative.ngram import NgramIndex


@dataclass
class SpecStats:
    """Counts since start, in vLLM's terms: ``drafts`` verify steps of a sequence with at least
    one draft, ``draft_tokens`` tokens drafted, ``accepted_tokens`` drafts kept,
    ``accepted_per_pos[i]`` drafts kept at position ``i``; a kept draft counts when the token
    it let the step emit was emitted (none past a token that ended the sequence), so a verify
    step emits ``accepted + 1`` tokens; ``skipped`` sequence-steps that drafted nothing, by
    reason (batch, acceptance, no_match, room, prefill: a step that also prefilled a
    prompt)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step emits on average: the accepted drafts and the step's own."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def copy(self) -> SpecStats:
        return SpecStats(self.drafts, self.draft_tokens, self.accepted_tokens,
                         list(self.accepted_per_pos), dict(self.skipped))


@dataclass
class _SeqState:
    index: NgramIndex
    fed: int = 0  # tokens of the text already in the index
    ema: float = 1.0  # recent acceptance; optimistic until measured
    paused_until: int = 0  # the step from which it drafts again
    probing: bool = False  # its next verify step follows a pause
    failed_probes: int = 0  # probes in a row that paused it again (backoff.py)


# (sequence id, its text's index, at most how many) -> drafts: where they come from
Drafter = Callable[[str, NgramIndex, int], list[int]]


def prompt_lookup(sid: str, index: NgramIndex, k: int) -> list[int]:
    return index.propose(k)


class BatchDrafter(Protocol):
    """Drafts made for a whole step at once, by a model every rank runs (the MTP module,
    engine/speculative/mtp_served.py). Asked about every sequence of every decode step, with
    the most it may draft (0 where it must draft nothing: the module still runs there, so its
    KV keeps up with the text)."""

    def propose(self, asks: Sequence[tuple[str, int]]) -> list[list[int]]: ...

    def retain(self, live: Iterable[str]) -> None: ...


class Speculator:
    """``drafter``: where drafts come from (default: prompt lookup; a bench replays or
    spoils them). ``max_rows``: the most rows a step should have (the largest CUDA graph
    bucket: more run eagerly, far slower), so a large batch drafts fewer tokens each."""

    def __init__(self, cfg: SpeculativeConfig, drafter: Drafter = prompt_lookup,
                 max_rows: int | None = None, batch: BatchDrafter | None = None) -> None:
        """``batch``: drafts from a model for the whole step (mtp) instead of ``drafter``."""
        self.cfg = cfg
        self.drafter = drafter
        self.batch = batch
        self.max_rows = max_rows
        self._backoff = cfg.backoff
        self.stats = SpecStats(accepted_per_pos=[0] * cfg.tokens)
        self._seqs: dict[str, _SeqState] = {}
        self._step = 0

    def plan(self, items: Sequence[tuple[str, Sequence[Sequence[int]], int]]
             ) -> list[list[int]]:
        """Drafts for one decode step: ``items`` are ``(sequence id, text parts, room)``, the
        text in parts (prompt, generated) and ``room`` the drafts its reservation and
        ``max_tokens`` allow; one list per item, empty where it drafts nothing."""
        self._step += 1
        out: list[list[int]] = [[] for _ in items]
        k = self.cfg.tokens
        if self.max_rows is not None and items:
            k = min(k, self.max_rows // len(items) - 1)
        budgets = [0] * len(items)
        if len(items) > self.cfg.max_batch or k < 1:
            self._skip("batch", len(items))
        else:
            for i, (sid, _, room) in enumerate(items):
                st = self._state(sid)
                if room <= 0:
                    self._skip("room")
                elif st.paused_until > self._step:
                    self._skip("acceptance")
                else:
                    budgets[i] = min(room, k)
        if self.batch is not None:
            out = self.batch.propose([(sid, b) for (sid, _, _), b in zip(items, budgets,
                                                                          strict=True)])
        else:
            for i, (sid, parts, _) in enumerate(items):
                if budgets[i]:
                    st = self._state(sid)
                    self._feed(st, parts)
                    out[i] = self.drafter(sid, st.index, budgets[i])
        for i, b in enumerate(budgets):
            out[i] = out[i][:b]
            if b and not out[i]:
                self._skip("no_match")
        return out

    def record(self, sid: str, drafted: int, accepted: int) -> None:
        """A verify step of ``sid`` kept ``accepted`` of its ``drafted`` drafts."""
        if drafted <= 0:
            return
        s = self.stats
        s.drafts += 1
        s.draft_tokens += drafted
        s.accepted_tokens += accepted
        for p in range(accepted):
            s.accepted_per_pos[p] += 1
        st = self._seqs.get(sid)
        if st is None:
            return
        d = self.cfg.ema_decay
        st.ema = d * st.ema + (1 - d) * accepted / drafted
        if st.ema < self.cfg.min_acceptance:
            if st.probing:  # the probe missed too: a longer pause
                st.failed_probes += 1
            st.paused_until = self._step + 1 + self._backoff.steps(st.failed_probes)
            st.ema = self.cfg.min_acceptance  # a probe after the pause: one miss pauses again
            st.probing = True
        elif st.probing:  # the probe was good: the next low spell pauses for the base again
            st.probing = False
            st.failed_probes = 0

    def retain(self, live: Iterable[str]) -> None:
        """Forget the sequences not in ``live`` (finished, cancelled)."""
        keep = set(live)
        for sid in [s for s in self._seqs if s not in keep]:
            del self._seqs[sid]
        if self.batch is not None:
            self.batch.retain(keep)

    def _state(self, sid: str) -> _SeqState:
        st = self._seqs.get(sid)
        if st is None:
            st = self._seqs[sid] = _SeqState(NgramIndex(self.cfg.ngram))
        return st

    @staticmethod
    def _feed(st: _SeqState, parts: Sequence[Sequence[int]]) -> None:
        """The text's tokens not yet in the index (the parts only ever grow at the end)."""
        skip = st.fed
        for part in parts:
            if skip >= len(part):
                skip -= len(part)
                continue
            new = part[skip:]
            st.index.extend(new)
            st.fed += len(new)
            skip = 0

    def _skip(self, reason: str, n: int = 1) -> None:
        self.stats.skipped[reason] = self.stats.skipped.get(reason, 0) + n


def draft_room(max_tokens: int, generated: int) -> int:
    """Drafts a decode sequence may verify after ``generated`` of its ``max_tokens`` tokens:
    the token fed now sits at the position of generated token ``generated``; its drafts take
    the next positions, whose KV admission reserved only up to the last token fed before
    ``max_tokens`` is reached (the last token is never fed), and the step emits at most
    ``drafts + 1`` tokens, which must not pass ``max_tokens``."""
    return max(0, max_tokens - generated - 1)


__all__ = ["BatchDrafter", "SpecStats", "Speculator", "draft_room"]
