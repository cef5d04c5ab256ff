"""A prefill's host does not wait on the device's queue (engine/device_queue.py, driver.py):
on a CPU instance that plays a device running each step in seconds, one after another
(``PDD_FAULT_DEVICE_LAG_S``), a prompt that arrives while another's token is still on the
device has its step enqueued at once, and in-order steps stop ``IN_ORDER_AHEAD`` ahead of the
device, so a cancelled long prompt does not run to its end; its blocks come back once its
queued chunk ran, not before."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from polling import wait_for
from runtime_fixtures import LocalCluster, http, plan_json, reference_tokens

from pdd_sidecar.engine.device_queue import DeviceMarks, to_device
from pdd_sidecar.engine.driver import IN_ORDER_AHEAD

pytestmark = pytest.mark.dataplane

BLOCK = 16
LAG_S = 1.0


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt) % 256 for i in range(n)]


def _prefill(url: str, prompt: list[int], out: dict[str, Any]) -> None:
    out["sent"] = time.monotonic()
    out["status"], out["body"] = http("POST", f"{url}/v1/prefill",
                                      {"prompt_ids": prompt, "max_tokens": 1}, timeout=120)
    out["answered"] = time.monotonic()


def _instance(cluster: LocalCluster, lag_s: float, **extra: Any) -> Any:
    prefill = cluster.instance("prefill", 1, 1,
                               cluster.plan_file(plan_json((1, 1), (1, 1), BLOCK)), BLOCK,
                               PDD_FAULT_DEVICE_LAG_S=str(lag_s), PDD_PREFIX_CACHE="0", **extra)
    prefill.wait_ready()
    return prefill


def _steps_run(url: str) -> float:
    status, text = http("GET", f"{url}/metrics")
    assert status == 200
    return sum(float(line.split()[-1]) for line in str(text).splitlines()
               if line.startswith("pdd_batch_size_count"))


def test_a_prompt_arriving_while_a_token_is_on_the_device_is_enqueued_before_it(
        cluster: LocalCluster) -> None:
    """The first prompt's step and its token take a lag each on the device; the second prompt
    comes once the first step is enqueued. Its step is enqueued as soon as the first step is done
    (in-order steps run ``IN_ORDER_AHEAD`` = 1 ahead), about a lag after it came; a host that
    waited for the first token before planning again would start it two lags after it came."""
    prefill = _instance(cluster, LAG_S)
    first, second = _prompt(40, 3), _prompt(24, 11)
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    steps = _steps_run(prefill.url)
    ta = threading.Thread(target=_prefill, args=(prefill.url, first, a))
    ta.start()
    wait_for("the first prompt's step", lambda: _steps_run(prefill.url) > steps, 30, 0.01)
    _prefill(prefill.url, second, b)  # its step is on the device now, for about a lag
    ta.join()
    for r, prompt in ((a, first), (b, second)):
        assert r["status"] == 200, r["body"]
        assert r["body"]["first_token"] == reference_tokens(prompt, 1, BLOCK)[0]
        assert r["body"]["timing"]["compute"] >= 2 * LAG_S * 1000 * 0.9  # step, then token
    assert IN_ORDER_AHEAD == 1
    assert 0.5 * LAG_S * 1000 < b["body"]["timing"]["queue"] < 1.5 * LAG_S * 1000, b["body"]
    assert b["sent"] < a["answered"]


def test_a_cancelled_long_prompt_stops_within_the_steps_enqueued_ahead(
        cluster: LocalCluster) -> None:
    """Eight chunks of a lag each on the device; the client leaves after 2.5 lags. The host ran
    at most ``IN_ORDER_AHEAD`` steps ahead of the device, so about four steps ran, not eight
    (a host that never waited would have enqueued all eight at once)."""
    lag, chunks, chunk = 0.5, 8, 64
    prefill = _instance(cluster, lag, PDD_CHUNK_TOKENS=str(chunk),
                        PDD_MAX_STEP_TOKENS=str(chunk))
    before = _steps_run(prefill.url)
    with pytest.raises(OSError):  # the client gives up: the prefill cancels the prompt
        http("POST", f"{prefill.url}/v1/prefill",
             {"prompt_ids": _prompt(chunks * chunk, 5), "max_tokens": 1}, timeout=2.5 * lag)
    time.sleep((chunks + 2) * lag)  # every step it enqueued is done by now
    ran = _steps_run(prefill.url) - before
    assert 1 <= ran < chunks and ran <= 2.5 + IN_ORDER_AHEAD + 1, ran
    status, stats = http("GET", f"{prefill.url}/v1/stats")
    assert status == 200 and stats["ranks"][0]["free_blocks"] == 256, stats


def _gauge(url: str, name: str) -> float:
    _, text = http("GET", f"{url}/metrics")
    return sum(float(line.split()[-1]) for line in str(text).splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def test_a_cancelled_prompts_blocks_come_back_once_its_queued_chunk_ran(
        cluster: LocalCluster) -> None:
    """The client leaves during the first of four chunks, which takes a lag on the device: the
    prompt is cancelled at once, but its 16 blocks stay taken until that chunk ran
    (engine/free_fence.py), then all come back. Freed at the cancel, they could be handed to a
    step or a load that does not wait for the chunk still reading and writing them."""
    lag, chunk = 4.0, 64
    prefill = _instance(cluster, lag, PDD_CHUNK_TOKENS=str(chunk),
                        PDD_MAX_STEP_TOKENS=str(chunk))

    def free() -> int:
        return int(http("GET", f"{prefill.url}/v1/stats")[1]["ranks"][0]["free_blocks"])

    wait_for("the warm-up's blocks back (its step takes a lag too)", lambda: free() == 256,
             timeout=3 * lag)
    sent = time.monotonic()
    with pytest.raises(OSError):
        http("POST", f"{prefill.url}/v1/prefill",
             {"prompt_ids": _prompt(4 * chunk, 9), "max_tokens": 1}, timeout=0.25 * lag)
    wait_for("the cancel", lambda: _gauge(prefill.url, "pdd_running_sequences") == 0
             and _gauge(prefill.url, "pdd_waiting_sequences") == 0, timeout=lag)
    held = free()
    assert time.monotonic() - sent < lag, "too slow a machine: the chunk ran meanwhile"
    assert held == 256 - 4 * chunk // BLOCK
    wait_for("the blocks back", lambda: free() == 256, timeout=3 * lag)


def test_cpu_marks_are_passed_when_set_or_after_their_lag() -> None:
    woken: list[float] = []
    marks = DeviceMarks(torch.device("cpu"), lambda: woken.append(time.monotonic()))
    assert marks.mark().done() and not woken
    lagging = DeviceMarks(torch.device("cpu"), lambda: woken.append(time.monotonic()), 0.2)
    set_at = time.monotonic()
    m, after = lagging.mark(), lagging.mark()
    assert not m.done()
    deadline = set_at + 5
    while not woken and time.monotonic() < deadline:
        time.sleep(0.01)
    assert woken and woken[0] - set_at >= 0.19 and m.done()  # the loop is woken, not polling
    assert not after.done()  # the second piece of work runs after the first
    t = to_device([[1, 2], [3, 4]], torch.int32, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [[1, 2], [3, 4]]


def _enqueue_seconds(url: str) -> tuple[float, float]:
    """The prefill host's time enqueuing in-order steps, and how many it enqueued."""
    status, text = http("GET", f"{url}/metrics")
    assert status == 200
    got = {line.split()[0]: float(line.split()[-1]) for line in str(text).splitlines()
           if line.startswith("pdd_step_enqueue_seconds_") and 'order="in_order"' in line}
    return (got.get('pdd_step_enqueue_seconds_sum{order="in_order"}', 0.0),
            got.get('pdd_step_enqueue_seconds_count{order="in_order"}', 0.0))


