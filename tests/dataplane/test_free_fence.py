"""A block a queued device step still references is never handed out (engine/free_fence.py).

The race: a prefill enqueues a multi-chunk prompt's chunk without waiting for it; the prompt is
cancelled; its blocks go back; a step of fresh prompts that overtakes the queued chunk on
another stream, or a host-tier load on the copy stream (which waits for no compute), is handed
one of them and writes it while the chunk still reads it (the units of its earlier chunks) or
writes it. The scheduler is driven here as the driver drives it: each planned step is
registered with the blocks of its chunks' tables and a mark, on the CPU a flag standing for
"the device ran it". Without the fence every assertion on the tables below fails: the blocks go
back at the cancel and the next allocation takes them.
"""

from __future__ import annotations

import pytest

from pdd_sidecar.engine.free_fence import FreeFence
from pdd_sidecar.engine.overtaking import written_blocks
from pdd_sidecar.engine.scheduler import CACHED_TOKENS, Scheduler, Sequence, State, StepPlan
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.kv.cache import PagedKVCache
from pdd_sidecar.kv.host_tier import HostTier
from pdd_sidecar.kv.prefix_cache import PrefixCache, chain_root

pytestmark = pytest.mark.dataplane

BLOCK = 4


class Ran:
    """A step's mark: done once the test says the device ran it."""

    def __init__(self) -> None:
        self.ran = False

    def done(self) -> bool:
        return self.ran


def _tokens(n: int, salt: int) -> list[int]:
    return [(i * 31 + salt * 17 + 3) % 97 for i in range(n)]


