"""The KV pool sized from memory (kv/pool_sizing.py) against made-up memory reports: a GPU of
its own, one shared with another process, warm-up peaks, what the probe leaves behind; every
error names the setting and the numbers. And the settings' env, and the warm-up shape the
driver and the probe share."""

from __future__ import annotations

import math

import pytest

from pdd_sidecar.engine.warmup_shape import (
    fresh_prompt_lengths,
    largest_step_prompts,
    unbounded_warmup_blocks,
    warmup_fresh_blocks,
    warmup_shape,
)
from pdd_sidecar.env import ConfigError, InstanceSettings
from pdd_sidecar.kv.cache import num_table_blocks
from pdd_sidecar.kv.pool_sizing import (
    FREE_HEADROOM_BYTES,
    GIB,
    MIB,
    NON_TORCH_FALLBACK_BYTES,
    MemoryReport,
    PoolSize,
    SizingError,
    agree,
    blocks_for,
    kv_budget,
    min_sequence,
    non_torch_bytes,
    size_pool,
)

PER_BLOCK = 4 * MIB  # 256 blocks a GiB
BS = 64
# The figures docs/kv-memory.md gives, written out here so that the expectations below are
# worked by hand from the memory report, not read back from the module under test.
HEADROOM_BLOCKS = 128  # the 512 MiB left free, in 4 MiB blocks


def lone(**changes: int) -> MemoryReport:
    """A 100 GiB GPU of its own: 18 GiB of weights stay, the warm-up peaks 2 GiB above them on a
    1 GiB scratch cache, 2 GiB outside torch; everything but those is free after the probe."""
    fields = {"total": 100 * GIB, "free": 80 * GIB, "torch_peak": 21 * GIB, "scratch": 1 * GIB,
              "non_torch": 2 * GIB, "resident": 18 * GIB}
    fields.update(changes)
    return MemoryReport(**fields)


def blocks(report: MemoryReport, utilization: float = 0.9, dcp: int = 1,
           min_tokens: int = 4096) -> int:
    return size_pool(report, utilization, PER_BLOCK, BS, dcp, min_tokens,
                     "a test's reason").blocks


def test_the_pool_it_sizes() -> None:
    pool = size_pool(lone(), 0.9, PER_BLOCK, BS, 2, 4096, "why", 163840)
    assert (pool.blocks, pool.source, pool.dcp, pool.block_size) == (68 * 256, "memory", 2, BS)
    assert pool.tokens == 68 * 256 * BS * 2 and pool.bytes == 68 * GIB
    assert pool.longest == 163840  # the model's length caps it
    small_model = size_pool(lone(), 0.9, PER_BLOCK, BS, 1, 512, "why", 512)
    assert small_model.longest == 512


def test_a_gpu_of_its_own_gives_the_pool_utilization_less_weights_warm_up_and_context() -> None:
    # 0.9 x 100 = 90 GiB, less 20 (weights 18 + warm-up 2) and 2 outside torch: 68 GiB
    assert blocks(lone()) == 68 * 256
    # at 1.0 (78 GiB) what is free binds: 80 GiB less the warm-up's 2 again and the headroom,
    # 77.5 GiB
    assert blocks(lone(), 1.0) == 78 * 256 - HEADROOM_BLOCKS == 19840
    assert blocks(lone(), 0.5) == 28 * 256
    # a higher warm-up peak (graphs, the largest step) leaves that much less
    assert blocks(lone(torch_peak=25 * GIB)) == 64 * 256
    # the scratch cache is in the peak, not in what serving needs
    assert blocks(lone(torch_peak=24 * GIB, scratch=4 * GIB)) == 68 * 256


