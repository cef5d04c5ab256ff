"""The webhook's TLS context, reloaded in place when its files change. Restarting the server
for a new certificate would refuse the API server's admission calls meanwhile (failurePolicy
Fail turns that into a refused `kubectl apply`); a context reloaded in place keeps the listening
socket, and every handshake after the reload gets the new certificate."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
import tempfile
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

log = logging.getLogger("pdd_operator.tls_reload")


def _public(key: Any) -> bytes:
    return key.public_bytes(  # type: ignore[no-any-return]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def read_pair(certfile: Path, keyfile: Path) -> tuple[bytes, bytes] | None:
    """Both files' bytes when the key belongs to the leaf certificate; None while a writer is
    between the two files (the caller retries), so a half-renewed pair is never loaded."""
    try:
        cert, key = certfile.read_bytes(), keyfile.read_bytes()
        leaf = x509.load_pem_x509_certificate(cert)
        private = serialization.load_pem_private_key(key, password=None)
    except (OSError, ValueError, TypeError):
        return None
    return (cert, key) if _public(leaf.public_key()) == _public(private.public_key()) else None


def load_pair(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """ssl loads a chain only from files: a private copy of the checked bytes, so what is
    loaded is what was checked even if the originals change meanwhile."""
    with tempfile.TemporaryDirectory(prefix="pdd-webhook-load-") as tmp:
        c, k = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
        k.touch(mode=0o600)
        k.write_bytes(key)
        c.write_bytes(cert)
        context.load_cert_chain(c, k)


def server_context(certfile: Path, keyfile: Path) -> ssl.SSLContext:
    pair = read_pair(certfile, keyfile)
    if pair is None:
        raise RuntimeError(f"webhook certificate {certfile} and key {keyfile} are unreadable "
                           "or do not belong together")
    context = ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)
    load_pair(context, *pair)
    return context


def _digest(cert: bytes, key: bytes) -> str:
    return hashlib.sha256(cert + b"\0" + key).hexdigest()


async def reload_forever(context: ssl.SSLContext, certfile: Path, keyfile: Path,
                         interval: float) -> None:
    """Polled, not watched: a mounted Secret's files change through a symlink swap that sends
    no event to the file itself."""
    pair = read_pair(certfile, keyfile)
    loaded = _digest(*pair) if pair else ""
    while True:
        await asyncio.sleep(interval)
        pair = read_pair(certfile, keyfile)
        if pair is None or _digest(*pair) == loaded:
            continue
        try:
            load_pair(context, *pair)
        except (OSError, ssl.SSLError) as exc:
            log.warning("webhook certificate %s not reloaded, retrying: %s", certfile, exc)
            continue
        loaded = _digest(*pair)
        log.info("webhook certificate reloaded from %s", certfile)
