"""A forked choice's own copy of the unit its prompt ends in (scheduler.py: Choices) is made
before the MTP module's command of the step, which writes the choice's first latent there; it
goes with the step's command when no module command runs, or when that one failed."""

from __future__ import annotations

import types
from typing import Any

import pytest

from pdd_sidecar.engine.scheduler import StepPlan
from pdd_sidecar.engine.speculative.config import SpeculativeConfig
from pdd_sidecar.engine.speculative.mtp_served import ServedMTPDrafts
from pdd_sidecar.engine.speculative.speculator import Speculator
from pdd_sidecar.engine.worker import RankWorker

pytestmark = pytest.mark.dataplane

COPY = (4, 9)


def _served(answer: dict[str, Any] | None = None) -> tuple[ServedMTPDrafts, list[dict[str, Any]]]:
    sent: list[dict[str, Any]] = []

    def run(cmd: dict[str, Any]) -> list[dict[str, Any]]:
        sent.append(cmd)
        return [answer or {"drafts": [[5] * k for *_, k, _b, _s in cmd["seqs"]]}]

    served = ServedMTPDrafts(run)
    served.begin("a", [3, 4], 7, None, None, False)  # prefilled here: no first draft pending
    return served, sent


def test_the_copies_go_with_the_module_command() -> None:
    served, sent = _served()
    served.verified("a", 6, [11])
    served.carry([COPY])
    assert served.propose([("a", 2)]) == [[5, 5]]
    assert sent[0]["copies"] == [COPY] and sent[0]["seqs"][0][0] == "a"
    assert served.uncarried() == []


def test_without_a_module_command_or_when_it_failed_the_step_makes_them() -> None:
    served, sent = _served()
    served.carry([COPY])
    assert served.propose([("a", 2)]) == [[]]  # nothing pending: no command
    assert sent == [] and served.uncarried() == [COPY]
    failing, sent = _served({"error": "rank 1: out of memory", "status": 500})
    failing.verified("a", 6, [11])
    failing.carry([COPY])
    assert failing.propose([("a", 2)]) == [[]]
    assert sent[0]["copies"] == [COPY] and failing.uncarried() == [COPY]


def test_a_rank_copies_before_the_module_runs() -> None:
    order: list[str] = []
    w = object.__new__(RankWorker)
    w.who = "rank 0"
    w.cache = types.SimpleNamespace(copy_blocks=lambda copies: order.append(f"copy {copies}"))
    w.mtp = types.SimpleNamespace(drafter=None, draft=lambda seqs: order.append("draft") or [[]])
    assert w.execute({"op": "mtp_draft", "seqs": [("a", 6, [11], 1, [3, 4], None)],
                      "copies": [COPY]}) == {"drafts": [[]]}
    assert order == [f"copy {[COPY]}", "draft"]


def test_the_driver_sends_a_steps_copies_with_its_module_command() -> None:
    """The step's command carries no copy the module's command made (it would undo the latent
    the module wrote), and carries them when the module had nothing to run."""
    from test_speculative_driver_counts import _driver, _next, _running

    for with_module in (True, False):
        d = _driver(_next([]))
        sent: list[dict[str, Any]] = []
        steps: list[dict[str, Any]] = []
        d.mtp = ServedMTPDrafts(lambda cmd, sent=sent: sent.append(cmd) or [{"drafts": [[1]]}])
        d.speculator = Speculator(SpeculativeConfig(method="mtp", tokens=1, min_acceptance=0.0),
                                  batch=d.mtp)
        leader = d.worker.run_as_leader
        d.worker.run_as_leader = (
            lambda cmd, steps=steps, leader=leader: steps.append(cmd) or leader(cmd))
        seq = _running(d, "s", [7, 8, 9], 10, 8)
        fork = _running(d, "s#1", [7, 8, 9], 12, 8)
        d.scheduler._copies = [(*COPY, fork)]
        entry = d.scheduler._decode_entry(seq)
        d.mtp.begin("s", seq.blocks, seq.context, None, None, False)
        if with_module:  # a position of "s" waits for the module
            d.mtp.verified("s", entry.position - 1, [10])
        d._run_step(StepPlan(prefill=[], decode=[entry]), poll=False)
        if with_module:
            assert sent[0]["copies"] == [COPY] and "copies" not in steps[-1]
        else:
            assert not sent and steps[-1]["copies"] == [COPY]
