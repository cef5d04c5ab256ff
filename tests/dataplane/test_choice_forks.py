"""A decode request's choices (n > 1) in the scheduler: one pull, then one sequence per choice
sharing the prompt's whole units, each with its own copy of the unit the prompt ends in;
blocks reserved for all at admission and freed once, by the last choice holding them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdd_sidecar.engine.sampling import SamplingParams, choice_seed
from pdd_sidecar.engine.scheduler import FORKS, Fork, NeverFits, Scheduler, Sequence, State
from pdd_sidecar.kv.cache import PagedKVCache
from pdd_sidecar.kv.prefix_cache import PrefixCache

pytestmark = pytest.mark.dataplane

BLOCK = 4


def _decode(blocks: int = 256, dcp: int = 1, cached: bool = False, max_running: int = 64
            ) -> tuple[Scheduler, PagedKVCache]:
    cache = PagedKVCache(blocks, 1, BLOCK, 2)
    pc = PrefixCache(cache, BLOCK * dcp, b"root") if cached else None
    return Scheduler("decode", cache, BLOCK, dcp, 1, max_running=max_running,
                     prefix_cache=pc), cache


def _request(prompt: int, max_new: int, n: int, rid: str = "r") -> Sequence:
    src = SimpleNamespace(num_tokens=prompt)
    seq = Sequence(rid, list(range(prompt)), max_new, prompt + max_new, source=src,
                   first_token=1, sampling=SamplingParams(seed=5))
    seq.extra["choice"] = 0
    seq.extra[FORKS] = [Fork(j, 1 + j, SamplingParams(seed=choice_seed(5, j)))
                        for j in range(1, n)]
    return seq


def _pulled(sched: Scheduler, seq: Sequence) -> list[Sequence]:
    plan = sched.plan()
    assert plan.pulls == [seq]
    done: list[Sequence] = []
    seq.on_done = done.append
    sched.on_pulled(seq.id, 0, None)
    return done


@pytest.mark.parametrize(("prompt", "dcp"), [(10, 1), (12, 1), (10, 2), (3, 1)])
def test_choices_share_the_prompts_whole_units_and_copy_the_last(prompt: int, dcp: int) -> None:
    sched, cache = _decode(dcp=dcp)
    n, max_new = 4, 6
    seq = _request(prompt, max_new, n)
    sched.submit(seq)
    need = sched.blocks_needed(prompt + max_new)
    shared = prompt // (BLOCK * dcp)
    free = cache.num_free
    done = _pulled(sched, seq)
    assert free - cache.num_free == need + (n - 1) * (need - shared)
    assert len(sched.running) == n and not done
    members = list(sched.running.values())
    assert [m.first_token for m in members] == [1, 2, 3, 4]
    assert [m.sampling.seed for m in members] == [choice_seed(5, j) for j in range(n)]
    assert len({m.sampling.seed for m in members}) == n
    for m in members[1:]:
        assert m.blocks[:shared] == seq.blocks[:shared]
        assert not set(m.blocks[shared:]) & set(seq.blocks)
    partial = prompt % (BLOCK * dcp) != 0
    want = [(seq.blocks[shared], m.blocks[shared]) for m in members[1:]] if partial else []
    assert sched.take_copies() == want and sched.take_copies() == []
    # Finishing in any order: each choice frees what is its own, the last one the shared.
    for i, m in enumerate([members[2], seq, members[1], members[3]]):
        sched._finish(m, "length")
        assert bool(done) == (i == 3)
    assert cache.num_free == free and done == [seq]


def test_cancelling_the_request_cancels_every_choice_even_after_the_first_finished() -> None:
    sched, cache = _decode()
    free = cache.num_free
    seq = _request(9, 5, 3)
    sched.submit(seq)
    done = _pulled(sched, seq)
    sched._finish(seq, "stop")
    assert sched.cancel(seq.id) is seq
    assert not sched.running and done == [seq] and cache.num_free == free
    assert all(m.finish_reason == "cancelled" for m in seq.extra["choice_group"].members[1:])


def test_a_failed_pull_frees_the_choices_blocks_too() -> None:
    sched, cache = _decode()
    free = cache.num_free
    seq = _request(9, 5, 3)
    sched.submit(seq)
    sched.plan()
    done: list[Sequence] = []
    seq.on_done = done.append
    sched.on_pulled(seq.id, 0, {"error": "gone", "kind": "transfer"})
    assert done == [seq] and seq.state is State.FINISHED and cache.num_free == free


def test_admission_reserves_a_slot_and_the_blocks_of_every_choice() -> None:
    sched, _ = _decode(blocks=20, max_running=4)
    with pytest.raises(NeverFits, match="choices"):
        sched.submit(_request(8, 4, 5, "five"))  # five choices, four slots
    big = _request(8, 40, 2, "big")  # 12 blocks each, 2 shared: 22 > 20
    with pytest.raises(NeverFits):
        sched.submit(big)
    a = _request(8, 4, 3, "a")  # 3 + 2 * 1 blocks, 3 slots
    b = _request(8, 4, 2, "b")  # 2 slots: waits for a's
    sched.submit(a)
    sched.submit(b)
    assert sched.plan().pulls == [a]
    sched.on_pulled("a", 0, None)
    assert sched.plan().pulls == [] and len(sched.running) == 3


def test_with_the_prefix_cache_the_shared_units_are_cached_once_and_stay() -> None:
    sched, cache = _decode(cached=True)
    seq = _request(10, 3, 3)
    sched.submit(seq)
    done = _pulled(sched, seq)
    members = list(sched.running.values())
    for m in members:
        m.output = [7, 7, 7]
        sched._finish(m, "length")
    pc = sched.prefix_cache
    assert pc is not None and done == [seq]
    assert pc.cached_blocks >= 2  # the prompt's two whole units, once
    assert not any(pc.refs(b) for b in range(cache.num_blocks))  # nothing left referenced
    assert pc.num_free == cache.num_blocks


def test_copy_blocks_copies_every_layer() -> None:
    cache = PagedKVCache(6, 3, BLOCK, 2)
    cache.kv.copy_(torch.randn_like(cache.kv))
    before = cache.kv.clone()
    cache.copy_blocks([(1, 4), (2, 5)])
    assert torch.equal(cache.kv[4], before[1]) and torch.equal(cache.kv[5], before[2])
    assert torch.equal(cache.kv[:4], before[:4])


def test_choice_seeds_keep_the_requests_for_choice_0_and_differ_by_index() -> None:
    for seed in (0, 7, 2**63 - 1, -5):
        seeds = [choice_seed(seed, j) for j in range(16)]
        assert seeds[0] == seed & (2**63 - 1)
        assert len(set(seeds)) == 16 and all(0 <= s < 2**63 for s in seeds)
        assert seeds == [choice_seed(seed, j) for j in range(16)]


def test_a_prefill_draws_each_choices_first_token_from_the_prompts_last_row() -> None:
    from pdd_sidecar.engine.driver import choice_rows
    from pdd_sidecar.engine.sampling import sample
    from pdd_sidecar.engine.scheduler import CHOICES

    one = Sequence("a", [1, 2], 4, 2, sampling=SamplingParams(temperature=1.0, seed=11))
    many = Sequence("b", [3], 4, 1, sampling=SamplingParams(temperature=1.0, seed=11))
    many.extra[CHOICES] = 6
    rows, params = choice_rows([(0, one), (1, many)])
    assert [(i, s.id) for i, s in rows] == [(0, "a")] + [(1, "b")] * 6
    assert params[0] is one.sampling and params[1] is many.sampling
    assert [p.seed for p in params[1:]] == [choice_seed(11, j) for j in range(6)]
    logits = torch.zeros(2, 256)  # uniform: the seeds alone choose
    tokens = sample(logits[[i for i, _ in rows]], params, [0] * len(rows))
    assert tokens[0] == tokens[1]  # choice 0 of "b" draws as a lone request seeded 11
    assert len(set(tokens[1:])) > 3


def test_ending_one_choice_leaves_the_others_running_before_and_after_the_fork() -> None:
    """Scheduler.end_choice (the router found a stop string in one choice): after the fork the
    choice finishes with "stop" and its own blocks go back; before it (still pulling) it is
    noted and finishes as it forks. The request is done only when its last choice is."""
    sched, cache = _decode()
    free = cache.num_free
    seq = _request(10, 6, 3)
    sched.submit(seq)
    done = _pulled(sched, seq)
    members = {m.extra["choice"]: m for m in sched.running.values()}
    assert sched.end_choice("r", 0) is seq  # the head: only itself, not the request
    assert seq.finish_reason == "stop" and seq.id not in sched.running
    assert sorted(m.extra["choice"] for m in sched.running.values()) == [1, 2]
    assert sched.end_choice("r", 0) is None and sched.end_choice("r", 7) is None
    assert sched.end_choice("r", 2) is members[2] and not done
    sched._finish(members[1], "length")
    assert done == [seq] and cache.num_free == free

    early = _request(10, 6, 3, rid="early")
    sched.submit(early)
    plan = sched.plan()
    assert plan.pulls == [early]
    assert sched.end_choice("early", 1) is None  # still pulling: noted
    early_done: list[Sequence] = []
    early.on_done = early_done.append
    sched.on_pulled("early", 0, None)
    running = sorted(m.extra["choice"] for m in sched.running.values())
    assert running == [0, 2]
    assert sched.end_choice("nope", 0) is None
    for m in list(sched.running.values()):
        sched._finish(m, "length")
    assert early_done == [early] and cache.num_free == free