def test_never_more_than_is_free_now_less_the_warm_up_again_and_the_headroom() -> None:
    """Another process holds 50 GiB of the GPU: 28 GiB are free after the probe, the real
    warm-up will take 2 of them again, and the headroom stays free."""
    shared = lone(free=28 * GIB)
    assert kv_budget(shared, 0.9) == (68 * GIB, 25 * GIB + 512 * MIB)  # 28 - 2 - 0.5
    assert blocks(shared) == 26 * 256 - HEADROOM_BLOCKS == 6528
    # a utilization that leaves less than the free memory wins again
    assert blocks(shared, 0.3) == (30 - 20 - 2) * 256


def test_a_prefill_and_a_decode_sharing_a_gpu_each_fit_their_share() -> None:
    """pdd serve gives each 0.45 of one 100 GiB GPU: each pool fits its share, and the first
    to size leaves the second its share of what is free."""
    assert blocks(lone(), 0.45) == (45 - 20 - 2) * 256  # 23 GiB
    # The first holds 20 + 2 + 23 = 45 GiB; the second, weights loaded (20), sees 35 free:
    # its share (23 GiB) binds, not what is free (35 - 2 - 0.5).
    assert blocks(lone(free=35 * GIB), 0.45) == 23 * 256
    # Had the first taken more than its share, the second gets only what is left:
    # 24 GiB free less the warm-up's 2 and the headroom, 21.5 GiB.
    assert blocks(lone(free=24 * GIB), 0.45) == 22 * 256 - HEADROOM_BLOCKS == 5504


def test_what_the_probe_left_reserved_counts_against_the_pool() -> None:
    assert blocks(lone(leftover=3 * GIB)) == 65 * 256


def test_dcp_and_block_size_in_the_pool_report() -> None:
    pool = PoolSize(blocks=1000, block_size=64, dcp=4, bytes_per_block=PER_BLOCK,
                    max_positions=163840, source="memory")
    assert (pool.tokens, pool.bytes, pool.longest) == (256000, 1000 * PER_BLOCK, 163840)
    short = PoolSize(100, 16, 1, 1024, 4096, "explicit")
    assert (short.tokens, short.longest) == (1600, 1600)
    # blocks a prefill keeps for itself (graphed prefix hits' scratch) are no sequence's
    kept = PoolSize(100, 16, 2, 1024, 4096, "explicit", reserved=10)
    assert (kept.tokens, kept.sequence_tokens, kept.longest) == (3200, 2880, 2880)
    text = pool.describe()
    assert "1000 blocks of 64 tokens" in text and "256000 tokens at dcp 4" in text
    assert "longest sequence 163840 tokens" in text and "(memory)" in text


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.01, math.nan, math.inf])
def test_a_utilization_outside_0_1_is_refused_naming_the_setting(bad: float) -> None:
    with pytest.raises(SizingError, match=r"PDD_GPU_MEMORY_UTILIZATION .*--gpu-memory-"
                       r"utilization.*: must be in \(0, 1\], got"):
        blocks(lone(), bad)


