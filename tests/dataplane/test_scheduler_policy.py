"""The prefill step policy: budgets by device, short prompts first, the oldest prompt's share,
chunks on block boundaries."""

from __future__ import annotations

import pytest

from pdd_sidecar.engine.scheduler import (
    DEVICE_BUDGETS,
    PrefillChunk,
    Scheduler,
    Sequence,
    step_budget,
)
from pdd_sidecar.kv.cache import PagedKVCache

pytestmark = pytest.mark.dataplane

BLOCK = 16


def _prefill(step: int, chunk: int, blocks: int = 4096, long_chunk: int | None = None
             ) -> Scheduler:
    return Scheduler("prefill", PagedKVCache(blocks, 1, BLOCK, 4), BLOCK, 1, 1,
                     step_tokens=step, chunk_tokens=chunk, long_chunk_tokens=long_chunk)


def _submit(sched: Scheduler, rid: str, n: int) -> Sequence:
    seq = Sequence(rid, list(range(n)), 1, n)
    sched.submit(seq)
    return seq


def _planned(sched: Scheduler) -> tuple[list[PrefillChunk], list[tuple[str, int]]]:
    """The next step's chunks, and (prompt, tokens) of each in order of prompt."""
    chunks = sched.plan().prefill
    return chunks, sorted((c.seq.id, len(c.tokens)) for c in chunks)


def _advance(sched: Scheduler, chunks: list[PrefillChunk]) -> None:
    for c in chunks:
        sched.on_chunk_done(c)
        if c.last:
            sched.finish_prefill(c.seq, keep_blocks=False)


def test_budgets_follow_the_device_unless_set() -> None:
    assert step_budget("cuda", None, None) == DEVICE_BUDGETS["cuda"] == (8192, 8192, 1024)
    assert step_budget("cpu", None, None) == DEVICE_BUDGETS["cpu"] == (2048, 512, 512)
    assert step_budget("mps", None, None) == DEVICE_BUDGETS["cpu"]
    assert step_budget("cuda", 4096, None) == (4096, 8192, 1024)
    assert step_budget("cpu", None, 128) == (2048, 128, 128)  # a long chunk never exceeds it
    assert step_budget("cuda", None, None, 4096) == (8192, 8192, 4096)


def test_a_short_prompt_gets_the_next_step_and_the_long_one_keeps_every_other() -> None:
    """While a 32k prompt runs alone its steps are whole chunks; a 1k prompt arriving gets the
    next step to itself; a second one arriving then shares the step after with one long chunk
    (the long prompt is never left out two steps in a row); alone again, whole chunks."""
    sched = _prefill(8192, 8192, long_chunk=2048)
    _submit(sched, "long", 32768)
    first = sched.plan().prefill
    assert [len(c.tokens) for c in first] == [8192]
    _advance(sched, first)
    _submit(sched, "short", 1000)
    chunks = sched.plan().prefill
    assert [(c.seq.id, len(c.tokens)) for c in chunks] == [("short", 1000)]
    _advance(sched, chunks)
    _submit(sched, "short2", 900)
    chunks = sched.plan().prefill
    assert [(c.seq.id, len(c.tokens)) for c in chunks] == [("long", 2048), ("short2", 900)]
    _advance(sched, chunks)
    assert [len(c.tokens) for c in sched.plan().prefill] == [8192]


def test_long_prompts_beside_each_other_keep_whole_chunks() -> None:
    """Only a short prompt's TTFT gains from short steps; two long prompts fill the step."""
    sched = _prefill(8192, 4096, long_chunk=1024)
    for rid, n in (("a", 20000), ("b", 12000)):
        _submit(sched, rid, n)
    chunks, planned = _planned(sched)
    assert planned == [("a", 4096), ("b", 4096)]
    _advance(sched, chunks)
    for rid, n in (("short", 500), ("short2", 600)):
        _submit(sched, rid, n)
    chunks, planned = _planned(sched)
    assert planned == [("short", 500), ("short2", 600)]
    for c in chunks:  # still running: a prompt's last token is sampled after its step
        sched.on_chunk_done(c)
    _submit(sched, "short3", 700)
    assert _planned(sched)[1] == [("a", 1024), ("b", 1024), ("short3", 700)]


def test_prompts_that_fit_a_chunk_are_never_cut_to_long_chunks() -> None:
    sched = _prefill(8192, 4096, long_chunk=1024)
    _submit(sched, "a", 4096)
    _submit(sched, "b", 3000)
    chunks = sched.plan().prefill
    assert sorted(len(c.tokens) for c in chunks) == [3000, 4096]


def test_one_long_prompt_runs_in_whole_chunks() -> None:
    sched = _prefill(8192, 8192)  # no long chunk set: the chunk itself
    _submit(sched, "long", 20000)
    lens = []
    while sched.running or sched.waiting:
        chunks = sched.plan().prefill
        lens.append([len(c.tokens) for c in chunks])
        _advance(sched, chunks)
    assert lens == [[8192], [8192], [3616]]