def test_a_paced_launch_serves_between_its_layers_and_loses_nothing(
        cluster: LocalCluster) -> None:
    """The CPU twin of a paced launch (engine/launch_pacing.py, ``PDD_FAULT_PACED_LAUNCH``):
    every in-order step is launched a layer at a time, each layer a lag on the pretend device,
    the host one layer ahead, so each step's launch waits for the device (the enqueue time
    shows it) while the driver serves: prompts arrive and are admitted, a client that leaves
    mid-launch has its prompt cancelled once the launch is over. Every answer is right and
    every block comes back."""
    lag, chunk = 0.2, 64
    prefill = _instance(cluster, lag, PDD_FAULT_PACED_LAUNCH="1", PDD_CHUNK_TOKENS=str(chunk),
                        PDD_MAX_STEP_TOKENS=str(chunk))
    before = _enqueue_seconds(prefill.url)
    long, short = _prompt(4 * chunk, 9), _prompt(24, 13)
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    ta = threading.Thread(target=_prefill, args=(prefill.url, long, a))
    ta.start()
    time.sleep(0.5 * lag)  # the long prompt's first step is being launched
    tb = threading.Thread(target=_prefill, args=(prefill.url, short, b))
    tb.start()
    with pytest.raises(OSError):  # leaves while steps are launched: cancelled
        http("POST", f"{prefill.url}/v1/prefill",
             {"prompt_ids": _prompt(3 * chunk, 21), "max_tokens": 1}, timeout=3 * lag)
    ta.join()
    tb.join()
    for r, prompt in ((a, long), (b, short)):
        assert r["status"] == 200, r["body"]
        assert r["body"]["first_token"] == reference_tokens(prompt, 1, BLOCK)[0]
    spent, steps = (x - y for x, y in zip(_enqueue_seconds(prefill.url), before, strict=True))
    assert steps >= 5 and spent >= 0.8 * lag * steps, (spent, steps)  # each waited a layer
    wait_for("every block back", lambda: http("GET", f"{prefill.url}/v1/stats")[1]
             ["ranks"][0]["free_blocks"] == 256, 30, 0.05)
