"""The operator's only door to the API server: a small async REST client on aiohttp.

Why not the `kubernetes` package's client: it is synchronous (a thread per call) and turns every
response into model objects, which costs more CPU than the whole reconcile on a 2-core box with
hundreds of objects. Writes are server-side apply (idempotent: the same desired object applied
twice is a no-op, applied after a crash converges) and deletes carry a uid precondition (a pod
replaced between our read and our write is never deleted by mistake).
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime
import heapq
import itertools
import json
import logging
import os
import ssl
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdd_api import keys
from pdd_api.models import API_GROUP, API_VERSION, KIND, PLURAL, ROLE_SCALE_KIND, ROLE_SCALE_PLURAL
from pdd_operator import credentials

log = logging.getLogger("pdd_operator.kube")

Obj = dict[str, Any]
RETRY_STATUSES = {409, 429, 500, 502, 503, 504}
LIST_PAGE = 100  # objects per LIST answer (the pager's limit)


@dataclass(frozen=True)
class Kind:
    prefix: str
    plural: str
    namespaced: bool = True


KINDS: dict[str, Kind] = {
    "Pod": Kind("/api/v1", "pods"),
    "Service": Kind("/api/v1", "services"),
    "ConfigMap": Kind("/api/v1", "configmaps"),
    "Event": Kind("/api/v1", "events"),
    "Secret": Kind("/api/v1", "secrets"),
    "Namespace": Kind("/api/v1", "namespaces", namespaced=False),
    "Node": Kind("/api/v1", "nodes", namespaced=False),
    "Deployment": Kind("/apis/apps/v1", "deployments"),
    "NetworkPolicy": Kind("/apis/networking.k8s.io/v1", "networkpolicies"),
    "LeaderWorkerSet": Kind("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    KIND: Kind(f"/apis/{API_GROUP}/{API_VERSION}", PLURAL),
    ROLE_SCALE_KIND: Kind(f"/apis/{API_GROUP}/{API_VERSION}", ROLE_SCALE_PLURAL),
    "ClusterKopfPeering": Kind("/apis/kopf.dev/v1", "clusterkopfpeerings", namespaced=False),
    "KopfPeering": Kind("/apis/kopf.dev/v1", "kopfpeerings"),
    "ValidatingWebhookConfiguration": Kind(
        "/apis/admissionregistration.k8s.io/v1", "validatingwebhookconfigurations", False
    ),
}


# Listed and watched as metadata only: the operator needs to know that its Secrets exist, never
# what they hold, so key bytes never pass through its memory after creation.
METADATA_ONLY = frozenset({"Secret"})
_PARTIAL = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
_PARTIAL_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


def _as_kind(obj: Obj, kind: str, api_version: str) -> Obj:
    """Stamp kind/apiVersion (metadata-only answers say PartialObjectMetadata)."""
    if kind in METADATA_ONLY:
        obj["kind"], obj["apiVersion"] = kind, api_version
    else:
        obj.setdefault("kind", kind)
        obj.setdefault("apiVersion", api_version)
    return obj


def _api_version(kind: str) -> str:
    return KINDS[kind].prefix.removeprefix("/api/").removeprefix("/apis/")


class _WatchExpired(Exception):
    """410 Gone: the resourceVersion is too old; list again."""


class ApiError(Exception):
    def __init__(self, status: int, body: Any, method: str | None = None,
                 path: str | None = None) -> None:
        self.status = status
        self.body = body
        self.method = method
        self.path = path
        message = body.get("message") if isinstance(body, dict) else str(body)
        where = f" {method} {path}" if method and path else ""
        super().__init__(f"HTTP {status}{where}: {message}")

    @property
    def message(self) -> str:
        """The API server's own words (a webhook's or CEL's refusal), else the whole error."""
        if isinstance(self.body, dict) and self.body.get("message"):
            return str(self.body["message"])
        return str(self)

    @property
    def reason(self) -> str:
        """The API's machine-readable reason (Forbidden, Invalid, AlreadyExists, ...)."""
        return str(self.body.get("reason") or "") if isinstance(self.body, dict) else ""


def parse_answer(status: int, method: str, path: str, text: str) -> Any:
    """JSON of an API answer. Anything else (a proxy's HTML page, the API server's plain-text
    `404 page not found` for a group that is not installed) is an ApiError naming the status,
    method and path, never a JSONDecodeError from deep inside a pass."""
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        snippet = " ".join(text.split())[:200]
        raise ApiError(status, f"non-JSON answer: {snippet!r}", method, path) from None


