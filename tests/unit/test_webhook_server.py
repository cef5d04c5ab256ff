"""The admission webhook on its own thread: AdmissionReview answers (the `pdd validate` rules,
HTTP 422 with the problems), served while the operator's event loop is busy, and a renewed
certificate served on the same socket."""

from __future__ import annotations

import asyncio
import copy
import json
import ssl
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from pdd_api.validation import validate_document
from pdd_operator.certs import make_bundle
from pdd_operator.tls_reload import server_context
from pdd_operator.webhook import review
from pdd_operator.webhook_server import WebhookThread

DOC: dict[str, Any] = {
    "apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
    "metadata": {"name": "demo", "namespace": "ns"},
    "spec": {"model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"}, "image": "pdd:0.1.0",
             "prefill": {"replicas": 1, "tensorParallelSize": 2},
             "decode": {"replicas": 2, "tensorParallelSize": 2}},
}


def request(obj: dict[str, Any] | None, old: dict[str, Any] | None = None,
            operation: str = "CREATE") -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "operation": operation, "object": obj,
                        "oldObject": old}}


def bad() -> dict[str, Any]:
    doc = copy.deepcopy(DOC)
    doc["spec"]["blockSize"] = 100
    doc["spec"]["decode"]["replicas"] = 0
    return doc


def test_review_admits_a_valid_spec_and_refuses_with_every_problem() -> None:
    ok = review(request(DOC))
    assert ok == {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                  "response": {"uid": "u-1", "allowed": True}}
    problems = validate_document(bad())
    assert len(problems) >= 2
    refused = review(request(bad()))["response"]
    assert refused == {"uid": "u-1", "allowed": False,
                       "status": {"code": 422, "message": "; ".join(problems)}}


def test_review_admits_an_update_that_leaves_the_spec_alone() -> None:
    """A finalizer or label change on an invalid object must pass (it can still be deleted)."""
    old = bad()
    new = copy.deepcopy(old)
    new["metadata"]["finalizers"] = []
    assert review(request(new, old, "UPDATE"))["response"]["allowed"] is True
    assert review(request(bad(), DOC, "UPDATE"))["response"]["allowed"] is False


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[tuple[WebhookThread, Path]]:
    bundle = make_bundle(["127.0.0.1"])
    certfile, keyfile = bundle.write(tmp_path)
    hook = WebhookThread("127.0.0.1", 0, "/validate", server_context(certfile, keyfile),
                         certfile, keyfile, 0.05, review).start()
    yield hook, tmp_path
    hook.stop()


def _post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    req = urllib.request.Request(f"https://127.0.0.1:{port}/validate",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def test_reviews_are_served_while_the_operator_loop_is_busy(
        served: tuple[WebhookThread, Path]) -> None:
    """The caller's event loop blocks on the request (as kopf's does on a long burst of
    handlers): a server on that loop could never answer."""
    hook, _ = served

    async def busy_loop() -> dict[str, Any]:
        return _post(hook.port, request(bad()))

    answer = asyncio.run(busy_loop())
    assert answer["response"]["allowed"] is False
    assert answer["response"]["status"]["message"] == "; ".join(validate_document(bad()))
    assert _post(hook.port, request(DOC))["response"]["allowed"] is True


def _served_leaf(port: int) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    import socket
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock, \
            ctx.wrap_socket(sock) as tls:
        return tls.getpeercert(binary_form=True)  # type: ignore[return-value]


def test_a_renewed_certificate_is_served_by_the_thread(
        served: tuple[WebhookThread, Path]) -> None:
    hook, directory = served
    first = _served_leaf(hook.port)
    fresh = make_bundle(["127.0.0.1"])
    fresh.write(directory)
    want = x509.load_pem_x509_certificate(fresh.cert_pem).public_bytes(
        serialization.Encoding.DER)
    deadline = time.monotonic() + 10
    while (seen := _served_leaf(hook.port)) == first and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen == want


def test_a_port_in_use_is_reported_by_start(served: tuple[WebhookThread, Path]) -> None:
    hook, directory = served
    other = WebhookThread("127.0.0.1", hook.port, "/validate", hook.context,
                          directory / "tls.crt", directory / "tls.key", 1.0, review)
    with pytest.raises(RuntimeError, match="could not start"):
        other.start()
