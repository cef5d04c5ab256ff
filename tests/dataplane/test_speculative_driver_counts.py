"""What the decode's driver counts of speculation (engine/driver.py with a toy next-token
model in place of the ranks): a verify step counts the drafts it emitted, none past a token
that ended the sequence; a step that also prefills a prompt samples the prompt's row apart
and verifies the drafts beside it."""

from __future__ import annotations

import contextlib
import types
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch

from pdd_sidecar.engine import timing
from pdd_sidecar.engine.driver import InstanceDriver
from pdd_sidecar.engine.sampling import SamplingParams
from pdd_sidecar.engine.scheduler import PrefillChunk, Scheduler, Sequence, State, StepPlan
from pdd_sidecar.engine.speculative.config import SpeculativeConfig
from pdd_sidecar.engine.speculative.speculator import Speculator

pytestmark = pytest.mark.dataplane

V = 128
A, B, C, STOP = 97, 98, 99, 2


def _next(pairs: list[tuple[int, int]]) -> torch.Tensor:
    """Logits that make each pair's second token follow its first."""
    table = torch.full((V, V), -5.0)
    for x, y in pairs:
        table[x, y] = 5.0
    return table


class _Blocks:
    num_blocks = num_free = 1000

    def allocate(self, n: int) -> list[int]:
        return list(range(n))

    def free(self, ids: Any) -> None:
        pass


def _driver(table: torch.Tensor) -> InstanceDriver:
    d = object.__new__(InstanceDriver)
    d.role = "decode"
    d.metrics = MagicMock()
    d.mtp = None
    d.speculator = Speculator(SpeculativeConfig(tokens=3, min_acceptance=0.0))
    d.scheduler = Scheduler("decode", _Blocks(), 4, 1, 1)
    d.settings = types.SimpleNamespace(fault_step_delay_s=0)
    d._scratch = []
    d._launching = frozenset()
    d.host_tier = None
    d._last_poll = 0.0
    d._drafted_for = {}

    def run_as_leader(cmd: dict[str, Any]) -> list[dict[str, Any]]:
        d.worker.logits = torch.stack([table[toks[-1]].clone() for toks, _, _ in cmd["chunks"]])
        return [{}]

    d.worker = types.SimpleNamespace(
        logits=None, mtp=None, run_as_leader=run_as_leader,
        engine=types.SimpleNamespace(logits_context=contextlib.nullcontext, kept={},
                                     logits_stream=None))
    return d


def _running(d: InstanceDriver, sid: str, prompt: list[int], first: int, max_tokens: int,
             stop: tuple[int, ...] = ()) -> Sequence:
    seq = Sequence(sid, list(prompt), max_tokens, len(prompt) + max_tokens,
                   sampling=SamplingParams(), stop_ids=frozenset(stop),
                   source=types.SimpleNamespace(num_tokens=len(prompt)), first_token=first,
                   state=State.RUNNING)
    d.scheduler.running[sid] = seq
    d.scheduler.by_id[sid] = seq
    return seq


def _step(d: InstanceDriver, seq: Sequence, prefill: list[PrefillChunk] | None = None) -> Any:
    entry = d.scheduler._decode_entry(seq)
    d._run_step(StepPlan(prefill=prefill or [], decode=[entry]), poll=False)
    return entry


def test_a_verify_step_counts_no_draft_past_the_token_that_ended_it() -> None:
    """The prompt holds an earlier turn ending in the stop id, so the drafts run on past it;
    the step emits two tokens (b's successor c, then the stop) and counts one draft kept."""
    d = _driver(_next([(A, B), (B, C), (C, STOP), (STOP, A)]))
    seq = _running(d, "s", [A, B, C, STOP, A, B, C, STOP, A], B, 16, stop=(STOP,))
    entry = _step(d, seq)
    assert entry.drafts == [C, STOP, A]
    assert seq.output == [C, STOP] and seq.finish_reason == "stop"
    st = d.speculator.stats
    assert (st.drafts, st.draft_tokens, st.accepted_tokens) == (1, 3, 1)
    assert st.accepted_per_pos == [1, 0, 0] and st.mean_accepted_length == 2.0
    assert seq.extra.get(timing.SPEC_ACCEPTED_TOKENS) == 1


def test_a_step_that_also_prefills_a_prompt_verifies_drafts_beside_it() -> None:
    """A short prompt prefilled on the decode (scheduler.py: Local prefill) shares the step with
    a speculating sequence: its first token comes from its own row, and the sequence's drafts
    are verified from the rows after it as in a decode-only step."""
    d = _driver(_next([(A, B), (B, C), (C, A)]))
    seq = _running(d, "s", [A, B, C] * 6, A, 30)
    local = Sequence("local", [C, A, B], 4, 7, sampling=SamplingParams(), state=State.RUNNING)
    d.scheduler.running["local"] = d.scheduler.by_id["local"] = local
    entry = _step(d, seq, [PrefillChunk(local, 0, [C, A, B])])
    assert entry.drafts == [B, C, A]
    assert seq.output == [B, C, A, B]  # the three drafts kept and the row after them
    assert local.output == [C]
    st = d.speculator.stats
    assert (st.drafts, st.draft_tokens, st.accepted_tokens) == (1, 3, 3)
    assert "prefill" not in st.skipped
    d.scheduler.running.pop("s")
    _step(d, _running(d, "t", [A, B, C] * 3, A, 8), [PrefillChunk(local, 0, [C, A, B])])
    assert "s" not in d.speculator._seqs  # a finished sequence forgotten in such a step too


def test_a_request_id_reused_by_a_new_sequence_drafts_from_its_own_text() -> None:
    """The id of a finished sequence, taken again by a new one before any step forgot it: the
    new text's drafts, not the old index's (which would propose the old continuation)."""
    d = _driver(_next([(A, B), (B, C), (C, A), (C, STOP), (STOP, C)]))
    old = _running(d, "s", [A, B, C] * 6, A, 30)
    assert _step(d, old).drafts == [B, C, A]
    d.scheduler.running.pop("s")
    new = _running(d, "s", [A, B, C, STOP, C, STOP] * 3, C, 30)
    assert _step(d, new).drafts == [STOP, C]  # what follows its last "STOP, C" in its text
