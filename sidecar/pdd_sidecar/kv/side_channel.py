"""Per-rank side channel: HTTP on PDD_SIDE_CHANNEL_PORT + rank, publishing NIXL agent metadata.

A reader POSTs its compatibility record to /handshake with a proof that it holds the
deployment's grant key; the publisher answers 401 without one, 409 naming the differing fields
(and both values), or 200 with its agent metadata, KV region and record. The reader checks the
record again on its side, so neither side trusts the other's check alone. The metadata is never
served to a caller without the key. The publication also carries the rank's transport record
(kv/transport.py), from which a reader on the same host and device picks a device copy.
It is a plain threaded http.server: it serves bytes fixed at start-up, so it never touches the
NIXL agent or the model and cannot disturb the rank's main loop.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pdd_sidecar.kv.compat import CompatError, CompatRecord, check_compatible
from pdd_sidecar.kv.grants import GrantError, check_handshake, handshake_auth
from pdd_sidecar.kv.transfer import PeerGone, RegionInfo
from pdd_sidecar.kv.transport import TransportRecord

log = logging.getLogger(__name__)


class PeerUnreachable(PeerGone):
    """The peer's side channel did not answer."""


@dataclass(frozen=True)
class PeerInfo:
    key: str  # host:port of the side channel
    role: str
    rank: int
    tp: int
    dcp: int
    instance_id: str
    agent_name: str
    metadata: bytes
    region: RegionInfo
    compat: CompatRecord
    transport: TransportRecord | None = None  # absent: the peer reads and is read over NIXL


def publication(
    *,
    role: str,
    rank: int,
    tp: int,
    dcp: int,
    instance_id: str,
    agent_name: str,
    metadata: bytes,
    region: RegionInfo,
    compat: CompatRecord,
    transport: TransportRecord | None = None,
) -> dict[str, Any]:
    extra = {} if transport is None else {"transport": transport.to_dict()}
    return {
        "role": role,
        "rank": rank,
        "tp": tp,
        "dcp": dcp,
        "instanceId": instance_id,
        "agentName": agent_name,
        "agentMetadata": base64.b64encode(metadata).decode(),
        "region": region.to_dict(),
        "compat": compat.to_dict(),
        **extra,
    }


class SideChannelServer:
    """Serves one rank's publication until closed."""

    def __init__(self, host: str, port: int, payload: dict[str, Any], key: bytes) -> None:
        body = json.dumps(payload).encode()
        compat = CompatRecord.from_dict(payload["compat"])
        label = f"{payload['role']} rank {payload['rank']}"

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("side channel: " + format, *args)

            def _send(self, code: int, data: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/healthz":
                    self._send(200, b'{"status":"ok"}')
                else:
                    self._send(404, b'{"error":"not found"}')

            def do_POST(self) -> None:
                if self.path != "/handshake":
                    self._send(404, b'{"error":"not found"}')
                    return
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                    request = json.loads(self.rfile.read(length) or b"{}")
                    if not isinstance(request, dict):
                        raise TypeError(f"the body must be a JSON object, got "
                                        f"{type(request).__name__}")
                    who = str(request.get("peer", "peer"))
                    check_handshake(key, request)
                    check_compatible(compat, CompatRecord.from_dict(request["compat"]), who)
                except GrantError as exc:
                    log.warning("refused handshake: %s", exc)
                    self._send(401, json.dumps({"error": f"{label}: {exc}"}).encode())
                    return
                except CompatError as exc:
                    log.warning("refused handshake: %s", exc)
                    msg = f"{label} refuses the hand-off: {exc}"
                    self._send(409, json.dumps({"error": msg}).encode())
                    return
                except (KeyError, ValueError, TypeError) as exc:
                    self._send(400, json.dumps({"error": f"bad handshake: {exc}"}).encode())
                    return
                self._send(200, body)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name=f"side-channel-{port}", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def handshake(
    host: str, port: int, local: CompatRecord, who: str, timeout_s: float, grant_key: bytes
) -> PeerInfo:
    """Exchange compatibility records with one remote rank and return its NIXL metadata."""
    key = f"{host}:{port}"
    request = urllib.request.Request(
        f"http://{key}/handshake",
        data=json.dumps({"peer": who, "compat": local.to_dict(),
                         **handshake_auth(grant_key, who, local.to_dict())}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            payload = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]
        except (ValueError, KeyError, TypeError):
            pass
        if exc.code in (401, 409):
            raise CompatError(detail) from None
        raise PeerUnreachable(f"peer {key}: side channel answered {exc.code}: {detail}") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PeerUnreachable(f"peer {key}: side channel unreachable: {reason}") from None
    try:
        info = PeerInfo(
            key=key,
            role=payload["role"],
            rank=int(payload["rank"]),
            tp=int(payload["tp"]),
            dcp=int(payload["dcp"]),
            instance_id=payload["instanceId"],
            agent_name=payload["agentName"],
            metadata=base64.b64decode(payload["agentMetadata"]),
            region=RegionInfo.from_dict(payload["region"]),
            compat=CompatRecord.from_dict(payload["compat"]),
            transport=(TransportRecord.from_dict(payload["transport"])
                       if payload.get("transport") is not None else None),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise PeerUnreachable(f"peer {key}: malformed side-channel answer: {exc}") from None
    check_compatible(local, info.compat, f"peer {key}")
    return info
