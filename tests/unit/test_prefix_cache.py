"""The prefix cache's bookkeeping, without torch: keys, refcounts, eviction order, safety."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pdd_sidecar.kv.errors import KVCacheFullError
from pdd_sidecar.kv.prefix_cache import PrefixCache, chain_root, unit_keys

RECORD = {"model": "tiny:builtin(seed=1)", "dtype": "float32", "block_size": 4,
          "cache_layout": "L2xB4xD8", "plan_version": 1, "plan_digest": "abc", "dcp": 1}


class Blocks:
    """A plain allocator: lowest free ids, strict about double frees."""

    def __init__(self, n: int) -> None:
        self.num_blocks = n
        self.free_ids = set(range(n))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise KVCacheFullError(f"requested {n}")
        ids = sorted(self.free_ids)[:n]
        self.free_ids -= set(ids)
        return ids

    def free(self, ids: Sequence[int]) -> None:
        assert not set(ids) & self.free_ids, f"double free {ids}"
        self.free_ids |= set(ids)


def make(n: int = 8, unit: int = 4, record: dict | None = None) -> tuple[PrefixCache, Blocks]:
    blocks = Blocks(n)
    return PrefixCache(blocks, unit, chain_root(record or RECORD)), blocks


def run(pc: PrefixCache, prompt: list[int], total_blocks: int) -> tuple[list[int], int]:
    """Admit a prompt the way the scheduler does, cache its whole units; (table, hit units)."""
    keys = pc.keys(prompt)
    hits = pc.lookup(keys[:(len(prompt) - 1) // pc.unit_tokens])
    table = pc.acquire(hits, total_blocks - len(hits), len(prompt))
    pc.insert(keys, table)
    return table, len(hits)


def test_keys_chain_over_whole_units_and_depend_on_everything_before() -> None:
    root = chain_root(RECORD)
    a = unit_keys(root, list(range(10)), 4)
    assert len(a) == 2  # the partial third unit has no key
    b = unit_keys(root, [99, *range(1, 10)], 4)
    assert a[0] != b[0] and a[1] != b[1]  # a change in unit 0 changes every later key
    c = unit_keys(root, [*range(4), 0, 0, 0, 0], 4)
    assert a[0] == c[0] and a[1] != c[1]


@pytest.mark.parametrize("field,value", [("model", "tiny:builtin(seed=2)"), ("dtype", "bfloat16"),
                                         ("block_size", 8), ("cache_layout", "L2xB4xD16"),
                                         ("plan_digest", "abd"), ("dcp", 2)])
def test_root_digest_separates_weights_dtype_layout_and_plan(field: str, value: object) -> None:
    tokens = list(range(8))
    other = {**RECORD, field: value}
    assert unit_keys(chain_root(RECORD), tokens, 4) != unit_keys(chain_root(other), tokens, 4)
    pc, _ = make()
    table, _ = run(pc, tokens + [1], 3)
    pc.free(table)
    assert pc.lookup(unit_keys(chain_root(other), tokens, 4)) == []
    assert pc.lookup(pc.keys(tokens)) == table[:2]


def test_shared_prefix_is_reused_and_refcounted() -> None:
    pc, blocks = make()
    a, hit_a = run(pc, list(range(9)), 3)
    b, hit_b = run(pc, list(range(8)) + [50, 51], 3)
    assert hit_a == 0 and hit_b == 2
    assert b[:2] == a[:2] and b[2] != a[2]
    assert pc.refs(a[0]) == 2 and pc.refs(a[2]) == 1
    assert pc.hit_tokens == 8 and pc.queried_tokens == 19
    pc.free(a)
    assert pc.refs(a[0]) == 1 and a[2] in blocks.free_ids  # uncached: back at once
    pc.free(b)
    assert pc.refs(a[0]) == 0 and pc.cached_blocks == 2
    assert pc.num_free == 8 and blocks.num_free == 6


def test_whole_prompt_cached_still_runs_its_last_token() -> None:
    pc, _ = make()
    a, _ = run(pc, list(range(8)), 2)
    pc.free(a)
    b, hit = run(pc, list(range(8)), 2)
    assert hit == 1 and b[0] == a[0] and b[1] != a[0]  # the last unit is computed again


def test_unreferenced_cached_blocks_are_evicted_lru_and_deepest_first() -> None:
    pc, blocks = make(n=6)
    a, _ = run(pc, list(range(12)) + [0], 4)  # caches 3 units
    pc.free(a)
    b, _ = run(pc, [7] * 4 + [1], 2)
    pc.free(b)
    assert pc.cached_blocks == 4 and pc.num_free == 6
    # a's table is older: its deepest unit goes first, then the one before it.
    c = pc.allocate(4)
    assert a[2] in c and a[1] in c and a[0] not in c and b[0] not in c
    assert pc.lookup(pc.keys(list(range(12)))) == [a[0]]
    pc.free(c)
    assert blocks.num_free == 6 - pc.cached_blocks


def test_a_hit_moves_to_the_back_of_the_eviction_line() -> None:
    pc, _ = make(n=4)
    a, _ = run(pc, [1] * 4 + [0], 2)
    pc.free(a)
    b, _ = run(pc, [2] * 4 + [0], 2)
    pc.free(b)
    c, hit = run(pc, [1] * 4 + [5], 2)  # a's unit is used again
    assert hit == 1
    pc.free(c)
    d = pc.allocate(3)
    assert a[0] not in d and b[0] in d


def test_referenced_blocks_are_never_evicted_or_handed_out() -> None:
    pc, _ = make(n=4)
    held, _ = run(pc, list(range(8)) + [1], 3)  # e.g. held by a lease for a decode
    assert pc.num_free == 1
    with pytest.raises(KVCacheFullError):
        pc.allocate(2)
    got = pc.allocate(1)
    assert not set(got) & set(held)
    assert not pc.fits([], 1)
    pc.free(got)
    pc.free(held)
    assert sorted(pc.allocate(4)) == [0, 1, 2, 3]


def test_fits_counts_reclaimed_hits_once() -> None:
    pc, _ = make(n=3)
    a, _ = run(pc, list(range(8)) + [1], 3)
    pc.free(a)
    hits = pc.lookup(pc.keys(list(range(8))))
    assert len(hits) == 2
    assert pc.fits(hits, 1) and not pc.fits(hits, 2)
    table = pc.acquire(hits, 1)
    assert table[:2] == hits and pc.num_free == 0


def test_double_free_and_foreign_blocks_are_refused_and_change_nothing() -> None:
    pc, _ = make()
    a, _ = run(pc, list(range(8)) + [1], 3)
    pc.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        pc.free([a[0]])
    with pytest.raises(ValueError, match="not allocated"):
        pc.free([a[2]])
    b, _ = run(pc, list(range(8)) + [2], 3)
    with pytest.raises(ValueError, match="not allocated"):
        pc.free([b[2], 7])
    assert pc.refs(b[2]) == 1
    with pytest.raises(ValueError):
        pc.free([b[2], b[2]])
    with pytest.raises(ValueError, match="not allocated"):
        pc.insert([b"k"], [7])


def test_identical_prompts_at_once_keep_the_first_copy_cached() -> None:
    pc, blocks = make()
    keys = pc.keys(list(range(8)))
    a = pc.acquire([], 3)
    b = pc.acquire([], 3)  # both admitted before either finished: no hit yet
    pc.insert(keys, a)
    pc.insert(keys, b)
    assert pc.lookup(keys) == a[:2]
    pc.free(b)
    assert set(b) <= blocks.free_ids
    pc.free(a)
    assert pc.cached_blocks == 2


def test_clear_returns_every_unreferenced_block() -> None:
    pc, blocks = make()
    a, _ = run(pc, list(range(8)) + [1], 3)
    b, _ = run(pc, [5] * 8 + [1], 3)
    pc.free(a)
    pc.clear()
    assert pc.cached_blocks == 0 and pc.lookup(pc.keys(list(range(8)))) == []
    pc.free(b)
    assert blocks.num_free == 8


# -- tails: a decode's finished partial unit, adopted by the one turn that continues it


def finish(pc: PrefixCache, tokens: list[int], table: list[int]) -> list[int]:
    """End a decode holding KV of ``tokens`` the way the scheduler does: whole units cached,
    the partial one kept as a tail; the rest of the table freed. The tail's block."""
    keys = pc.keys(tokens)
    pc.insert(keys, table)
    w = len(keys)
    partial = tokens[w * pc.unit_tokens:]
    assert partial and pc.insert_tail(keys[-1] if keys else pc.root, partial, table[w])
    pc.free(table[:w] + table[w + 1:])
    return [table[w]]


