"""Waiting on a live system in tests: a guard against hangs, never a timing assertion."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 60,
             interval: float = 0.3) -> Any:
    """Poll until `probe` returns something truthy; the failure names what never happened
    and the last value seen, which is what one needs to debug a slow or stuck controller."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last seen: {last!r}")
