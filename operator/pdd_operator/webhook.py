"""Admission: the same rules and messages as `pdd validate`, plus what CEL cannot check
(metadata.name must leave room for `-prefill-<i>` in a DNS label).

Every spec field may change: a change that needs new pods rolls them (rollout policy), so there is
no field to freeze. An update that leaves the spec alone (finalizers, labels, status) is always
admitted, so an invalid object that slipped in without the webhook can still be deleted.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import logging
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdd_api.models import API_GROUP, API_VERSION, PLURAL
from pdd_api.validation import validate_document
from pdd_operator.builders import is_subset
from pdd_operator.certs import TlsBundle, make_bundle, renew_at
from pdd_operator.config import Config
from pdd_operator.kube import ApiError, Kube, path_of

log = logging.getLogger("pdd_operator.webhook")
HANDLER_ID = "validate"


def admission_problems(new: Mapping[str, Any], old: Mapping[str, Any] | None) -> list[str]:
    if old is not None and old.get("spec") == new.get("spec"):
        return []
    return validate_document(new)


def review(request: Mapping[str, Any]) -> dict[str, Any]:
    """The AdmissionReview answer to an AdmissionReview request (admission.k8s.io/v1): refused
    with HTTP 422 and the problems joined by "; " (the API server shows them after `admission
    webhook "validate.pddeployments.serving.pdd.dev" denied the request: `)."""
    req = request.get("request") or {}
    new = req.get("object")
    old = req.get("oldObject")
    problems = (admission_problems(new, old if isinstance(old, Mapping) else None)
                if isinstance(new, Mapping) else [])
    response: dict[str, Any] = {"uid": req.get("uid", ""), "allowed": not problems}
    if problems:
        response["status"] = {"code": 422, "message": "; ".join(problems)}
    return {"apiVersion": request.get("apiVersion", "admission.k8s.io/v1"),
            "kind": "AdmissionReview", "response": response}


def webhook_hosts(cfg: Config) -> list[str]:
    if cfg.webhook_service:
        ns, name = cfg.webhook_service.split("/", 1)
        return [f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local", f"{name}.{ns}", name]
    return [cfg.webhook_host, "localhost", "127.0.0.1"]


def webhook_configuration(cfg: Config, ca_pem: bytes) -> dict[str, Any]:
    client: dict[str, Any] = {"caBundle": base64.b64encode(ca_pem).decode()}
    if cfg.webhook_service:
        ns, name = cfg.webhook_service.split("/", 1)
        client["service"] = {"namespace": ns, "name": name, "port": cfg.webhook_port,
                             "path": f"/{HANDLER_ID}"}
    else:
        client["url"] = f"https://{cfg.webhook_host}:{cfg.webhook_port}/{HANDLER_ID}"
    hook: dict[str, Any] = {
        "name": f"validate.{PLURAL}.{API_GROUP}",
        "clientConfig": client,
        "rules": [{
            "apiGroups": [API_GROUP], "apiVersions": [API_VERSION], "resources": [PLURAL],
            "operations": ["CREATE", "UPDATE"], "scope": "Namespaced",
        }],
        "failurePolicy": "Fail",
        "matchPolicy": "Equivalent",
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "timeoutSeconds": 10,
    }
    if cfg.namespaces:
        hook["namespaceSelector"] = {"matchExpressions": [{
            "key": "kubernetes.io/metadata.name", "operator": "In",
            "values": sorted(cfg.namespaces),
        }]}
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": cfg.webhook_config_name,
                     "labels": {"app.kubernetes.io/name": "pdd-operator"}},
        "webhooks": [hook],
    }


async def ensure_webhook_configuration(kube: Kube, cfg: Config, ca_pem: bytes) -> None:
    """Fill in the webhook configuration the manifests ship (empty, so nothing calls a webhook
    before an operator serves it): the operator's RBAC allows get and patch of that one object
    and no create. A local run without the manifests (URL mode) creates its own."""
    desired = webhook_configuration(cfg, ca_pem)
    name = cfg.webhook_config_name
    path = path_of("ValidatingWebhookConfiguration", None, name)
    have = await kube.get("ValidatingWebhookConfiguration", None, name)
    if have is None:
        try:
            await kube.create(desired)
            return
        except ApiError as exc:
            if exc.status != 409:
                raise
            have = await kube.get("ValidatingWebhookConfiguration", None, name)
    if have is not None and is_subset(desired["webhooks"], have.get("webhooks") or []):
        return
    # JSON merge patch replaces the list: exactly our one webhook, whatever was there.
    await kube.request("PATCH", path, body={"webhooks": desired["webhooks"]},
                       content_type="application/merge-patch+json")


def _validity(cfg: Config) -> datetime.timedelta:
    return datetime.timedelta(seconds=cfg.cert_validity_seconds)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


async def ensure_tls(kube: Kube, cfg: Config, renew: bool = False) -> TlsBundle:
    """One certificate for all replicas when a Secret is configured (the caBundle must match
    whichever replica the Service picks), else a fresh one for this process. `renew`: the
    Secret's certificate is replaced unless another replica already renewed it."""
    if not cfg.tls_secret:
        return make_bundle(webhook_hosts(cfg), validity=_validity(cfg))
    ns, name = cfg.tls_secret.split("/", 1)
    for _ in range(3):
        found = await kube.get("Secret", ns, name)
        data = (found or {}).get("data") or {}
        if all(k in data for k in ("ca.crt", "tls.crt", "tls.key")):
            stored = TlsBundle(*(base64.b64decode(data[k]) for k in ("ca.crt", "tls.crt",
                                                                      "tls.key")))
            if not renew or renew_at(stored.cert_pem) > _now():
                return stored
        bundle = make_bundle(webhook_hosts(cfg), validity=_validity(cfg))
        secret = {
            "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": name, "namespace": ns},
            "data": {k: base64.b64encode(v).decode() for k, v in (
                ("ca.crt", bundle.ca_pem), ("tls.crt", bundle.cert_pem),
                ("tls.key", bundle.key_pem))},
        }
        try:
            if found is None:
                await kube.create(secret)
            else:
                await kube.apply(secret)
            return bundle
        except ApiError as exc:
            if exc.status != 409:
                raise
    raise RuntimeError(f"could not create or read the TLS secret {cfg.tls_secret}")


