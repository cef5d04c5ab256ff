"""kopf glue, kept thin: every handler feeds the reconciler and returns.

- PDDeployment events (create, update, the initial listing on resume) -> one pass for it;
- events of the objects it owns (pods, services, configmaps, the router), from the operator's
  own light watches (kube.Kube.watch) -> one pass for the owner, so a deleted pod comes back
  and a pod turning Ready updates status at once;
- a periodic pass (re-list, then one pass per PDDeployment), paused with kopf's peering;
- the validating webhook -> the same rules as `pdd validate`, served on its own thread
  (webhook_server.py), outside kopf;
- PDDRoleScale events, and PDDeployment events for the PDDRoleScales naming it -> the role's
  spec.<role>.replicas follows the PDDRoleScale, its status follows the role (role_scale.py).
kopf's peering pauses all of this in every replica but the leader (the parts outside kopf read
the peering object and follow the same rule).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import kopf

from pdd_api.models import API_GROUP, API_VERSION, KIND, PLURAL, ROLE_SCALE_KIND, ROLE_SCALE_PLURAL
from pdd_operator import credentials, metrics, role_scale
from pdd_operator.autoscaler import Autoscaler
from pdd_operator.builders import Scraper
from pdd_operator.config import CONFIG
from pdd_operator.kube import KINDS, ApiError, Kube, now_rfc3339
from pdd_operator.peering import paused
from pdd_operator.reconciler import Reconciler
from pdd_operator.tls_reload import server_context
from pdd_operator.webhook import (
    HANDLER_ID,
    ensure_webhook_configuration,
    prepare_tls,
    review,
    rotate_forever,
)
from pdd_operator.webhook_server import WebhookThread

log = logging.getLogger("pdd_operator")


class NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf deep-copies every event's body to diff it for on.create/on.update handlers. This
    operator has none (it is level-based: on.event, a periodic pass, a webhook), and the copies were
    the largest CPU cost at a few hundred PDDeployments (bench/operator_scale.py)."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        return {}


class _State:
    reconciler: Reconciler | None = None
    kube: Kube | None = None
    tasks: list[asyncio.Task[Any]] = []
    webhook: WebhookThread | None = None


STATE = _State()


def reconciler() -> Reconciler:
    if STATE.reconciler is None:
        raise kopf.TemporaryError("operator is starting", delay=1)
    return STATE.reconciler


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf logs in as the operator's own client does (credentials.py): its default login goes
    through the `kubernetes` package and would import it for nothing."""
    creds = credentials.load()
    if creds.via_client:
        return cast(kopf.ConnectionInfo | None, kopf.login_via_client(**kwargs))
    scheme, _, token = (creds.header() or "").partition(" ")
    return kopf.ConnectionInfo(
        server=creds.host, ca_path=creds.ca_file, ca_data=creds.ca_data,
        insecure=creds.insecure or None, certificate_path=creds.cert_file,
        certificate_data=creds.cert_data, private_key_path=creds.key_file,
        private_key_data=creds.key_data, scheme=scheme or None, token=token or None)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    cfg = CONFIG
    settings.posting.enabled = False  # the reconciler posts its own, meaningful events
    settings.persistence.finalizer = f"{API_GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = NoDiffBase(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    settings.peering.name = cfg.peering_name
    settings.peering.priority = cfg.priority
    settings.peering.standalone = cfg.standalone
    settings.peering.mandatory = False
    settings.peering.lifetime = cfg.peering_lifetime
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 4
    kube = Kube.from_environment(cfg.concurrency)
    STATE.kube = kube
    if not cfg.standalone:
        missing = await missing_peering_crd(kube, cfg.namespaces)
        if missing is not None:
            log.warning(
                "peering CRD %s is not installed: running standalone, so a second replica "
                "would act as well. To run several replicas (HA), apply "
                "manifests/base/kopf-peering.yaml (kopf's peering CRDs); --standalone "
                "silences this warning.", missing)
            cfg.standalone = True
            settings.peering.standalone = True
        else:
            await ensure_peering(kube, cfg.peering_name, cfg.namespaces)
    rec = Reconciler(kube, scraper=(Scraper(cfg.operator_namespace, cfg.operator_name)
                                    if cfg.operator_namespace else None))
    if rec.scraper is None:
        log.info("own namespace unknown (no PDD_OPERATOR_NAMESPACE, no service account): "
                 "NetworkPolicies admit no pod for the planner's scrapes")
    await rec.seed(cfg.namespaces or None)
    STATE.reconciler = rec
    loop = asyncio.get_running_loop()
    if not cfg.standalone:
        rec.paused = await peering_paused(kube, cfg)
        STATE.tasks.append(loop.create_task(peering_loop(rec, kube)))
    STATE.tasks.append(loop.create_task(periodic_loop(rec)))
    if cfg.autoscaler:
        STATE.tasks.append(loop.create_task(Autoscaler(rec, kube).run_forever()))
    STATE.tasks.append(loop.create_task(rec.watch_children(cfg.namespaces or None)))
    if cfg.webhook_port:
        tls = await prepare_tls(kube, cfg)
        # Its own thread and event loop (webhook_server.py): admission reviews never wait
        # behind the passes. A renewed certificate (rotate_forever's, or cert-manager's) is
        # loaded into the live context there.
        STATE.webhook = WebhookThread(
            cfg.webhook_addr, cfg.webhook_port, f"/{HANDLER_ID}",
            server_context(tls.certfile, tls.keyfile), tls.certfile, tls.keyfile,
            min(60.0, max(1.0, cfg.cert_validity_seconds / 30)), review).start()
        if tls.bundle is not None:
            await ensure_webhook_configuration(kube, cfg, tls.bundle.ca_pem)
            STATE.tasks.append(loop.create_task(
                rotate_forever(kube, cfg, tls.bundle, tls.certfile.parent)))
        else:
            log.info("webhook certificate from %s, managed outside the operator: the webhook "
                     "configuration and its caBundle are left to it (cert-manager cainjector)",
                     cfg.webhook_cert_dir)
    if cfg.metrics_port:
        metrics.serve(cfg.metrics_port)
    log.info("pdd-operator started: namespaces=%s priority=%s",
             cfg.namespaces or "all", cfg.priority)


