"""What the instances say of their load, for choosing the replica a scale-down takes out.

Best effort and short: an instance that does not answer in time (or a NetworkPolicy that keeps
the operator out) just has no load, and the choice falls back on the highest index.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from pdd_api import keys
from pdd_operator.drain import Load

log = logging.getLogger("pdd_operator")
LOAD_TIMEOUT_S = 1.0


async def _one(session: aiohttp.ClientSession, url: str) -> Load | None:
    try:
        async with session.get(url) as resp:
            body: Any = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        log.debug("no load from %s: %s", url, exc)
        return None
    return Load.from_report(body.get("load")) if isinstance(body, dict) else None


async def fetch_loads(pods: list[dict[str, Any]], port: int = keys.HTTP_PORT,
                      timeout_s: float = LOAD_TIMEOUT_S) -> dict[str, Load]:
    """Pod name -> its instance's load (the `load` object of /readyz), for the pods that have
    an IP and answer within `timeout_s`."""
    urls = {}
    for p in pods:
        ip = (p.get("status") or {}).get("podIP")
        if ip and not (p.get("metadata") or {}).get("deletionTimestamp"):
            host = f"[{ip}]" if ":" in ip else ip
            urls[p["metadata"]["name"]] = f"http://{host}:{port}/readyz"
    if not urls:
        return {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        got = await asyncio.gather(*(_one(session, u) for u in urls.values()))
    return {name: load for name, load in zip(urls, got, strict=True) if load is not None}
