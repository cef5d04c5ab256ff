"""The collector's pauses are timed by generation, once per collection, observed only when
flushed, and stop being timed once removed; freezing collects the garbage first and keeps the
rest out of later walks."""

from __future__ import annotations

import gc
import subprocess
import sys

from pdd_sidecar.gc_pauses import PauseTimer


class Recorded:
    def __init__(self) -> None:
        self.seen: dict[str, list[float]] = {}

    def labels(self, *values: str) -> Recorded.Child:
        return Recorded.Child(self.seen.setdefault(values[0], []))

    class Child:
        def __init__(self, into: list[float]) -> None:
            self.into = into

        def observe(self, amount: float) -> None:
            self.into.append(amount)


def test_each_collection_is_timed_under_its_generation_and_observed_at_a_flush() -> None:
    hist = Recorded()
    timer = PauseTimer(hist).install()
    timer.install()  # once only
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        # Nothing reaches the histogram inside a collection (a metric's lock may be held).
        assert not any(hist.seen.values()), hist.seen
        timer.flush()
        assert len(hist.seen["0"]) >= 1 and len(hist.seen["2"]) >= 2, hist.seen
        gc.collect(1)
    finally:
        timer.remove()  # flushes what is left
    assert len(hist.seen["1"]) >= 1, hist.seen
    assert all(0 <= t < 5 for ts in hist.seen.values() for t in ts)
    before = {g: len(ts) for g, ts in hist.seen.items()}
    gc.collect(2)
    assert {g: len(ts) for g, ts in hist.seen.items()} == before
    assert timer not in gc.callbacks


FREEZE = """
import gc, weakref
from pdd_sidecar.gc_pauses import freeze_heap
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a
dead = weakref.ref(a)
del a, b
gc.disable()
freeze_heap()
assert dead() is None, "a cycle left alive by the freeze"
assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
print("ok")
"""


def test_freezing_collects_the_garbage_first() -> None:
    out = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
