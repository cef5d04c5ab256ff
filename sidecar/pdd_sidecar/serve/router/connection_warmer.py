"""The router's connections to its instances, opened before a burst needs them.

A burst of N requests needs N connections to the prefill and N to the decode at once. Opened
on demand, each costs the router's loop a TCP handshake and the instance's loop an accept, and
the instance's loop may be starved of the GIL by a running step: on one H200 the first request
of a 64-request burst reached an idle prefill alone, the next ones arrived over new
connections more than the prefill's 1.5 ms of gathering later, and the prefill ran the first
by itself (48 ms) while the rest waited (run 18, docs/serving.md). So each ready instance
gets ``WARM_CONNECTIONS`` kept-alive connections from the router, topped up every
``WARM_INTERVAL_S`` (a cheap ``GET /readyz`` on each), which the requests then find idle in
aiohttp's pool. The router keeps idle connections ``KEEPALIVE_S`` (less than the instances'
``INSTANCE_KEEPALIVE_S``, so the instance never closes one the router is about to use; both
live in serve/discovery.py, which both sides import).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import aiohttp

log = logging.getLogger(__name__)

WARM_CONNECTIONS = 64
WARM_INTERVAL_S = 30.0


def due(urls: Iterable[str], last: dict[str, float], now: float,
        interval_s: float = WARM_INTERVAL_S) -> list[str]:
    """The ready instances whose connections were not topped up within ``interval_s``."""
    return [u for u in urls if now - last.get(u, float("-inf")) >= interval_s]


class ConnectionWarmer:
    """Tops up the router's pool of idle connections to each ready instance."""

    def __init__(self, connections: int = WARM_CONNECTIONS, path: str = "/readyz") -> None:
        self.connections = connections
        self.path = path
        self.last: dict[str, float] = {}
        self._tasks: set[asyncio.Task[int]] = set()

    def ensure(self, session: aiohttp.ClientSession | None, ready: Iterable[str]) -> None:
        """Start a top-up for each ready instance that is due; it runs beside the requests.
        One that was not ready since is due again when it is (restarted, its connections are
        gone)."""
        if session is None or session.closed or self.connections <= 0:
            return
        ready = list(ready)
        self.last = {u: t for u, t in self.last.items() if u in ready}
        loop = asyncio.get_running_loop()
        for url in due(ready, self.last, loop.time()):
            self.last[url] = loop.time()
            task = loop.create_task(self.warm(session, url))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def warm(self, session: aiohttp.ClientSession, url: str) -> int:
        """``connections`` requests at once, each on a connection of its own (a pooled idle
        one where there is one, else a new one), all back in the pool after; how many
        answered."""
        async def one() -> bool:
            try:
                async with session.get(f"{url}{self.path}",
                                       timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    await resp.read()
                    return True
            except (TimeoutError, aiohttp.ClientError, OSError):
                return False

        answered = sum(await asyncio.gather(*(one() for _ in range(self.connections))))
        if answered < self.connections:
            log.info("%s: %d of %d warm connections answered", url, answered, self.connections)
        return answered

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
