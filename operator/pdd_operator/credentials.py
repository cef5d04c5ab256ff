"""Where the API server is and how to authenticate, read without the `kubernetes` package.

Importing that package (its client builds hundreds of model classes) costs about 40 MiB of
resident memory, a quarter of the operator's at a few hundred PDDeployments, and the operator
never uses it beyond loading credentials. The common cases are read here: the in-cluster service
account (its token re-read when the kubelet rotates the file) and kubeconfigs with certificates,
tokens or token files. Whatever else a kubeconfig may ask for (exec plugins, auth providers,
basic auth) is left to the `kubernetes` package, imported only then.
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class CredentialsError(Exception):
    pass


@dataclass
class Credentials:
    host: str
    ca_file: str | None = None
    ca_data: str | None = None  # PEM
    insecure: bool = False
    cert_file: str | None = None
    key_file: str | None = None
    cert_data: str | None = None  # PEM
    key_data: str | None = None  # PEM
    header: Callable[[], str | None] = field(default=lambda: None)  # Authorization
    via_client: bool = False  # loaded by the `kubernetes` package

    def ssl_context(self) -> ssl.SSLContext | bool:
        if self.insecure:
            return False
        ctx = ssl.create_default_context(cafile=self.ca_file, cadata=self.ca_data)
        if self.cert_file and self.key_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        elif self.cert_data and self.key_data:
            # load_cert_chain reads files only: a private file for the moment it takes.
            with tempfile.TemporaryDirectory() as tmp:
                cert, key = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
                for path, text in ((cert, self.cert_data), (key, self.key_data)):
                    path.touch(0o600)
                    path.write_text(text)
                ctx.load_cert_chain(str(cert), str(key))
        return ctx



def _file_token(path: Path) -> Callable[[], str | None]:
    """A bearer token file re-read when it changes (the kubelet rotates projected tokens)."""
    cache: dict[str, Any] = {}

    def read() -> str | None:
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            return cache.get("header")
        if cache.get("mtime") != mtime:
            token = path.read_text().strip()
            cache["header"], cache["mtime"] = f"Bearer {token}" if token else None, mtime
        return cache.get("header")
    return read


def in_cluster() -> Credentials | None:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get(
        "KUBERNETES_SERVICE_PORT")
    if not host or not port or not (SA_DIR / "token").exists():
        return None
    if ":" in host:
        host = f"[{host}]"
    ca = SA_DIR / "ca.crt"
    return Credentials(host=f"https://{host}:{port}", ca_file=str(ca) if ca.exists() else None,
                       header=_file_token(SA_DIR / "token"))


def _pem(b64: str | None, what: str) -> str | None:
    if b64 is None:
        return None
    try:
        return base64.b64decode("".join(b64.split()), validate=True).decode()
    except ValueError as exc:
        raise CredentialsError(f"kubeconfig: {what} is not base64 PEM: {exc}") from None


def from_kubeconfig(path: str | None = None) -> Credentials | None:
    """The current context of KUBECONFIG (first file that names each entry wins, as kubectl
    reads it) or ~/.kube/config; None when it needs the `kubernetes` package."""
    raw = path or os.environ.get("KUBECONFIG") or "~/.kube/config"
    files = [Path(os.path.expanduser(p)) for p in raw.split(os.pathsep) if p]
    current: str | None = None
    entries: dict[str, dict[str, Any]] = {"contexts": {}, "clusters": {}, "users": {}}
    found = False
    for f in files:
        if not f.exists():
            continue
        found = True
        doc = yaml.safe_load(f.read_text()) or {}
        current = current or doc.get("current-context")
        for section, inner in (("contexts", "context"), ("clusters", "cluster"),
                               ("users", "user")):
            for item in doc.get(section) or []:
                entries[section].setdefault(item["name"], {**(item.get(inner) or {}),
                                                           "_dir": f.parent})
    if not found:
        raise CredentialsError(f"no kubeconfig at {raw} (KUBECONFIG) and no service account")
    if not current or current not in entries["contexts"]:
        raise CredentialsError(f"kubeconfig {raw}: current-context {current!r} is not defined")
    ctx = entries["contexts"][current]
    cluster = entries["clusters"].get(ctx.get("cluster"))
    user = entries["users"].get(ctx.get("user"), {"_dir": None})
    if cluster is None or not cluster.get("server"):
        raise CredentialsError(f"kubeconfig {raw}: context {current!r} names no cluster server")
    if any(k in user for k in ("exec", "auth-provider", "username", "password")):
        return None

    def rel(d: dict[str, Any], key: str) -> str | None:
        value = d.get(key)
        return str(d["_dir"] / os.path.expanduser(value)) if value else None

    token_file = rel(user, "tokenFile")
    header: Callable[[], str | None]
    if user.get("token"):
        static = f"Bearer {user['token']}"
        header = lambda: static  # noqa: E731
    elif token_file:
        header = _file_token(Path(token_file))
    else:
        header = lambda: None  # noqa: E731
    return Credentials(
        host=str(cluster["server"]), ca_file=rel(cluster, "certificate-authority"),
        ca_data=_pem(cluster.get("certificate-authority-data"), "certificate-authority-data"),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        cert_file=rel(user, "client-certificate"), key_file=rel(user, "client-key"),
        cert_data=_pem(user.get("client-certificate-data"), "client-certificate-data"),
        key_data=_pem(user.get("client-key-data"), "client-key-data"), header=header)


def via_client(kubeconfig: str | None = None) -> Credentials:
    """The `kubernetes` package's loaders (exec plugins, auth providers, basic auth)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        if kubeconfig:
            raise config.ConfigException("explicit kubeconfig")
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)

    def header() -> str | None:
        if cfg.refresh_api_key_hook is not None:
            cfg.refresh_api_key_hook(cfg)
        bearer = cfg.auth_settings().get("BearerToken")
        return str(bearer["value"]) if bearer and bearer.get("value") else None

    return Credentials(host=cfg.host, ca_file=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
                       cert_file=cfg.cert_file, key_file=cfg.key_file, header=header,
                       via_client=True)


def load(kubeconfig: str | None = None) -> Credentials:
    """In-cluster service account when there is one (and no kubeconfig is named), else the
    kubeconfig, as kubectl and the `kubernetes` package choose."""
    creds = None if kubeconfig else in_cluster()
    if creds is None:
        creds = from_kubeconfig(kubeconfig)
    return creds if creds is not None else via_client(kubeconfig)
