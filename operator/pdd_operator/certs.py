"""Webhook TLS made here with `cryptography` (kopf's self-signed path needs oscrypto, which
breaks on current OpenSSL): a CA whose certificate is the webhook's caBundle, and a server
certificate for the addresses the API server may use."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=365)
SKEW = datetime.timedelta(minutes=5)  # clocks of the API server and the operator may differ


@dataclass(frozen=True)
class TlsBundle:
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    def write(self, directory: Path) -> tuple[Path, Path]:
        """Written aside and renamed into place: a server re-reading the pair while it is
        renewed sees the old or the new files, never half of each for long."""
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = directory / "tls.crt", directory / "tls.key"
        new_cert, new_key = directory / ".tls.crt.new", directory / ".tls.key.new"
        new_key.write_bytes(self.key_pem)
        new_key.chmod(0o600)
        new_cert.write_bytes(self.cert_pem + self.ca_pem)
        os.replace(new_key, key)
        os.replace(new_cert, cert)
        return cert, key


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def renew_at(cert_pem: bytes) -> datetime.datetime:
    """Two thirds into the certificate's validity: late enough to renew rarely, early enough
    that a failed renewal has a third of the life left to be retried."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return start + (end - start) * 2 / 3


def make_bundle(hosts: list[str], now: datetime.datetime | None = None,
                validity: datetime.timedelta = VALIDITY) -> TlsBundle:
    """`hosts`: DNS names and IP addresses, all put in the SAN (the API server checks it)."""
    now = now or datetime.datetime.now(datetime.UTC)
    skew = min(SKEW, validity / 10)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("pdd-operator-webhook-ca")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - skew)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0] if hosts else "pdd-operator"))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - skew)
        .not_valid_after(now + validity)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return TlsBundle(ca.public_bytes(pem), cert.public_bytes(pem), _pem_key(key))
