"""Overtaking prefill steps (engine/overtaking.py): the order kept around them, and when an
engine uses them. The streams themselves need a CUDA device: tests/gpu/test_overtaking.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pdd_sidecar import env
from pdd_sidecar.engine import overtaking
from pdd_sidecar.engine.comm import SingleComm
from pdd_sidecar.engine.launch_pacing import LaunchPacer
from pdd_sidecar.engine.overtaking import BlockOrder, steps_since, written_blocks
from pdd_sidecar.engine.rank_engine import RankEngine, new_cache
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.model.rank_model import load_rank_model

pytestmark = pytest.mark.dataplane


def test_a_block_written_in_order_holds_back_an_overtaking_step_until_that_work_is_done(
        ) -> None:
    order = BlockOrder()
    ran = {"first": False, "second": False}
    assert not order.must_wait([1, 2])  # nothing written yet
    order.written_in_order([1, 2, 3], lambda: ran["first"])
    order.written_in_order([7], lambda: ran["second"])
    assert not order.must_wait([4, 5, 6])  # other blocks: it overtakes
    assert order.must_wait([6, 7]) and order.must_wait([2])  # a block handed on while queued
    assert order.pending == 4
    ran["first"] = True  # the older step is done: its blocks no longer hold anything back
    assert not order.must_wait([1, 2]) and order.must_wait([7]) and order.pending == 1
    assert order.busy()
    ran["second"] = True
    assert not order.must_wait([1, 7]) and order.pending == 0 and not order.busy()


def test_a_step_seen_done_is_dropped_though_a_later_one_still_runs() -> None:
    """Blocks written by an earlier burst, long done, never hold back a short prompt while a
    long prompt's chunk (other blocks) is still queued."""
    order = BlockOrder()
    order.written_in_order(range(100), lambda: True)
    order.written_in_order([500, 501], lambda: False)
    assert not order.must_wait([10, 11]) and order.pending == 2


def test_only_a_single_rank_cuda_engine_with_prefill_graphs_overtakes() -> None:
    model = load_rank_model("builtin", 0, 1, torch.float32, torch.device("cpu"))
    eng = RankEngine(model, new_cache(model, 64, 16), SingleComm())
    assert eng.overtaking is None and eng.logits_stream is None
    assert isinstance(eng.logits_context(), contextlib.nullcontext)
    with pytest.raises(ValueError, match="overtake needs a CUDA cache"):
        RankEngine(model, new_cache(model, 64, 16), SingleComm(), decode_mode="padded",
                   prefill_buckets=(32, 64), overtake=True)


def test_the_counter_gains_the_steps_since_it_was_last_brought_up_to_date() -> None:
    assert steps_since((0, 0), (5, 2)) == {"false": 3, "true": 2}
    assert steps_since((5, 2), (7, 2)) == {"false": 2, "true": 0}
    assert steps_since((7, 2), (8, 3)) == {"false": 0, "true": 1}


def test_a_step_writes_the_blocks_of_its_tokens_positions_not_the_tables_it_reads() -> None:
    table = [10, 11, 12, 13, 14, 15]
    assert written_blocks([SeqChunk([1], 70, table)], 16) == [14]  # a decode token
    assert written_blocks([SeqChunk([1] * 30, 20, table)], 16) == [11, 12, 13]
    assert written_blocks([SeqChunk([1] * 16, 0, table), SeqChunk([2], 47, table[3:])],
                          16) == [10, 15]


def test_the_setting_is_checked_on_every_device_and_named_when_wrong(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert overtaking.PDD_OVERTAKING == env.PDD_OVERTAKING
    model = load_rank_model("builtin", 0, 1, torch.float32, torch.device("cpu"))
    monkeypatch.setenv("PDD_OVERTAKING", "yes")
    with pytest.raises(ValueError, match="PDD_OVERTAKING: must be 0 or 1, got 'yes'"):
        RankEngine(model, new_cache(model, 64, 16), SingleComm())
    monkeypatch.setenv("PDD_OVERTAKING", "0")
    assert not overtaking.overtaking_enabled()
    assert RankEngine(model, new_cache(model, 64, 16), SingleComm()).overtaking is None
    monkeypatch.delenv("PDD_OVERTAKING")
    assert overtaking.overtaking_enabled() and overtaking.overtaking_enabled({})


def test_an_in_order_step_calls_its_pacer_after_each_layer_and_computes_the_same() -> None:
    """The engine's side of a paced launch (engine/launch_pacing.py): a step of enough tokens
    is launched in slices, a smaller one whole, and both compute what they do unpaced."""
    model = load_rank_model("builtin", 0, 1, torch.float32, torch.device("cpu"))
    plain = RankEngine(model, new_cache(model, 64, 16), SingleComm())
    paced = RankEngine(model, new_cache(model, 64, 16), SingleComm())
    seen: list[int] = []

    class Passed:
        def done(self) -> bool:
            return True

    def mark() -> Passed:
        seen.append(len(seen))
        return Passed()

    paced.pacer = LaunchPacer(mark, lambda oldest: None, slice_layers=1, ahead=1,
                              min_tokens=30)
    prompt = [(7 * i + 3) % 100 for i in range(40)]
    chunks = [SeqChunk(prompt[:32], 0, [0, 1, 2]), SeqChunk(prompt[:9], 0, [5])]
    want = plain.step(chunks)
    got = paced.step(chunks)
    layers = model.config.num_hidden_layers
    assert len(seen) == layers - 1  # a mark after each layer but the last
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    more = [SeqChunk(prompt[32:], 32, [0, 1, 2])]  # 8 tokens: launched whole
    torch.testing.assert_close(paced.step(more), plain.step(more), rtol=0, atol=0)
    assert len(seen) == layers - 1


def test_an_in_order_step_refused_half_way_still_ends_its_registration() -> None:
    """An in-order step counts in the overtaking order from before its launch; one refused
    during it (a token id out of range) must still be seen done, or it and every step
    registered after it would stay pending for good."""
    model = load_rank_model("builtin", 0, 1, torch.float32, torch.device("cpu"))
    eng = RankEngine(model, new_cache(model, 64, 16), SingleComm())
    ended: list[list[SeqChunk]] = []

    class Order:  # the engine's side of engine/overtaking.py, without a CUDA stream
        def in_order(self, chunks: list[SeqChunk]) -> object:
            return lambda: ended.append(chunks)

    eng.overtaking = Order()  # type: ignore[assignment]
    bad = [SeqChunk([1, 2, model.config.vocab_size], 0, [0])]
    with pytest.raises(ValueError, match="token"):
        eng.step(bad)
    assert ended == [bad]
    good = [SeqChunk([1, 2, 3], 0, [1])]
    assert eng.step(good) is not None and ended == [bad, good]
