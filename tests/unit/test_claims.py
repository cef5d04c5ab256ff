"""The decode's claim client: one kept connection per thread and prefill, a prefill's idle close
survived, refusals told apart from an unreachable prefill, the READ's planning done while the
claim is away."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from polling import wait_for

from pdd_sidecar.kv import claims
from pdd_sidecar.kv.claims import ClaimRefused, claim
from pdd_sidecar.kv.transfer import TransferError


class Prefill(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.connections = 0
        self.bodies: list[dict[str, Any]] = []
        self.status = 200
        self.close_after_answer = False
        self.answer_after: threading.Event | None = None  # the answer waits for it (2 s at most)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # answering a client that dropped its connection (as a failed planning does)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Prefill

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.bodies.append(json.loads(body))
        if self.server.answer_after is not None:
            self.server.answer_after.wait(2.0)
        status = self.server.status
        out = json.dumps({"claimed": True} if status == 200 else
                         {"error": {"message": f"refused with {status}"}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
        if self.server.close_after_answer:  # as a server does when a kept connection idles out
            self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    server = Prefill()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    claims._drop(server.url)


GRANT = {"request_id": "r1", "epoch": 3}


def test_claims_of_one_thread_share_a_connection(prefill: Prefill) -> None:
    for _ in range(5):
        claim(prefill.url, GRANT, 30.0, 5.0)
    assert prefill.connections == 1
    assert prefill.bodies == [{"kv_transfer_params": GRANT, "hold_s": 30.0}] * 5


def test_each_thread_has_its_own_connection(prefill: Prefill) -> None:
    claim(prefill.url, GRANT, 30.0, 5.0)
    other = threading.Thread(target=claim, args=(prefill.url, GRANT, 30.0, 5.0))
    other.start()
    other.join()
    claim(prefill.url, GRANT, 30.0, 5.0)
    assert prefill.connections == 2
    assert len(prefill.bodies) == 3


def test_a_connection_the_prefill_closed_is_replaced(prefill: Prefill) -> None:
    prefill.close_after_answer = True
    for _ in range(3):
        claim(prefill.url, GRANT, 30.0, 5.0)
    assert len(prefill.bodies) == 3  # each claim ran once, none was lost or doubled
    assert prefill.connections == 3


def test_refusals_and_failures_say_what_the_prefill_said(prefill: Prefill) -> None:
    prefill.status = 410
    with pytest.raises(ClaimRefused, match="refused with 410"):
        claim(prefill.url, GRANT, 30.0, 5.0)
    prefill.status = 500
    with pytest.raises(TransferError, match="claim answered 500: refused with 500"):
        claim(prefill.url, GRANT, 30.0, 5.0)
    prefill.status = 200
    claim(prefill.url, GRANT, 30.0, 5.0)  # the connection outlived the refusals
    assert prefill.connections == 1


def test_an_unreachable_prefill_is_a_transfer_error(prefill: Prefill) -> None:
    url = prefill.url
    prefill.shutdown()
    prefill.server_close()
    with pytest.raises(TransferError, match="unreachable for the claim"):
        claim(url, GRANT, 30.0, 2.0)
    with pytest.raises(TransferError, match="not an http"):
        claim("ftp://x", GRANT, 30.0, 2.0)


def test_the_planning_runs_while_the_claim_is_away(prefill: Prefill) -> None:
    """The prefill answers only once the planning ran: run after the answer, as it was, the
    claim would wait 2 s and the planning would see no claim received."""
    planned = threading.Event()
    prefill.answer_after = planned
    seen: list[int] = []

    def plan() -> None:
        for _ in range(200):  # the claim is in flight: the prefill gets it meanwhile
            if prefill.bodies:
                break
            threading.Event().wait(0.005)
        seen.append(len(prefill.bodies))
        planned.set()

    claim(prefill.url, GRANT, 30.0, 1.0, plan)
    assert seen == [1]


def test_a_failed_planning_is_raised_and_its_connection_not_reused(prefill: Prefill) -> None:
    def plan() -> None:
        raise ValueError("no such block")

    with pytest.raises(ValueError, match="no such block"):
        claim(prefill.url, GRANT, 30.0, 5.0, plan)
    claim(prefill.url, GRANT, 30.0, 5.0)  # its answer unread, that connection was dropped
    assert prefill.connections == 2
    # The dropped connection's handler may still be reading its body on a loaded machine.
    wait_for("both claims received", lambda: len(prefill.bodies) == 2, timeout=10, interval=0.05)


def test_a_claim_sent_again_on_a_new_connection_plans_once(prefill: Prefill) -> None:
    prefill.close_after_answer = True
    claim(prefill.url, GRANT, 30.0, 5.0)  # leaves a kept connection the prefill closed
    runs: list[int] = []
    claim(prefill.url, GRANT, 30.0, 5.0, lambda: runs.append(1))
    assert runs == [1]
    assert len(prefill.bodies) == 2 and prefill.connections == 2