async def missing_peering_crd(kube: Kube, namespaces: list[str]) -> str | None:
    """The peering CRD this mode needs when the API server does not serve it, else None."""
    kind = "KopfPeering" if namespaces else "ClusterKopfPeering"
    if await kube.serves(kind):
        return None
    return f"{KINDS[kind].plural}.kopf.dev"


async def ensure_peering(kube: Kube, name: str, namespaces: list[str]) -> None:
    """kopf pauses replicas only through an existing peering object; without one every
    replica would act, so the operator creates it (the CRDs come with the manifests)."""
    objs = [{"apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
             "metadata": {"name": name, "namespace": ns}} for ns in namespaces] or [
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}]
    for obj in objs:
        try:
            await kube.apply(obj)
        except ApiError as exc:
            log.warning("no peering object %s (%s): replicas will not exclude each other",
                        name, exc)


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    for task in STATE.tasks:
        task.cancel()
    if STATE.webhook is not None:
        STATE.webhook.stop()
    if STATE.kube is not None:
        await STATE.kube.close()


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
async def pddeployment_event(event: kopf.RawEvent, **_: Any) -> None:
    obj = cast(dict[str, Any], event["object"])
    rec = reconciler()
    deleted = event["type"] == "DELETED"
    echo = not deleted and is_echo(rec, obj)
    ns, name = rec.observe_pdd(obj, deleted=deleted)
    if not deleted and not echo:
        rec.kick(ns, name)
    for scale in rec.role_scales_in(ns, name):
        await sync_role_scale(rec, scale)


def is_echo(rec: Reconciler, obj: dict[str, Any]) -> bool:
    """The event shows the very version the operator holds already: the answer of its own
    status write (a pass's or the planner's), which it took when it wrote it. The writer has
    acted on everything it knew; a pass more would find nothing to do (one per status write
    and PDDeployment, hundreds at once when hundreds are created)."""
    meta = obj.get("metadata") or {}
    held = rec.pdds.get((str(meta.get("namespace")), str(meta.get("name"))))
    if held is None or not meta.get("resourceVersion"):
        return False
    return bool(held["metadata"].get("uid") == meta.get("uid")
                and held["metadata"].get("resourceVersion") == meta["resourceVersion"])


