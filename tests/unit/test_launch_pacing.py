"""The pacing of an in-order step's launch (engine/launch_pacing.py): a mark after each slice of
layers, and the host handed to the driver while more than ``ahead`` slices are queued."""

from __future__ import annotations

import pytest

from pdd_sidecar.engine.launch_pacing import LaunchPacer


class _Device:
    """Marks passed when the test says the device ran that far."""

    def __init__(self) -> None:
        self.set = 0
        self.ran = 0

    def mark(self) -> _Mark:
        self.set += 1
        return _Mark(self, self.set)


class _Mark:
    def __init__(self, device: _Device, n: int) -> None:
        self.device = device
        self.n = n

    def done(self) -> bool:
        return self.device.ran >= self.n


def test_the_host_waits_only_while_more_than_ahead_slices_are_queued() -> None:
    device = _Device()
    served: list[int] = []

    def serve(oldest: _Mark) -> None:  # the device runs one slice per wait
        served.append(oldest.n)
        device.ran += 1

    pacer = LaunchPacer(device.mark, serve, slice_layers=2, ahead=2)
    for layer in range(10):
        pacer.after_layer(layer, 10)
    # marks after layers 1, 3, 5, 7 (none after the last); waits once the third was set
    assert device.set == 4
    assert served == [1, 2] and pacer.waits == 2 and pacer.queued == 2


def test_a_device_that_keeps_up_never_holds_the_host() -> None:
    device = _Device()

    def serve(oldest: _Mark) -> None:
        raise AssertionError("waited")

    pacer = LaunchPacer(device.mark, serve, slice_layers=1, ahead=1)
    for layer in range(27):
        pacer.after_layer(layer, 27)
        device.ran = device.set
    assert device.set == 26 and pacer.waits == 0 and pacer.queued == 0


def test_serve_is_called_again_until_the_oldest_slice_is_done() -> None:
    """An arrival ends a wait too: the pacer asks again until the device has caught up."""
    device = _Device()
    calls = []

    def serve(oldest: _Mark) -> None:
        calls.append(oldest.n)
        if len(calls) == 3:
            device.ran = oldest.n

    pacer = LaunchPacer(device.mark, serve, slice_layers=1, ahead=1)
    pacer.after_layer(0, 5)
    pacer.after_layer(1, 5)
    assert calls == [1, 1, 1] and pacer.queued == 1


def test_only_steps_of_many_tokens_are_paced() -> None:
    device = _Device()
    pacer = LaunchPacer(device.mark, lambda m: None, min_tokens=4096)
    assert pacer.paces(4096) and pacer.paces(8192) and not pacer.paces(4095)


def test_slices_and_lookahead_are_positive() -> None:
    device = _Device()
    with pytest.raises(ValueError, match="slice_layers 0"):
        LaunchPacer(device.mark, lambda m: None, slice_layers=0)
    with pytest.raises(ValueError, match="ahead 0"):
        LaunchPacer(device.mark, lambda m: None, ahead=0)