def test_a_short_prompt_is_not_stuck_behind_a_long_one() -> None:
    sched = _prefill(8192, 8192)
    _submit(sched, "long", 32768)
    _advance(sched, sched.plan().prefill)  # the long prompt's first chunk
    _submit(sched, "short", 1000)
    chunks = sched.plan().prefill
    assert [(c.seq.id, len(c.tokens), c.last) for c in chunks] == [("short", 1000, True)]


def test_short_prompts_without_pause_cannot_starve_the_oldest() -> None:
    """The long prompt sits out at most every other step, and then keeps its share."""
    sched = _prefill(2048, 2048)
    long = _submit(sched, "long", 10000)
    done = 0
    ran_last = False
    for i in range(80):
        for j in range(8):  # more short prompts than a step holds, every step
            _submit(sched, f"s{i}-{j}", 512)
        chunks = sched.plan().prefill
        assert sum(len(c.tokens) for c in chunks) <= 2048
        mine = [c for c in chunks if c.seq is long]
        assert bool(mine) != ran_last  # never left out twice, never twice in a row
        if mine:
            assert len(mine[0].tokens) >= min(512, len(long.prompt) - long.computed)
        ran_last = bool(mine)
        _advance(sched, chunks)
        if long.computed == len(long.prompt):
            done = i + 1
            break
    assert done and done <= 2 * -(-10000 // 512)


def test_chunks_end_on_block_boundaries_unless_they_end_the_prompt() -> None:
    sched = _prefill(1000, 600)
    for i, n in enumerate((999, 37, 700)):
        _submit(sched, f"r{i}", n)
    seen = 0
    while sched.running or sched.waiting:
        chunks = sched.plan().prefill
        assert chunks and sum(len(c.tokens) for c in chunks) <= 1000
        for c in chunks:
            assert c.last or len(c.tokens) % BLOCK == 0
            assert c.start == c.seq.computed
        seen += len(chunks)
        _advance(sched, chunks)
    assert seen >= 4


def test_the_first_step_is_full_at_its_token_budget_or_its_slots() -> None:
    sched = _prefill(2048, 512)
    for i in range(3):
        _submit(sched, f"a{i}", 600)  # 512 of each fits the first step
    assert not sched.first_step_full()
    _submit(sched, "a3", 600)
    assert sched.first_step_full()
    few_slots = Scheduler("prefill", PagedKVCache(4096, 1, BLOCK, 4), BLOCK, 1, 1,
                          max_running=2, step_tokens=8192, chunk_tokens=512)
    _submit(few_slots, "b0", 10)
    assert not few_slots.first_step_full()
    _submit(few_slots, "b1", 10)
    assert few_slots.first_step_full()


def test_while_a_step_is_launched_only_fresh_prompts_outside_it_are_planned() -> None:
    """A long prompt's chunk and a short prompt share the step being launched; a fresh short
    prompt arriving meanwhile is planned alone (nothing of the launching step twice, no long
    prompt), and the long prompt's turn-taking stays as the step left it."""
    sched = _prefill(8192, 4096, long_chunk=1024)
    _submit(sched, "long", 20000)
    _advance(sched, sched.plan().prefill)
    _submit(sched, "short", 500)
    _advance(sched, sched.plan().prefill)  # the short one's own step
    _submit(sched, "mid", 700)
    launching = sched.plan().prefill
    assert sorted((c.seq.id, len(c.tokens)) for c in launching) == [("long", 1024),
                                                                  ("mid", 700)]
    _submit(sched, "new", 300)
    _submit(sched, "big", 5000)  # more than a chunk: never in such a step
    fresh = sched.plan_fresh({c.seq.id for c in launching}).prefill
    assert [(c.seq.id, c.start, len(c.tokens)) for c in fresh] == [("new", 0, 300)]
    _advance(sched, launching)
    _advance(sched, fresh)
    sched.cancel("big")
    _submit(sched, "next", 200)
    after = sched.plan().prefill  # the long prompt ran in the launching step: it sits out
    assert [c.seq.id for c in after] == ["next"]
    decode = Scheduler("decode", PagedKVCache(64, 1, BLOCK, 4), BLOCK, 1, 1)
    assert decode.plan_fresh(set()).prefill == []


def test_prompts_an_instance_runs_itself_are_gathered_as_a_burst() -> None:
    """An idle instance gathers a burst (engine/driver.py) while prompts it prefills itself
    wait: every prompt of a prefill, a decode's local ones, never a decode's pulls alone."""
    assert not _prefill(8192, 8192).prompts_waiting()
    sched = _prefill(8192, 8192)
    _submit(sched, "p", 40)
    assert sched.prompts_waiting()
    decode = Scheduler("decode", PagedKVCache(4096, 1, BLOCK, 4), BLOCK, 1, 1)

    class Grant:
        num_tokens = 40

    decode.submit(Sequence("pulled", [], 8, 48, source=Grant()))
    assert not decode.prompts_waiting()
    decode.submit(Sequence("local", list(range(30)), 8, 38))
    assert decode.prompts_waiting()
