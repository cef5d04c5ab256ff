"""Operator settings: command line (python -m pdd_operator) or environment (kopf run -m ...)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from pdd_api.keys import OPERATOR_APP_NAME
from pdd_api.models import API_GROUP
from pdd_operator.credentials import SA_DIR


def _own_namespace() -> str | None:
    """The namespace this operator runs in: PDD_OPERATOR_NAMESPACE (the chart and the kustomize
    base set it from the downward API), else the in-cluster service account's; None outside a
    cluster."""
    if ns := os.environ.get("PDD_OPERATOR_NAMESPACE"):
        return ns
    try:
        return (SA_DIR / "namespace").read_text().strip() or None
    except OSError:
        return None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw else default


@dataclass
class Config:
    namespaces: list[str] = field(default_factory=list)  # empty: all namespaces
    resync_seconds: float = 30.0
    metrics_port: int = 8080
    liveness_port: int = 8081
    webhook_port: int = 9443  # 0: no webhook
    webhook_addr: str = "0.0.0.0"
    webhook_host: str = "127.0.0.1"  # how the API server reaches the webhook (URL mode)
    webhook_service: str | None = None  # "<namespace>/<name>": in-cluster Service mode
    webhook_config_name: str = f"pdd-operator.{API_GROUP}"
    tls_secret: str | None = None  # "<namespace>/<name>": share one certificate across replicas
    peering_name: str = "pdd-operator"
    priority: int = field(default_factory=lambda: random.randint(1, 1_000_000))
    standalone: bool = False
    peering_lifetime: int = 60  # seconds a silent peer is still taken as alive
    concurrency: int = 64
    cert_validity_seconds: float = 365 * 86400.0  # webhook certificate; renewed at 2/3
    # A directory holding tls.crt, tls.key (and ca.crt) managed outside the operator, e.g. a
    # cert-manager Certificate's Secret with cainjector filling the caBundle: the operator
    # then serves those files and neither patches the webhook configuration nor renews.
    webhook_cert_dir: str | None = None
    # The autoscaling planner's loop (spec.autoscaling); off: every role's replicas come from
    # spec, whatever spec.autoscaling says (a platform that scales with HPA/KEDA only).
    autoscaler: bool = True
    # The data-plane NetworkPolicy admits the planner's scrapes only from pods labelled
    # app.kubernetes.io/name=operator_name in operator_namespace; None (an operator outside the
    # cluster): from no pod.
    operator_namespace: str | None = None
    operator_name: str = OPERATOR_APP_NAME

    @classmethod
    def from_env(cls) -> Config:
        ns = [n for n in os.environ.get("PDD_NAMESPACES", "").split(",") if n]
        cfg = cls(namespaces=ns)
        cfg.resync_seconds = float(os.environ.get("PDD_RESYNC_SECONDS", cfg.resync_seconds))
        cfg.metrics_port = _env_int("PDD_METRICS_PORT", cfg.metrics_port)
        cfg.liveness_port = _env_int("PDD_LIVENESS_PORT", cfg.liveness_port)
        cfg.webhook_port = _env_int("PDD_WEBHOOK_PORT", cfg.webhook_port)
        cfg.webhook_host = os.environ.get("PDD_WEBHOOK_HOST", cfg.webhook_host)
        cfg.webhook_service = os.environ.get("PDD_WEBHOOK_SERVICE") or None
        cfg.webhook_config_name = os.environ.get("PDD_WEBHOOK_CONFIG", cfg.webhook_config_name)
        cfg.tls_secret = os.environ.get("PDD_TLS_SECRET") or None
        cfg.peering_name = os.environ.get("PDD_PEERING", cfg.peering_name)
        if os.environ.get("PDD_PRIORITY"):
            cfg.priority = int(os.environ["PDD_PRIORITY"])
        cfg.standalone = os.environ.get("PDD_STANDALONE", "") in ("1", "true")
        cfg.peering_lifetime = _env_int("PDD_PEERING_LIFETIME", cfg.peering_lifetime)
        cfg.concurrency = _env_int("PDD_CONCURRENCY", cfg.concurrency)
        cfg.cert_validity_seconds = float(os.environ.get("PDD_WEBHOOK_CERT_VALIDITY_SECONDS")
                                          or cfg.cert_validity_seconds)
        cfg.webhook_cert_dir = os.environ.get("PDD_WEBHOOK_CERT_DIR") or None
        cfg.autoscaler = os.environ.get("PDD_AUTOSCALER", "1") not in ("0", "false")
        cfg.operator_namespace = _own_namespace()
        cfg.operator_name = os.environ.get("PDD_OPERATOR_NAME") or cfg.operator_name
        return cfg


CONFIG = Config.from_env()
