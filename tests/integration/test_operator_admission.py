"""Admission and invalid specs: the operator's webhook rejects what `pdd validate` rejects, with
the same messages (plus the name rule CEL cannot express), and a spec that got past admission
anyway (a CRD without CEL, no webhook) is reported as Validated=False with nothing changed."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from localcluster import Cluster
from operator_fixtures import (  # noqa: F401  (fixtures)
    EXAMPLES,
    Kubectl,
    Operator,
    conditions,
    events_of,
    install_crd,
    kube,
    load_example,
    make_namespace,
    op_namespace,
    pdd,
    pods_of,
    routing_cm,
    teardown_namespace,
    wait_for,
    wait_ready,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def no_cel(kube: Kubectl) -> Iterator[None]:
    """Only the webhook validates: CEL in the CRD would answer first with the same words."""
    install_crd(kube, cel=False)
    yield
    install_crd(kube)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, kube: Kubectl, no_cel: None, op_namespace: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(cluster, op_namespace, tmp_path_factory.mktemp("operator")).start()
    yield op
    teardown_namespace(kube, op_namespace, op)


def base() -> dict[str, Any]:
    return copy.deepcopy(load_example(EXAMPLES[0]))


def mutate(path: str, value: Any) -> dict[str, Any]:
    doc = base()
    node = doc
    *parents, leaf = path.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    return doc


INVALID = {
    "dcp-not-1-or-tp": mutate("spec.decode.decodeContextParallelSize", 3),
    "block-size": mutate("spec.blockSize", 100),
    "gpu-limit": mutate("spec.prefill.resources", {"limits": {"nvidia.com/gpu": 1}}),
    "replicas-zero": mutate("spec.decode.replicas", 0),
    "name-too-long": mutate("metadata.name", "n" * 48),
}


def pdd_validate(doc: dict[str, Any], tmp: Path) -> list[str]:
    path = tmp / "doc.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = subprocess.run([sys.executable, "-m", "pdd_cli.main", "validate", "-f", str(path)],
                         capture_output=True, text=True)
    assert out.returncode == 1, out
    prefix = f"{path}: document 1 ({doc['metadata']['name']}): "
    return [line[len(prefix):] for line in out.stderr.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("case", sorted(INVALID))
def test_webhook_rejects_with_pdd_validate_messages(case: str, kube: Kubectl,
                                                   operator: Operator, op_namespace: str,
                                                   tmp_path: Path) -> None:
    doc = INVALID[case]
    problems = pdd_validate(doc, tmp_path)
    assert problems
    out = kube.apply(doc, "-n", op_namespace, check=False)
    assert out.returncode != 0
    expected = ('admission webhook "validate.pddeployments.serving.pdd.dev" denied the request: '
                + "; ".join(problems))
    assert expected in out.stderr, out.stderr
    assert kube.maybe("get", "pddeployment", doc["metadata"]["name"], "-n", op_namespace) is None


def test_webhook_admits_valid_and_dry_runs(kube: Kubectl, operator: Operator,
                                           op_namespace: str) -> None:
    out = kube.apply(base(), "-n", op_namespace, "--dry-run=server")
    assert "(server dry run)" in out.stdout
    bad = kube.apply(INVALID["block-size"], "-n", op_namespace, "--dry-run=server", check=False)
    assert "spec.blockSize: must be a positive multiple of 16" in bad.stderr


def test_invalid_spec_that_reached_the_operator(cluster: Cluster, kube: Kubectl, no_cel: None,
                                                tmp_path: Path) -> None:
    ns = make_namespace(kube, "opinv")
    op = Operator(cluster, ns, tmp_path, webhook=False).start()
    try:
        name = base()["metadata"]["name"]
        kube.apply(base(), "-n", ns)
        wait_ready(kube, ns, name, op)
        before = {p["metadata"]["name"]: (p["metadata"]["uid"], p["metadata"]["resourceVersion"])
                  for p in pods_of(kube, ns, name)}
        cm_before = routing_cm(kube, ns, name)["data"]
        kube("patch", "pddeployment", name, "-n", ns, "--type=merge", "-p",
             json.dumps({"spec": {"decode": {"decodeContextParallelSize": 3}}}))
        message = ("spec.decode.decodeContextParallelSize: must be 1 or equal to "
                   "tensorParallelSize (4), got 3")

        def invalid() -> dict[str, Any] | None:
            obj = pdd(kube, ns, name)
            c = conditions(obj).get("Validated")
            gen = obj["metadata"]["generation"]
            return obj if c and c["status"] == "False" and c["observedGeneration"] == gen else None

        obj = wait_for("Validated=False", invalid)
        c = conditions(obj)
        assert c["Validated"]["reason"] == "InvalidSpec"
        assert message in c["Validated"]["message"]
        assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "InvalidSpec"
        assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
        warnings = [e for e in events_of(kube, ns, name) if e["reason"] == "InvalidSpec"]
        assert warnings and warnings[0]["type"] == "Warning"
        assert message in warnings[0]["message"]
        # Nothing was created, replaced or changed.
        after = {p["metadata"]["name"]: (p["metadata"]["uid"], p["metadata"]["resourceVersion"])
                 for p in pods_of(kube, ns, name)}
        assert after == before
        cms = kube.json("get", "configmaps", "-n", ns, "-l",
                        f"app.kubernetes.io/instance={name}")["items"]
        assert [c["data"] for c in cms] == [cm_before], "no new plan published"
        # Fixing the spec resumes normal service.
        kube("patch", "pddeployment", name, "-n", ns, "--type=merge", "-p",
             json.dumps({"spec": {"decode": {"decodeContextParallelSize": 4}}}))
        obj = wait_ready(kube, ns, name, op)
        assert conditions(obj)["Validated"]["status"] == "True"
    finally:
        teardown_namespace(kube, ns, op)


def test_webhook_certificate_is_renewed_at_two_thirds_of_its_life(
        cluster: Cluster, kube: Kubectl, no_cel: None, tmp_path: Path) -> None:
    import base64
    import socket
    import ssl
    import time

    from cryptography import x509

    ns = make_namespace(kube, "oprot")
    life = 30.0
    op = Operator(cluster, ns, tmp_path, env={"PDD_WEBHOOK_CERT_VALIDITY_SECONDS": str(life)})

    def served() -> bytes:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        with socket.create_connection(("127.0.0.1", op.webhook_port), timeout=5) as s:
            with ctx.wrap_socket(s) as tls:
                der = tls.getpeercert(binary_form=True)
                assert der is not None
                return der

    def ca_bundle() -> bytes:
        vwc = kube.json("get", "validatingwebhookconfiguration", op.webhook_config)
        return base64.b64decode(vwc["webhooks"][0]["clientConfig"]["caBundle"])

    try:
        op.start()
        first = served()
        started = time.monotonic()
        cert = x509.load_der_x509_certificate(first)
        life_s = (cert.not_valid_after_utc - cert.not_valid_before_utc).total_seconds()
        assert life_s < 2 * life, "the configured validity is used"
        new = wait_for("a renewed certificate served", lambda: (d := served()) != first and d,
                       timeout=3 * life)
        took = time.monotonic() - started
        # renewed at two thirds of its life (not at the start, not after it expired)
        assert life_s / 3 < took + 3 < life_s, (took, life_s)
        print(f"\nFIGURE webhook certificate ({life_s:.0f} s life) renewed after {took:.1f} s")
        # the API server trusts the new one: the caBundle holds the CA that signed it, and a
        # client verifying against the caBundle (as the API server does) completes TLS with
        # the name the configuration uses (not a kubectl apply: CEL, in a CRD other sessions
        # on this shared cluster may reinstall, could answer before the webhook)
        renewed = x509.load_der_x509_certificate(new)
        bundle = wait_for("the caBundle to carry the new CA", lambda: (
            (b := ca_bundle()) and _issuer_key(renewed, x509.load_pem_x509_certificates(b))
            and b), timeout=10)
        verify = ssl.create_default_context(cadata=bundle.decode())
        with socket.create_connection(("127.0.0.1", op.webhook_port), timeout=5) as s:
            with verify.wrap_socket(s, server_hostname="127.0.0.1") as tls:
                assert tls.getpeercert(binary_form=True) == new
    finally:
        teardown_namespace(kube, ns, op)


def _spki() -> tuple[Any, Any]:
    from cryptography.hazmat.primitives import serialization

    return serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo


def _issuer_key(cert: Any, cas: list[Any]) -> bytes:
    """The public key (PEM) of the CA in `cas` that signed `cert`, or b''."""
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
        except Exception:  # noqa: BLE001 - not this one
            continue
        return bytes(ca.public_key().public_bytes(*_spki()))
    return b""
