"""Spreading a burst of new requests over turns of the router's event loop.

asyncio runs, in one turn, every callback that was ready when the turn began: 256 requests
arriving together are parsed, routed and sent on in one turn of ~0.6 ms each, and a probe that
arrives meanwhile waits for all of them (the router's `/readyz` took 165-299 ms at the start of
256 streams on one H200). Letting a bounded amount of work start per turn bounds what any other
callback waits for: a probe, a token of a running stream.

The bound is not small: a burst should still reach the prefill as one, which then runs it in
one step (engine/driver.py gather_burst). Eight requests a turn spread 64 over ~40 ms, the
prefill started stepping on the first few, and 64 prompts of 32 tokens took 5.4x their engine
time to the first token instead of 4.6x. A request's cost grows with its body (parsing the
prompt, hashing it for the routing policy, sending it on twice): 64 requests of 1,024 token ids
were a turn of ~115 ms, and the router's `/readyz` took 123 ms at the start of 256 streams
(59 ms in another run). So a request counts one unit per started 4 KiB of body, and a turn
takes 64 units: 64 short prompts, or 32 of a thousand tokens.
"""

from __future__ import annotations

import asyncio

UNITS_PER_TURN = 64
UNIT_BYTES = 4096


def units_of(body_bytes: int) -> int:
    """What a request of ``body_bytes`` counts against a turn."""
    return 1 + max(body_bytes, 0) // UNIT_BYTES


class StartGate:
    """At most ``per_turn`` units of requests enter per turn of the loop (one request at
    least, whatever its units); the rest retry each turn, the earliest first.

    Only CPU work belongs after ``enter``, up to the request's first wait on the network."""

    def __init__(self, per_turn: int = UNITS_PER_TURN) -> None:
        if per_turn < 1:
            raise ValueError(f"per_turn: must be at least 1, got {per_turn}")
        self.per_turn = per_turn
        self._used = 0  # units entered this turn
        self._resetting = False

    async def enter(self, units: int = 1) -> None:
        while self._used and self._used + units > self.per_turn:
            await asyncio.sleep(0)  # woken next turn, after the reset queued before it
        self._used += units
        if not self._resetting:
            self._resetting = True
            asyncio.get_running_loop().call_soon(self._reset)

    def _reset(self) -> None:
        self._used = 0
        self._resetting = False
