"""Which rows of which blocks a decode rank reads, from the first token its own prefix cache
lacks on: pure arithmetic, checked against a token-by-token model of the two block tables."""

from __future__ import annotations

import itertools

import pytest

from pdd_api.plan import SidePlan
from pdd_api.routing import plan_routing
from pdd_sidecar.kv.transfer import (
    ReadSpec,
    RegionInfo,
    Rows,
    Run,
    plan_read_specs,
    row_descriptors,
    spec_bytes,
)

SIDES = [(1, 1), (2, 1), (2, 2), (4, 4)]
CONFIGS = list(itertools.product(SIDES, SIDES))
LAYERS, BLOCK, ROW = 3, 4, 32
REGION = RegionInfo(addr=1 << 20, num_blocks=64, num_layers=LAYERS, block_size=BLOCK,
                    row_bytes=ROW, mem_type="DRAM", device_id=0)


def _table(num_chunks: int, dcp: int, offset: int) -> list[int]:
    n = -(-num_chunks // dcp)
    return [offset + 2 * i for i in range(n)]  # never consecutive: every block its own run


def _moved(specs: list[ReadSpec]) -> set[tuple[int, int, int, int]]:
    """(prefill rank, remote block, local block, row) of every row the specs read."""
    rows = set()
    for s in specs:
        for r in s.runs:
            for i, row in itertools.product(range(r.n), range(BLOCK)):
                rows.add((s.prefill_rank, r.remote_start + i, r.local_start + i, row))
        for p in s.partials:
            rows |= {(s.prefill_rank, p.remote_block, p.local_block, row)
                     for row in range(p.lo, p.hi)}
    return rows


@pytest.mark.parametrize(("prefill", "decode"), CONFIGS, ids=lambda s: f"tp{s[0]}dcp{s[1]}")
@pytest.mark.parametrize("num_tokens", [1, 7, 8, 21])
def test_every_token_from_the_start_on_is_read_once_per_holder_and_nothing_before_it(
        prefill: tuple[int, int], decode: tuple[int, int], num_tokens: int) -> None:
    plan = plan_routing(SidePlan(tensor_parallel_size=prefill[0],
                                 decode_context_parallel_size=prefill[1]),
                        SidePlan(tensor_parallel_size=decode[0],
                                 decode_context_parallel_size=decode[1]), BLOCK)
    num_chunks = -(-num_tokens // BLOCK)
    ptable, dtable = _table(num_chunks, prefill[1], 1), _table(num_chunks, decode[1], 40)
    for start in range(num_tokens + 2):
        for d in range(decode[0]):
            specs = plan_read_specs(plan.reads_of(d), num_tokens, BLOCK, prefill[1], decode[1],
                                    ptable, dtable, start)
            want = set()
            for t in range(start, num_tokens):
                g = t // BLOCK
                if decode[1] > 1 and g % decode[1] != d:
                    continue  # another decode rank holds it
                owner = g % prefill[1] if prefill[1] > 1 else None
                readers = [s.prefill_rank for s in plan.reads_of(d)
                           if g % s.chunk_modulus == s.chunk_residue]
                assert len(readers) == 1 and (owner is None or readers[0] == owner)
                want.add((readers[0], ptable[g // prefill[1]], dtable[g // decode[1]], t % BLOCK))
            got = _moved(specs)
            assert got == want, (start, d)
            assert sum(spec_bytes(s, REGION) for s in specs) == len(want) * LAYERS * ROW
            assert all(len(s.partials) <= 2 and all(0 <= p.lo < p.hi <= BLOCK and p.n < BLOCK
                                                    for p in s.partials) for s in specs)
            assert sorted(g for s in specs for g in s.chunks) == sorted(
                {(t // BLOCK) for t in range(start, num_tokens)
                 if decode[1] == 1 or (t // BLOCK) % decode[1] == d})


def test_a_start_in_the_last_partial_chunk_reads_one_row_range_of_it() -> None:
    """10 tokens, the decode holds 9: chunk 2 is both the first and the last chunk read."""
    plan = plan_routing(SidePlan(tensor_parallel_size=1, decode_context_parallel_size=1),
                        SidePlan(tensor_parallel_size=1, decode_context_parallel_size=1), BLOCK)
    (spec,) = plan_read_specs(plan.reads_of(0), 10, BLOCK, 1, 1, [5, 6, 7], [20, 21, 22], 9)
    assert spec.runs == [] and spec.partials == [Rows(7, 22, 1, 2)] and spec.chunks == [2]
    assert spec_bytes(spec, REGION) == LAYERS * ROW
    (spec,) = plan_read_specs(plan.reads_of(0), 10, BLOCK, 1, 1, [5, 6, 7], [20, 21, 22], 10)
    assert spec.chunks == [] and not spec.runs and not spec.partials


@pytest.mark.parametrize(("pdcp", "ddcp"), [(1, 2), (2, 1), (2, 2)])
def test_a_start_mid_chunk_under_dcp_reads_the_same_rows_on_either_side(pdcp: int,
                                                                        ddcp: int) -> None:
    """Token 6 of 14 (blocks of 4): chunk 1 from row 2, chunk 2 whole, chunk 3 rows 0-1; with
    DCP each chunk sits in table[g // dcp] of the rank g % dcp, at the same rows."""
    plan = plan_routing(SidePlan(tensor_parallel_size=pdcp, decode_context_parallel_size=pdcp),
                        SidePlan(tensor_parallel_size=ddcp, decode_context_parallel_size=ddcp),
                        BLOCK)
    ptable, dtable = [10, 11, 12, 13], [30, 31, 32, 33]
    got: dict[int, tuple[int, int, int, int]] = {}
    for d in range(ddcp if ddcp > 1 else 1):
        for s in plan_read_specs(plan.reads_of(d), 14, BLOCK, pdcp, ddcp, ptable, dtable, 6):
            for r in s.runs:
                assert r.n == 1
                got[2] = (r.remote_start, r.local_start, 0, BLOCK)
                assert s.prefill_rank == (2 % pdcp)
            for p in s.partials:
                g = 1 if p.lo else 3
                got[g] = (p.remote_block, p.local_block, p.lo, p.hi)
                assert s.prefill_rank == g % pdcp and (ddcp == 1 or d == g % ddcp)
    assert got == {
        1: (ptable[1 // pdcp], dtable[1 // ddcp], 2, 4),
        2: (ptable[2 // pdcp], dtable[2 // ddcp], 0, 4),
        3: (ptable[3 // pdcp], dtable[3 // ddcp], 0, 2),
    }


def test_a_negative_start_is_refused() -> None:
    with pytest.raises(ValueError, match="start_token"):
        plan_read_specs([], 8, BLOCK, 1, 1, [0, 1], [0, 1], -1)


def test_spec_bytes_count_whole_blocks_and_row_ranges() -> None:
    spec = ReadSpec(prefill_rank=0, runs=[Run(3, 0, 2)],
                    partials=[Rows(9, 9, 3, 4), Rows(10, 7, 0, 2)])
    assert spec_bytes(spec, REGION) == (2 * BLOCK + 1 + 2) * LAYERS * ROW


def test_row_descriptors_start_at_the_first_row_of_each_layers_slab() -> None:
    """[blocks, layers, block_size, latent]: block b's layer l starts at
    ((b * layers + l) * block_size) rows."""
    descs = row_descriptors(REGION, 5, 1, 3)
    assert descs == [(REGION.addr + ((5 * LAYERS + layer) * BLOCK + 1) * ROW, 2 * ROW, 0)
                     for layer in range(LAYERS)]
