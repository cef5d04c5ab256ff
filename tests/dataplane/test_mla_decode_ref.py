"""The batched paged MLA decode reference (what the CPU runs and the Triton kernel is tested
against) agrees with the single-sequence ``decode_attention`` over ``PagedKVCache.read``, and the
sync-free expert sort groups tokens the way the grouped GEMM expects."""

from __future__ import annotations

import pytest
import torch

from pdd_sidecar.engine.dcp import merge_by_lse
from pdd_sidecar.kv.cache import PagedKVCache
from pdd_sidecar.model.kernels.mla_decode import paged_mla_decode, paged_mla_decode_ref
from pdd_sidecar.model.kernels.moe_grouped import sort_by_expert
from pdd_sidecar.model.mla import decode_attention

pytestmark = pytest.mark.dataplane

C, R, H, BS, LAYERS = 32, 8, 4, 16, 3


def _cache(dtype: torch.dtype, g: torch.Generator) -> PagedKVCache:
    cache = PagedKVCache(64, LAYERS, BS, C + R, dtype)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g).to(dtype))
    return cache


def _tables(
    cache: PagedKVCache, lens: list[int], g: torch.Generator
) -> tuple[torch.Tensor, list[list[int]]]:
    """Non-contiguous per-sequence tables (shuffled free ids), padded with a block id that holds
    other data so a read past a sequence's end would show."""
    free = torch.randperm(cache.num_blocks, generator=g).tolist()
    per_seq = []
    for n in lens:
        k = max(1, -(-n // BS))
        per_seq.append([free.pop() for _ in range(k)])
    width = max(len(t) for t in per_seq) + 1
    pad = free[0]
    table = torch.tensor([t + [pad] * (width - len(t)) for t in per_seq], dtype=torch.int32)
    return table, per_seq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_equals_per_sequence_decode_attention(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    cache = _cache(dtype, g)
    lens = [0, 1, 15, 16, 17, 50, 3 * BS]
    table, per_seq = _tables(cache, lens, g)
    q = torch.randn(len(lens), H, C + R, generator=g).to(dtype)
    layer, scale = 1, 0.17
    out, lse = paged_mla_decode_ref(
        q, cache.kv, layer, table, torch.tensor(lens, dtype=torch.int32), C, scale
    )
    assert out.shape == (len(lens), H, C) and out.dtype == torch.float32
    assert lse.shape == (len(lens), H) and lse.dtype == torch.float32
    for b, n in enumerate(lens):
        kv = cache.read(layer, torch.tensor(per_seq[b]), n)
        want_out, want_lse = decode_attention(q[b], kv, C, scale)
        assert torch.equal(out[b], want_out), b
        assert torch.equal(lse[b], want_lse), b
    assert torch.equal(out[0], torch.zeros(H, C))
    assert torch.isneginf(lse[0]).all()
    assert torch.isfinite(lse[1:]).all()


def test_cpu_dispatch_is_the_reference() -> None:
    g = torch.Generator().manual_seed(3)
    cache = _cache(torch.float32, g)
    lens = [5, 40]
    table, _ = _tables(cache, lens, g)
    q = torch.randn(2, H, C + R, generator=g)
    sl = torch.tensor(lens, dtype=torch.int32)
    got = paged_mla_decode(q, cache.kv, 2, table, sl, C, 0.2)
    want = paged_mla_decode_ref(q, cache.kv, 2, table, sl, C, 0.2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_lse_is_natural_log_and_merges_split_context() -> None:
    """Two ranks holding disjoint blocks of one sequence merge by LSE to the whole sequence."""
    g = torch.Generator().manual_seed(11)
    cache = _cache(torch.float32, g)
    ids = torch.randperm(cache.num_blocks, generator=g)[:4].tolist()
    q = torch.randn(1, H, C + R, generator=g)
    full = paged_mla_decode_ref(
        q, cache.kv, 0, torch.tensor([ids]), torch.tensor([4 * BS - 3]), C, 0.3
    )
    r0 = paged_mla_decode_ref(
        q, cache.kv, 0, torch.tensor([ids[:2]]), torch.tensor([2 * BS]), C, 0.3
    )
    r1 = paged_mla_decode_ref(
        q, cache.kv, 0, torch.tensor([ids[2:]]), torch.tensor([2 * BS - 3]), C, 0.3
    )
    out, lse = merge_by_lse(torch.stack([r0[0][0], r1[0][0]]), torch.stack([r0[1][0], r1[1][0]]))
    torch.testing.assert_close(out, full[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, full[1][0], rtol=1e-5, atol=1e-5)
    kv = cache.read(0, torch.tensor(ids), 4 * BS - 3)
    scores = (q[0] @ kv.T) * 0.3
    torch.testing.assert_close(full[1][0], torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"q": torch.zeros(2, H)}, "q"),
        ({"kv_lora_rank": C + R}, "kv_lora_rank"),
        ({"layer": LAYERS}, "layer"),
        ({"block_tables": torch.zeros(3, 2, dtype=torch.int32)}, "block_tables"),
        ({"seq_lens": torch.tensor([1, 2, 3], dtype=torch.int32)}, "seq_lens"),
        ({"seq_lens": torch.tensor([1, 2 * BS + 1], dtype=torch.int32)}, "seq_lens"),
        ({"seq_lens": torch.tensor([1.0, 2.0])}, "seq_lens"),
    ],
)
def test_bad_input_names_the_field(change: dict[str, object], field: str) -> None:
    args: dict[str, object] = {
        "q": torch.zeros(2, H, C + R),
        "kv_cache": torch.zeros(8, LAYERS, BS, C + R),
        "layer": 0,
        "block_tables": torch.zeros(2, 2, dtype=torch.int32),
        "seq_lens": torch.tensor([1, 2], dtype=torch.int32),
        "kv_lora_rank": C,
        "scale": 1.0,
    }
    args.update(change)
    with pytest.raises(ValueError, match=field):
        paged_mla_decode_ref(**args)  # type: ignore[arg-type]


def test_sort_by_expert_groups_every_choice_once() -> None:
    g = torch.Generator().manual_seed(5)
    num_experts, k = 9, 3
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(20)])
    order, rows, offs = sort_by_expert(ids, num_experts)
    flat = ids.flatten()
    assert sorted(order.tolist()) == list(range(flat.numel()))
    assert torch.equal(rows, order // k)
    sorted_ids = flat[order]
    assert torch.equal(sorted_ids, torch.sort(flat).values)
    counts = torch.bincount(flat, minlength=num_experts)
    assert offs.dtype == torch.int32
    assert torch.equal(offs.long(), torch.cumsum(counts, 0))
    starts = torch.cat([torch.zeros(1, dtype=torch.long), offs.long()[:-1]])
    for e in range(num_experts):
        assert (sorted_ids[starts[e] : offs[e]] == e).all()
