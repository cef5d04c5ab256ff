"""The driver does not wait on the device's queue: a step's inputs go up without a host sync,
and the points it needs (tokens sampled, a step done) wake its loop when the device passes them.

Why: on CUDA a copy from pageable host memory without ``non_blocking`` synchronizes its stream,
and reading sampled tokens waits for everything queued before them. A prefill host that waits so
cannot take a new prompt meanwhile: on one H200 (run 28, docs/serving.md) 1k prompts arriving
during a 32k prompt's prefill waited a median 188 ms before their step was even planned, while
the host sat in the next long chunk's first copy until the chunk before it was done.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch


def to_device(values: Sequence[int] | Sequence[Sequence[int]], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """Host integers on ``device``, on CUDA through pinned memory and an asynchronous copy:
    the stream is not synchronized, and the pinned buffer is not reused before the copy ran
    (torch's host allocator records the copy)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def tensor_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, as ``to_device`` does it."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class Mark(Protocol):
    def done(self) -> bool: ...


class _Passed:
    """A point a synchronous device (the CPU) has already passed."""

    def done(self) -> bool:
        return True


class _Lagging:
    """A point a lagging CPU passes at ``at`` (tests: ``PDD_FAULT_DEVICE_LAG_S``)."""

    def __init__(self, at: float, wake: Callable[[], None]) -> None:
        self.at = at
        timer = threading.Timer(at - time.monotonic(), wake)
        timer.daemon = True
        timer.start()

    def done(self) -> bool:
        return time.monotonic() >= self.at


class _EventMark:
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())


class DeviceMarks:
    """Points in a device's streams, each of which wakes the loop (``wake``) once the device
    has passed it. A thread per stream waits for that stream's points in order: they complete
    in order there, and a point on the overtaking stream must not wait behind the default
    stream's. On the CPU every point is passed when set; with ``lag_s`` (tests) the CPU plays a
    device that runs each piece of work between two points in ``lag_s``, one after another."""

    def __init__(self, device: torch.device, wake: Callable[[], None],
                 lag_s: float = 0.0) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.lag_s = lag_s
        self._lag_free_at = 0.0
        self._wake = wake
        self._watchers: dict[int, queue.SimpleQueue[torch.cuda.Event]] = {}

    def mark(self) -> Mark:
        """A point after everything enqueued so far on the current stream."""
        if not self.cuda:
            if self.lag_s <= 0:
                return _Passed()
            self._lag_free_at = max(time.monotonic(), self._lag_free_at) + self.lag_s
            return _Lagging(self._lag_free_at, self._wake)
        stream = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event(blocking=True)  # its waiter sleeps instead of spinning
        event.record(stream)
        waiting = self._watchers.get(stream.cuda_stream)
        if waiting is None:
            waiting = self._watchers[stream.cuda_stream] = queue.SimpleQueue()
            threading.Thread(target=self._watch, args=(waiting,), daemon=True,
                             name=f"device-marks-{len(self._watchers)}").start()
        waiting.put(event)
        return _EventMark(event)

    def _watch(self, waiting: queue.SimpleQueue[torch.cuda.Event]) -> None:
        while True:
            waiting.get().synchronize()  # without the GIL
            self._wake()
