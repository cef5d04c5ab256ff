"""An in-order eager step is launched a few layers at a time, and the driver serves in between.

Why: a CUDA stream takes about a thousand pending launches before the host blocks in the next
one (``bench/launch_queue.py``: after 1,021), and an eager step of a 27-layer model makes about
2,100. A host that launched a long prompt's 8,192-token chunk in one go sat inside it until the
device had run half of it, a wait the driver could not leave: run 31 (docs/serving.md) took a
mean 114 ms to enqueue such a step, and a 1k prompt that arrived meanwhile had its overtaking
step planned, or its sampled token read, only after that (median 5.0x its idle TTFT during a
32k prefill). Paced, the host launches the next slice of layers only while at most ``ahead``
slices wait on the device, and spends the wait in the driver (``serve``): sampled tokens go out,
arriving prompts are admitted, and a step of them overtakes the rest of the long one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pure Python: the marks are the driver's (engine/device_queue.py)
    from pdd_sidecar.engine.device_queue import Mark

# A layer is about 79 launches (bench/launch_queue.py) and, at 8,192 tokens on one H200, ~7 ms
# of device time, against a millisecond or less to launch it. Whatever is queued when a short
# prompt's step overtakes still shares the SMs with it (run 32: with up to nine layers queued,
# slices of three, a 24 ms step took a median 81 ms), so the host stays one layer ahead.
SLICE_LAYERS = 1
SLICES_AHEAD = 1
# Steps of fewer tokens are launched whole: their device time is short anyway (a 1k prompt's
# step ~24 ms), and per-layer slices would leave the device idle between them.
PACED_MIN_TOKENS = 4096


class LaunchPacer:
    """Called after each layer an in-order step launches (``after_layer``): at a slice's end it
    sets a mark after it, and while more than ``ahead`` slices are queued it hands the wait to
    ``serve``, which returns once something happened (the oldest slice done or an arrival)."""

    def __init__(self, mark: Callable[[], Mark], serve: Callable[[Mark], None],
                 slice_layers: int = SLICE_LAYERS, ahead: int = SLICES_AHEAD,
                 min_tokens: int = PACED_MIN_TOKENS) -> None:
        if slice_layers < 1 or ahead < 1:
            raise ValueError(f"slice_layers {slice_layers} and ahead {ahead} must be >= 1")
        self._mark = mark
        self._serve = serve
        self.slice_layers = slice_layers
        self.ahead = ahead
        self.min_tokens = min_tokens
        self._queued: deque[Mark] = deque()
        self.waits = 0  # times the host waited for the device between two slices

    def paces(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` tokens is launched in slices."""
        return tokens >= self.min_tokens

    def after_layer(self, layer: int, layers: int) -> None:
        """After ``layer`` (0-based) of ``layers``; nothing after the last: what follows is
        the step's own end."""
        if (layer + 1) % self.slice_layers or layer + 1 >= layers:
            return
        self._queued.append(self._mark())
        while self.queued > self.ahead:
            self.waits += 1
            self._serve(self._queued[0])

    @property
    def queued(self) -> int:
        """Slices whose mark the device has not passed."""
        while self._queued and self._queued[0].done():
            self._queued.popleft()
        return len(self._queued)
