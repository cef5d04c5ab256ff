"""The pace of a NIXL agent's progress thread: fast only while a peer may need it."""

from __future__ import annotations

from pdd_sidecar.kv.transfer import FAST_PROGRESS_S, IDLE_PROGRESS_S, LINGER_S, ProgressPace


def test_idle_until_a_read_is_claimed_and_fast_until_it_is_notified() -> None:
    pace = ProgressPace(adaptive=True)
    assert pace.interval(0.0) == IDLE_PROGRESS_S
    assert pace.expect("r1", now=1.0, seconds=30.0)  # was idle: the thread is woken
    assert pace.interval(1.0) == FAST_PROGRESS_S
    assert not pace.expect("r2", now=1.1, seconds=30.0)  # already fast: no wake needed
    assert not pace.kick(now=1.1)
    pace.settle("r2")
    pace.settle("other")  # a notification for something else settles nothing
    assert pace.interval(1.5) == FAST_PROGRESS_S
    pace.settle("r1")
    assert pace.interval(1.5) == IDLE_PROGRESS_S


def test_every_claiming_reader_must_notify() -> None:
    """Two decode ranks claim one request: the first one's notification leaves the second's
    READ running, which may still need this side to progress."""
    pace = ProgressPace(adaptive=True)
    pace.expect("r1", now=0.0, seconds=30.0)
    pace.expect("r1", now=0.1, seconds=30.0)
    pace.settle("r1")
    assert pace.interval(0.2) == FAST_PROGRESS_S
    pace.settle("r1")
    assert pace.interval(0.2) == IDLE_PROGRESS_S
    pace.settle(None)  # not a READ's notification
    assert pace.interval(0.2) == IDLE_PROGRESS_S


def test_a_claim_never_notified_stops_counting_when_its_pin_runs_out() -> None:
    pace = ProgressPace(adaptive=True)
    pace.expect("r1", now=0.0, seconds=10.0)
    assert pace.interval(9.9) == FAST_PROGRESS_S
    assert pace.interval(10.0) == IDLE_PROGRESS_S
    pace.settle("r1")  # a late notification of a forgotten claim is harmless
    assert pace.interval(10.1) == IDLE_PROGRESS_S


def test_own_transfers_keep_it_fast_a_moment() -> None:
    pace = ProgressPace(adaptive=True)
    assert pace.kick(now=5.0)
    assert pace.interval(5.0 + LINGER_S / 2) == FAST_PROGRESS_S
    assert pace.interval(5.0 + LINGER_S) == IDLE_PROGRESS_S


def test_without_adaptive_always_fast() -> None:
    pace = ProgressPace(adaptive=False)
    assert pace.interval(0.0) == FAST_PROGRESS_S
    assert not pace.expect("r1", now=0.0, seconds=1.0)  # never idle: never woken
    pace.settle("r1")
    assert pace.interval(100.0) == FAST_PROGRESS_S
