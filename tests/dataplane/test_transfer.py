"""Transfer layer: descriptor arithmetic, and real NIXL READs between synthetic KV caches."""

from __future__ import annotations

import itertools
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
import torch

from pdd_api.plan import RoutingPlan, SidePlan  # noqa: E402
from pdd_api.routing import bytes_per_decode_rank, plan_routing  # noqa: E402
from pdd_sidecar.kv.compat import CompatError, CompatRecord, check_compatible  # noqa: E402
from pdd_sidecar.kv.lease import LeaseTable, notif_message, parse_notif  # noqa: E402
from pdd_sidecar.kv.side_channel import (  # noqa: E402
    PeerUnreachable,
    SideChannelServer,
    handshake,
    publication,
)
from pdd_sidecar.kv.transfer import (  # noqa: E402
    KVTransferAgent,
    PreppedBlocks,
    ReadSpec,
    ReadStats,
    RegionInfo,
    Run,
    coalesce,
    plan_read_specs,
    pow2_pieces,
    spec_bytes,
)

pytestmark = pytest.mark.dataplane

SIDES = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 4)]
CONFIGS = list(itertools.product(SIDES, SIDES))
LAYERS, BLOCK, LATENT, NUM_BLOCKS = 3, 4, 8, 48


def test_coalesce_merges_runs_consecutive_on_both_sides() -> None:
    pairs = [(0, 10), (1, 11), (2, 12), (5, 13), (6, 14), (7, 20)]
    assert coalesce(pairs) == [Run(0, 10, 3), Run(5, 13, 2), Run(7, 20, 1)]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 13, 64, 100])
def test_pow2_pieces_cover_the_run_in_popcount_pieces(n: int) -> None:
    pieces = pow2_pieces(n, max_levels=12)
    assert len(pieces) == bin(n).count("1")
    covered = [o + i for o, lvl in pieces for i in range(1 << lvl)]
    assert covered == list(range(n))
    capped = pow2_pieces(n, max_levels=2)
    assert sum(1 << lvl for _, lvl in capped) == n and all(lvl <= 1 for _, lvl in capped)


def test_prepped_indices_are_distinct_and_in_range() -> None:
    layout = PreppedBlocks(num_blocks=10)
    seen = {(lvl, s): layout.index(lvl, s) for lvl in range(layout.levels)
            for s in range(10 - (1 << lvl) + 1)}
    assert len(set(seen.values())) == len(seen) == len(layout)
    assert max(seen.values()) == len(layout) - 1


def _plan(prefill: tuple[int, int], decode: tuple[int, int]) -> RoutingPlan:
    """The routing plan between two (tp, dcp) layouts."""
    return plan_routing(SidePlan(tensor_parallel_size=prefill[0],
                                 decode_context_parallel_size=prefill[1]),
                        SidePlan(tensor_parallel_size=decode[0],
                                 decode_context_parallel_size=decode[1]), BLOCK)