# The pass (reconciler.Reconciler.run) a request is made for, in the order passes started.
PASS_ORDER: contextvars.ContextVar[int | None] = contextvars.ContextVar("pass_order",
                                                                       default=None)
_PASSES = itertools.count(1)


def start_pass() -> None:
    """Numbers the current task's pass (tasks it starts inherit the number): see PriorityGate."""
    PASS_ORDER.set(next(_PASSES))


class PriorityGate:
    """At most `slots` requests in flight; a waiting request of lower `priority` value goes
    first. When hundreds of PDDeployments arrive at once the API server is the bottleneck, and
    pods are what users wait for: they pass before Services, status and events.

    Within a priority, requests go in the order their passes started, not in arrival order: a
    pass writes its status only once all its writes are done, and hundreds of first passes
    whose writes took turns all finished together at the end of the queue (Ready=True ~20 s
    after the pods at 200 PDDeployments). Taken pass by pass, the first finish first.

    Going first at the gate is not enough: once in flight, a Service or a status patch takes
    the API server's time as a pod does, and a burst of first passes keeps it saturated. While
    any pod request waits or is in flight, at most `beside_pods` other requests are in flight
    (the rest wait for the pods), so pods are created at the pace of creating pods alone."""

    def __init__(self, slots: int, beside_pods: int | None = None) -> None:
        self.free = slots
        self.beside_pods = max(1, slots // 8) if beside_pods is None else beside_pods
        self.pods = 0  # pod requests waiting or in flight
        self.others = 0  # other requests in flight
        self._waiters: list[tuple[int, int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def _allowed(self, priority: int) -> bool:
        return priority == PRIORITY_POD or self.pods == 0 or self.others < self.beside_pods

    def _take(self, priority: int) -> None:
        self.free -= 1
        if priority != PRIORITY_POD:
            self.others += 1

    async def acquire(self, priority: int) -> None:
        if priority == PRIORITY_POD:
            self.pods += 1
        if self.free > 0 and not self._waiters and self._allowed(priority):
            self._take(priority)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        seq = next(self._seq)
        order = PASS_ORDER.get()
        # Outside a pass (autoscaler, peering): as if a pass started now.
        heapq.heappush(self._waiters, (priority, next(_PASSES) if order is None else order,
                                       seq, fut))
        self._wake()  # a pod may pass others held back beside the free slots
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(priority)  # woken and cancelled at once: pass the slot on
            else:
                if priority == PRIORITY_POD:
                    self.pods -= 1
                self._wake()
            raise

    def release(self, priority: int) -> None:
        """Gives back a slot taken by acquire(priority)."""
        self.free += 1
        if priority == PRIORITY_POD:
            self.pods -= 1
        else:
            self.others -= 1
        self._wake()

    def _wake(self) -> None:
        # Pods sort first: a head that may not go means no pod waits behind it.
        while self.free > 0 and self._waiters:
            priority, *_, fut = self._waiters[0]
            if fut.done():
                heapq.heappop(self._waiters)
                continue
            if not self._allowed(priority):
                return
            heapq.heappop(self._waiters)
            self._take(priority)
            fut.set_result(None)


# Status before other objects: one small write per pass, and the one users wait on once the
# pods are up (a pass's Services and NetworkPolicies never wait on it for long).
PRIORITY_POD, PRIORITY_STATUS, PRIORITY_OBJECT, PRIORITY_EVENT = 0, 1, 2, 3


class FaultInjector:
    """PDD_FAULT_EXIT_AFTER_WRITES=N: the process dies (no cleanup) after N writes. Tests use
    it to stop the operator in the middle of a reconcile, deterministically."""

    def __init__(self) -> None:
        raw = os.environ.get("PDD_FAULT_EXIT_AFTER_WRITES")
        self.left = int(raw) if raw else None

    def wrote(self) -> None:
        if self.left is None:
            return
        self.left -= 1
        if self.left <= 0:
            log.error("fault injection: exiting after the configured number of writes")
            os._exit(17)


def path_of(kind: str, namespace: str | None, name: str | None = None,
            sub: str | None = None) -> str:
    k = KINDS[kind]
    p = k.prefix
    if k.namespaced and namespace:
        p += f"/namespaces/{namespace}"
    p += f"/{k.plural}"
    if name:
        p += f"/{name}"
    if sub:
        p += f"/{sub}"
    return p


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Kube:
    def __init__(self, host: str, ssl_ctx: ssl.SSLContext | bool, auth: Any = None,
                 concurrency: int = 64) -> None:
        self.host = host.rstrip("/")
        self._ssl = ssl_ctx
        self._auth = auth  # callable -> header value, or None
        self._concurrency = concurrency
        self._session: aiohttp.ClientSession | None = None
        self._watch_session: aiohttp.ClientSession | None = None
        self.fault = FaultInjector()
        self.writes = 0
        self.gate = PriorityGate(concurrency)
        # (namespace, name, uid, type, reason) -> (Event name, count): repeats aggregate.
        self._events: dict[tuple[str, str, str, str, str], tuple[str, int]] = {}
        self._event_locks: dict[tuple[str, str, str, str, str], asyncio.Lock] = {}

    @classmethod
    def from_environment(cls, concurrency: int = 64, kubeconfig: str | None = None) -> Kube:
        """In-cluster service account when there is one, else KUBECONFIG (as kubectl does)."""
        creds = credentials.load(kubeconfig)
        return cls(creds.host, creds.ssl_context(), creds.header, concurrency)

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            conn = aiohttp.TCPConnector(limit=self._concurrency, ssl=self._ssl)
            self._session = aiohttp.ClientSession(
                connector=conn, timeout=aiohttp.ClientTimeout(total=60)
            )
        return self._session

    async def close(self) -> None:
        for session in (self._session, self._watch_session):
            if session is not None:
                await session.close()

    async def watch(self, kind: str, namespace: str | None, selector: str,
                    handle: Callable[[str, Obj], None],
                    keep: Callable[[Obj], Obj] | None = None) -> None:
        """List, then watch from the list's resourceVersion, forever; a broken or expired
        watch (410 Gone) lists again. `handle(type, obj)` sees ADDED/MODIFIED/DELETED, and
        every listed object as ADDED. Cheaper per event than kopf's machinery, which matters
        for the pods of hundreds of PDDeployments."""
        if self._watch_session is None or self._watch_session.closed:
            self._watch_session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ssl=self._ssl),
                timeout=aiohttp.ClientTimeout(total=None, sock_read=400),
                read_bufsize=2**20,
            )
        while True:
            try:
                items, rv = await self.list_rv(kind, namespace, selector, keep=keep)
                for item in items:
                    handle("ADDED", item)
                while True:
                    rv = await self._watch_once(kind, namespace, selector, rv, handle)
            except _WatchExpired:
                continue
            except (TimeoutError, aiohttp.ClientError, ConnectionError, ApiError) as exc:
                log.warning("watch of %s failed, listing again: %s", kind, exc)
                await asyncio.sleep(1)

    async def _watch_once(self, kind: str, namespace: str | None, selector: str,
                          rv: str | None, handle: Callable[[str, Obj], None]) -> str | None:
        assert self._watch_session is not None
        params = {"watch": "1", "allowWatchBookmarks": "true", "timeoutSeconds": "300",
                  "labelSelector": selector}
        if rv is not None:
            params["resourceVersion"] = rv
        headers = {"Accept": _PARTIAL if kind in METADATA_ONLY else "application/json"}
        token = self._auth() if self._auth else None
        if token:
            headers["Authorization"] = token
        api_version = _api_version(kind)
        async with self._watch_session.get(self.host + path_of(kind, namespace),
                                           params=params, headers=headers) as resp:
            if resp.status >= 400:
                where = path_of(kind, namespace)
                body = parse_answer(resp.status, "GET", where, await resp.text())
                raise ApiError(resp.status, body, "GET", where)
            async for line in resp.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                etype = event.get("type")
                if etype == "ERROR":
                    if obj.get("code") == 410:
                        raise _WatchExpired()
                    raise ApiError(int(obj.get("code") or 0), obj)
                raw = (obj.get("metadata") or {}).get("resourceVersion")
                if raw:
                    rv = str(raw)  # opaque: passed back as it came
                if etype == "BOOKMARK":
                    continue
                handle(str(etype), _as_kind(obj, kind, api_version))
        return rv

    async def request(self, method: str, path: str, *, params: Mapping[str, str] | None = None,
                      body: Any = None, content_type: str = "application/json",
                      retries: int = 5, priority: int = PRIORITY_OBJECT,
                      accept: str = "application/json") -> Any:
        await self.gate.acquire(priority)
        try:
            return await self._request(method, path, params=params, body=body,
                                       content_type=content_type, retries=retries,
                                       accept=accept)
        finally:
            self.gate.release(priority)

    async def _request(self, method: str, path: str, *, params: Mapping[str, str] | None,
                       body: Any, content_type: str, retries: int, accept: str) -> Any:
        headers = {"Accept": accept}
        if body is not None:
            headers["Content-Type"] = content_type
        token = self._auth() if self._auth else None
        if token:
            headers["Authorization"] = token
        data = json.dumps(body) if body is not None else None
        delay = 0.1
        for attempt in range(retries + 1):
            try:
                session = await self.session()
                async with session.request(method, self.host + path, params=params,
                                           data=data, headers=headers) as resp:
                    text = await resp.text()
                    try:
                        payload = parse_answer(resp.status, method, path, text)
                    except ApiError as bad:
                        if resp.status < 400:
                            raise
                        payload = bad.body
                    if resp.status < 400:
                        if method != "GET":
                            self.writes += 1
                            self.fault.wrote()
                        return payload
                    err = ApiError(resp.status, payload, method, path)
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
                err = ApiError(0, str(exc), method, path)
            retryable = err.status in RETRY_STATUSES or err.status == 0
            # A 409 on a precondition or a create is an answer, not a transient: the caller
            # re-reads.
            if err.status == 409 and method in ("DELETE", "POST"):
                retryable = False
            if not retryable or attempt == retries:
                raise err
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        raise AssertionError("unreachable")

    async def get(self, kind: str, namespace: str | None, name: str, *,
                  metadata_only: bool = False) -> Obj | None:
        try:
            out = await self.request("GET", path_of(kind, namespace, name),
                                     accept=_PARTIAL if metadata_only else "application/json")
            if metadata_only and out is not None:
                out = _as_kind(out, kind, _api_version(kind)) if kind in METADATA_ONLY else {
                    **out, "kind": kind, "apiVersion": _api_version(kind)}
            return out  # type: ignore[no-any-return]
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def serves(self, kind: str) -> bool:
        """Whether the API server serves `kind` (its group is installed and lists it): the
        discovery document every client may read, no RBAC on CRDs needed."""
        k = KINDS[kind]
        try:
            doc = await self.request("GET", k.prefix, retries=2)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == k.plural for r in (doc or {}).get("resources") or [])

    async def list_objects(self, kind: str, namespace: str | None = None,
                           selector: str | None = None, *, metadata_only: bool = False,
                           keep: Callable[[Obj], Obj] | None = None) -> list[Obj]:
        return (await self.list_rv(kind, namespace, selector, metadata_only=metadata_only,
                                   keep=keep))[0]

    async def list_rv(self, kind: str, namespace: str | None = None,
                      selector: str | None = None, *, metadata_only: bool = False,
                      keep: Callable[[Obj], Obj] | None = None) -> tuple[list[Obj], str | None]:
        """Items and the list's resourceVersion (the snapshot they describe).

        Read in pages of LIST_PAGE objects, each page's items passed through `keep` (the
        store's `lean`) before the next is asked for: one answer of every pod of hundreds of
        PDDeployments, parsed at once, was the operator's peak memory. A continue token that
        expired (410) starts the list over, as client-go's pager does."""
        base = {"labelSelector": selector} if selector else {}
        accept = _PARTIAL_LIST if metadata_only or kind in METADATA_ONLY else "application/json"
        api_version = _api_version(kind)
        items: list[Obj] = []
        token = ""
        while True:
            params = {**base, "limit": str(LIST_PAGE)}
            if token:
                params["continue"] = token
            try:
                out = await self.request("GET", path_of(kind, namespace), params=params,
                                         accept=accept)
            except ApiError as exc:
                if exc.status != 410 or not token:
                    raise
                items, token = [], ""
                continue
            page: list[Obj] = out.get("items") or []  # metadata-only lists say null when empty
            for item in page:
                item = _as_kind(item, kind, api_version)
                items.append(keep(item) if keep is not None else item)
            meta = out.get("metadata") or {}
            del out, page  # the page's parsed answer, before the next is asked for
            token = str(meta.get("continue") or "")
            if not token:
                raw_rv = meta.get("resourceVersion")
                return items, str(raw_rv) if raw_rv else None

    async def create(self, obj: Obj) -> Obj:
        meta = obj["metadata"]
        out: Obj = await self.request("POST", path_of(obj["kind"], meta.get("namespace")),
                                      params={"fieldManager": keys.FIELD_MANAGER}, body=obj,
                                      retries=2, priority=PRIORITY_POD if obj["kind"] == "Pod"
                                      else PRIORITY_OBJECT)
        return out

    async def apply(self, obj: Obj) -> Obj:
        """Server-side apply with force: the operator owns the fields it sets, so a manual edit
        of one of them (by kubectl edit, another manager) is taken back."""
        meta = obj["metadata"]
        path = path_of(obj["kind"], meta.get("namespace"), meta["name"])
        params = {"fieldManager": keys.FIELD_MANAGER, "force": "true"}
        prio = PRIORITY_POD if obj["kind"] == "Pod" else PRIORITY_OBJECT
        out: Obj = await self.request("PATCH", path, params=params, body=obj,
                                      content_type="application/apply-patch+yaml",
                                      priority=prio)
        return out

    async def delete(self, kind: str, namespace: str | None, name: str, *,
                     uid: str | None = None, grace_seconds: int | None = None) -> Obj | None:
        body: Obj = {"kind": "DeleteOptions", "apiVersion": "v1",
                     "propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            out: Obj = await self.request("DELETE", path_of(kind, namespace, name), body=body,
                                          priority=PRIORITY_POD if kind == "Pod" else
                                          PRIORITY_OBJECT)
            return out
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def patch(self, kind: str, namespace: str, name: str, patch: Obj, *,
                    uid: str | None = None) -> Obj:
        """A JSON merge patch (annotations the operator keeps state in); with `uid`, only of
        that object (a replaced one answers 409)."""
        body = dict(patch)
        if uid:
            body["metadata"] = {**(body.get("metadata") or {}), "uid": uid}
        out: Obj = await self.request(
            "PATCH", path_of(kind, namespace, name), body=body,
            params={"fieldManager": keys.FIELD_MANAGER},
            content_type="application/merge-patch+json",
            priority=PRIORITY_POD if kind == "Pod" else PRIORITY_OBJECT)
        return out

    async def patch_status(self, kind: str, namespace: str, name: str, status: Obj) -> Obj:
        out: Obj = await self.request(
            "PATCH", path_of(kind, namespace, name, "status"), body={"status": status},
            content_type="application/merge-patch+json", priority=PRIORITY_STATUS,
        )
        return out

    async def post_event(self, involved: Mapping[str, Any], event_type: str, reason: str,
                         message: str, series: str = "") -> None:
        """Events are best-effort: a lost one must never fail a reconcile. One Event per
        object, type, reason and ``series``: a repeat bumps its count and lastTimestamp and
        takes the new message (`kubectl describe` shows `(x3 over 5m)`), as the kubelet's
        correlator does, instead of a new object each time. ``series`` keeps apart what shares a
        reason but not a subject (prefill's ScaledUp must not overwrite decode's)."""
        meta = involved["metadata"]
        key = (meta["namespace"], meta["name"], str(meta.get("uid")), event_type,
               f"{reason}/{series}")
        lock = self._event_locks.setdefault(key, asyncio.Lock())
        async with lock:
            try:
                await self._post_event(key, involved, event_type, reason, message[:1024])
            except ApiError as exc:
                log.warning("could not post event %s/%s: %s", reason, meta["name"], exc)

    async def _post_event(self, key: tuple[str, str, str, str, str],
                          involved: Mapping[str, Any], event_type: str, reason: str,
                          message: str) -> None:
        meta = involved["metadata"]
        ts = now_rfc3339()
        seen = self._events.get(key)
        if seen is not None:
            name, count = seen
            try:
                await self.request(
                    "PATCH", path_of("Event", meta["namespace"], name),
                    body={"count": count + 1, "lastTimestamp": ts, "message": message},
                    content_type="application/merge-patch+json", retries=2,
                    priority=PRIORITY_EVENT)
                self._events[key] = (name, count + 1)
                return
            except ApiError as exc:
                if exc.status != 404:  # gone (events expire): post a new one
                    raise
        name = f"{meta['name']}.{uuid.uuid4().hex[:16]}"
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion", f"{API_GROUP}/{API_VERSION}"),
                "kind": involved.get("kind", KIND),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": event_type,
            "reason": reason,
            "message": message,
            "firstTimestamp": ts,
            "lastTimestamp": ts,
            "count": 1,
            "source": {"component": keys.FIELD_MANAGER},
            "reportingComponent": keys.FIELD_MANAGER,
        }
        await self.request("POST", path_of("Event", meta["namespace"]), body=event,
                           retries=2, priority=PRIORITY_EVENT)
        if len(self._events) > 20_000:
            self._events.clear()
            self._event_locks = {key: self._event_locks[key]}
        self._events[key] = (name, 1)
