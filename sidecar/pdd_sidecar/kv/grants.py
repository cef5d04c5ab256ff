"""Transfer grants: what lets a decode read a prefill's KV, signed with the deployment's key.

A prefill signs each grant (request, instance, rank block ids, block epoch, expiry, where to
read) with an HMAC over its canonical JSON; the key is the deployment's Secret, mounted in every
pod of that deployment and nowhere else. So a decode reads only what a prefill of its own
deployment handed out, a caller cannot point a decode at arbitrary blocks or hosts, and the
side channel gives NIXL metadata only to holders of the key. The epoch names one allocation of
the blocks: once they are released or reused the prefill refuses to let them be read again.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

GRANT_FIELDS = (
    "request_id", "instance_id", "host", "side_channel_port", "tp", "dcp", "block_size",
    "block_ids", "num_tokens", "plan_digest", "epoch", "expires_at",
)
# Signed when present: an instance spanning pods lists each rank's side channel, and every grant
# kv/handoff.py writes names its version. Presence is part of the signed text, so neither adding
# nor stripping a field keeps a signature valid.
OPTIONAL_GRANT_FIELDS = ("rank_endpoints", "version")
SIGNATURE = "signature"
MIN_KEY_BYTES = 16
HANDSHAKE_SKEW_S = 300.0
GRANT_MARGIN_S = 0.5  # a decode starts no READ closer than this to the grant's expiry


class GrantError(ValueError):
    """A grant or authenticated call that must be refused; the message says why."""


class GrantExpired(GrantError):
    """A genuine grant whose time is up (or too close to it to start a READ)."""


def load_key(path: str) -> bytes:
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise GrantError(f"cannot read the transfer-grant key {path!r}: {exc.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise GrantError(f"the transfer-grant key {path!r} has {len(key)} bytes; at least "
                         f"{MIN_KEY_BYTES} are needed")
    return key


def _mac(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def _canonical(params: Mapping[str, Any]) -> bytes:
    try:
        fields = {k: params[k] for k in GRANT_FIELDS}
    except KeyError as exc:
        raise GrantError(f"kv_transfer_params: missing {exc.args[0]!r}") from None
    fields.update({k: params[k] for k in OPTIONAL_GRANT_FIELDS if k in params})
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def sign(params: Mapping[str, Any], key: bytes) -> dict[str, Any]:
    """``params`` with its signature added."""
    return {**params, SIGNATURE: _mac(key, b"grant:" + _canonical(params))}


def verify(params: Any, key: bytes, now: float | None = None, margin_s: float = 0.0) -> None:
    """Refuse a grant that is not an object, was not signed with ``key``, or expires within
    ``margin_s``."""
    if not isinstance(params, Mapping):
        raise GrantError("kv_transfer_params: must be an object")
    got = params.get(SIGNATURE)
    if not isinstance(got, str) or not got.isascii():  # compare_digest takes ASCII only
        raise GrantError("kv_transfer_params: not signed (no hex signature)")
    if not hmac.compare_digest(got, _mac(key, b"grant:" + _canonical(params))):
        raise GrantError("kv_transfer_params: signature does not match (not issued by a "
                         "prefill of this deployment, or altered)")
    expires = params["expires_at"]
    if isinstance(expires, bool) or not isinstance(expires, int | float):
        raise GrantError("kv_transfer_params: expires_at must be a number")
    try:
        expires = float(expires)
    except OverflowError:
        expires = math.nan
    if not math.isfinite(expires):  # nan would never expire
        raise GrantError("kv_transfer_params: expires_at must be a finite time")
    now = time.time() if now is None else now
    if now > expires - margin_s:
        raise GrantExpired(f"kv_transfer_params: the grant for request {params['request_id']!r} "
                         f"expired {now - expires + margin_s:.1f}s ago (with a {margin_s:.0f}s "
                         f"margin)")


def handshake_auth(key: bytes, peer: str, compat: Mapping[str, Any],
                   now: float | None = None) -> dict[str, Any]:
    """What a reader adds to a side-channel handshake to prove it holds the key."""
    ts = time.time() if now is None else now
    body = json.dumps({"peer": peer, "compat": compat, "ts": ts}, sort_keys=True).encode()
    return {"ts": ts, "auth": _mac(key, b"handshake:" + body)}


def check_handshake(key: bytes, request: Mapping[str, Any], now: float | None = None) -> None:
    ts, auth = request.get("ts"), request.get("auth")
    if (not isinstance(auth, str) or not auth.isascii() or isinstance(ts, bool)
            or not isinstance(ts, int | float)):
        raise GrantError("handshake not authenticated (no key proof)")
    body = json.dumps({"peer": request.get("peer"), "compat": request.get("compat"), "ts": ts},
                      sort_keys=True).encode()
    if not hmac.compare_digest(auth, _mac(key, b"handshake:" + body)):
        raise GrantError("handshake key proof does not match (another deployment's key?)")
    now = time.time() if now is None else now
    if abs(now - ts) > HANDSHAKE_SKEW_S:
        raise GrantError(f"handshake key proof is {abs(now - ts):.0f}s old")