def adopt(pc: PrefixCache, prompt: list[int], total_blocks: int) -> tuple[list[int], int]:
    """Admit a decode prompt: whole-unit hits, then the tail it continues; (table, cached)."""
    keys = pc.keys(prompt)
    hits = pc.lookup(keys[:len(prompt) // pc.unit_tokens])
    start = len(hits) * pc.unit_tokens
    tail = pc.lookup_tail(keys[len(hits) - 1] if hits else pc.root,
                          prompt[start:start + pc.unit_tokens])
    n_new = total_blocks - len(hits) - (tail is not None)
    table = pc.acquire(hits, n_new, len(prompt), tail)
    return table, start + (tail.tokens if tail else 0)


def test_a_tail_is_adopted_by_a_prompt_that_continues_it_for_the_tokens_they_share() -> None:
    pc, blocks = make()
    a = pc.acquire([], 3)
    (tail,) = finish(pc, list(range(10)), a)  # units [0..4) and [4..8), tail 8, 9
    assert (pc.cached_blocks, pc.tail_blocks) == (2, 1)
    assert pc.refs(tail) == 0 and tail not in blocks.free_ids
    assert pc.num_free == 8 and blocks.num_free == 5
    hit_before = pc.hit_tokens
    b, cached = adopt(pc, list(range(9)) + [77, 78, 79], 4)  # shares 8 of the tail's rows
    assert cached == 9 and b[:3] == a and pc.hit_tokens - hit_before == 9
    assert pc.refs(tail) == 1 and pc.tail_blocks == 0  # the request's alone now
    assert pc.num_free == 4
    pc.free(b)
    assert pc.tail_blocks == 0 and tail in blocks.free_ids  # not cached: back to the allocator


def test_a_tail_whose_first_token_differs_or_under_another_parent_is_not_adopted() -> None:
    pc, _ = make()
    (tail,) = finish(pc, list(range(6)), pc.acquire([], 2))
    keys = pc.keys(list(range(4)))
    assert pc.lookup_tail(keys[0], [9, 5]) is None  # the first token differs
    assert pc.lookup_tail(pc.root, [4, 5]) is None  # not after the root
    assert pc.lookup_tail(keys[0], []) is None  # nothing after the hits
    hit = pc.lookup_tail(keys[0], [4, 5, 6, 7])
    assert hit is not None and (hit.block, hit.tokens) == (tail, 2)
    assert pc.lookup_tail(keys[0], [4, 9]).tokens == 1  # type: ignore[union-attr]


def test_a_tail_has_exactly_one_adopter() -> None:
    pc, _ = make()
    finish(pc, list(range(6)), pc.acquire([], 2))
    keys = pc.keys(list(range(4)))
    first = pc.lookup_tail(keys[0], [4, 5])
    second = pc.lookup_tail(keys[0], [4, 5])
    assert first == second and first is not None
    a = pc.acquire(pc.lookup(keys), 0, tail=first)
    with pytest.raises(ValueError, match="not a cached tail"):
        pc.acquire(pc.lookup(keys), 0, tail=second)
    assert pc.lookup_tail(keys[0], [4, 5]) is None
    b, cached = adopt(pc, list(range(6)), 2)
    assert cached == 4 and b[0] == a[0] and b[1] != a[1]  # the unit shared, the tail not
    assert pc.refs(a[0]) == 2 and pc.refs(a[1]) == 1 and pc.refs(b[1]) == 1


def test_a_shared_or_whole_block_never_becomes_a_tail() -> None:
    pc, _ = make()
    a = pc.acquire([], 2)
    pc.insert(pc.keys(list(range(4))), a)
    b = pc.acquire(pc.lookup(pc.keys(list(range(4)))), 1)
    assert not pc.insert_tail(pc.root, [0, 1], a[0])  # cached whole, and b reads it
    unit0 = pc.keys(list(range(4)))[0]
    assert pc.insert_tail(unit0, [], a[1]) is False  # nothing to keep
    with pytest.raises(ValueError, match="fewer than 4"):
        pc.insert_tail(unit0, [1, 2, 3, 4], a[1])
    with pytest.raises(ValueError, match="not allocated"):
        pc.insert_tail(unit0, [1], 7)
    pc.free(b)
    assert pc.tail_blocks == 0 and pc.refs(a[0]) == 1 and pc.refs(a[1]) == 1


def test_a_new_tail_for_the_same_parent_replaces_and_frees_the_old_one() -> None:
    pc, blocks = make()
    (old,) = finish(pc, [1, 2, 3, 4, 5], pc.acquire([], 2))
    b, cached = adopt(pc, [1, 2, 3, 4, 6], 2)  # another answer after the same first unit
    assert cached == 4 and old not in b
    (new,) = finish(pc, [1, 2, 3, 4, 6, 7], b)
    assert pc.tail_blocks == 1 and old in blocks.free_ids and new not in blocks.free_ids
    keys = pc.keys([1, 2, 3, 4])
    assert pc.lookup_tail(keys[0], [5]) is None
    assert pc.lookup_tail(keys[0], [6, 7]).block == new  # type: ignore[union-attr]
    assert pc.num_free == 8 and blocks.num_free == 8 - pc.cached_blocks - pc.tail_blocks


def test_tails_are_evicted_first_and_oldest_first() -> None:
    pc, blocks = make(n=5)
    (t1,) = finish(pc, [1] * 4 + [2], pc.acquire([], 2))
    (t2,) = finish(pc, [3] * 4 + [4], pc.acquire([], 2))
    assert pc.num_free == 5 and blocks.num_free == 1 and pc.tail_blocks == 2
    got = pc.allocate(2)
    assert t1 in got and pc.tail_blocks == 1 and pc.cached_blocks == 2
    got += pc.allocate(1)
    assert t2 in got and pc.tail_blocks == 0 and pc.cached_blocks == 2
    got += pc.allocate(2)  # now whole units
    assert pc.cached_blocks == 0 and pc.num_free == 0
    pc.free(got)
    assert blocks.num_free == 5


def test_fits_counts_the_adopted_tail_once() -> None:
    pc, _ = make(n=3)
    finish(pc, list(range(6)), pc.acquire([], 2))  # one unit cached, one tail, one free
    keys = pc.keys(list(range(4)))
    hits = pc.lookup(keys)
    tail = pc.lookup_tail(keys[0], [4, 5, 6])
    assert pc.num_free == 3
    assert pc.fits(hits, 1, tail) and not pc.fits(hits, 2, tail)
    table = pc.acquire(hits, 1, tail=tail)
    assert len(set(table)) == 3 and pc.num_free == 0


def test_clear_returns_tails_too() -> None:
    pc, blocks = make()
    finish(pc, list(range(7)), pc.acquire([], 2))
    finish(pc, [9] * 3, pc.acquire([], 1))  # a tail right after the root
    assert (pc.cached_blocks, pc.tail_blocks) == (1, 2)
    pc.clear()
    assert pc.cached_blocks == pc.tail_blocks == 0 and blocks.num_free == 8
    assert pc.lookup_tail(pc.root, [9]) is None
