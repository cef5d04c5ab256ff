"""The router's start gate: a burst enters a few per loop turn, in arrival order."""

from __future__ import annotations

import asyncio

import pytest

from pdd_sidecar.serve.start_gate import StartGate


def test_a_burst_enters_a_few_per_turn_in_order() -> None:
    async def main() -> list[str]:
        gate = StartGate(per_turn=3)
        seen: list[str] = []
        done = asyncio.Event()

        async def request(i: int) -> None:
            async with gate:
                seen.append(f"r{i}")

        async def ticker() -> None:  # one mark per loop turn
            while not done.is_set():
                seen.append("|")
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        await asyncio.gather(*(request(i) for i in range(10)))
        done.set()
        await tick
        return seen

    seen = asyncio.run(main())
    entered = [s for s in seen if s != "|"]
    assert entered == [f"r{i}" for i in range(10)]
    per_turn = [len(run) for run in "".join(
        "|" if s == "|" else "x" for s in seen).split("|")]
    assert max(per_turn) == 3  # the gate, not the loop, bounds a turn
    assert sum(per_turn) == 10


def test_a_request_cancelled_while_waiting_gives_no_slot_away() -> None:
    async def main() -> int:
        gate = StartGate(per_turn=1)
        order: list[int] = []

        async def request(i: int) -> None:
            async with gate:
                order.append(i)
                await asyncio.sleep(0.01)

        first = asyncio.create_task(request(0))
        await asyncio.sleep(0)
        waiting = asyncio.create_task(request(1))
        await asyncio.sleep(0)
        waiting.cancel()
        third = asyncio.create_task(request(2))
        await asyncio.gather(first, third)
        assert waiting.cancelled()
        return order == [0, 2]

    assert asyncio.run(main())


def test_per_turn_below_one_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="per_turn: must be at least 1, got 0"):
        StartGate(per_turn=0)
