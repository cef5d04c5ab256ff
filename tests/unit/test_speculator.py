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


def _always_wrong(steps: int, cfg: SpeculativeConfig) -> list[int]:
    """The steps (1-based) at which one sequence whose every draft misses verifies drafts."""
    spec = Speculator(cfg, drafter=lambda sid, index, k: [0] * k)
    verified = []
    for step in range(1, steps + 1):
        (drafts,) = spec.plan([("a", ([5, 6, 7],), 8)])
        if drafts:
            verified.append(step)
            spec.record("a", len(drafts), 0)
    return verified


def test_probes_of_a_sequence_whose_drafts_always_miss_back_off_to_the_cap() -> None:
    cfg = SpeculativeConfig(tokens=2, pause_steps=32, pause_max_steps=1024)
    verified = _always_wrong(8192, cfg)
    # two misses pause it (EMA 1 -> 0.5 -> 0.25); each probe that misses doubles the pause
    gaps = [b - a - 1 for a, b in zip(verified, verified[1:], strict=False)]
    assert verified[:2] == [1, 2]
    assert gaps[1:8] == [32, 64, 128, 256, 512, 1024, 1024], gaps
    # about one verify step per 1024 once backed off; a fixed 32-step pause (cap = base)
    # verifies every 33rd step for ever
    assert len(verified) == 14, verified
    assert len(_always_wrong(8192, SpeculativeConfig(tokens=2, pause_steps=32,
                                                     pause_max_steps=32))) == 250


def test_a_good_probe_resets_the_backoff() -> None:
    cfg = SpeculativeConfig(tokens=2, min_acceptance=0.35, pause_steps=4, pause_max_steps=64)
    spec = Speculator(cfg)
    item = [("a", (REPEAT,), 4)]

    def run_until_drafting() -> int:
        waited = 0
        while not spec.plan(item)[0]:
            waited += 1
        return waited

    assert run_until_drafting() == 0
    spec.record("a", 2, 0)
    assert run_until_drafting() == 0
    spec.record("a", 2, 0)  # paused for 4
    assert run_until_drafting() == 4
    spec.record("a", 2, 0)  # the probe missed: 8
    assert run_until_drafting() == 8
    spec.record("a", 2, 2)  # the probe was good: drafting again, backoff reset
    assert run_until_drafting() == 0
    spec.record("a", 2, 0)  # EMA (0.35 + 1) / 2 = 0.675 -> 0.34: paused for the base again
    assert run_until_drafting() == 4


def test_the_backoff_pause_never_passes_its_cap() -> None:
    from pdd_sidecar.engine.speculative.backoff import PauseBackoff
    b = PauseBackoff(32, 1024)
    assert [b.steps(n) for n in (0, 1, 5, 6, 100, 10**6)] == [32, 64, 1024, 1024, 1024, 1024]
    assert PauseBackoff(0, 0).steps(10) == 0
    assert PauseBackoff(3, 10).steps(2) == 10
    with pytest.raises(ValueError, match="speculative.pause_max_steps"):
        SpeculativeConfig(pause_steps=32, pause_max_steps=16)
