"""The router's warm round trip: ready means a real prefill -> decode hand-off has run.

Each instance warms its own engine before it answers ready (engine/driver.py), but what lies
between them — the HTTP connections, the decode's first NIXL connection to the prefill's ranks,
the claim path — is first set up by a request. The router runs one small completion through
itself as soon as a prefill and a decode of its plan are ready, and reports ready only once
it came back, so `pdd serve` prints "ready" and a Service sends traffic only after that, and no
user's first request pays for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

WARMUP_PROMPT_TOKENS = 32  # two blocks at the default block size: a multi-block READ
WARMUP_MAX_TOKENS = 2  # a first token from the prefill, one from the decode
RETRY_S = 1.0


class Generates(Protocol):
    @property
    def warmable(self) -> bool: ...

    async def generate(self, rid: str, req: Any, trip: Any, emit: Any) -> Any: ...


def warmup_prompt(vocab_size: int | None) -> list[int]:
    """Token ids every model accepts (any vocabulary holds its first few ids)."""
    top = max(2, min(vocab_size or 256, 256))
    return [1 + (7 * i) % (top - 1) for i in range(WARMUP_PROMPT_TOKENS)]


class WarmRoundTrip:
    """Runs the round trip once a ready pair exists; retried until one succeeds."""

    def __init__(self) -> None:
        self.done = False
        self.seconds: float | None = None
        self.last_error = ""
        self._task: asyncio.Task[None] | None = None

    def ensure(self, router: Generates, make_request: Any, make_trip: Any,
               on_done: Callable[[float], None]) -> None:
        """Start the round trip if the pools are ready and none runs or ran."""
        if self.done or not router.warmable:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(router, make_request, make_trip, on_done))

    async def _run(self, router: Generates, make_request: Any, make_trip: Any,
                   on_done: Callable[[float], None]) -> None:
        rid = f"warmup-{uuid.uuid4().hex[:16]}"
        start = time.monotonic()
        trip = make_trip()
        try:
            outs = await router.generate(rid, make_request(), trip, None)
        except Exception as exc:  # an instance going away mid-warm-up: the next round retries
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("warm round trip failed (retrying): %s", self.last_error)
            await asyncio.sleep(RETRY_S)
            return
        self.seconds = time.monotonic() - start
        on_done(self.seconds)
        self.done = True
        log.info("warm round trip in %.3fs: prefill %s -> decode %s, %d tokens",
                 self.seconds, trip.prefill, trip.decode, len(outs[0].token_ids))

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
