"""The router's start gate: a burst enters a bounded amount per loop turn, in arrival order."""

from __future__ import annotations

import asyncio

import pytest

from pdd_sidecar.serve.router.start_gate import UNIT_BYTES, StartGate, units_of


def _turns(per_turn: int, units: list[int]) -> list[list[int]]:
    """Which requests (by index) entered in each loop turn."""

    async def main() -> list[str]:
        gate = StartGate(per_turn=per_turn)
        seen: list[str] = []
        done = asyncio.Event()

        async def request(i: int) -> None:
            await gate.enter(units[i])
            seen.append(str(i))

        async def ticker() -> None:  # one mark per loop turn
            while not done.is_set():
                seen.append("|")
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        await asyncio.gather(*(request(i) for i in range(len(units))))
        done.set()
        await tick
        return seen

    turns: list[list[int]] = [[]]
    for s in asyncio.run(main()):
        if s == "|":
            turns.append([])
        else:
            turns[-1].append(int(s))
    return [t for t in turns if t]


def test_a_burst_enters_a_bounded_amount_per_turn_in_order() -> None:
    turns = _turns(3, [1] * 10)
    assert [i for t in turns for i in t] == list(range(10))
    assert [len(t) for t in turns] == [3, 3, 3, 1]  # the gate, not the loop, bounds a turn


def test_larger_bodies_count_more_and_one_always_enters() -> None:
    turns = _turns(4, [2, 2, 2, 1, 1, 9, 1])
    assert turns == [[0, 1], [2, 3, 4], [5], [6]]


def test_a_request_cancelled_while_waiting_takes_nothing() -> None:
    async def main() -> list[int]:
        gate = StartGate(per_turn=1)
        order: list[int] = []

        async def request(i: int) -> None:
            await gate.enter()
            order.append(i)

        tasks = [asyncio.create_task(request(i)) for i in range(3)]
        await asyncio.sleep(0)  # request 0 entered, 1 and 2 wait for the next turn
        tasks[1].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert tasks[1].cancelled()
        return order

    assert asyncio.run(main()) == [0, 2]


def test_units_follow_the_body_size() -> None:
    assert [units_of(n) for n in (0, 300, UNIT_BYTES - 1, UNIT_BYTES, 7500, -1)] == [
        1, 1, 1, 2, 2, 1]


def test_per_turn_below_one_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="per_turn: must be at least 1, got 0"):
        StartGate(per_turn=0)
