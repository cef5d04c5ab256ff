"""The routing rule: exactly-once delivery from a holder, minimum bytes, complete release."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd_api.plan import RoutingPlan, SidePlan
from pdd_api.routing import bytes_per_decode_rank, chunks_read, load_plan, plan_routing


def holds(rank: int, dcp: int, chunk: int) -> bool:
    return dcp == 1 or chunk % dcp == rank


@st.composite
def side(draw: st.DrawFn) -> SidePlan:
    tp = draw(st.integers(1, 16))
    dcp = draw(st.sampled_from([1, tp]))
    return SidePlan(tensor_parallel_size=tp, decode_context_parallel_size=dcp)


@st.composite
def valid_pair(draw: st.DrawFn) -> tuple[SidePlan, SidePlan]:
    p, d = draw(side()), draw(side())
    a, b = p.decode_context_parallel_size, d.decode_context_parallel_size
    if a % b and b % a:
        d = SidePlan(tensor_parallel_size=d.tensor_parallel_size, decode_context_parallel_size=1)
    return p, d


@settings(max_examples=400, deadline=None)
@given(valid_pair(), st.integers(1, 40))
def test_every_decode_rank_gets_each_held_chunk_once_from_a_holder(
    pair: tuple[SidePlan, SidePlan], num_chunks: int
) -> None:
    p, d = pair
    plan = plan_routing(p, d, 64)
    for dr in plan.decode_ranks:
        received: dict[int, list[int]] = {}
        for read in dr.reads:
            for g in range(num_chunks):
                if read.covers(g):
                    received.setdefault(g, []).append(read.prefill_rank)
        wanted = {g for g in range(num_chunks) if holds(dr.rank, d.decode_context_parallel_size, g)}
        assert set(received) == wanted
        for g, sources in received.items():
            assert len(sources) == 1, f"D{dr.rank} reads chunk {g} from {sources}"
            assert holds(sources[0], p.decode_context_parallel_size, g)
            assert sources[0] < p.tensor_parallel_size


@settings(max_examples=300, deadline=None)
@given(valid_pair(), st.integers(1, 5000))
def test_bytes_moved_are_the_minimum(pair: tuple[SidePlan, SidePlan], tokens: int) -> None:
    p, d = pair
    plan = plan_routing(p, d, 16)
    per_rank = bytes_per_decode_rank(plan, tokens, 3)
    dcp = d.decode_context_parallel_size
    # Minimum: each decode rank receives exactly the tokens of the chunks it holds.
    expected = [
        3 * sum(min(16, tokens - g * 16) for g in range(-(-tokens // 16)) if holds(r, dcp, g))
        for r in range(d.tensor_parallel_size)
    ]
    assert per_rank == expected
    if dcp > 1:
        assert sum(per_rank) == 3 * tokens
    else:
        assert sum(per_rank) == 3 * tokens * d.tensor_parallel_size


@settings(max_examples=300, deadline=None)
@given(valid_pair())
def test_notifications_release_every_prefill_rank(pair: tuple[SidePlan, SidePlan]) -> None:
    p, d = pair
    plan = plan_routing(p, d, 64)
    addressed = {r: 0 for r in range(p.tensor_parallel_size)}
    for dr in plan.decode_ranks:
        assert {r.prefill_rank for r in dr.reads} <= set(dr.notifies)
        assert len(set(dr.notifies)) == len(dr.notifies)
        for n in dr.notifies:
            addressed[n] += 1
    for pr in plan.prefill_ranks:
        assert pr.expected_notifications == addressed[pr.rank] >= 1


def S(tp: int, dcp: int) -> SidePlan:  # noqa: N802
    return SidePlan(tensor_parallel_size=tp, decode_context_parallel_size=dcp)


# (prefill, decode) -> per decode rank: [(prefill rank, modulus, residue)], notifies
REFERENCE = {
    "P TP4/DCP1 -> D TP4/DCP1": (
        S(4, 1), S(4, 1), "replicated-to-replicated",
        [([(0, 1, 0)], [0]), ([(1, 1, 0)], [1]), ([(2, 1, 0)], [2]), ([(3, 1, 0)], [3])],
    ),
    "P TP2/DCP1 -> D TP4/DCP1": (
        S(2, 1), S(4, 1), "replicated-to-replicated",
        [([(0, 1, 0)], [0]), ([(0, 1, 0)], [0]), ([(1, 1, 0)], [1]), ([(1, 1, 0)], [1])],
    ),
    "P TP4/DCP4 -> D TP4/DCP4": (
        S(4, 4), S(4, 4), "sharded-to-sharded",
        [([(0, 4, 0)], [0]), ([(1, 4, 1)], [1]), ([(2, 4, 2)], [2]), ([(3, 4, 3)], [3])],
    ),
    "P TP4/DCP1 -> D TP4/DCP4": (
        S(4, 1), S(4, 4), "replicated-to-sharded",
        [([(0, 4, 0)], [0]), ([(1, 4, 1)], [1]), ([(2, 4, 2)], [2]), ([(3, 4, 3)], [3])],
    ),
    "P TP4/DCP4 -> D TP4/DCP1": (
        S(4, 4), S(4, 1), "sharded-to-replicated",
        [([(0, 4, 0), (1, 4, 1), (2, 4, 2), (3, 4, 3)], [0, 1, 2, 3])] * 4,
    ),
    "P TP2/DCP2 -> D TP4/DCP4": (
        S(2, 2), S(4, 4), "sharded-to-sharded",
        [([(0, 4, 0)], [0]), ([(1, 4, 1)], [1]), ([(0, 4, 2)], [0]), ([(1, 4, 3)], [1])],
    ),
    "P TP2/DCP1 -> D TP4/DCP4": (
        S(2, 1), S(4, 4), "replicated-to-sharded",
        [([(0, 4, 0)], [0]), ([(0, 4, 1)], [0]), ([(1, 4, 2)], [1]), ([(1, 4, 3)], [1])],
    ),
    # The PR's own picture: P dcp4 -> D dcp2.
    "P TP4/DCP4 -> D TP2/DCP2": (
        S(4, 4), S(2, 2), "sharded-to-sharded",
        [([(0, 4, 0), (2, 4, 2)], [0, 2]), ([(1, 4, 1), (3, 4, 3)], [1, 3])],
    ),
}


@pytest.mark.parametrize("name", list(REFERENCE))
def test_reference_configurations(name: str) -> None:
    p, d, case, expected = REFERENCE[name]
    plan = plan_routing(p, d, 64)
    assert plan.case == case
    got = [
        ([(r.prefill_rank, r.chunk_modulus, r.chunk_residue) for r in dr.reads], dr.notifies)
        for dr in plan.decode_ranks
    ]
    assert got == expected


def test_expected_notifications_of_reference() -> None:
    plan = plan_routing(S(4, 4), S(4, 1), 64)
    assert [p.expected_notifications for p in plan.prefill_ranks] == [4, 4, 4, 4]
    plan = plan_routing(S(2, 1), S(4, 1), 64)
    assert [p.expected_notifications for p in plan.prefill_ranks] == [2, 2]


def test_unread_prefill_ranks_are_still_released() -> None:
    plan = plan_routing(S(4, 1), S(2, 1), 64)
    assert plan.summary() == "D0 <- P0; D1 <- P2"
    assert [dr.notifies for dr in plan.decode_ranks] == [[0, 1], [2, 3]]
    assert [p.expected_notifications for p in plan.prefill_ranks] == [1, 1, 1, 1]


def test_plan_json_contract_shape() -> None:
    plan = plan_routing(S(4, 4), S(2, 2), 64)
    doc = json.loads(plan.to_json())
    assert doc == {
        "version": 1, "case": "sharded-to-sharded", "blockSize": 64,
        "prefill": {"tensorParallelSize": 4, "decodeContextParallelSize": 4},
        "decode": {"tensorParallelSize": 2, "decodeContextParallelSize": 2},
        "decodeRanks": [
            {"rank": 0, "reads": [{"prefillRank": 0, "chunkModulus": 4, "chunkResidue": 0},
                                  {"prefillRank": 2, "chunkModulus": 4, "chunkResidue": 2}],
             "notifies": [0, 2]},
            {"rank": 1, "reads": [{"prefillRank": 1, "chunkModulus": 4, "chunkResidue": 1},
                                  {"prefillRank": 3, "chunkModulus": 4, "chunkResidue": 3}],
             "notifies": [1, 3]},
        ],
        "prefillRanks": [{"rank": r, "expectedNotifications": 1} for r in range(4)],
    }
    assert RoutingPlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{", "malformed routing plan"),
        ('{"version": 2}', "version"),
        (
            plan_routing(S(2, 2), S(2, 2), 64).to_json().replace('"decodeRanks":[{"rank":0',
                                                                   '"decodeRanks":[{"rank":-1'),
            "decodeRanks.0.rank",
        ),
        (
            plan_routing(S(2, 2), S(2, 2), 64).to_json().replace(
                '"prefill":{"tensorParallelSize":2', '"prefill":{"tensorParallelSize":3'
            ),
            "prefillRanks has 2 entries",
        ),
    ],
)
def test_malformed_plans_are_refused(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match="malformed routing plan") as info:
        RoutingPlan.from_json(text)
    assert needle in str(info.value)


def test_chunks_read_maps_each_chunk_to_its_source() -> None:
    plan = plan_routing(S(4, 4), S(2, 2), 64)
    assert chunks_read(plan, 1, 8) == {1: 1, 5: 1, 3: 3, 7: 3}


def test_load_plan_refuses_a_plan_that_breaks_the_rule() -> None:
    good = plan_routing(S(4, 4), S(2, 2), 64)
    assert load_plan(good.to_json()) == good
    swapped = good.to_json().replace('"prefillRank":2', '"prefillRank":3', 1)
    with pytest.raises(ValueError, match="unsound routing plan: decode rank 0 reads chunk 2 from "
                                         "prefill rank 3, which does not hold it"):
        load_plan(swapped)
    rule = plan_routing(S(2, 1), S(2, 1), 64)
    crossed = rule.model_copy(update={"decode_ranks": [
        rule.decode_ranks[1].model_copy(update={"rank": 0}),
        rule.decode_ranks[0].model_copy(update={"rank": 1}),
    ]})
    with pytest.raises(ValueError, match="mismatched routing plan: it differs from the rule"):
        load_plan(crossed.to_json())
    partial = plan_routing(S(4, 1), S(4, 1), 64).to_json().replace(
        '"prefill":{"tensorParallelSize":4,"decodeContextParallelSize":1',
        '"prefill":{"tensorParallelSize":4,"decodeContextParallelSize":2',
    )
    with pytest.raises(ValueError, match="prefill.decodeContextParallelSize must be 1 or 4, got 2"):
        load_plan(partial)
