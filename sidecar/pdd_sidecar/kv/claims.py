"""A decode rank's claim on a prefill's blocks, made right before it READs them.

The prefill answers 200 once it has pinned the blocks for ``hold_s`` (so neither its lease nor
a release can hand them to another request while the READ runs), or 410 when the grant's epoch
is gone: the blocks were released, expired or reused, and reading them would copy someone else's
KV. Any other failure is the prefill being unreachable.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

from pdd_sidecar.kv.errors import GRANT_REFUSED, LEASE_EXPIRED
from pdd_sidecar.kv.transfer import PeerGone, TransferError

CLAIM_MARGIN_S = 5.0  # pinned beyond the READ's own time bound

# Each pull thread keeps one connection per prefill: a claim per READ on a fresh connection
# cost both sides a connect, an accept and a close, and the prefill's HTTP loop does that
# work between answering its own requests.
_connections = threading.local()


class ClaimRefused(RuntimeError):
    """The prefill no longer holds the granted blocks; ``cause`` says whether its lease ran out
    (lease_expired) or the blocks were released, reused or never this grant's (grant_refused),
    as the prefill's answer names it (its error ``kind``)."""

    def __init__(self, message: str, cause: str = GRANT_REFUSED) -> None:
        super().__init__(message)
        self.cause = cause


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, bool]:
    """This thread's connection to ``url`` (whether it was used before)."""
    pool: dict[str, http.client.HTTPConnection] = _connections.__dict__.setdefault("pool", {})
    conn = pool.get(url)
    if conn is not None:
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        return conn, True
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TransferError(f"prefill {url}: not an http(s) URL for the claim")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, parts.port, timeout=timeout_s)
    pool[url] = conn
    return conn, False


# What using a connection the far side has closed raises (RemoteDisconnected is a
# ConnectionResetError); a timeout is not among them: the claim may be running there.
_CLOSED = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


def _drop(url: str) -> None:
    conn = _connections.__dict__.get("pool", {}).pop(url, None)
    if conn is not None:
        conn.close()


def _post(url: str, body: bytes, timeout_s: float,
          meanwhile: Callable[[], None] | None = None) -> tuple[int, bytes]:
    """One claim round trip, ``meanwhile`` run once while the claim is away."""
    conn, reused = _connection(url, timeout_s)
    try:
        conn.request("POST", "/v1/claim", body, {"Content-Type": "application/json"})
    except (http.client.HTTPException, OSError) as exc:
        return _again_or_raise(url, body, timeout_s, meanwhile, reused, exc)
    if meanwhile is not None:
        try:
            meanwhile()
        except BaseException:
            _drop(url)  # its answer is never read: the connection cannot serve another
            raise
    try:
        response = conn.getresponse()
        data = response.read()
    except (http.client.HTTPException, OSError) as exc:
        return _again_or_raise(url, body, timeout_s, None, reused, exc)
    if response.will_close:
        _drop(url)
    return response.status, data


def _again_or_raise(url: str, body: bytes, timeout_s: float,
                    meanwhile: Callable[[], None] | None, reused: bool,
                    exc: Exception) -> tuple[int, bytes]:
    """A connection the prefill closed while idle fails on its next use before the claim was
    read: that one is tried again once on a new connection (a claim is idempotent: pinning
    again only extends the pin); anything else is raised."""
    _drop(url)
    if reused and isinstance(exc, _CLOSED):
        return _post(url, body, timeout_s, meanwhile)  # a new connection: not retried again
    raise exc


def claim(url: str, grant: dict[str, Any], hold_s: float, timeout_s: float,
          meanwhile: Callable[[], None] | None = None) -> None:
    """Pin the granted blocks, or raise why not. ``meanwhile`` (the READ's planning) runs
    while the claim is on its way, not after its answer."""
    body = json.dumps({"kv_transfer_params": grant, "hold_s": hold_s}).encode()
    try:
        status, data = _post(url, body, timeout_s, meanwhile)
    except (http.client.HTTPException, OSError) as exc:
        raise PeerGone(f"prefill {url} unreachable for the claim: {exc}") from None
    if status < 300:
        return
    detail, kind = data.decode(errors="replace"), None
    try:
        err = json.loads(detail)["error"]
        if isinstance(err, dict):
            detail, kind = err["message"], err.get("kind")
        else:
            detail = str(err)
    except (ValueError, KeyError, TypeError):
        pass
    if status in (403, 410):
        raise ClaimRefused(f"prefill {url} refused the claim: {detail}",
                           LEASE_EXPIRED if kind == LEASE_EXPIRED else GRANT_REFUSED) from None
    raise TransferError(f"prefill {url}: claim answered {status}: {detail}") from None
