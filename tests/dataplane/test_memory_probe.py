"""The start-up memory probe (engine/memory_probe.py) run on a CPU against a pretend device
memory: the driver's warm-up fits the probe's scratch cache for both roles, the largest step
runs, everything the probe made is gone after it, and what it read reaches the sizing. On a GPU
the same code reads torch.cuda and NVML instead (docs/kv-memory.md)."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

from pdd_sidecar.engine import memory_probe, rank_engine
from pdd_sidecar.engine.comm import SingleComm
from pdd_sidecar.env import InstanceSettings
from pdd_sidecar.kv.pool_sizing import (
    GIB,
    SizingError,
    min_sequence,
)
from pdd_sidecar.model.rank_model import load_rank_model

pytestmark = pytest.mark.dataplane

BS = 16


def settings(role: str, **env: str) -> InstanceSettings:
    return InstanceSettings.from_env({
        "PDD_ROLE": role, "PDD_TP_SIZE": "1", "PDD_BLOCK_SIZE": str(BS),
        "PDD_ROUTING_FILE": "/r.json", "PDD_GRANT_KEY_FILE": "/k", **env})


class PretendMemory:
    """A 100 GiB device: 10 GiB reserved before the probe and after it, a 14 GiB peak while the
    probe runs, 11 GiB held by the process in all (NVML), 80 GiB free after."""

    def __init__(self, seen: dict[str, Any]) -> None:
        self.seen = seen
        self.alive_at_peak: bool | None = None
        self.alive_at_settle: list[bool] = []  # at each settle: any engine or cache alive
        self.calls: list[str] = []

    def _alive(self) -> bool:
        return any(ref() is not None for ref in self.seen["engines"] + self.seen["caches"])

    def settle(self) -> None:
        self.calls.append("settle")
        self.alive_at_settle.append(self._alive())

    def reserved(self) -> int:
        return 10 * GIB

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def peak(self) -> int:
        self.alive_at_peak = self._alive()
        self.calls.append("peak")
        return 14 * GIB

    def free_total(self) -> tuple[int, int]:
        return 80 * GIB, 100 * GIB

    def process_used(self) -> int | None:
        return 11 * GIB


@pytest.fixture
def tracked(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Every engine and cache the probe makes, by weak reference, and each step's prompt
    lengths."""
    seen: dict[str, Any] = {"engines": [], "caches": [], "steps": []}

    class Tracked(rank_engine.RankEngine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            seen["engines"].append(weakref.ref(self))

        def step(self, chunks: Any, want_logits: bool = True) -> Any:
            seen["steps"].append([(c.start, len(c.tokens)) for c in chunks])
            return super().step(chunks, want_logits)

    made = rank_engine.new_cache

    def new_cache(*args: Any, **kwargs: Any) -> Any:
        cache = made(*args, **kwargs)
        seen["caches"].append(weakref.ref(cache.kv))
        return cache

    monkeypatch.setattr(rank_engine, "RankEngine", Tracked)
    monkeypatch.setattr(rank_engine, "new_cache", new_cache)
    return seen


@pytest.fixture(scope="module")
def model() -> Any:
    return load_rank_model("builtin", 0, 1, "float32", "cpu", 1234)


def test_a_prefill_probe_runs_the_warm_up_and_the_largest_step_then_frees_it(
        model: Any, tracked: dict[str, Any]) -> None:
    s = settings("prefill", PDD_CHUNK_TOKENS="256", PDD_MAX_STEP_TOKENS="1024")
    mem = PretendMemory(tracked)
    report = memory_probe.probe(model, SingleComm(), s, torch.device("cpu"), 0, mem)
    steps = tracked["steps"]
    assert steps[0] == [(0, 256)]  # the warm-up's chunk, then its ragged continuation
    assert [(0, 256)] * 4 == steps[-1]  # the largest step: 1024 tokens of fresh prompts
    assert mem.alive_at_peak is True
    assert mem.calls[:2] == ["settle", "reset_peak"] and mem.calls[-1] == "settle"
    # all of it gone before the memory is read again: the engine (and with it, on a GPU, its
    # CUDA graphs) and the scratch cache
    assert mem.alive_at_settle == [False, False]
    assert len(tracked["engines"]) == len(tracked["caches"]) == 1
    per_block = memory_probe.bytes_per_block(model, BS)
    scratch_blocks = 1 + 256 // BS + 6 + 4 * (256 // BS)  # 265 tokens, spare, the step
    assert report.scratch == scratch_blocks * per_block
    assert (report.total, report.free, report.torch_peak, report.resident) == (
        100 * GIB, 80 * GIB, 14 * GIB, 10 * GIB)
    assert report.non_torch == GIB and report.leftover == 0


def test_a_decode_probe_and_the_blocks_it_sizes(model: Any, tracked: dict[str, Any]) -> None:
    s = settings("decode", PDD_GPU_MEMORY_UTILIZATION="0.5", PDD_CHUNK_TOKENS="256")
    mem = PretendMemory(tracked)
    blocks = memory_probe.rank_blocks(model, SingleComm(), s, torch.device("cpu"), 0, mem)
    steps = tracked["steps"]
    # A decode prefills prompts too (local prefill, fallback): the warm-up's chunk first, as a
    # prefill's; the decode step at batch 1 (eager on a CPU); last a prompt chunk beside
    # running rows, as a local prefill's steps are: a fresh one (split into graphs on a
    # GPU), then one that continues it (eager).
    assert steps[0] == [(0, 256)]
    assert [(1, 1)] in steps
    assert steps[-2:] == [[(0, BS + 3), (1, 1), (1, 1)], [(BS + 3, BS + 3), (1, 1), (1, 1)]]
    per_block = memory_probe.bytes_per_block(model, BS)
    scratch = (1 + 256 // BS + 6) * per_block  # 265 tokens and the fresh prompts' spare
    # 0.5 x 100 GiB, less the peak without the scratch cache, less 1 GiB outside torch
    assert blocks == (50 * GIB - (14 * GIB - scratch) - GIB) // per_block
    assert mem.alive_at_settle == [False, False]


def test_the_pool_explicit_on_a_cpu_or_agreed_from_memory(
        model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def gather(mine: Any) -> list[Any]:
        raise AssertionError("no rank agrees on what nobody measured")

    cpu = torch.device("cpu")
    pool = memory_probe.size_rank_pool(model, SingleComm(), settings("decode"), cpu, 0, gather)
    assert (pool.blocks, pool.source) == (1024, "cpu default")  # docs/kv-memory.md
    assert pool.longest == min(pool.tokens, model.config.max_position_embeddings)
    cuda = torch.device("cuda", 0)  # never touched: the measuring itself is replaced here
    explicit = settings("decode", PDD_NUM_BLOCKS="77")
    pool = memory_probe.size_rank_pool(model, SingleComm(), explicit, cuda, 0, gather)
    assert (pool.blocks, pool.source, pool.tokens) == (77, "explicit", 77 * BS)

    monkeypatch.setattr(memory_probe, "rank_blocks", lambda *a, **k: 700)
    pool = memory_probe.size_rank_pool(model, SingleComm(), settings("decode"), cuda, 0,
                                       lambda mine: [mine, (650, None)])
    assert (pool.blocks, pool.source) == (650, "memory")

    def too_small(*args: Any, **kwargs: Any) -> int:
        raise SizingError("the pool would get 3 blocks")

    monkeypatch.setattr(memory_probe, "rank_blocks", too_small)
    with pytest.raises(SizingError, match="rank 1: the pool would get 3 blocks"):
        memory_probe.size_rank_pool(model, SingleComm(), settings("decode"), cuda, 1,
                                    lambda mine: [(900, None), mine])


def test_the_smallest_useful_sequence_of_the_builtin_model(model: Any) -> None:
    assert min_sequence(model.config.max_position_embeddings)[0] == min(
        4096, model.config.max_position_embeddings)


def test_running_out_of_memory_at_start_names_the_setting_and_the_numbers() -> None:
    s = settings("prefill", PDD_GPU_MEMORY_UTILIZATION="0.45")
    err = memory_probe.oom_error("loading the weights", torch.device("cuda", 1), 3 * GIB,
                                 140 * GIB, s)
    text = str(err)
    assert isinstance(err, SizingError)
    assert "CUDA out of memory while loading the weights on cuda:1" in text
    assert "3.00 GiB of 140.00 GiB free" in text
    assert "PDD_GPU_MEMORY_UTILIZATION" in text and "--gpu-memory-utilization" in text
    assert "now 0.45" in text and "--prefill-memory-share" in text


def test_nvml_not_there_means_the_documented_fallback() -> None:
    """Here (no pynvml, or no GPU for NVML) the bytes outside torch come from the fallback."""
    assert memory_probe.nvml_process_bytes(torch.device("cpu")) is None
