"""Which sequences draft in a decode step, how much, and when speculation turns itself off."""

from __future__ import annotations

import pytest

from pdd_sidecar.engine.speculative.config import SpeculativeConfig
from pdd_sidecar.engine.speculative.speculator import Speculator, draft_room

REPEAT = [1, 2, 3, 4] * 4  # every ending occurred before: n-gram drafts always exist


def test_drafts_continue_each_sequences_text_given_in_parts() -> None:
    spec = Speculator(SpeculativeConfig(tokens=3))
    out = spec.plan([("a", ([1, 2, 3, 4], [1], [2]), 5), ("b", ([9, 8, 7], [], []), 5)])
    assert out == [[3, 4, 1], []]  # "b"'s ending never occurred before
    assert spec.stats.skipped == {"no_match": 1}
    # the parts only grow: the index takes the new tokens, and drafts follow them
    assert spec.plan([("a", ([1, 2, 3, 4], [1], [2, 3, 4, 1]), 5)]) == [[2, 3, 4]]


def test_drafts_never_pass_the_room_left() -> None:
    spec = Speculator(SpeculativeConfig(tokens=3))
    assert spec.plan([("a", (REPEAT,), 2)]) == [[1, 2]]
    assert spec.plan([("a", (REPEAT,), 0)]) == [[]]
    assert spec.stats.skipped == {"room": 1}


@pytest.mark.parametrize("max_tokens,generated,room", [(16, 0, 15), (16, 14, 1), (16, 15, 0),
                                                        (1, 0, 0), (3, 5, 0)])
def test_room_keeps_drafts_inside_the_reservation(max_tokens: int, generated: int,
                                                  room: int) -> None:
    assert draft_room(max_tokens, generated) == room
    # the step's tokens (drafts and the one after) never pass max_tokens
    assert generated + room + 1 <= max(max_tokens, generated + 1)


def test_a_step_of_more_sequences_than_the_threshold_drafts_nothing() -> None:
    spec = Speculator(SpeculativeConfig(tokens=2, max_batch=2))
    two = [(str(i), (REPEAT,), 4) for i in range(2)]
    assert all(spec.plan(two))
    three = [(str(i), (REPEAT,), 4) for i in range(3)]
    assert spec.plan(three) == [[], [], []]
    assert spec.stats.skipped == {"batch": 3}


def test_low_acceptance_pauses_a_sequence_then_it_tries_again() -> None:
    cfg = SpeculativeConfig(tokens=2, min_acceptance=0.3, ema_decay=0.5, pause_steps=3)
    spec = Speculator(cfg)
    item = [("a", (REPEAT,), 4)]
    assert spec.plan(item)
    spec.record("a", 2, 0)  # ema 0.5: still drafting
    assert spec.plan(item)
    spec.record("a", 2, 0)  # ema 0.25 < 0.3: paused for 3 steps
    assert [spec.plan(item) for _ in range(3)] == [[[]]] * 3
    assert spec.stats.skipped == {"acceptance": 3}
    assert spec.plan(item)  # the probe
    spec.record("a", 2, 2)  # accepted: drafting goes on
    assert spec.plan(item) and spec.plan(item)


def test_stats_follow_vllms_terms() -> None:
    spec = Speculator(SpeculativeConfig(tokens=3))
    spec.plan([("a", (REPEAT,), 4)])
    spec.record("a", 3, 2)
    spec.record("a", 3, 0)
    spec.record("a", 0, 0)  # no drafts: no verify step
    s = spec.stats
    assert (s.drafts, s.draft_tokens, s.accepted_tokens) == (2, 6, 2)
    assert s.accepted_per_pos == [1, 1, 0]
    assert s.mean_accepted_length == 2.0
    assert s.acceptance == pytest.approx(1 / 3)


def test_finished_sequences_are_forgotten() -> None:
    spec = Speculator(SpeculativeConfig(tokens=1))
    spec.plan([("a", (REPEAT,), 4), ("b", (REPEAT,), 4)])
    spec.retain(["b"])
    assert set(spec._seqs) == {"b"}


@pytest.mark.parametrize("kw,field", [({"method": "eagle"}, "speculative.method"),
                                      ({"tokens": 0}, "speculative.tokens"),
                                      ({"max_batch": -1}, "speculative.max_batch"),
                                      ({"min_acceptance": 1.5}, "speculative.min_acceptance"),
                                      ({"ema_decay": 1.0}, "speculative.ema_decay"),
                                      ({"pause_steps": -2}, "speculative.pause_steps")])
def test_bad_settings_name_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig(**kw)  # type: ignore[arg-type]


def test_settings_off_mean_no_speculation() -> None:
    assert SpeculativeConfig.from_settings(None, 3) is None
    assert SpeculativeConfig.from_settings("off", None) is None
    cfg = SpeculativeConfig.from_settings("ngram", 2, max_batch=8)
    assert cfg == SpeculativeConfig(tokens=2, max_batch=8)


def test_a_large_batch_drafts_fewer_tokens_to_stay_within_the_largest_graph() -> None:
    spec = Speculator(SpeculativeConfig(tokens=8), max_rows=16)
    text = list(range(10)) * 2  # drafts of up to 10 tokens exist
    assert [len(d) for d in spec.plan([(str(i), (text,), 9) for i in range(2)])] == [7, 7]
    assert [len(d) for d in spec.plan([(str(i), (text,), 9) for i in range(4)])] == [3] * 4
    assert spec.plan([(str(i), (text,), 9) for i in range(9)]) == [[]] * 9  # 9 x 2 > 16
    assert spec.stats.skipped == {"batch": 9}


def test_mtp_is_a_method_and_drafts_one_token_unless_told() -> None:
    assert SpeculativeConfig.from_settings("mtp", None) == SpeculativeConfig(method="mtp",
                                                                             tokens=1)
    assert SpeculativeConfig.from_settings("mtp", 2) == SpeculativeConfig(method="mtp", tokens=2)
    assert SpeculativeConfig.from_settings("ngram", None) == SpeculativeConfig(tokens=3)
