"""An idle prefill gathers a burst before its first step (engine/driver.py gather_burst)."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest

from pdd_sidecar.engine import driver
from pdd_sidecar.engine.driver import Inbox, gather_burst

pytestmark = pytest.mark.dataplane


def _sender(inbox: Inbox, first: int, then_after_s: float, second: int) -> threading.Thread:
    def send() -> None:
        for i in range(first):
            inbox.put(("submit", i, None))
        time.sleep(then_after_s)
        for i in range(second):
            inbox.put(("submit", first + i, None))

    return threading.Thread(target=send)


def test_a_burst_is_gathered_up_to_its_pause() -> None:
    inbox: Inbox = queue.Queue()
    got: list[Any] = []
    sender = _sender(inbox, 40, 1.0, 5)
    sender.start()
    n = gather_burst(inbox, lambda kind, payload, fut: got.append(payload),
                     quiet_s=0.2, max_s=5.0)
    sender.join()
    assert n == 40 and got == list(range(40))  # not the 5 sent after the pause
    assert inbox.qsize() == 5


def test_gathering_stops_at_its_bound_while_work_keeps_coming() -> None:
    inbox: Inbox = queue.Queue()
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            inbox.put(("wake", None, None))
            time.sleep(0.001)

    t = threading.Thread(target=trickle)
    t.start()
    start = time.monotonic()
    try:
        n = gather_burst(inbox, lambda *item: None, quiet_s=3.0, max_s=0.1)
    finally:
        stop.set()
        t.join()
    assert n > 0 and time.monotonic() - start < 2.0  # the bound, not the quiet gap, ended it


def test_nothing_more_coming_costs_one_quiet_gap() -> None:
    inbox: Inbox = queue.Queue()
    start = time.monotonic()
    assert gather_burst(inbox, lambda *item: None, quiet_s=0.05, max_s=5.0) == 0
    assert time.monotonic() - start < 1.0


def test_gathering_stops_once_the_first_step_is_full() -> None:
    inbox: Inbox = queue.Queue()
    for i in range(40):
        inbox.put(("submit", i, None))
    got: list[Any] = []
    n = gather_burst(inbox, lambda kind, payload, fut: got.append(payload),
                     full=lambda: len(got) >= 8, quiet_s=1.0, max_s=5.0)
    assert n == 8 and got == list(range(8)) and inbox.qsize() == 32


def test_the_driver_sleeps_through_the_gap_and_takes_the_burst_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests arriving 0.2 ms apart are not handled one by one as they come (each wake of
    the driver would take the GIL from the HTTP loop reading the rest), but together after
    the quiet gap: what was there when it began at once, the rest in one take after it."""
    sleeps = [0]

    class Clock:
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(s: float) -> None:
            sleeps[0] += 1
            time.sleep(s)

    monkeypatch.setattr(driver, "time", Clock)
    inbox: Inbox = queue.Queue()
    taken_after: list[int] = []  # for each request handled, the gaps slept before it

    def send() -> None:
        for i in range(10):
            inbox.put(("submit", i, None))
            time.sleep(0.0002)

    sender = threading.Thread(target=send)
    sender.start()
    n = gather_burst(inbox, lambda *item: taken_after.append(sleeps[0]), quiet_s=0.3,
                     max_s=5.0)
    sender.join()
    assert n == 10
    # handled as they came, the ten would spread over up to ten takes
    assert len(set(taken_after)) <= 2 and taken_after.count(1) >= 8, taken_after
