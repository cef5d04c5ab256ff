"""Overtaking prefill steps (engine/overtaking.py) on a CUDA device (run by hand; skipped
without one): a graphed step of fresh prompts runs ahead of device work queued before it and
sampling it waits for it alone; it gives the logits of the same step run in order; later
in-order work sees its KV; and it waits after all when a block it writes may still be written
by the queued work; and it overtakes an in-order step half-way through that step's paced launch
(engine/launch_pacing.py).

    PYTHONPATH=sidecar python -m pytest tests/gpu/test_overtaking.py -q
"""

from __future__ import annotations

import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from pdd_sidecar.engine.comm import SingleComm  # noqa: E402
from pdd_sidecar.engine.device_queue import DeviceMarks, Mark  # noqa: E402
from pdd_sidecar.engine.launch_pacing import LaunchPacer  # noqa: E402
from pdd_sidecar.engine.rank_engine import RankEngine, new_cache  # noqa: E402
from pdd_sidecar.engine.seq_chunk import SeqChunk  # noqa: E402
from pdd_sidecar.model.rank_model import load_rank_model  # noqa: E402

DEV = torch.device("cuda")
BLOCK = 16
SLEEP_CYCLES = 2_000_000_000  # about a second of queued device work at ~2 GHz


def _engines() -> dict[bool, RankEngine]:
    model = load_rank_model("builtin", 0, 1, torch.bfloat16, DEV)
    return {o: RankEngine(model, new_cache(model, 256, BLOCK), SingleComm(), overtake=o)
            for o in (False, True)}


def _queued_work(eng: RankEngine | None = None) -> tuple[torch.cuda.Event, float]:
    """A second of device time on the default stream, and the host time it was enqueued; with
    ``eng``, known to its overtaking order as an in-order step (writing a block no test uses)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    if eng is not None and eng.overtaking is not None:
        eng.overtaking.in_order([SeqChunk([1], 0, [255])])()
    done = torch.cuda.Event()
    done.record()
    return done, time.perf_counter()


def _warm(eng: RankEngine) -> None:
    """Capture the 128-token bucket's graph now: a capture synchronizes the device."""
    eng.step([SeqChunk([1] * 90, 0, list(range(200, 210)))])
    torch.cuda.synchronize()


def test_a_short_step_overtakes_queued_work_and_equals_the_in_order_step() -> None:
    engines = _engines()
    assert engines[True].overtaking is not None and engines[False].overtaking is None
    prompt = [(3 * i + 1) % 100 for i in range(1200)]
    head = SeqChunk(prompt[:600], 0, list(range(0, 80)))
    tail = SeqChunk(prompt[600:], 600, head.block_ids)  # a continuing chunk runs in order
    short = SeqChunk([(5 * i + 2) % 100 for i in range(100)], 0, list(range(100, 110)))
    more = SeqChunk([7, 8, 9], 100, short.block_ids)
    for eng in engines.values():
        _warm(eng)
    ref = engines[False]
    ref_short = ref.step([short]).argmax(-1).tolist()
    ref_more = ref.step([more])
    eng = engines[True]
    assert eng.overtaking is not None
    eng.step([head])
    eng.step([tail])
    assert eng.logits_stream is None
    torch.cuda.synchronize()
    eng.step([short])  # nothing queued in order: nothing to overtake, it runs in order
    assert eng.logits_stream is None and eng.overtaking.steps == 0
    done, t0 = _queued_work(eng)
    logits = eng.step([short])
    assert eng.logits_stream is eng.overtaking.stream
    with eng.logits_context():
        tokens = logits.argmax(-1).tolist()
    waited = time.perf_counter() - t0
    assert not done.query(), f"sampling the short step waited for the queued work ({waited} s)"
    assert tokens == ref_short and eng.overtaking.waited == 0
    after = eng.step([more])  # in order again, reading the short prompt's KV
    assert eng.logits_stream is None
    torch.testing.assert_close(after, ref_more, rtol=0, atol=0)


def test_an_overtaking_step_waits_when_its_blocks_may_still_be_written() -> None:
    eng = _engines()[True]
    assert eng.overtaking is not None
    _warm(eng)
    done, _ = _queued_work()
    # as a cancelled prompt's chunk still queued would: its blocks then go to a new prompt
    eng.overtaking.in_order([SeqChunk([1] * 600, 0, list(range(0, 40)))])()
    logits = eng.step([SeqChunk([(5 * i + 2) % 100 for i in range(100)], 0,
                                list(range(30, 40)))])
    with eng.logits_context():
        logits.argmax(-1).tolist()
    assert done.query() and eng.overtaking.waited == 1


