"""`python -m pdd_operator [--namespace NS ...] [--webhook-port P] ...` against KUBECONFIG (or the
in-cluster service account). Options override the PDD_* environment (see config.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from pdd_operator.config import CONFIG


def parse(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pdd_operator", description=__doc__)
    ap.add_argument("-n", "--namespace", action="append", default=None,
                    help="watch only this namespace (repeatable); default: all namespaces")
    ap.add_argument("--resync-seconds", type=float, default=None)
    ap.add_argument("--metrics-port", type=int, default=None, help="0 disables")
    ap.add_argument("--liveness-port", type=int, default=None, help="0 disables")
    ap.add_argument("--webhook-port", type=int, default=None, help="0 disables the webhook")
    ap.add_argument("--webhook-host", default=None,
                    help="host the API server uses to reach the webhook (URL mode)")
    ap.add_argument("--webhook-service", default=None,
                    help="NAMESPACE/NAME of the webhook Service (in-cluster mode)")
    ap.add_argument("--webhook-config-name", default=None)
    ap.add_argument("--tls-secret", default=None, help="NAMESPACE/NAME shared by replicas")
    ap.add_argument("--webhook-cert-dir", default=None,
                    help="serve tls.crt/tls.key from DIR, managed outside the operator "
                         "(cert-manager): no caBundle patch, no renewal")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="API requests in flight at most (default 64)")
    ap.add_argument("--peering", default=None, help="kopf peering name")
    ap.add_argument("--priority", type=int, default=None, help="peering priority")
    ap.add_argument("--standalone", action="store_true", help="no peering")
    ap.add_argument("--no-autoscaler", action="store_true",
                    help="do not run the autoscaling planner (PDD_AUTOSCALER=0)")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    cfg = CONFIG
    if args.namespace:
        cfg.namespaces = list(args.namespace)
    for attr in ("resync_seconds", "metrics_port", "liveness_port", "webhook_port",
                 "webhook_host", "webhook_service", "webhook_config_name", "tls_secret",
                 "priority", "concurrency", "webhook_cert_dir"):
        value = getattr(args, attr)
        if value is not None:
            setattr(cfg, attr, value)
    if args.peering:
        cfg.peering_name = args.peering
    cfg.standalone = cfg.standalone or args.standalone
    cfg.autoscaler = cfg.autoscaler and not args.no_autoscaler

    with _without_kubernetes_package():
        import kopf

        import pdd_operator.handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if not args.verbose:
        # kopf reports every handler call at INFO; the reconciler logs what matters.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    liveness = f"http://0.0.0.0:{cfg.liveness_port}/healthz" if cfg.liveness_port else None
    profile = os.environ.get("PDD_PROFILE")  # a path: cProfile stats written at exit
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    _small_tls_buffers()
    try:
        _run(kopf, cfg, liveness)
    finally:
        if profiler is not None and profile:
            profiler.disable()
            profiler.dump_stats(profile)
    return 0


TLS_READ_BUFFER = 32 * 1024


def _small_tls_buffers() -> None:
    """asyncio gives every TLS connection a 256 KiB read buffer, zeroed (so resident) when the
    connection opens. The operator opens up to --concurrency (64) connections to the API
    server when hundreds of PDDeployments arrive at once, kopf its own, and the API server more
    to the webhook: 16 MiB and more at the peak (bench/operator_scale.py). A TLS record holds
    16 KiB at most, so 32 KiB reads lose nothing that matters here."""
    from asyncio import sslproto

    sslproto.SSLProtocol.max_size = TLS_READ_BUFFER


@contextlib.contextmanager
def _without_kubernetes_package() -> Iterator[None]:
    """kopf imports the `kubernetes` package when it is installed (to accept its models as
    bodies, to log in through it): about 40 MiB of resident memory that this operator never
    uses (credentials.py). Hidden while kopf loads; importable later for the kubeconfigs that
    need it (exec plugins)."""
    if "kubernetes" in sys.modules:
        yield
        return
    sys.modules["kubernetes"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        del sys.modules["kubernetes"]


def _run(kopf: Any, cfg: Any, liveness: str | None) -> None:
    asyncio.run(kopf.operator(
        clusterwide=not cfg.namespaces,
        namespaces=cfg.namespaces,
        standalone=cfg.standalone,
        priority=cfg.priority,
        peering_name=cfg.peering_name,
        liveness_endpoint=liveness,
    ))


if __name__ == "__main__":
    sys.exit(main())