@dataclass(frozen=True)
class WebhookTls:
    """What the webhook server serves. `bundle` is None when the certificate is managed
    outside the operator (cert-manager): nothing to patch, nothing to renew here."""

    certfile: Path
    keyfile: Path
    ca_pem: bytes | None
    bundle: TlsBundle | None


async def prepare_tls(kube: Kube, cfg: Config) -> WebhookTls:
    if cfg.webhook_cert_dir:
        directory = Path(cfg.webhook_cert_dir)
        certfile, keyfile, cafile = (directory / n for n in ("tls.crt", "tls.key", "ca.crt"))
        missing = [str(f) for f in (certfile, keyfile) if not f.is_file()]
        if missing:
            raise RuntimeError(f"webhook certificate directory {directory} (--webhook-cert-dir)"
                               f" lacks {', '.join(missing)}: mount the Certificate's Secret")
        return WebhookTls(certfile, keyfile,
                          cafile.read_bytes() if cafile.is_file() else None, None)
    bundle = await ensure_tls(kube, cfg)
    certfile, keyfile = write_tls(bundle)
    return WebhookTls(certfile, keyfile, bundle.ca_pem, bundle)


def write_tls(bundle: TlsBundle, directory: Path | None = None) -> tuple[Path, Path]:
    return bundle.write(directory or Path(tempfile.mkdtemp(prefix="pdd-webhook-")))


async def rotate_forever(kube: Kube, cfg: Config, bundle: TlsBundle, directory: Path) -> None:
    """Renew the webhook certificate at two thirds of its life. The new files replace the
    old in place (tls_reload loads them into the live context); the caBundle carries the new CA
    and the previous one until the next renewal, so a replica still serving the previous
    certificate (it adopts the new one from the shared Secret at its own renewal time) is
    trusted meanwhile."""
    current = bundle
    while True:
        wait = (renew_at(current.cert_pem) - _now()).total_seconds()
        await asyncio.sleep(max(1.0, wait))
        try:
            fresh = await ensure_tls(kube, cfg, renew=True)
            if fresh.cert_pem == current.cert_pem:
                continue
            await ensure_webhook_configuration(kube, cfg, fresh.ca_pem + current.ca_pem)
            write_tls(fresh, directory)
            log.info("webhook certificate renewed; next renewal at %s",
                     renew_at(fresh.cert_pem).isoformat())
            current = fresh
        except Exception as exc:  # noqa: BLE001 - a third of the life is left to retry
            log.warning("webhook certificate renewal failed, retrying: %s", exc)
            await asyncio.sleep(min(30.0, max(1.0, cfg.cert_validity_seconds / 30)))