def test_a_step_overtakes_an_in_order_step_half_way_through_its_paced_launch() -> None:
    """The in-order step's launch stops after its first layer (the device is a second behind);
    the pacer's wait launches a short prompt's step, whose tokens are read before the queued
    work is done. Both give what they give unpaced, in order."""
    engines = _engines()
    prompt = [(3 * i + 1) % 100 for i in range(1300)]
    head = SeqChunk(prompt[:600], 0, list(range(0, 90)))
    long = SeqChunk(prompt[600:], 600, head.block_ids)  # a continuing chunk: eager, in order
    short = SeqChunk([(5 * i + 2) % 100 for i in range(100)], 0, list(range(100, 110)))
    for eng in engines.values():
        _warm(eng)
        eng.step([head])
    ref = engines[False]
    ref_long = ref.step([long])
    ref_short = ref.step([short]).argmax(-1).tolist()
    eng = engines[True]
    assert eng.overtaking is not None
    marks = DeviceMarks(DEV, lambda: None)
    seen: dict[str, object] = {}

    def serve(oldest: Mark) -> None:
        if "short" not in seen:
            logits = eng.step([short])
            with eng.logits_context():
                seen["short"] = logits.argmax(-1).tolist()
            seen["queued_done"] = done.query()
            seen["stream"] = eng.logits_stream
        while not oldest.done():
            time.sleep(0.001)

    pacer = LaunchPacer(marks.mark, serve, slice_layers=1, ahead=1, min_tokens=1)
    eng.pacer = pacer
    done, _ = _queued_work()
    out = eng.step([long])
    assert eng.logits_stream is None  # the long step's own logits, in order
    torch.testing.assert_close(out, ref_long, rtol=0, atol=0)
    assert seen["short"] == ref_short and seen["stream"] is eng.overtaking.stream
    assert seen["queued_done"] is False, "the short step's tokens waited for the queued work"
    assert pacer.waits >= 1 and eng.overtaking.steps == 1 and eng.overtaking.waited == 0


def test_an_overtaking_step_waits_for_an_in_order_graph_still_queued() -> None:
    """Graphs share one memory pool: a graph replayed in order behind queued work and an
    overtaking one must not run at once. The overtaking step waits for it, and both give what
    they give in order."""
    engines = _engines()
    first = SeqChunk([(3 * i + 1) % 100 for i in range(200)], 0, list(range(0, 13)))
    second = SeqChunk([(5 * i + 2) % 100 for i in range(100)], 0, list(range(100, 110)))
    for eng in engines.values():
        _warm(eng)
    ref = engines[False]
    want_first, want_second = ref.step([first]).clone(), ref.step([second]).clone()
    eng = engines[True]
    assert eng.overtaking is not None
    eng.step([first])  # its graph captured, nothing queued: in order
    torch.cuda.synchronize()
    done, _ = _queued_work(eng)  # a second of in-order work: fresh steps would overtake it
    with torch.inference_mode():  # as step() replays it: an in-order graph behind that work
        got_first = eng._prefill_padded([first], True)
    eng.overtaking.after_graph()
    got_second = eng.step([second])
    assert eng.logits_stream is eng.overtaking.stream and eng.overtaking.waited == 1
    torch.cuda.synchronize()
    assert done.query()
    torch.testing.assert_close(got_first, want_first, rtol=0, atol=0)
    torch.testing.assert_close(got_second, want_second, rtol=0, atol=0)


def test_an_overtaking_step_waits_for_an_in_order_decode_graph_still_queued() -> None:
    """The same for a decode bucket's graph an in-order step replayed (a prefill whose prompt
    has one token left after its cached prefix runs it as a decode row): ``step`` fences it."""
    eng = _engines()[True]
    assert eng.overtaking is not None
    _warm(eng)
    prompt = SeqChunk([(3 * i + 1) % 100 for i in range(40)], 0, [20, 21, 22])
    eng.step([prompt])
    row = SeqChunk([7], 40, [20, 21, 22])
    eng.step([row])  # its decode graph captured, nothing queued
    torch.cuda.synchronize()
    done, _ = _queued_work()  # queued, unknown to the overtaking order: only the fence holds
    eng.step([SeqChunk([8], 41, [20, 21, 22])])  # an in-order replay behind it
    eng.step([SeqChunk([1] * 90, 0, list(range(200, 210)))])  # fresh: would overtake
    assert eng.overtaking.waited == 1
    torch.cuda.synchronize()
    assert done.query()
