"""The paged latent KV cache: the layout contract, allocation, and the DCP chunk arithmetic."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pdd_sidecar.engine.comm import run_threads  # noqa: E402
from pdd_sidecar.engine.rank_engine import RankEngine, allocate_request, new_cache  # noqa: E402
from pdd_sidecar.kv import cache as kvc  # noqa: E402
from pdd_sidecar.kv.cache import KVCacheFullError, PagedKVCache  # noqa: E402
from pdd_sidecar.model.rank_model import load_rank_model  # noqa: E402

pytestmark = pytest.mark.dataplane


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=300),
    bs=st.integers(min_value=1, max_value=20),
    dcp=st.sampled_from([1, 2, 4, 8]),
)
def test_chunk_arithmetic(n, bs, dcp):
    chunks = kvc.num_chunks(n, bs)
    held = [kvc.local_chunks(n, bs, dcp, r) for r in range(dcp)]
    if dcp == 1:
        assert held[0] == list(range(chunks))
    else:
        assert sorted(g for h in held for g in h) == list(range(chunks))  # each exactly once
    table = kvc.num_table_blocks(n, bs, dcp)
    for r, gs in enumerate(held):
        assert len(gs) == kvc.num_local_blocks(n, bs, dcp, r) <= table
        for k, g in enumerate(gs):
            assert kvc.holds_chunk(r, g, dcp)
            assert kvc.local_block_index(g, dcp) == k
            assert kvc.chunk_owner(g, dcp) == (r if dcp > 1 else 0)
        mine = [t for t in range(n) if kvc.holds_chunk(r, t // bs, dcp)]
        assert kvc.local_token_count(n, bs, dcp, r) == len(mine)
        # a rank's tokens fill its local blocks in order: the i-th held token is at slot i
        for i, t in enumerate(mine):
            owner, k, off = kvc.token_slot(t, bs, dcp)
            assert (k, off) == divmod(i, bs)
            assert dcp == 1 or owner == r


def test_layout_is_block_major_and_contiguous():
    c = PagedKVCache(10, 3, 4, 40, torch.bfloat16)
    assert c.kv.shape == (10, 3, 4, 40)
    assert c.kv.is_contiguous()
    assert c.bytes_per_block == 3 * 4 * 40 * 2
    assert c.kv[1].data_ptr() - c.kv[0].data_ptr() == c.bytes_per_block
    assert (c.num_blocks, c.num_layers, c.block_size, c.latent_dim) == (10, 3, 4, 40)
    assert c.dtype == torch.bfloat16 and c.device == torch.device("cpu")


def test_allocation_prefers_lowest_contiguous_run():
    c = PagedKVCache(10, 1, 2, 4)
    a, b, d = c.allocate(3), c.allocate(2), c.allocate(4)
    assert (a, b, d) == ([0, 1, 2], [3, 4], [5, 6, 7, 8])
    c.free(b)
    assert c.allocate(2) == [3, 4]  # the freed run, not split
    c.free(a)
    assert c.allocate(2) == [0, 1]
    # no run of 3 left (free: 2 and 9): lowest free ids
    assert c.allocate(2) == [2, 9]
    assert c.num_free == 0
    assert kvc.contiguous_runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]


def test_full_cache_raises_clear_error_and_stays_usable():
    c = PagedKVCache(4, 1, 2, 4)
    c.allocate(3)
    with pytest.raises(KVCacheFullError, match=r"requested 2 blocks .* 1 free of 4"):
        c.allocate(2)
    assert isinstance(KVCacheFullError("x"), RuntimeError)
    assert c.num_free == 1 and c.allocate(1) == [3]


def test_free_rejects_double_free():
    c = PagedKVCache(4, 1, 2, 4)
    ids = c.allocate(2)
    c.free(ids)
    with pytest.raises(ValueError, match="not allocated"):
        c.free(ids)


def test_sharded_cache_holds_exactly_the_replicated_chunks():
    """After prefill, rank r's local block k (dcp 4) equals chunk k*4+r of a dcp-1 cache."""
    prompt = list(range(1, 24))  # 23 tokens, bs 4: 6 chunks, last partial
    bs, tp = 4, 4

    def prefill(dcp):
        def body(rank, comm):
            model = load_rank_model("builtin", rank, tp)
            cache = new_cache(model, 8, bs)
            cache.allocate(1)  # offset the request so ids differ from chunk numbers
            table = allocate_request(cache, len(prompt), dcp)
            RankEngine(model, cache, comm, dcp).prefill(prompt, table)
            return cache, table

        return run_threads(tp, body)

    replicated = prefill(1)
    sharded = prefill(4)
    full_cache, full_table = replicated[0]
    assert full_table == list(range(1, 7))
    for r, (cache, table) in enumerate(sharded):
        assert table == [1, 2]  # shared table: every rank allocated identically
        for k, g in enumerate(kvc.local_chunks(len(prompt), bs, 4, r)):
            n = min(bs, len(prompt) - g * bs)
            mine = cache.kv[table[k], :, :n]
            ref = full_cache.kv[full_table[g], :, :n]
            assert torch.equal(mine, ref), (r, k, g)
            assert mine.abs().sum() > 0
        # nothing written outside the rank's chunks
        unused = [b for b in range(8) if b not in table[: kvc.num_local_blocks(23, bs, 4, r)]]
        assert float(cache.kv[unused].abs().sum()) == 0.0
    # replicated ranks hold identical caches
    for cache, _ in replicated[1:]:
        assert torch.equal(cache.kv, full_cache.kv)


def test_write_then_read_follows_the_block_table():
    """Tokens written at (table[k], offset) come back in token order from a scattered table,
    only from the requested layer, and the last partial block is cut to the token count."""
    c = PagedKVCache(8, 3, 4, 6)
    table = torch.tensor([5, 1, 6])
    n = 10
    vals = torch.arange(n * 6, dtype=torch.float32).view(n, 6)
    pos = torch.arange(n)
    c.write(1, table[pos // 4], pos % 4, vals)
    assert torch.equal(c.read(1, table, n), vals)
    assert torch.equal(c.read(1, table, 7), vals[:7])
    assert float(c.read(0, table, n).abs().sum()) == 0.0
    assert c.read(2, table, 0).shape == (0, 6)
