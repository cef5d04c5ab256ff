"""The operator's credentials without the `kubernetes` package (pdd_operator.credentials)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdd_operator import credentials
from pdd_operator.credentials import CredentialsError, from_kubeconfig

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None,
           current: str = "c") -> Path:
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": current,
           "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
           "clusters": [{"name": "k", "cluster": cluster or {"server": "https://k:6443"}}],
           "users": [{"name": "u", "user": user}]}
    path.write_text(json.dumps(doc))
    return path


def test_embedded_data_and_token(tmp_path: Path) -> None:
    pem = "-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----\n"
    b64 = base64.b64encode(pem.encode()).decode()
    cfg = _write(tmp_path / "kc", {"token": "t0k", "client-certificate-data": b64,
                                   "client-key-data": b64},
                 {"server": "https://k:6443", "certificate-authority-data": b64})
    creds = from_kubeconfig(str(cfg))
    assert creds is not None and not creds.via_client
    assert creds.host == "https://k:6443"
    assert creds.ca_data == pem and creds.cert_data == pem and creds.key_data == pem
    assert creds.header() == "Bearer t0k"


def test_token_file_relative_to_the_kubeconfig_and_reread(tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("one\n")
    cfg = _write(tmp_path / "kc", {"tokenFile": "tok"},
                 {"server": "https://k", "certificate-authority": "ca.crt",
                  "insecure-skip-tls-verify": True})
    creds = from_kubeconfig(str(cfg))
    assert creds is not None
    assert creds.ca_file == str(tmp_path / "ca.crt")
    assert creds.header() == "Bearer one"
    (tmp_path / "tok").write_text("two")
    os.utime(tmp_path / "tok", ns=(1, 10**18))  # a rotated file: another mtime
    assert creds.header() == "Bearer two"
    assert creds.ssl_context() is False


def test_first_file_wins_and_exec_is_left_to_the_client(tmp_path: Path) -> None:
    a = _write(tmp_path / "a", {"exec": {"command": "get-token"}})
    b = _write(tmp_path / "b", {"token": "ignored"}, current="other")
    assert from_kubeconfig(f"{a}{os.pathsep}{b}") is None


def test_errors_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(CredentialsError, match="current-context 'nope'"):
        from_kubeconfig(str(_write(tmp_path / "kc", {}, current="nope")))
    with pytest.raises(CredentialsError, match="no kubeconfig"):
        from_kubeconfig(str(tmp_path / "missing"))
    bad = _write(tmp_path / "bad", {"client-key-data": "%%%"})
    with pytest.raises(CredentialsError, match="client-key-data"):
        from_kubeconfig(str(bad))


def test_in_cluster_needs_the_service_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert credentials.in_cluster() is None


def test_operator_entry_does_not_import_the_kubernetes_package() -> None:
    """kopf would import it (about 40 MiB resident) if the entry point let it."""
    code = ("import sys\n"
            "from pdd_operator.__main__ import _without_kubernetes_package\n"
            "with _without_kubernetes_package():\n"
            "    import kopf\n"
            "    import pdd_operator.handlers\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kubernetes'))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "operator"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True)
    assert out.stdout.strip() == "[]"
