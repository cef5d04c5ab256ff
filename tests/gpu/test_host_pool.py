"""The host KV tier's copies on a CUDA device (kv/host_pool.py; run by hand, skipped without
one): the pool is page-locked; copies are bit-exact both ways; a load does not wait for compute
queued before it, and the compute stream waits for the load; a prefix scattered block by block
loads while a queued step runs, its seconds its copies' own; and its load rate against a pinned
copy of the same bytes timed the same way (printed, not asserted: the target lives in
bench/kv_tiers.py (b)). The CPU twin of the order is in tests/dataplane/test_host_tier.py.

    PYTHONPATH=sidecar python -m pytest tests/gpu/test_host_pool.py -q -s
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from pdd_sidecar.kv.cache import PagedKVCache  # noqa: E402
from pdd_sidecar.kv.host_pool import HostKVPool, pinned_copy_rate  # noqa: E402

DEV = torch.device("cuda")
SLEEP_CYCLES = 2_000_000_000  # about a second of queued device work at ~2 GHz


def _cache(num_blocks: int, layers: int = 3, block: int = 16, latent: int = 64) -> PagedKVCache:
    cache = PagedKVCache(num_blocks, layers, block, latent, dtype=torch.bfloat16, device=DEV)
    cache.kv.copy_(torch.randn(cache.kv.shape, device=DEV, dtype=torch.bfloat16))
    return cache


def test_the_pool_is_pinned_and_copies_are_bit_exact_both_ways() -> None:
    cache = _cache(40)
    before = cache.kv.clone()
    pool = HostKVPool(cache, 32)
    assert pool.host.is_pinned()
    offloads = [(b, s) for s, b in enumerate([5, 6, 7, 30, 2, 11, 12, 13, 39])]
    pool.run(offloads, [], [torch.cuda.current_stream()])
    torch.cuda.synchronize()
    for b, s in offloads:
        assert torch.equal(pool.host[s], before[b].cpu()), (b, s)
    cache.kv.zero_()
    loads = [(s, 20 + i) for i, s in enumerate([8, 0, 1, 2, 4, 3, 7, 6, 5])]
    pool.run([], loads, [torch.cuda.current_stream()])
    got = cache.kv.clone()  # on the compute stream, which waits for the loads
    torch.cuda.synchronize()
    for s, b in loads:
        assert torch.equal(got[b].cpu(), pool.host[s]), (s, b)
    stats = pool.take_stats()
    assert stats["load"]["bytes"] == stats["offload"]["bytes"] == 9 * cache.bytes_per_block
    assert stats["load"]["seconds"] >= 0 and stats["offload"]["seconds"] >= 0


def test_a_load_runs_beside_queued_compute_and_the_compute_stream_waits_for_it() -> None:
    cache = _cache(16)
    pool = HostKVPool(cache, 8)
    pool.host.copy_(torch.randn(pool.host.shape).to(torch.bfloat16))
    compute = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # a queued step that touches none of the blocks
    queued = torch.cuda.Event()
    queued.record(compute)
    pool.run([], [(s, 8 + s) for s in range(8)], [compute])
    pool.wait()
    assert not queued.query(), "the load waited for the compute queued before it"
    torch.cuda.synchronize()
    assert torch.equal(cache.kv[8:16].cpu(), pool.host)
    # The other way: a load held up on its own stream; the step after it reads its blocks.
    cache.kv.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(pool.stream.stream):
        torch.cuda._sleep(SLEEP_CYCLES // 4)
    pool.run([], [(s, s) for s in range(8)], [compute])
    read = cache.kv[:8].clone()
    torch.cuda.synchronize()
    assert torch.equal(read.cpu(), pool.host), "the step read the blocks before the load"


def test_a_scattered_load_runs_beside_a_queued_step_and_times_its_copies_alone(
        capsys: pytest.CaptureFixture[str]) -> None:
    """512 V2-Lite blocks (27 layers x 64 tokens x 576 x bf16, 1.9 MiB) whose slots and
    blocks are consecutive on neither side together: 512 copies, the tier's worst case, issued
    behind a step queued on the compute stream. On the device's clock the copies end before
    that step does, and the seconds counted are shorter than the step: the copies' own, not
    the wait behind compute a load that waited for it would count."""
    n = 512
    cache = PagedKVCache(2 * n, 27, 64, 576, dtype=torch.bfloat16, device=DEV)
    pool = HostKVPool(cache, 2 * n)
    pool.host[::2].fill_(1.0)
    loads = [(2 * i, 2 * i + 1) for i in range(n)]  # even slots into odd blocks
    compute = torch.cuda.current_stream()
    for _ in range(2):  # the first batch pays for the events' creation
        pool.run([], loads, [compute])
        torch.cuda.synchronize()
        pool.take_stats()
    step = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    step[0].record(compute)
    torch.cuda._sleep(SLEEP_CYCLES)  # a queued step that touches none of the blocks
    step[1].record(compute)
    pool.run([], loads, [compute])
    [(_, _, _, copied)] = pool._timing
    torch.cuda.synchronize()
    got = pool.take_stats()["load"]
    step_ms = step[0].elapsed_time(step[1])
    assert step[0].elapsed_time(copied) < step_ms, "the load waited for the queued step"
    assert got["seconds"] * 1000.0 < step_ms
    assert pool.copies["load"] == 3 * n
    assert bool((cache.kv[1::2] == 1.0).all())
    assert got["bytes"] == n * cache.bytes_per_block and got["blocks"] == n
    rate = got["bytes"] / got["seconds"]
    pinned = pinned_copy_rate(n * cache.bytes_per_block, DEV)
    with capsys.disabled():
        print(f"\nhost tier load, {n} scattered blocks of {cache.bytes_per_block} bytes: "
              f"{rate / 1e9:.1f} GB/s = {rate / pinned:.2f} of a pinned copy of the same bytes "
              f"({pinned / 1e9:.1f} GB/s; bench/kv_tiers.py (b) wants >= 0.80)")
