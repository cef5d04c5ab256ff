"""The host does not wait on the device's queue (engine/device_queue.py) on a CUDA device (run
by hand; skipped without one): an eager prefill step (fresh, continuing and decode rows in one),
picking its rows and sampling them (greedy and seeded top-p/top-k, and with the sampling controls)
and copying the tokens to the host synchronize nothing, and a mark wakes its waiter once the
device passed it.

    PYTHONPATH=sidecar python -m pytest tests/gpu/test_device_queue.py -q
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from pdd_sidecar.engine.comm import SingleComm  # noqa: E402
from pdd_sidecar.engine.device_queue import DeviceMarks  # noqa: E402
from pdd_sidecar.engine.rank_engine import RankEngine, new_cache  # noqa: E402
from pdd_sidecar.engine.sampling import (  # noqa: E402
    SamplingParams,
    TokenHistory,
    pick_rows,
    sample,
    sample_on_device,
)
from pdd_sidecar.engine.seq_chunk import SeqChunk  # noqa: E402
from pdd_sidecar.model.rank_model import load_rank_model  # noqa: E402

T = TypeVar("T")
DEV = torch.device("cuda")
BLOCK = 16
ROWS = [2, 0]  # rows picked as the driver picks the live ones
PARAMS = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3)]


def _without_host_sync(step: Callable[[], T]) -> T:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_an_eager_step_and_its_sampled_tokens_synchronize_nothing() -> None:
    model = load_rank_model("builtin", 0, 1, torch.bfloat16, DEV)
    eng = RankEngine(model, new_cache(model, 256, BLOCK), SingleComm(), decode_mode="eager",
                     prefill_buckets=())
    vocab = model.config.vocab_size
    long = [(3 * i + 1) % vocab for i in range(500)]
    other = [(7 * i + 2) % vocab for i in range(60)]
    eng.step([SeqChunk(long[:300], 0, list(range(0, 40))),
              SeqChunk(other, 0, list(range(40, 50)))])

    def step() -> torch.Tensor:
        logits = eng.step([SeqChunk(long[300:], 300, list(range(0, 40))),  # continuing
                           SeqChunk([5], 60, list(range(40, 50))),  # a decode row
                           SeqChunk(long[:100], 0, list(range(60, 70)))])  # fresh
        assert logits is not None
        tokens = sample_on_device(pick_rows(logits, ROWS), PARAMS, [0, 1])
        return tokens.to("cpu", non_blocking=True)

    step()  # compiles the kernels of these shapes first
    on_host = _without_host_sync(step)
    torch.cuda.synchronize()
    eng2 = RankEngine(model, new_cache(model, 256, BLOCK), SingleComm(), decode_mode="eager",
                      prefill_buckets=())
    eng2.step([SeqChunk(long[:300], 0, list(range(0, 40))),
               SeqChunk(other, 0, list(range(40, 50)))])
    ref = eng2.step([SeqChunk(long[300:], 300, list(range(0, 40))),
                     SeqChunk([5], 60, list(range(40, 50))),
                     SeqChunk(long[:100], 0, list(range(60, 70)))])
    assert ref is not None
    assert on_host.tolist() == sample(ref[ROWS], PARAMS, [0, 1])


def test_the_sampling_controls_synchronize_nothing_and_match_the_cpu() -> None:
    """logit_bias, min_tokens and the penalties (engine/sampling.py) go up asynchronously."""
    vocab = 256
    g = torch.Generator().manual_seed(5)
    cpu = torch.randn(3, vocab, generator=g) * 4
    params = [SamplingParams(logit_bias=((3, 100.0), (9, -5.0)), min_tokens=4,
                             repetition_penalty=1.3, frequency_penalty=0.5,
                             presence_penalty=0.25),
              SamplingParams(),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, min_tokens=1,
                             frequency_penalty=-0.7)]
    histories = [TokenHistory(list(range(40)), [5, 5, 7], frozenset({3, 11})), None,
                 TokenHistory([1, 2], [2, 2, 2, 9], frozenset({4}))]
    logits = cpu.to(DEV, torch.bfloat16)

    def step() -> torch.Tensor:
        tokens = sample_on_device(logits, params, [3, 0, 4], histories)
        return tokens.to("cpu", non_blocking=True)

    step()
    on_host = _without_host_sync(step)
    torch.cuda.synchronize()
    # The greedy rows as the CPU chooses them (the seeded draw uses its device's generator).
    got = on_host.tolist()
    assert got[:2] == sample(logits.cpu(), params, [3, 0, 4], histories)[:2]
    assert got[0] != 3  # held back by min_tokens despite its +100


def test_a_mark_wakes_its_waiter_once_the_device_passed_it() -> None:
    woken = threading.Event()
    marks = DeviceMarks(DEV, woken.set)
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # a quarter of a second or so of queued device work
    m = marks.mark()
    set_at = time.perf_counter()
    assert not m.done()
    assert woken.wait(30)
    assert m.done() and time.perf_counter() - set_at > 0.01