def _tables(num_chunks: int, dcp: int, offset: int) -> list[int]:
    """A block table with a hole, so runs break and coalescing has work to do."""
    n = -(-num_chunks // dcp)
    return [offset + i + (3 if i >= n // 2 else 0) for i in range(n)]


@pytest.mark.parametrize(("prefill", "decode"), CONFIGS, ids=lambda s: f"tp{s[0]}dcp{s[1]}")
@pytest.mark.parametrize("num_tokens", [1, 4, 9, 30])
def test_read_specs_give_each_decode_rank_exactly_its_chunks(
    prefill: tuple[int, int], decode: tuple[int, int], num_tokens: int
) -> None:
    plan = _plan(prefill, decode)
    num_chunks = -(-num_tokens // BLOCK)
    ptable, dtable = _tables(num_chunks, prefill[1], 5), _tables(num_chunks, decode[1], 2)
    row = LATENT * 4
    from pdd_sidecar.kv.transfer import RegionInfo

    region = RegionInfo(0, NUM_BLOCKS, LAYERS, BLOCK, row, "DRAM", 0)
    minimum = bytes_per_decode_rank(plan, num_tokens, LAYERS * row)
    for d in range(decode[0]):
        specs = plan_read_specs(plan.reads_of(d), num_tokens, BLOCK, prefill[1], decode[1],
                                ptable, dtable)
        chunks = sorted(g for s in specs for g in s.chunks)
        held = [g for g in range(num_chunks) if decode[1] == 1 or g % decode[1] == d]
        assert chunks == held
        for s in specs:
            for g in s.chunks:
                assert prefill[1] == 1 or g % prefill[1] == s.prefill_rank
        assert sum(spec_bytes(s, region) for s in specs) == minimum[d]


@pytest.mark.parametrize(("prefill", "decode"), CONFIGS, ids=lambda s: f"tp{s[0]}dcp{s[1]}")
@pytest.mark.parametrize(("num_tokens", "first_chunk"), [(30, 0), (30, 2), (30, 5), (30, 7),
                                                         (30, 8), (32, 8), (9, 1)])
def test_read_specs_from_a_first_chunk_leave_out_only_the_chunks_before_it(
    prefill: tuple[int, int], decode: tuple[int, int], num_tokens: int, first_chunk: int
) -> None:
    """A decode holding the first chunks already (its prefix cache) reads each later chunk
    exactly as a full read would, with the same specs per prefill rank, and nothing else.
    (A start mid-chunk: tests/unit/test_read_specs.py.)"""
    plan = _plan(prefill, decode)
    num_chunks = -(-num_tokens // BLOCK)
    ptable, dtable = _tables(num_chunks, prefill[1], 5), _tables(num_chunks, decode[1], 2)
    region = RegionInfo(0, NUM_BLOCKS, LAYERS, BLOCK, LATENT * 4, "DRAM", 0)
    read: list[int] = []
    for d in range(decode[0]):
        full = plan_read_specs(plan.reads_of(d), num_tokens, BLOCK, prefill[1], decode[1],
                               ptable, dtable)
        part = plan_read_specs(plan.reads_of(d), num_tokens, BLOCK, prefill[1], decode[1],
                               ptable, dtable, first_chunk * BLOCK)
        assert [s.prefill_rank for s in part] == [s.prefill_rank for s in full]
        for f, p in zip(full, part, strict=True):
            assert p.chunks == [g for g in f.chunks if g >= first_chunk]
            pairs = {(r.remote_start + i, r.local_start + i) for r in p.runs for i in range(r.n)}
            assert pairs == {(ptable[g // prefill[1]], dtable[g // decode[1]]) for g in p.chunks
                             if not f.partials or g != num_chunks - 1}
            assert p.partials == (f.partials if num_chunks - 1 >= first_chunk else [])
        moved = sum(spec_bytes(s, region) for s in part)
        rows = sum(min(BLOCK, num_tokens - g * BLOCK) for s in part for g in s.chunks)
        assert moved == rows * LAYERS * region.row_bytes
        read.extend(g for s in part for g in s.chunks)
    # Every chunk from the first on is read, by as many decode ranks as a full read has.
    per_chunk = 1 if decode[1] > 1 else decode[0]
    assert sorted(read) == sorted(list(range(first_chunk, num_chunks)) * per_chunk)


# ---------------------------------------------------------------- real NIXL


class _Rank:
    def __init__(self, name: str) -> None:
        self.kv = torch.zeros(NUM_BLOCKS, LAYERS, BLOCK, LATENT, dtype=torch.float32)
        self.agent = KVTransferAgent(name, self.kv)


@pytest.fixture(scope="module")
def ranks() -> Iterator[tuple[list[_Rank], list[_Rank]]]:
    prefill, decode = [_Rank(f"p{i}") for i in range(4)], [_Rank(f"d{i}") for i in range(4)]
    yield prefill, decode
    for r in decode + prefill:
        r.agent.close()


def _content(g: int, num_tokens: int) -> torch.Tensor:
    """Chunk g as [layers, block, latent]; rows past the prompt are -1 (must never arrive)."""
    layer = torch.arange(LAYERS).view(-1, 1, 1) * 1000.0
    tok = (g * BLOCK + torch.arange(BLOCK)).view(1, -1, 1).float()
    lat = torch.arange(LATENT).view(1, 1, -1) * 0.01
    out = (layer + tok + lat).expand(LAYERS, BLOCK, LATENT).clone()
    filled = max(0, min(BLOCK, num_tokens - g * BLOCK))
    out[:, filled:] = -1.0
    return out


CANARY = -7.0  # never a value of the prefill's cache: content >= 0, filler -1 and -5


def _fill_prefill(pranks: list[_Rank], dcp: int, num_tokens: int, ptable: list[int]) -> None:
    """Each of ``pranks`` (one prefill instance's ranks) holds the content of the chunks it
    keeps under ``dcp``; -5 elsewhere."""
    for p, rank in enumerate(pranks):
        rank.kv.fill_(-5.0)
        for g in range(-(-num_tokens // BLOCK)):
            if dcp == 1 or g % dcp == p:
                rank.kv[ptable[g // dcp]] = _content(g, num_tokens)


def _read(dr: _Rank, pranks: list[_Rank], specs: list[ReadSpec]) -> ReadStats:
    """One decode rank's NIXL READ of ``specs``, each from the prefill rank it names."""
    work = []
    for spec in specs:
        src = pranks[spec.prefill_rank]
        work.append((dr.agent.connect(src.agent.name, src.agent.metadata(), src.agent.region),
                     spec))
    return dr.agent.read(work, timeout_s=30)


def _check_only_the_plan_landed(kv: torch.Tensor, d: int, dcp: int, num_tokens: int,
                                dtable: list[int], source: Callable[[int], torch.Tensor],
                                reported_bytes: int, start: int = 0) -> None:
    """The whole destination cache against what the READ may write: the planned chunks' filled
    rows from token ``start`` on equal the prefill's block (``source(chunk)``), every other byte
    still holds the canary. The bytes that changed are counted from memory, not taken from the
    plan or the agent."""
    want = torch.full_like(kv, CANARY)
    for g in range(start // BLOCK, -(-num_tokens // BLOCK)):
        if dcp > 1 and g % dcp != d:
            continue
        lo, filled = max(start - g * BLOCK, 0), min(BLOCK, num_tokens - g * BLOCK)
        want[dtable[g // dcp], :, lo:filled] = source(g)[:, lo:filled]
    changed = kv != CANARY
    wrong = (kv != want).nonzero()
    assert wrong.numel() == 0, (
        f"decode rank {d}: {len(wrong)} values differ from the plan, first at "
        f"[block, layer, row, latent] {wrong[0].tolist()}: got {kv[tuple(wrong[0])].item()}, "
        f"want {want[tuple(wrong[0])].item()}")
    assert int(changed.sum()) * kv.element_size() == reported_bytes


@pytest.mark.parametrize(("prefill", "decode"), CONFIGS, ids=lambda s: f"tp{s[0]}dcp{s[1]}")
def test_nixl_reads_move_exactly_the_plan(
    ranks: tuple[list[_Rank], list[_Rank]], prefill: tuple[int, int], decode: tuple[int, int]
) -> None:
    pranks, dranks = ranks
    plan = _plan(prefill, decode)
    for num_tokens in (3, 8, 22):
        num_chunks = -(-num_tokens // BLOCK)
        ptable, dtable = _tables(num_chunks, prefill[1], 1), _tables(num_chunks, decode[1], 7)
        _fill_prefill(pranks[:prefill[0]], prefill[1], num_tokens, ptable)
        minimum = bytes_per_decode_rank(plan, num_tokens, LAYERS * LATENT * 4)
        sources = [r.kv.clone() for r in pranks[:prefill[0]]]
        for d in range(decode[0]):
            dr = dranks[d]
            dr.kv.fill_(CANARY)
            specs = plan_read_specs(plan.reads_of(d), num_tokens, BLOCK, prefill[1], decode[1],
                                    ptable, dtable)
            stats = _read(dr, pranks, specs)
            assert stats.bytes == minimum[d]
            runs = sum(len(s.runs) for s in specs)
            tails = sum(len(s.partials) for s in specs)
            assert stats.descriptors <= sum(
                len(pow2_pieces(r.n, 12)) for s in specs for r in s.runs) + tails * LAYERS
            assert stats.descriptors >= runs
            _check_only_the_plan_landed(
                dr.kv, d, decode[1], num_tokens, dtable,
                lambda g, t=ptable: pranks[g % prefill[1]].kv[t[g // prefill[1]]], stats.bytes)
            for p in plan.decode_ranks[d].notifies:
                src = pranks[p]
                peer = dr.agent.connect(src.agent.name, src.agent.metadata(), src.agent.region)
                dr.agent.notify(peer, notif_message(f"req-{num_tokens}"))
        for p in range(prefill[0]):
            assert torch.equal(pranks[p].kv, sources[p]), f"prefill rank {p} was written to"
        # Every prefill rank hears exactly its expected notifications.
        for p in range(prefill[0]):
            got = []
            for _ in range(10000):
                got += [parse_notif(m) for m in pranks[p].agent.poll_notifs()]
                if len(got) >= plan.prefill_ranks[p].expected_notifications:
                    break
                time.sleep(0.001)
            assert got == [f"req-{num_tokens}"] * plan.prefill_ranks[p].expected_notifications


@pytest.mark.parametrize(("prefill", "decode"), [((1, 1), (1, 1)), ((2, 2), (1, 1)),
                                                 ((1, 1), (2, 2)), ((2, 2), (2, 2))],
                         ids=lambda s: f"tp{s[0]}dcp{s[1]}")
def test_nixl_reads_from_a_token_mid_chunk_move_only_the_rows_from_it(
    ranks: tuple[list[_Rank], list[_Rank]], prefill: tuple[int, int], decode: tuple[int, int]
) -> None:
    """A decode that adopted a prefix-cache tail reads a chunk from a row within it: the row
    ranges' descriptors start at that row in every layer's slab, and nothing before it lands."""
    pranks, dranks = ranks
    plan = _plan(prefill, decode)
    num_tokens = 22
    num_chunks = -(-num_tokens // BLOCK)
    ptable, dtable = _tables(num_chunks, prefill[1], 1), _tables(num_chunks, decode[1], 7)
    _fill_prefill(pranks[:prefill[0]], prefill[1], num_tokens, ptable)
    for start in (1, 6, 9, 21):
        for d in range(decode[0]):
            dr = dranks[d]
            dr.kv.fill_(CANARY)
            specs = plan_read_specs(plan.reads_of(d), num_tokens, BLOCK, prefill[1], decode[1],
                                    ptable, dtable, start)
            stats = _read(dr, pranks, specs)
            held = sum(max(0, min(BLOCK, num_tokens - g * BLOCK) - max(start - g * BLOCK, 0))
                       for g in range(num_chunks) if decode[1] == 1 or g % decode[1] == d)
            assert stats.bytes == held * LAYERS * LATENT * 4
            _check_only_the_plan_landed(
                dr.kv, d, decode[1], num_tokens, dtable,
                lambda g, t=ptable: pranks[g % prefill[1]].kv[t[g // prefill[1]]], stats.bytes,
                start)


def test_side_channel_handshake_refuses_a_mismatch_naming_both_values(
    ranks: tuple[list[_Rank], list[_Rank]]
) -> None:
    pranks, _ = ranks
    mine = CompatRecord("builtin:seed=0", "float32", BLOCK, "layout-a", 1, "abc")
    payload = publication(role="prefill", rank=0, tp=1, dcp=1, instance_id="i0",
                          agent_name=pranks[0].agent.name, metadata=pranks[0].agent.metadata(),
                          region=pranks[0].agent.region, compat=mine)
    key = b"k" * 32
    server = SideChannelServer("127.0.0.1", 0, payload, key)
    try:
        info = handshake("127.0.0.1", server.port, mine, "decode rank 0", 5, key)
        assert info.agent_name == "p0" and info.region == pranks[0].agent.region
        other = CompatRecord("builtin:seed=0", "bfloat16", BLOCK, "layout-a", 1, "abc")
        with pytest.raises(CompatError, match="dtype: local 'float32' != .*'bfloat16'"):
            handshake("127.0.0.1", server.port, other, "decode rank 0", 5, key)
        # Another deployment's key gets no metadata, and neither does a plain GET.
        with pytest.raises(CompatError, match="key proof does not match"):
            handshake("127.0.0.1", server.port, mine, "decode rank 0", 5, b"x" * 32)
        with pytest.raises(urllib.error.HTTPError) as got:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metadata", timeout=5)
        assert got.value.code == 404
        # A body that is not a JSON object gets a 400 naming what was wrong, never a dropped
        # connection.
        for body in (b"[1, 2]", b'"text"', b"3", b"{not json"):
            req = urllib.request.Request(f"http://127.0.0.1:{server.port}/handshake", data=body,
                                         headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as got:
                urllib.request.urlopen(req, timeout=5)
            assert got.value.code == 400, body
            assert "bad handshake" in json.loads(got.value.read())["error"], body
    finally:
        server.close()
    with pytest.raises(PeerUnreachable, match=f"127.0.0.1:{server.port}"):
        handshake("127.0.0.1", server.port, mine, "decode rank 0", 2, key)


def test_check_compatible_lists_every_difference() -> None:
    a = CompatRecord("m1", "float32", 64, "L", 1, "x")
    b = CompatRecord("m2", "float32", 128, "L", 1, "x")
    with pytest.raises(CompatError) as err:
        check_compatible(a, b, "peer p")
    assert "model: local 'm1' != peer p 'm2'" in str(err.value)
    assert "block_size: local 64 != peer p 128" in str(err.value)


def test_lease_table_releases_on_notifications_or_time() -> None:
    table = LeaseTable(lease_seconds=10, expected={0: 1, 1: 2})
    table.hold("a", [1, 2], now=0)
    table.hold("b", [3], now=5)
    assert table.notified("a", 0) is None
    assert table.notified("a", 1) is None
    held = table.notified("a", 1)
    assert held is not None and held.blocks == [1, 2]
    assert table.notified("a", 1) is None and table.stray_notifications == 1
    assert table.expire(now=14.9) == []
    gone = table.expire(now=15)
    assert [h.request_id for h in gone] == ["b"] and len(table) == 0
    assert table.expired_total == 1 and table.released_total == 1
