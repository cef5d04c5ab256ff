"""--webhook-cert-dir (cert-manager): the operator serves the mounted files and touches no API
object for its certificate; without it, it makes (or reads) its own and manages the rest."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from pdd_operator.certs import make_bundle
from pdd_operator.config import Config
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