class _Prefill:
    def __init__(self, num_blocks: int, host_slots: int = 0) -> None:
        self.cache = PagedKVCache(num_blocks, 1, BLOCK, 2)
        self.pc = PrefixCache(self.cache, BLOCK, chain_root({"dcp": 1}))
        self.tier = HostTier(host_slots, BLOCK) if host_slots else None
        if self.tier is not None:
            self.pc.on_evict = self.tier.spill
        self.sched = Scheduler("prefill", self.cache, BLOCK, 1, 1, step_tokens=16,
                               chunk_tokens=16, long_chunk_tokens=16, prefix_cache=self.pc,
                               host_tier=self.tier)

    def submit(self, rid: str, prompt: list[int]) -> Sequence:
        seq = Sequence(rid, prompt, 2, len(prompt))
        self.sched.submit(seq)
        return seq

    def enqueue(self, plan: StepPlan) -> Ran:
        """What the driver does with a step it enqueued: register it, then move on."""
        mark = Ran()
        self.sched.fence.queued({b for c in plan.prefill for b in c.seq.blocks}, mark)
        if self.tier is not None:
            self.tier.take()
        for c in plan.prefill:
            self.sched.on_chunk_done(c)
        return mark

    def run_prompt(self, rid: str, prompt: list[int]) -> None:
        seq = self.submit(rid, prompt)
        while seq.state is not State.FINISHED:
            plan = self.sched.plan()
            self.enqueue(plan).ran = True
            if plan.prefill and plan.prefill[-1].last:
                self.sched.finish_prefill(seq, keep_blocks=False)

    def cancelled_with_a_chunk_queued(self) -> tuple[Ran, set[int], set[int]]:
        """A 19-token prompt in chunks of 16: its first chunk ran, its second (tokens 16-18)
        is queued, then it is cancelled. The mark of the queued chunk, the blocks it reads and
        those it writes."""
        a = self.submit("a", _tokens(19, 1))
        first = self.sched.plan()
        assert [(c.seq.id, c.start, len(c.tokens)) for c in first.prefill] == [("a", 0, 16)]
        self.enqueue(first).ran = True
        second = self.sched.plan()
        assert [(c.start, len(c.tokens)) for c in second.prefill] == [(16, 3)]
        queued = self.enqueue(second)
        chunk = second.prefill[0]
        writes = set(written_blocks([SeqChunk(chunk.tokens, chunk.start, a.blocks)], BLOCK))
        reads = set(a.blocks[:chunk.start // BLOCK])
        self.sched.cancel("a")
        assert a.state is State.FINISHED and a.blocks == []
        return queued, reads, writes


def test_a_fresh_step_is_not_handed_a_block_a_cancelled_prompts_queued_chunk_reads() -> None:
    f = _Prefill(num_blocks=5)
    queued, reads, writes = f.cancelled_with_a_chunk_queued()
    assert reads == {0, 1, 2, 3} and writes == {4}
    b = f.submit("b", _tokens(8, 2))
    plan = f.sched.plan_fresh(frozenset())  # what would overtake the queued chunk
    # Freed at the cancel, b would get blocks 3 and 4: 3 read by the queued chunk (and 4
    # written), both overwritten by a step that does not wait for it.
    assert not set(b.blocks) & (reads | writes), b.blocks
    assert plan.prefill == [] and b.state is State.WAITING
    assert f.sched.fence.held_blocks == 5  # all of a's table, still referenced
    assert not f.sched.fence.settle()  # the chunk has not run: nothing goes back
    queued.ran = True
    assert f.sched.fence.settle() == 5 and f.sched.fence.held_blocks == 0
    plan = f.sched.plan_fresh(frozenset())
    assert [c.seq.id for c in plan.prefill] == ["b"]
    assert set(b.blocks) & (reads | writes)  # the same blocks, now that nothing reads them


def test_a_host_load_is_not_handed_a_block_a_cancelled_prompts_queued_chunk_reads() -> None:
    f = _Prefill(num_blocks=6, host_slots=16)
    x = _tokens(9, 5)  # two whole units
    f.run_prompt("x", x)
    f.run_prompt("y", _tokens(21, 6))  # 6 blocks: x's units go to host memory
    assert len(f.tier.lookup(f.pc.keys(x)[:2])) == 2
    queued, reads, writes = f.cancelled_with_a_chunk_queued()
    again = f.submit("x2", x)
    f.sched.plan()
    assert not set(again.blocks) & (reads | writes), again.blocks  # its loads would write them
    assert again.state is State.WAITING
    assert not f.tier.take().loads
    queued.ran = True
    f.sched.fence.settle()
    f.sched.plan()
    assert again.state is State.RUNNING and again.extra[CACHED_TOKENS] == 2 * BLOCK
    loads = f.tier.take().loads
    assert [b for _, b in loads] == again.blocks[:2]
    assert {b for _, b in loads} & (reads | writes)  # handed out once the chunk ran


def test_a_prompt_that_leaves_before_its_command_takes_its_loads_with_it() -> None:
    """Admitted with host hits, cancelled before the command carrying its loads is built: the
    loads are dropped and their slots unpinned, so the blocks' next owner keeps its KV."""
    f = _Prefill(num_blocks=6, host_slots=16)
    x = _tokens(9, 5)
    f.run_prompt("x", x)
    f.run_prompt("y", _tokens(21, 6))
    slots = f.tier.lookup(f.pc.keys(x)[:2])
    seq = f.submit("x2", x)
    f.sched.plan()
    f.sched.hold()  # the driver held the step back: the loads are still queued
    assert f.tier._pins == {s: 1 for s in slots} and len(f.tier._ops.loads) == 2
    f.sched.cancel("x2")
    assert seq.state is State.FINISHED
    assert f.tier._pins == {} and f.tier.loaded_blocks == 0
    assert f.sched.fence.held_blocks == 0  # no step referenced them: back at once
    ops = f.tier.take()
    assert ops.loads == [] and ops.offloads  # what its admission evicted still goes out


def test_a_free_waits_for_every_step_that_references_one_of_its_blocks() -> None:
    freed: list[list[int]] = []
    fence = FreeFence(freed.append)
    first, second, other = Ran(), Ran(), Ran()
    fence.queued([1, 2, 3], first)
    fence.queued([3, 4], second)
    fence.queued([9], other)
    fence.free([7, 8])  # no queued step references them
    fence.free([2, 3])  # both of the first two
    fence.free([4])
    assert freed == [[7, 8]] and fence.held_blocks == 3 and fence.pending_steps == 3
    other.ran = True
    second.ran = True  # before the first: an overtaking step may finish first
    assert fence.settle() == 1 and freed == [[7, 8], [4]]
    first.ran = True
    assert fence.settle() == 2 and freed == [[7, 8], [4], [2, 3]]
    assert fence.pending_steps == 0 and fence.held_blocks == 0
    fence.free([1])  # every step done: at once
    assert freed[-1] == [1]


def test_steps_registered_done_hold_nothing() -> None:
    """On the CPU each step is done when enqueued: a free goes through at once."""
    freed: list[list[int]] = []
    fence = FreeFence(freed.append)
    done = Ran()
    done.ran = True
    fence.queued([1, 2], done)
    fence.free([2, 1])
    assert freed == [[2, 1]] and fence.pending_steps == 0
