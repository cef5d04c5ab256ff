"""The event loop the HTTP servers run on.

Every request crosses three aiohttp servers (router, prefill, decode), and under a burst each
of their loops is the queue the requests wait in: in a 64-request burst on a 2-core machine
without a GPU, the prefill's answer took 27 ms to reach the router's client (median) on uvloop
against 47 ms on asyncio's own loop (the transport writes and the selector were a fifth of each
loop's time). So uvloop, as vLLM and SGLang serve on, whenever it is installed; asyncio's loop
where it is not (a platform without a wheel) or when PDD_EVENT_LOOP=asyncio asks for it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging

from pdd_sidecar.env import PDD_EVENT_LOOP, ConfigError

log = logging.getLogger(__name__)


def loop_kind(choice: str, uvloop_installed: bool) -> str:
    """``uvloop`` or ``asyncio`` for PDD_EVENT_LOOP's ``choice``; a forced uvloop that is not
    installed is a ConfigError naming it."""
    if choice == "asyncio":
        return "asyncio"
    if uvloop_installed:
        return "uvloop"
    if choice == "uvloop":
        raise ConfigError(f"{PDD_EVENT_LOOP}: uvloop, but the uvloop package is not installed "
                          f"(pip install uvloop, or set {PDD_EVENT_LOOP}=asyncio)")
    return "asyncio"


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def new_event_loop(kind: str, who: str) -> asyncio.AbstractEventLoop:
    """A new loop of ``kind`` (what ``loop_kind`` resolved at start), logged as ``who``'s."""
    if kind == "uvloop":
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    log.info("%s serves HTTP on the %s event loop (%s)", who, kind, PDD_EVENT_LOOP)
    return loop