def test_weights_and_warm_up_that_do_not_fit_are_refused_with_the_numbers() -> None:
    with pytest.raises(SizingError) as exc:
        blocks(lone(), 0.2)
    text = str(exc.value)
    assert "PDD_GPU_MEMORY_UTILIZATION" in text and "=0.2" in text
    assert "20.00 GiB" in text and "2.00 GiB more outside torch" in text
    assert "0.2 x 100.00 GiB = 20.00 GiB" in text and "22.00 GiB" in text
    with pytest.raises(SizingError, match="0.50 GiB the probe left reserved"):
        blocks(lone(leftover=GIB // 2), 0.22)


def test_a_pool_too_small_for_one_sequence_says_which_length_and_why() -> None:
    # 0.225 x 100 = 22.5 GiB less 22: 0.5 GiB = 128 blocks of 64 tokens = 8192 tokens
    assert blocks(lone(), 0.225, min_tokens=8192) == 128
    with pytest.raises(SizingError) as exc:
        blocks(lone(), 0.225, min_tokens=8193)
    text = str(exc.value)
    assert "128 blocks of 64 tokens (8192 tokens" in text
    assert "one sequence of 8193 tokens (a test's reason) needs 129 blocks" in text
    assert "PDD_NUM_BLOCKS" in text and "--num-blocks" in text
    assert "less the weights and warm-up" in text
    # DCP 2 holds twice the tokens in the same blocks per rank
    assert blocks(lone(), 0.225, dcp=2, min_tokens=16384) == 128


def test_too_small_because_another_process_holds_the_gpu_says_so() -> None:
    with pytest.raises(SizingError, match="another process holds the rest of the GPU"):
        blocks(lone(free=2 * GIB + FREE_HEADROOM_BYTES + 100 * MIB))


def test_the_smallest_useful_sequence() -> None:
    tokens, why = min_sequence(163840)
    assert tokens == 4096 and "worth serving" in why  # docs/kv-memory.md's 4096
    assert min_sequence(4096)[0] == 4096 and min_sequence(0)[0] == 4096  # 0: length unknown
    assert min_sequence(512) == (512, "the model's maximum length")
    assert min_sequence(4095) == (4095, "the model's maximum length")
    assert blocks_for(4096, 64, 1) == 64 and blocks_for(4096, 64, 2) == 32
    assert blocks_for(4097, 64, 2) == 33 and blocks_for(0, 64, 1) == 1


def test_bytes_outside_torch_from_nvml_or_the_fallback() -> None:
    assert non_torch_bytes(None, 5 * GIB) == NON_TORCH_FALLBACK_BYTES
    assert non_torch_bytes(7 * GIB, 5 * GIB) == 2 * GIB
    assert non_torch_bytes(4 * GIB, 5 * GIB) == 0


def test_every_rank_agrees_on_the_smallest_and_a_failing_rank_is_named() -> None:
    assert agree([(900, None), (850, None), (1000, None)]) == 850
    with pytest.raises(SizingError, match="rank 1: too small"):
        agree([(900, None), (None, "too small"), (None, "other")])


# ---------------------------------------------------------------- the settings


ENV = {"PDD_ROLE": "decode", "PDD_TP_SIZE": "1", "PDD_BLOCK_SIZE": "64",
       "PDD_ROUTING_FILE": "/r.json", "PDD_GRANT_KEY_FILE": "/k"}


def test_num_blocks_unset_is_sized_and_set_wins() -> None:
    s = InstanceSettings.from_env(ENV)
    assert s.num_blocks is None and s.gpu_memory_utilization == 0.9
    assert InstanceSettings.from_env({**ENV, "PDD_NUM_BLOCKS": ""}).num_blocks is None
    assert InstanceSettings.from_env({**ENV, "PDD_NUM_BLOCKS": "3000"}).num_blocks == 3000
    for bad, why in (("0", "must be >= 1, got 0"), ("many", "must be an integer, got 'many'")):
        with pytest.raises(ConfigError, match=f"PDD_NUM_BLOCKS: {why}"):
            InstanceSettings.from_env({**ENV, "PDD_NUM_BLOCKS": bad})


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.5", "nan", "inf", "most"])
def test_gpu_memory_utilization_env_outside_0_1_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="PDD_GPU_MEMORY_UTILIZATION: must be"):
        InstanceSettings.from_env({**ENV, "PDD_GPU_MEMORY_UTILIZATION": bad})


def test_gpu_memory_utilization_env_in_range() -> None:
    for ok in ("1", "0.45", "0.05"):
        s = InstanceSettings.from_env({**ENV, "PDD_GPU_MEMORY_UTILIZATION": ok})
        assert s.gpu_memory_utilization == float(ok)


# ---------------------------------------------------------------- the warm-up's shape


def test_a_prefill_warms_up_a_chunk_and_a_ragged_continuation_as_far_as_the_cache_holds() -> None:
    # 8225 tokens in blocks of 64: 129; two fresh prompts of at most 2 x 64 + 5 = 133 tokens,
    # 3 blocks each
    full = warmup_shape("prefill", 10_000, 64, 1, 8192, 256, (1, 2, 4), False)
    assert full.prompt_tokens == 8192 + 32 + 1 and full.batch_sizes == []
    assert full.blocks == 129 + 2 * 3
    assert unbounded_warmup_blocks("prefill", 64, 1, 8192) == 135
    # the scratch cache of exactly that many blocks runs the same prompt
    assert warmup_shape("prefill", full.blocks, 64, 1, 8192, 256, (1,), False) == full
    # blocks of 16 at dcp 2: a fresh prompt of 37 tokens is 3 chunks, 2 table blocks; the
    # continuing prompt gets the 20 - 2 x 2 left, 16 blocks of 32 tokens
    cut = warmup_shape("prefill", 20, 16, 2, 512, 256, (1,), False)
    assert cut.prompt_tokens == 16 * 32 == 512 and cut.blocks == 20
    # dcp 2: 129 chunks in 65 table blocks, each 133-token fresh prompt 3 chunks in 2
    dcp2 = warmup_shape("prefill", 10_000, 64, 2, 8192, 256, (1,), False)
    assert dcp2.blocks == 65 + 2 * 2
    assert unbounded_warmup_blocks("prefill", 64, 2, 8192) == 69


def test_the_warmups_fresh_prompts_fit_their_blocks_at_any_block_size() -> None:
    """Blocks of 4: the 13-token fresh prompt needs 4 table blocks (3 fell short)."""
    assert warmup_fresh_blocks(4, 1) == 4 and warmup_fresh_blocks(64, 1) == 3
    for bs in (1, 2, 4, 8, 16, 64):
        for dcp in (1, 2, 4):
            need = max(num_table_blocks(n, bs, dcp) for n in fresh_prompt_lengths(bs))
            assert warmup_fresh_blocks(bs, dcp) >= need


def test_a_decode_warms_up_every_bucket_up_to_its_running_limit() -> None:
    buckets = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    shape = warmup_shape("decode", 1024, 64, 1, 8192, 100, buckets, False)
    assert shape.batch_sizes == [1, 2, 4, 8, 16, 32, 64, 128]
    assert warmup_shape("decode", 1024, 64, 1, 8192, 1000, buckets, False).batch_sizes[-1] == 256
    assert warmup_shape("decode", 1024, 64, 1, 8192, 100, buckets, True).batch_sizes == [1]


def test_a_decode_warms_up_its_own_prefill_path_as_a_prefill_does() -> None:
    """A decode prefills short prompts itself (and every prompt while no prefill is ready): the
    same chunk-sized prompt and ragged continuation as a prefill's warm-up, so its first local
    prefill compiles and captures nothing on a request's path."""
    buckets = (1, 2, 4, 8)
    decode = warmup_shape("decode", 10_000, 64, 1, 8192, 8, buckets, False)
    prefill = warmup_shape("prefill", 10_000, 64, 1, 8192, 8, buckets, False)
    assert decode.prompt_tokens == prefill.prompt_tokens == 8192 + 32 + 1
    assert decode.blocks == prefill.blocks == 129 + 2 * 3
    assert unbounded_warmup_blocks("decode", 64, 1, 8192) == 135
    cut = warmup_shape("decode", 20, 16, 2, 512, 8, buckets, False)
    assert cut.prompt_tokens == 512 and cut.blocks == 20 and cut.batch_sizes == [1, 2, 4, 8]


def test_the_probe_runs_the_largest_step_when_it_is_more_than_a_chunk() -> None:
    assert largest_step_prompts("prefill", 8192, 8192) == []
    assert largest_step_prompts("prefill", 16384, 8192) == [8192, 8192]
    assert largest_step_prompts("prefill", 2048, 512) == [512] * 4
    assert largest_step_prompts("prefill", 1000, 512) == [512, 488]
    assert largest_step_prompts("decode", 16384, 8192) == []
