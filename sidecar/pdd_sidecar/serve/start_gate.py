"""Spreading a burst of new requests over turns of the router's event loop.

asyncio runs, in one turn, every callback that was ready when the turn began: 256 requests
arriving together are parsed, routed and sent on in one turn of ~0.6 ms each, and a probe that
arrives meanwhile waits for all of them (the router's `/readyz` took 165-299 ms at the start of
256 streams on one H200). Letting a bounded number of requests start per turn bounds what any
other callback waits for: a probe, a token of a running stream.

The bound is not small: a burst should still reach the prefill as one, which then runs it in
one step (engine/driver.py gather_burst). Eight a turn spread 64 requests over ~40 ms, the
prefill started stepping on the first few, and 64 prompts of 32 tokens took 5.4x their engine
time to the first token instead of 4.6x. 64 a turn keeps such a burst whole; such a turn is
50-75 ms of the loop (bench/router_overhead.py), and the router's `/readyz` at the start of
256 streams took 59 and 123 ms in two runs.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

REQUESTS_PER_TURN = 64


class StartGate:
    """At most ``per_turn`` requests enter per turn of the loop; the rest wait in arrival order.

    Only CPU work belongs inside: a slot is given back one turn after it was taken, and a slot
    held across a wait on the network (a slow client's body) would hold up the rest."""

    def __init__(self, per_turn: int = REQUESTS_PER_TURN) -> None:
        if per_turn < 1:
            raise ValueError(f"per_turn: must be at least 1, got {per_turn}")
        self._slots = asyncio.Semaphore(per_turn)

    async def __aenter__(self) -> None:
        await self._slots.acquire()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        asyncio.get_running_loop().call_soon(self._slots.release)
