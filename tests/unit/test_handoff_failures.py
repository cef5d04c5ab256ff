"""Hand-off failures by cause (kv/errors.py): the prefill's lease says why a claim is refused
and why a holding went unread, the decode's claim reads the cause the prefill answered, and both
roles expose every cause from the start."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from prometheus_client import generate_latest

from pdd_sidecar.kv.claims import ClaimRefused, claim
from pdd_sidecar.kv.errors import HANDOFF_FAILURE_CAUSES
from pdd_sidecar.kv.lease import LeaseTable
from pdd_sidecar.kv.transfer import PeerGone
from pdd_sidecar.metrics import InstanceMetrics


def test_a_refused_claim_says_its_cause() -> None:
    t = LeaseTable(10.0, {0: 1})
    t.hold("r1", [1, 2], now=0.0, epoch=7)
    refused = t.claim("r1", 6, now=1.0, hold_s=5)
    assert refused is not None and refused.cause == "grant_refused"
    assert "released or reused" in refused
    refused = t.claim("r1", 7, now=11.0, hold_s=5)
    assert refused is not None and refused.cause == "lease_expired"
    assert refused == "the lease of request 'r1' ran out"
    assert t.claim("r1", 7, now=2.0, hold_s=5) is None


def test_an_expired_holding_claimed_and_never_read_is_a_peer_gone() -> None:
    t = LeaseTable(1.0, {0: 1})
    t.hold("unclaimed", [1], now=0.0)
    t.hold("claimed", [2], now=0.0)
    assert t.claim("claimed", 0, now=0.5, hold_s=2.0) is None
    causes = {h.request_id: t.expiry_cause(h) for h in t.expire(now=10.0)}
    assert causes == {"unclaimed": "lease_expired", "claimed": "peer_gone"}


class _Prefill(BaseHTTPRequestHandler):
    answer: tuple[int, dict[str, object]] = (200, {})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        status, body = self.answer
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def prefill() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), _Prefill)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("kind,cause", [("lease_expired", "lease_expired"),
                                        ("grant_refused", "grant_refused"),
                                        ("gone", "grant_refused")])
def test_the_decode_reads_the_cause_the_prefill_answered(prefill: str, kind: str,
                                                         cause: str) -> None:
    _Prefill.answer = (410, {"error": {"message": "no", "kind": kind, "code": 410}})
    with pytest.raises(ClaimRefused) as err:
        claim(f"{prefill}/", {}, 1.0, 5.0)
    assert err.value.cause == cause


def test_an_unreachable_prefill_is_gone() -> None:
    with pytest.raises(PeerGone, match="unreachable for the claim"):
        claim("http://127.0.0.1:9", {}, 1.0, 2.0)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_cause_is_exposed_on_both_roles(role: str) -> None:
    text = generate_latest(InstanceMetrics(role).registry).decode()
    for cause in HANDOFF_FAILURE_CAUSES:
        assert f'pdd_kv_handoff_failures_total{{cause="{cause}",role="{role}"}} 0.0' in text