@kopf.on.event(API_GROUP, API_VERSION, ROLE_SCALE_PLURAL)
async def role_scale_event(event: kopf.RawEvent, **_: Any) -> None:
    obj = cast(dict[str, Any], event["object"])
    rec = reconciler()
    meta = obj["metadata"]
    key = (meta["namespace"], meta["name"])
    target = (obj.get("spec") or {}).get("deployment", "")
    if event["type"] == "DELETED":
        rec.role_scales.pop(key, None)
        # The next PDDRoleScale of that role, if any, takes over.
        for scale in rec.role_scales_in(key[0], target):
            await sync_role_scale(rec, scale)
    else:
        rec.role_scales[key] = obj
        await sync_role_scale(rec, obj)
    # The role's owner, replicas and conflicts may have changed: a pass rebuilds them.
    if (key[0], target) in rec.pdds:
        rec.kick(key[0], target)


async def sync_role_scale(rec: Reconciler, scale: dict[str, Any]) -> None:
    """Write what role_scale.sync says; a refused PDDeployment patch goes into the status with
    the API server's words. Errors are logged: the next event or pass retries."""
    ns, own = scale["metadata"]["namespace"], scale["metadata"]["name"]
    spec = scale.get("spec") or {}
    name, role = spec.get("deployment", ""), spec.get("role", "")
    result = role_scale.sync(scale, rec.pdds.get((ns, name)), rec.role_scales_in(ns),
                             rec.writers.get((ns, name), {}).get(role), now_rfc3339())
    status = result.status
    try:
        if result.fill_replicas is not None:
            await rec.kube.patch(ROLE_SCALE_KIND, ns, own,
                                 {"spec": {"replicas": result.fill_replicas}})
        if result.deployment_patch is not None:
            try:
                await rec.kube.patch(KIND, ns, name, result.deployment_patch)
            except ApiError as exc:
                if exc.status >= 500:
                    raise
                status = role_scale.refused(result, name, role, spec.get("replicas"),
                                            exc.message,
                                            (scale.get("status") or {}).get("appliedReplicas"))
        if role_scale.status_changed(scale, status):
            await rec.kube.patch_status(ROLE_SCALE_KIND, ns, own, status)
    except ApiError as exc:
        log.warning("%s %s/%s: %s", ROLE_SCALE_KIND, ns, own, exc)


async def periodic_loop(rec: Reconciler) -> None:
    """The periodic pass: re-list every owned object, then one pass per PDDeployment, so an
    event missed by a watch costs at most one period, and the PDDRoleScales again (a write
    that failed is retried). Skipped while peering pauses us."""
    while True:
        await asyncio.sleep(CONFIG.resync_seconds)
        try:
            if not rec.paused:
                await rec.resync_all()
                for scale in list(rec.role_scales.values()):
                    await sync_role_scale(rec, scale)
        except Exception as exc:  # noqa: BLE001 - the next period retries
            log.warning("periodic resync failed: %s", exc)


async def peering_loop(rec: Reconciler, kube: Kube, period: float = 5.0) -> None:
    """kopf pauses its own watches; the child watches and the periodic pass run outside kopf
    and follow the same verdict, read from the peering object."""
    while True:
        try:
            now_paused = await peering_paused(kube, CONFIG)
            if now_paused != rec.paused:
                log.info("peering: %s", "pausing" if now_paused else "resuming")
            rec.paused = now_paused
        except Exception as exc:  # noqa: BLE001 - keep the last verdict, retry
            log.warning("peering check failed: %s", exc)
        await asyncio.sleep(period)


async def peering_paused(kube: Kube, cfg: Any) -> bool:
    if cfg.namespaces:
        objs = [await kube.get("KopfPeering", ns, cfg.peering_name) for ns in cfg.namespaces]
    else:
        objs = [await kube.get("ClusterKopfPeering", None, cfg.peering_name)]
    return any(paused((o or {}).get("status"), cfg.priority) for o in objs)
