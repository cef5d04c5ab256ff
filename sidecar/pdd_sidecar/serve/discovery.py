"""Replica discovery: static URLs from config, or the pods behind a headless Service.

A headless Service's DNS name resolves to one A record per ready pod, so re-resolving it
periodically tracks scale-ups and restarts without talking to the Kubernetes API.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import aiohttp

from pdd_sidecar.env import DEFAULT_HTTP_PORT

log = logging.getLogger(__name__)


def split_service(service: str) -> tuple[str, int]:
    """`name.ns.svc[:port]` -> (host, port)."""
    service = service.strip()
    if "://" in service:
        service = service.split("://", 1)[1]
    host, _, port = service.rstrip("/").partition(":")
    return host, int(port) if port else DEFAULT_HTTP_PORT


async def resolve_service(service: str) -> list[str]:
    """Base URLs of the Service's pods (sorted, so round robin order is stable)."""
    host, port = split_service(service)
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        log.warning("cannot resolve %s: %s", host, exc)
        return []
    addrs = sorted({str(info[4][0]) for info in infos})
    return [f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}" for a in addrs]


DEFAULT_KEEPALIVE_S = 15.0  # aiohttp's own
# Idle connections between the router and pdd instances: the router keeps them less long than
# the instances do, so an instance never closes one the router is about to use
# (serve/router/connection_warmer.py).
KEEPALIVE_S = 60.0  # the router's upstream pool
INSTANCE_KEEPALIVE_S = 120.0  # the instances' HTTP servers


async def replicas(urls: list[str], service: str) -> list[str]:
    """Static URLs when configured (stable names, e.g. per-pod DNS), else the Service's pods:
    using both would list every pod twice, under its name and under its address."""
    if urls:
        return list(urls)
    return await resolve_service(service) if service else []


def fresh_dns_connector(limit: int = 100,
                        keepalive_s: float = DEFAULT_KEEPALIVE_S) -> aiohttp.TCPConnector:
    """A connector that resolves names on each new connection: a replaced pod keeps its
    per-pod name but not its address, and aiohttp's cache would send requests to the old
    address for up to 10 s (connections that stay open are reused as before). Idle
    connections are kept ``keepalive_s``."""
    return aiohttp.TCPConnector(limit=limit, use_dns_cache=False, keepalive_timeout=keepalive_s)
