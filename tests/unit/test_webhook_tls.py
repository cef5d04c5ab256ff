"""--webhook-cert-dir (cert-manager): the operator serves the mounted files and touches no API
object for its certificate; without it, it makes (or reads) its own and manages the rest."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from pdd_operator.certs import make_bundle
from pdd_operator.config import Config
from pdd_operator.tls_reload import read_pair, reload_forever, server_context
from pdd_operator.webhook import prepare_tls


class NoApi:
    """Any API call fails the test."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the operator called the API ({name}) for a mounted certificate")


def test_mounted_certificate_is_served_as_is(tmp_path: Path) -> None:
    bundle = make_bundle(["pdd-operator-webhook.pdd-system.svc"])
    for name, data in (("tls.crt", bundle.cert_pem), ("tls.key", bundle.key_pem),
                       ("ca.crt", bundle.ca_pem)):
        (tmp_path / name).write_bytes(data)
    cfg = Config(webhook_cert_dir=str(tmp_path), tls_secret="pdd-system/ignored")
    tls = asyncio.run(prepare_tls(NoApi(), cfg))  # type: ignore[arg-type]
    assert (tls.certfile, tls.keyfile) == (tmp_path / "tls.crt", tmp_path / "tls.key")
    assert tls.ca_pem == bundle.ca_pem
    assert tls.bundle is None  # nothing to patch, nothing to renew


def test_missing_files_are_named(tmp_path: Path) -> None:
    (tmp_path / "tls.crt").write_text("x")
    with pytest.raises(RuntimeError, match="lacks .*tls.key"):
        asyncio.run(prepare_tls(NoApi(), Config(webhook_cert_dir=str(tmp_path))))  # type: ignore[arg-type]


def test_without_a_directory_the_operator_makes_its_own(tmp_path: Path) -> None:
    tls = asyncio.run(prepare_tls(NoApi(), Config()))  # type: ignore[arg-type]
    assert tls.bundle is not None and tls.ca_pem == tls.bundle.ca_pem
    assert tls.certfile.read_bytes().startswith(tls.bundle.cert_pem)


async def _served_leaf(port: int) -> bytes:
    client = ssl.create_default_context()
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    return der  # type: ignore[no-any-return]


def _leaf_der(pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)


def test_a_renewed_certificate_is_served_without_closing_the_socket(tmp_path: Path) -> None:
    """The reload swaps the pair in the live context: the same listening socket serves the old
    certificate, then the new one; a key from another pair (a writer between the two files)
    is not loaded."""
    first, second = make_bundle(["127.0.0.1"]), make_bundle(["127.0.0.1"])
    certfile, keyfile = first.write(tmp_path)
    context = server_context(certfile, keyfile)

    async def scenario() -> list[bytes]:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=context)
        port = server.sockets[0].getsockname()[1]
        reloader = asyncio.create_task(reload_forever(context, certfile, keyfile, 0.05))
        seen = [await _served_leaf(port)]
        keyfile.write_bytes(second.key_pem)  # half-written: the old pair stays
        await asyncio.sleep(0.3)
        seen.append(await _served_leaf(port))
        second.write(tmp_path)
        await asyncio.sleep(0.3)
        seen.append(await _served_leaf(port))
        reloader.cancel()
        server.close()
        return seen

    seen = asyncio.run(scenario())
    assert seen == [_leaf_der(first.cert_pem)] * 2 + [_leaf_der(second.cert_pem)]


def test_a_pair_that_does_not_belong_together_is_refused(tmp_path: Path) -> None:
    first, second = make_bundle(["127.0.0.1"]), make_bundle(["127.0.0.1"])
    certfile, keyfile = first.write(tmp_path)
    assert read_pair(certfile, keyfile) is not None
    keyfile.write_bytes(second.key_pem)
    assert read_pair(certfile, keyfile) is None
    with pytest.raises(RuntimeError, match="do not belong together"):
        server_context(certfile, keyfile)
