"""One level-based reconcile pass per PDDeployment, serialised per object and coalesced.

Whatever triggers it (the PDDeployment's own events, an owned object's events, the periodic
resync, a retry after a failure), a pass reads the current PDDeployment and the owned objects
from the store, computes the desired objects with the pure builders, acts on the difference and
writes status. It never depends on what happened before, so an operator restarted at any point
converges to the same objects.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pdd_api import keys
from pdd_api.autoscale import role_autoscaling, with_replicas
from pdd_api.models import GPU_RESOURCE, KIND, ROLES, PDDeploymentSpec
from pdd_api.validation import parse_spec, validate_name, validate_spec
from pdd_operator import builders_lws, drain, metrics
from pdd_operator.builders import (
    ROUTING_VOLUME,
    Desired,
    Obj,
    Owner,
    Role,
    Scraper,
    build,
    build_grant_secret,
    grant_secret_name,
    is_routing_configmap,
    network_policy_names,
    selector,
    with_indices,
)
from pdd_operator.conditions import (
    AVAILABLE,
    DISAGGREGATED,
    NAME_CONFLICT,
    NO_PREFILL_READY,
    READY,
    REPLICAS_CONFLICT,
    STUCK_REASONS,
    VALIDATED,
    ObjectError,
    carry_autoscaling,
    compute_status,
    router_state,
    with_errors,
    with_replicas_conflict,
)
from pdd_operator.drain_io import fetch_loads
from pdd_operator.held_names import HeldNames
from pdd_operator.kube import ApiError, Kube, now_rfc3339, start_pass
from pdd_operator.replica_owner import Ownership, Writer, conflict, ownership, replicas_writers
from pdd_operator.role_scale import driver
from pdd_operator.rollout import (
    Delete,
    PodInfo,
    RolePlan,
    Roll,
    coordinate,
    foreign,
    needs_apply,
    plan_role,
    pod_info,
    roll_starting,
    surge_fits,
)
from pdd_operator.store import Store, lean

log = logging.getLogger("pdd_operator")
Key = tuple[str, str]
CHILD_KINDS = ("Pod", "Service", "ConfigMap", "Deployment", "Secret", "NetworkPolicy")
MANAGED_SELECTOR = f"{keys.LABEL_MANAGED_BY}={keys.MANAGED_BY}"
LWS_DISCOVERY_PERIOD = 30.0  # seconds between checks for the LeaderWorkerSet CRD


@dataclass
class _KeyState:
    task: asyncio.Task[None] | None = None
    dirty: bool = False
    failures: int = 0
    last_failure: str | None = None


@dataclass
class Outcome:
    """What a pass did, for events and tests."""

    created: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    errors: list[ObjectError] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    status: dict[str, Any] | None = None
    roll: Roll | None = None


class PassErrors(Exception):
    """Some objects could not be written; status says which. Raised after the status write so
    the pass is retried with backoff."""

    def __init__(self, errors: list[ObjectError]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{e.ref}: {e.message}" for e in errors))


def _ref(obj: Obj) -> str:
    return f"{obj['kind']} {obj['metadata']['name']}"


def _full_ref(kind: str, namespace: str, name: str) -> str:
    return f"{kind} {namespace}/{name}"


def _metadata(obj: Obj) -> Obj:
    """What the store keeps of a Secret: never its data."""
    return {k: obj[k] for k in ("apiVersion", "kind", "metadata") if k in obj}


class Reconciler:
    def __init__(self, kube: Kube, store: Store | None = None, *, debounce: float = 0.02,
                 child_debounce: float = 0.3, max_backoff: float = 30.0,
                 scraper: Scraper | None = None) -> None:
        self.kube = kube
        self.scraper = scraper
        self.store = store or Store()
        self.pdds: dict[Key, Obj] = {}
        # PDDRoleScales (fed by the handlers) and, per PDDeployment, who last wrote each
        # role's spec replicas (managedFields, which the kept copies leave out).
        self.role_scales: dict[Key, Obj] = {}
        self.writers: dict[Key, dict[str, Writer]] = {}
        self.debounce = debounce
        self.child_debounce = child_debounce
        self.max_backoff = max_backoff
        self._keys: dict[Key, _KeyState] = {}
        self._locks: dict[Key, asyncio.Lock] = {}
        self.on_pass: Callable[[Key, Outcome], Awaitable[None]] | None = None
        self._background: set[asyncio.Task[None]] = set()
        # The last ReplicasConflict message posted per object: two passes that both read the
        # status from before the first one's patch must not post the same event twice.
        self._conflict_posted: dict[str, str] = {}
        self.paused = False  # kopf peering: another replica leads (set by the handlers)
        self.lws_served = False  # the LeaderWorkerSet CRD is installed (multi-node instances)
        self._built: dict[Key, tuple[tuple[Any, ...], tuple[
            list[str], PDDeploymentSpec | None, Desired | None]]] = {}
        self._owned: dict[Key, dict[str, Ownership]] = {}  # per role, from the last build
        self._holed: dict[Key, tuple[Any, Desired, Desired]] = {}  # drain.py's index holes
        self.held = HeldNames(kube)

    # ------------------------------------------------------------------ inputs

    def role_scales_in(self, ns: str, deployment: str | None = None) -> list[Obj]:
        """The PDDRoleScales seen in a namespace, those naming `deployment` where given."""
        return [s for (n, _), s in self.role_scales.items() if n == ns and (
            deployment is None or (s.get("spec") or {}).get("deployment") == deployment)]

    def observe_pdd(self, body: Obj, deleted: bool = False) -> Key:
        raw, body = body, lean(body)  # a copy: kopf's event body is left as it is
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if deleted:
            self.pdds.pop(key, None)
            self._built.pop(key, None)
            self._owned.pop(key, None)
            self._holed.pop(key, None)
            self._locks.pop(key, None)
            self.writers.pop(key, None)
        else:
            current = self.pdds.get(key)
            # resourceVersions are opaque: only the generation (an integer by contract) says
            # that an event is older than what we hold; within one generation the last
            # arrival wins (at worst a status read one event late, rewritten by the next pass).
            if current is None or current["metadata"].get("uid") != meta.get("uid") or _gen(
                body
            ) >= _gen(current):
                self.pdds[key] = body
                if "managedFields" in raw.get("metadata", {}):
                    self.writers[key] = replicas_writers(raw)
        metrics.DEPLOYMENTS.set(len(self.pdds))
        return key

    def observe_child(self, kind: str, obj: Obj, deleted: bool = False) -> None:
        if deleted:
            self.store.remove(kind, obj)
        elif not self.store.upsert(kind, obj):
            return  # older than what we know (our own write's response came first)
        meta = obj.get("metadata", {})
        inst = (meta.get("labels") or {}).get(keys.LABEL_INSTANCE)
        if inst is not None and not self.paused and (meta.get("namespace"), inst) in self.pdds:
            # Pods change state in bursts (scheduled, started, Ready): one pass per burst
            # keeps status writes, the API server's load at scale, down.
            self.kick(meta["namespace"], inst, self.child_debounce)

    async def watch_children(self, namespaces: list[str] | None) -> None:
        """Watches of the owned objects feed the store and kick their owner's pass."""
        def handler(kind: str) -> Callable[[str, Obj], None]:
            return lambda etype, obj: self.observe_child(kind, obj, etype == "DELETED")

        await asyncio.gather(*(
            self.kube.watch(kind, ns, MANAGED_SELECTOR, handler(kind))
            for ns in (namespaces or [None])  # type: ignore[list-item]
            for kind in CHILD_KINDS), self._watch_lws(namespaces, handler))

    def _child_kinds(self) -> tuple[str, ...]:
        return CHILD_KINDS + ((builders_lws.LWS_KIND,) if self.lws_served else ())

    async def _watch_lws(self, namespaces: list[str] | None,
                         handler: Callable[[str], Callable[[str, Obj], None]]) -> None:
        """LeaderWorkerSets are watched once their CRD is served (installed before or after
        the operator started); a cluster without it runs every one-pod role as before."""
        kind = builders_lws.LWS_KIND
        while not self.lws_served:
            try:
                self.lws_served = await self.kube.serves(kind)
            except ApiError as exc:
                log.warning("cannot tell whether %s is served: %s", kind, exc)
            if not self.lws_served:
                await asyncio.sleep(LWS_DISCOVERY_PERIOD)
        await asyncio.gather(*(self.kube.watch(kind, ns, MANAGED_SELECTOR, handler(kind), lean)
                               for ns in (namespaces or [None])))  # type: ignore[list-item]

    async def seed(self, namespaces: list[str] | None) -> None:
        """Fill the store before any pass runs, so a restarted operator sees what exists."""
        self.lws_served = await self.kube.serves(builders_lws.LWS_KIND)
        for ns in namespaces or [None]:  # type: ignore[list-item]
            for kind in self._child_kinds():
                for obj in await self.kube.list_objects(kind, ns, MANAGED_SELECTOR, keep=lean):
                    self.store.upsert(kind, obj)

    async def resync(self, namespace: str, name: str) -> None:
        """Authoritative re-read of one PDDeployment's objects (the periodic pass)."""
        selector = f"{MANAGED_SELECTOR},{keys.LABEL_INSTANCE}={name}"
        for kind in self._child_kinds():
            since = self.store.mark()
            objs = await self.kube.list_objects(kind, namespace, selector, keep=lean)
            self.store.replace_instance(kind, namespace, name, objs, since)

    async def resync_all(self) -> None:
        """The periodic pass: one LIST per kind and namespace, then a pass for every
        PDDeployment (a LIST per PDDeployment would cost 4 requests each)."""
        for ns in sorted({ns for ns, _ in self.pdds}):
            names = [n for n_ns, n in self.pdds if n_ns == ns]
            for kind in self._child_kinds():
                since = self.store.mark()
                objs = await self.kube.list_objects(kind, ns, MANAGED_SELECTOR, keep=lean)
                grouped: dict[str, list[Obj]] = {n: [] for n in names}
                for o in objs:
                    inst = (o["metadata"].get("labels") or {}).get(keys.LABEL_INSTANCE)
                    if inst in grouped:
                        grouped[inst].append(o)
                for n, items in grouped.items():
                    self.store.replace_instance(kind, ns, n, items, since)
            for n in names:
                self.kick(ns, n)

    # ------------------------------------------------------------------ scheduling

    def kick(self, namespace: str, name: str, delay: float | None = None) -> None:
        """Schedule a pass after `delay` (default: the debounce); kicks that arrive while one
        is pending or running are folded into it (one more pass at most)."""
        key = (namespace, name)
        st = self._keys.setdefault(key, _KeyState())
        if st.task is not None and not st.task.done():
            st.dirty = True
            return
        st.dirty = False
        wait = self.debounce if delay is None else delay
        st.task = asyncio.get_running_loop().create_task(self._loop(key, st, wait))

    async def _loop(self, key: Key, st: _KeyState, delay: float) -> None:
        await asyncio.sleep(delay)
        while True:
            st.dirty = False
            try:
                await self.run(*key)
                st.failures = 0
                st.last_failure = None
            except Exception as exc:  # noqa: BLE001 - any failure is retried with backoff
                st.failures += 1
                delay = min(self.max_backoff, 0.5 * 2 ** (st.failures - 1))
                log.warning("reconcile of %s/%s failed (retry in %.1fs): %s", *key, delay, exc)
                await self._failure_event(key, st, exc)
                await asyncio.sleep(delay)
                st.dirty = True
            if not st.dirty or key not in self.pdds:
                break

    async def _failure_event(self, key: Key, st: _KeyState, exc: Exception) -> None:
        text = str(exc)
        body = self.pdds.get(key)
        if body is not None and text != st.last_failure:
            st.last_failure = text
            await self.kube.post_event(body, "Warning", "ReconcileFailed", text)

    def lock(self, key: Key) -> asyncio.Lock:
        """Held by a pass and by the autoscaler's status write: each reads the status the
        other wrote, so neither undoes the other's part."""
        return self._locks.setdefault(key, asyncio.Lock())

    async def run(self, namespace: str, name: str) -> Outcome | None:
        """One serialised pass; raises on failure (the caller retries)."""
        key = (namespace, name)
        lock = self.lock(key)
        async with lock:
            start_pass()
            start = time.perf_counter()
            try:
                outcome = await self._reconcile(key)
            except Exception:
                metrics.RECONCILES.labels("error").inc()
                metrics.ERRORS.inc()
                raise
            finally:
                metrics.LATENCY.observe(time.perf_counter() - start)
            metrics.RECONCILES.labels("ok").inc()
            for kind in self._child_kinds():
                metrics.MANAGED.labels(kind).set(self.store.count(kind))
            if outcome is not None and self.on_pass is not None:
                await self.on_pass(key, outcome)
            return outcome

    # ------------------------------------------------------------------ the pass

    async def _reconcile(self, key: Key) -> Outcome | None:
        body = self.pdds.get(key)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        ns, name = key
        meta = body["metadata"]
        generation = int(meta.get("generation") or 0)
        raw_spec = body.get("spec")
        owner = Owner(name, ns, meta["uid"])
        scales: dict[str, Obj | None] = {
            r: driver(self.role_scales_in(ns, name), name, r) for r in ROLES}
        problems, spec, desired = self._desired_for(owner, generation, raw_spec,
                                                    body.get("status"), scales)
        outcome = Outcome()
        if problems:
            status = compute_status(
                generation=generation, problems=problems, plan=None, routing_published=False,
                roles={}, wanted={}, max_unavailable=1, router=router_state(False, None, None),
                previous=body.get("status"), now=now_rfc3339(),
            )
            status = carry_autoscaling(status, body.get("status"), autoscaled=True)
            await self._write_status(body, status)
            outcome.status = status
            return outcome

        assert spec is not None and desired is not None
        desired = await self._scale_down(owner, spec, desired)
        roles: dict[str, RolePlan] = {}
        infos: dict[str, list[PodInfo]] = {}
        for role in ("prefill", "decode"):
            observed = self._role_pods(ns, name, role)
            surge = [p for p in observed if _is_surge(p)]
            roles[role] = plan_role(desired.pods[role], [p for p in observed if p not in surge],
                                    owner.uid, spec.rollout.maxUnavailable, owner.name)
            infos[role] = [pod_info(p) for p in observed if not self._foreign(p, owner)]
        roll = await self._coordinate(owner, spec, desired, roles, infos, outcome)
        surge_plan = RolePlan(create=roll.create, delete=roll.delete)
        self._lws_plans(owner, desired, roles)
        # One wave of writes: a pod created before its ConfigMap just waits for the volume
        # (the kubelet retries the mount), so nothing here needs ordering; latency is one
        # round trip instead of three.
        await asyncio.gather(*(self._act_on_pods(owner, roles[r], outcome, spec)
                               for r in roles),
                             self._act_on_pods(owner, surge_plan, outcome, spec),
                             self._apply_others(owner, desired, outcome),
                             self._guard(_full_ref("Secret", ns, grant_secret_name(name)),
                                         self._ensure_grant_key(owner, outcome), outcome))
        await self._apply_lws(owner, desired, outcome)
        await self._prune_routing(owner, desired, outcome)

        cm = self.store.get("ConfigMap", ns, desired.configmap["metadata"]["name"])
        published = cm is not None and cm.get("data") == desired.configmap["data"]
        router_obs = self.store.get("Deployment", ns, name)
        status = compute_status(
            generation=generation, problems=[], plan=desired.plan, routing_published=published,
            roles=self._roles_after_creates(owner, spec, desired, roles, outcome),
            wanted={"prefill": spec.prefill.replicas, "decode": spec.decode.replicas},
            max_unavailable=spec.rollout.maxUnavailable,
            router=router_state(spec.router.enabled, desired.router_deployment, router_obs),
            previous=body.get("status"), now=now_rfc3339(), roll_note=_roll_note(roll, infos),
            no_prefill=spec.router.noPrefill,
        )
        for role in ("prefill", "decode"):
            status[role]["selector"] = ",".join(
                f"{k}={v}" for k, v in selector(owner, role).items())
        builders_lws.leaders_only(status, desired)
        conflicts = outcome.conflicts + [
            _full_ref("Pod", ns, n) for r in ("prefill", "decode") for n in roles[r].conflicts]
        status = with_errors(status, errors=outcome.errors, conflicts=conflicts,
                             generation=generation, previous=body.get("status"),
                             now=now_rfc3339(), role_refs={
                                 r: {_full_ref("Pod", ns, p["metadata"]["name"])
                                     for p in desired.pods[r].values()}
                                 | self._lws_refs(ns, desired, r)
                                 for r in ("prefill", "decode")})
        status = builders_lws.mark_missing_crd(status)
        status = carry_autoscaling(status, body.get("status"),
                                   autoscaled=any(role_autoscaling(spec, r) for r in ROLES))
        status = with_replicas_conflict(status, self._conflicts(key), generation,
                                        body.get("status"), now_rfc3339())
        self._events(body, outcome)
        await self._write_status(body, status)
        outcome.status = status
        if outcome.errors:
            raise PassErrors(outcome.errors)
        return outcome

    def _roles_after_creates(self, owner: Owner, spec: PDDeploymentSpec, desired: Desired,
                             roles: dict[str, RolePlan], outcome: Outcome) -> dict[str, RolePlan]:
        """What status reports of each role once this pass's pods are created: the store holds
        them (their create answers), so status says `<pod> is Pending` rather than `being
        created`. Status computed from the plan made before the creates changed again in the
        very next pass (the pods' watch events trigger it): two status writes, two events of
        the PDDeployment for kopf, for every new PDDeployment; now the next pass finds nothing
        new to write. Only a pass that created pods and removed none (a roll or a scale-down
        keeps the plan it acted on); LeaderWorkerSet roles keep their own plans."""
        if (not any(c.startswith("Pod ") for c in outcome.created) or outcome.deleted
                or outcome.replaced or outcome.ended or builders_lws.lws_roles(desired)):
            return roles
        out = dict(roles)
        for role in ("prefill", "decode"):
            observed = [p for p in self._role_pods(owner.namespace, owner.name, role)
                        if not _is_surge(p)]
            out[role] = plan_role(desired.pods[role], observed, owner.uid,
                                  spec.rollout.maxUnavailable, owner.name)
        return out

    def _conflicts(self, key: Key) -> list[tuple[str, str]]:
        """Each role's writer that is not its owner (replica_owner.conflict)."""
        writers = self.writers.get(key, {})
        out = []
        for role, owned in self._owned.get(key, {}).items():
            found = conflict(owned, writers.get(role), key[1])
            if found is not None:
                out.append(found)
        return out

    async def _coordinate(self, owner: Owner, spec: PDDeploymentSpec, desired: Desired,
                          roles: dict[str, RolePlan], infos: dict[str, list[PodInfo]],
                          outcome: Outcome) -> Roll:
        """A routing-plan change rolls both roles together (rollout.coordinate); free GPUs
        are counted once, when the roll starts."""
        if builders_lws.lws_roles(desired):
            # A role of LeaderWorkerSets rolls group by group (its own controller): no surge
            # pods, each role's own budget.
            return Roll(allowed={r: list(rp.delete) for r, rp in roles.items()})
        current = desired.configmap["metadata"]["labels"][keys.LABEL_PLAN_HASH]
        replicas = {"prefill": spec.prefill.replicas, "decode": spec.decode.replicas}
        room: bool | None = None
        why = ""
        if roll_starting(current, infos, replicas):
            room, why = await self._surge_room(list(desired.surge_pods.values()))
        surge: dict[str, Obj] = {str(r): p for r, p in desired.surge_pods.items()}
        roll = coordinate(current, replicas, roles, infos, surge, room)
        for role, rp in roles.items():
            rp.delete = roll.allowed[role]
        if room is not None or why:
            body = self.pdds.get((owner.namespace, owner.name))
            if body is not None:
                self._post(body, [("Normal", "PlanRoll", (
                    f"routing plan {current}: one surge pod per role, then the replicas"
                    if roll.mode == "Surge" else
                    f"routing plan {current}: replacing role by role, prefill first ({why})"
                ))])
        outcome.roll = roll
        return roll

    async def _surge_room(self, wanted: list[Obj]) -> tuple[bool | None, str]:
        """Whether one more pod of each role fits in free GPUs now, and why not. Needs to
        list nodes and every namespace's pods; without that right (namespaced mode without
        the gpu-capacity component) the room is unknown and the roll goes role by role."""
        try:
            nodes = await self.kube.list_objects("Node")
            pods = await self.kube.list_objects("Pod")
        except ApiError as exc:
            if exc.status not in (401, 403):
                raise
            return None, f"free GPUs unknown: {exc.message}"
        fits = surge_fits(wanted, nodes, pods, GPU_RESOURCE)
        return fits, "" if fits else "no room for a surge pod per role in free GPUs"

    def _lws_plans(self, owner: Owner, desired: Desired, roles: dict[str, RolePlan]) -> None:
        """A role that spans pods counts LWS groups (builders_lws.role_plan); the pods its
        plan_role saw are leftovers of one-pod instances, deleted as before."""
        ns = owner.namespace
        pods = self.store.of_instance("Pod", ns, owner.name)
        for want in builders_lws.lws_objects(desired):
            role = want["metadata"]["labels"][keys.LABEL_COMPONENT]
            have = self.store.get(builders_lws.LWS_KIND, ns, want["metadata"]["name"])
            plan = builders_lws.role_plan(want, have, builders_lws.lws_pods_of(
                pods, owner.name, role))
            plan.delete, plan.excess = roles[role].delete, plan.excess + roles[role].excess
            roles[role] = plan

    def _lws_refs(self, ns: str, desired: Desired, role: str) -> set[str]:
        return {_full_ref(o["kind"], ns, o["metadata"]["name"])
                for o in builders_lws.lws_objects(desired)
                if o["metadata"]["labels"][keys.LABEL_COMPONENT] == role}

    async def _apply_lws(self, owner: Owner, desired: Desired, outcome: Outcome) -> None:
        """After the role Services: LWS creates a Service of its own name (the role's) when
        none exists, and one it created would not be ours. An LWS of a role that no longer spans
        pods is deleted (its pods with it)."""
        ns, kind = owner.namespace, builders_lws.LWS_KIND
        wanted = builders_lws.lws_objects(desired)

        async def one(obj: Obj) -> None:
            name = obj["metadata"]["name"]
            svc = self.store.get("Service", ns, name)
            if svc is None or self._foreign(svc, owner):
                return  # the Service is written (or refused) first; the next pass goes on
            have = self.store.get(kind, ns, name)
            if have is not None and self._foreign(have, owner):
                outcome.conflicts.append(_full_ref(kind, ns, name))
                return
            if not needs_apply(obj, have):
                return
            if have is None and await self._held_by_another(kind, owner, name, outcome):
                return
            try:
                await self._apply(obj)
            except ApiError as exc:
                if exc.status == 404:  # no such resource: the CRD is not installed
                    raise ApiError(404, {"message": builders_lws.missing_crd_message()}
                                   ) from None
                raise
            metrics.ACTIONS.labels(kind, "apply").inc()
            (outcome.created if have is None else outcome.restored).append(_ref(obj))

        await asyncio.gather(*(self._guard(_full_ref(kind, ns, o["metadata"]["name"]),
                                           one(o), outcome) for o in wanted))
        names = {o["metadata"]["name"] for o in wanted}
        for have in self.store.of_instance(kind, ns, owner.name):
            meta = have["metadata"]
            if (meta["name"] not in names and not meta.get("deletionTimestamp")
                    and _owned_by(have, owner.uid)):
                await self._guard(_full_ref(kind, ns, meta["name"]),
                                  self._delete(kind, have, outcome.deleted), outcome)

    def _desired_for(self, owner: Owner, generation: int, raw_spec: Any,
                     status: Mapping[str, Any] | None = None,
                     scales: Mapping[str, Obj | None] | None = None) -> tuple[
            list[str], PDDeploymentSpec | None, Desired | None]:
        """Validation and builders run once per generation, autoscaling decision and
        PDDRoleScale (the replicas change with nothing else); most passes are triggered by pod
        events and reuse them. The builders see the replicas of each role's
        owner (replica_owner.py): the planner's, a PDDRoleScale's or the spec's."""
        key = (owner.namespace, owner.name)
        scales = scales or {}
        cached = self._built.get(key)
        version = (owner.uid, generation, _autoscaled_replicas(status), tuple(
            (_name(s), (s.get("spec") or {}).get("replicas"),
             (s.get("status") or {}).get("appliedReplicas")) if s else None
            for s in (scales.get(r) for r in ROLES)))
        if cached is not None and cached[0] == version:
            return cached[1]
        problems = validate_name(owner.name, raw_spec) + validate_spec(raw_spec)
        if problems:
            result: tuple[list[str], PDDeploymentSpec | None, Desired | None] = (
                problems, None, None)
        else:
            spec = parse_spec(raw_spec)  # read as the API server reads it (nulls, 2.0)
            owned: dict[str, Ownership] = {
                r: ownership(spec, r, status, scales.get(r)) for r in ROLES}
            self._owned[key] = owned
            spec = with_replicas(spec, {r: o.replicas for r, o in owned.items()})
            desired = build(owner, spec, self.scraper)
            result = ([], spec, builders_lws.apply_lws(owner, spec, desired))
        self._built[key] = (version, result)
        return result

    async def _apply(self, obj: Obj) -> Obj:
        out = await self.kube.apply(obj)
        self.store.upsert(obj["kind"], out, written=True)
        return out

    async def _guard(self, ref: str, action: Awaitable[Any], outcome: Outcome) -> None:
        """One object's failure is recorded for status, never aborts the rest of the pass."""
        try:
            await action
        except ApiError as exc:
            outcome.errors.append(ObjectError(ref, exc.status, exc.message))

    def _foreign(self, obj: Obj, owner: Owner) -> bool:
        return foreign(obj, owner.uid, owner.name, KIND)

    async def _held_by_another(self, kind: str, owner: Owner, name: str,
                               outcome: Outcome) -> bool:
        """Before our first write of a name: an object the store does not know (it lacks our
        labels) may hold it. Server-side apply with force would take it over, and garbage
        collection would delete it with the PDDeployment."""
        existing = await self.held.get(kind, owner.namespace, name)
        if existing is not None and self._foreign(existing, owner):
            outcome.conflicts.append(_full_ref(kind, owner.namespace, name))
            return True
        return False

    async def _apply_others(self, owner: Owner, desired: Desired, outcome: Outcome) -> None:
        async def one(obj: Obj) -> None:
            kind, name = obj["kind"], obj["metadata"]["name"]
            have = self.store.get(kind, owner.namespace, name)
            if have is not None and self._foreign(have, owner):
                outcome.conflicts.append(_full_ref(kind, owner.namespace, name))
                return
            if not needs_apply(obj, have):
                return
            if have is None and await self._held_by_another(kind, owner, name, outcome):
                return
            await self._apply(obj)
            metrics.ACTIONS.labels(kind, "apply").inc()
            (outcome.created if have is None else outcome.restored).append(_ref(obj))

        await asyncio.gather(*(
            self._guard(_full_ref(o["kind"], owner.namespace, o["metadata"]["name"]), one(o),
                        outcome)
            for o in desired.owned_non_pods()))
        unwanted: list[tuple[str, str]] = []
        if desired.router_deployment is None:
            unwanted += [("Deployment", owner.name), ("Service", owner.name)]
        if not desired.network_policies:
            unwanted += [("NetworkPolicy", n) for n in network_policy_names(owner.name)]
        for kind, name in unwanted:
            have = self.store.get(kind, owner.namespace, name)
            if have is not None and _owned_by(have, owner.uid):
                await self._guard(_full_ref(kind, owner.namespace, name),
                                  self._delete(kind, have, outcome.deleted), outcome)

    async def _prune_routing(self, owner: Owner, desired: Desired, outcome: Outcome) -> None:
        """Routing ConfigMaps of earlier plans (and v1alpha1's `<name>-routing`) go once no pod
        of this PDDeployment mounts them: a pod keeps the plan it started with until replaced."""
        ns, name = owner.namespace, owner.name
        current = desired.configmap["metadata"]["name"]
        used = {
            v["configMap"].get("name")
            for p in self.store.of_instance("Pod", ns, name)
            for v in (p.get("spec") or {}).get("volumes") or []
            if v.get("name") == ROUTING_VOLUME and isinstance(v.get("configMap"), dict)
        }
        for cm in self.store.of_instance("ConfigMap", ns, name):
            meta = cm["metadata"]
            cm_name = meta["name"]
            if (cm_name == current or cm_name in used or meta.get("deletionTimestamp")
                    or not is_routing_configmap(name, cm_name)
                    or not _owned_by(cm, owner.uid)):
                continue
            await self._guard(_full_ref("ConfigMap", ns, cm_name),
                              self._delete("ConfigMap", cm, outcome.deleted), outcome)

    async def _ensure_grant_key(self, owner: Owner, outcome: Outcome) -> None:
        """The transfer-grant key: created once with 32 random bytes, never rewritten (the
        Secret is immutable), never read back (the store keeps its metadata only)."""
        name = grant_secret_name(owner.name)
        ref = _full_ref("Secret", owner.namespace, name)
        have = self.store.get("Secret", owner.namespace, name)
        if have is None:
            # Created first, read only when taken (409): one request, not two, per new
            # PDDeployment (the store knows every Secret of ours from the start).
            try:
                out = await self.kube.create(build_grant_secret(owner, secrets.token_bytes(32)))
            except ApiError as exc:
                if exc.status != 409:
                    raise
                have = await self.kube.get("Secret", owner.namespace, name, metadata_only=True)
                if have is None:
                    raise
            else:
                self.store.upsert("Secret", _metadata(out), written=True)
                metrics.ACTIONS.labels("Secret", "create").inc()
                outcome.created.append(f"Secret {name}")
                return
        if self._foreign(have, owner):
            outcome.conflicts.append(ref)
        elif (have.get("metadata", {}).get("labels") or {}).get(keys.LABEL_MANAGED_BY):
            self.store.upsert("Secret", _metadata(have), written=True)

    async def _delete(self, kind: str, obj: Obj, into: list[str],
                      grace: int | None = None) -> None:
        meta = obj["metadata"]
        try:
            out = await self.kube.delete(kind, meta["namespace"], meta["name"], uid=meta["uid"],
                                         grace_seconds=grace)
        except ApiError as exc:
            if exc.status == 409:
                # Replaced since we read it (uid precondition): re-read and decide again.
                fresh = await self.kube.get(kind, meta["namespace"], meta["name"])
                if fresh is not None:
                    self.store.upsert(kind, fresh, written=True)
                else:
                    self.store.remove(kind, obj)
                raise
            raise
        metrics.ACTIONS.labels(kind, "delete").inc()
        if out is not None and out.get("kind") == kind and out.get("metadata", {}).get(
            "deletionTimestamp"
        ):
            self.store.upsert(kind, out, written=True)
        else:
            self.store.remove(kind, out if out and out.get("kind") == kind else obj)
        into.append(f"{kind} {meta['name']}")

    def _role_pods(self, ns: str, name: str, role: str) -> list[Obj]:
        return [p for p in self.store.of_instance("Pod", ns, name)
                if (p["metadata"].get("labels") or {}).get(keys.LABEL_COMPONENT) == role
                and not builders_lws.is_lws_pod(p)]

    async def _scale_down(self, owner: Owner, spec: PDDeploymentSpec,
                          desired: Desired) -> Desired:
        """Which replicas each one-pod role keeps (drain.py): the pods chosen to go are marked
        (and so excluded from the desired pods, then deleted with their drain time as grace
        period by this pass); a marked pod not yet deleted is taken back on a scale-up."""
        ns, name = owner.namespace, owner.name
        lws = builders_lws.lws_roles(desired)
        indices: dict[Role, list[int]] = {}
        body = self.pdds.get((ns, name))
        for role in ("prefill", "decode"):
            if role in lws:
                continue
            members = [m for p in self._role_pods(ns, name, role)
                       if not _is_surge(p) and not self._foreign(p, owner)
                       and (m := drain.member(p)) is not None]
            replicas = getattr(spec, role).replicas
            loads: dict[str, drain.Load] = {}
            if drain.needs_choice(replicas, members):
                loads = await fetch_loads([p for p in self._role_pods(ns, name, role)
                                           if not _is_surge(p)])
            decision = drain.replica_indices(replicas, members, loads)
            stamp = now_rfc3339()
            seconds = getattr(spec, role).drainSeconds
            for m, why in decision.mark:
                await self._patch_pod(ns, m, drain.mark_patch(stamp, why))
                log.info("%s/%s: draining %s (%s)", ns, name, m.name, why)
                if body is not None:
                    self._post(body, [("Normal", drain.DRAINING, (
                        f"Draining {m.name} ({role} {len(members) - len(decision.mark)} of "
                        f"{len(members)} kept, {replicas} wanted): chosen as {why}; it takes "
                        f"no new requests and finishes its work within {seconds}s"))])
            for m in decision.unmark:
                await self._patch_pod(ns, m, drain.unmark_patch())
                if body is not None:
                    self._post(body, [("Normal", drain.DRAIN_CANCELLED, (
                        f"Keeping {m.name}: {role} scaled back up to {replicas} before it "
                        "was deleted"))])
            if not decision.contiguous or decision.keep != sorted(desired.pods[role]):
                indices[role] = decision.keep  # type: ignore[index]
        if not indices:
            return desired
        # Reused while nothing changes: passes compare against the same objects (rollout's
        # drift memo is keyed by them).
        version = (id(desired), tuple(sorted((r, tuple(v)) for r, v in indices.items())))
        cached = self._holed.get((ns, name))
        if cached is not None and cached[0] == version and cached[1] is desired:
            return cached[2]
        out = with_indices(owner, spec, desired, indices)
        self._holed[(ns, name)] = (version, desired, out)
        return out

    async def _patch_pod(self, ns: str, m: drain.Member, patch: Obj) -> None:
        """Written before the pass acts on it: a failure raises, and the pass is retried
        with the pod still counted as a replica."""
        out = await self.kube.patch("Pod", ns, m.name, patch, uid=m.uid)
        self.store.upsert("Pod", out, written=True)

    async def _act_on_pods(self, owner: Owner, rp: RolePlan, outcome: Outcome,
                           spec: PDDeploymentSpec | None = None) -> None:
        namespace = owner.namespace

        async def create(pod: Obj) -> None:
            """POST, not apply: a pod of that name we do not know (no labels of ours) answers
            409 instead of being taken over."""
            name = pod["metadata"]["name"]
            try:
                out = await self.kube.create(pod)
            except ApiError as exc:
                if exc.status != 409:
                    raise
                if await self._held_by_another("Pod", owner, name, outcome):
                    return
                out = await self.kube.apply(pod)
            self.store.upsert("Pod", out, written=True)
            metrics.ACTIONS.labels("Pod", "create").inc()
            outcome.created.append(_ref(pod))

        async def restore(pod: Obj) -> None:
            try:
                await self._apply(pod)
                outcome.restored.append(_ref(pod))
            except ApiError as exc:
                if exc.status != 422:
                    raise
                # An edit of an immutable pod field cannot be applied back: replace the pod.
                have = self.store.get("Pod", pod["metadata"]["namespace"],
                                      pod["metadata"]["name"])
                if have is not None:
                    log.info("%s/%s: deleting pod %s: an immutable field drifted (%s)",
                             namespace, owner.name, pod["metadata"]["name"], exc)
                    await self._delete("Pod", have, outcome.replaced)

        async def delete(d: Delete) -> None:
            have = self.store.get("Pod", namespace, d.name) or {
                "metadata": {"name": d.name, "uid": d.uid, "namespace": namespace}}
            into = {"Replace": outcome.replaced, "Ended": outcome.ended}.get(
                d.reason, outcome.deleted)
            grace = _drain_grace(spec, have) if d.reason in DRAINED_DELETES else None
            log.info("%s/%s: deleting pod %s (uid %s): %s%s", namespace, owner.name, d.name,
                     d.uid, d.reason, f" (drain up to {grace}s)" if grace else "")
            await self._delete("Pod", have, into, grace)

        def ref(name: str) -> str:
            return _full_ref("Pod", namespace, name)

        await asyncio.gather(
            *(self._guard(ref(p["metadata"]["name"]), create(p), outcome) for p in rp.create),
            *(self._guard(ref(p["metadata"]["name"]), restore(p), outcome) for p in rp.restore),
            *(self._guard(ref(d.name), delete(d), outcome) for d in rp.delete))

    def _events(self, body: Obj, outcome: Outcome) -> None:
        posts = []
        if outcome.created:
            posts.append(("Normal", "Created", "Created " + ", ".join(outcome.created)))
        if outcome.replaced:
            posts.append(("Normal", "Replacing", "Deleted to replace with the new spec: "
                          + ", ".join(outcome.replaced)))
        if outcome.ended:
            posts.append(("Warning", "ReplacingEnded", "Deleted to replace, the pod had ended "
                          "(Failed or Succeeded): " + ", ".join(outcome.ended)))
        if outcome.deleted:
            posts.append(("Normal", "Deleted", "Deleted " + ", ".join(outcome.deleted)))
        if outcome.restored:
            posts.append(("Normal", "Restored", "Re-applied after a change made outside the "
                          "operator: " + ", ".join(outcome.restored)))
        self._post(body, posts)

    def _post(self, body: Obj, posts: list[tuple[str, str, str]]) -> None:
        """Events never hold up a pass: they are posted in the background."""
        for event_type, reason, message in posts:
            task = asyncio.get_running_loop().create_task(
                self.kube.post_event(body, event_type, reason, message))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _write_status(self, body: Obj, status: dict[str, Any]) -> None:
        previous = body.get("status") or {}
        if _comparable(previous) == _comparable(status):
            return
        self._transition_events(body, previous, status)
        meta = body["metadata"]
        out = await self.kube.patch_status(KIND, meta["namespace"], meta["name"], status)
        self.observe_pdd(out)

    def _transition_events(self, body: Obj, old: dict[str, Any],
                                 new: dict[str, Any]) -> None:
        before = {c["type"]: c for c in old.get("conditions") or []}
        posts = []
        for c in new.get("conditions") or []:
            b = before.get(c["type"])
            changed = b is None or (b.get("status"), b.get("reason"), b.get("message")) != (
                c["status"], c["reason"], c["message"])
            if not changed:
                continue
            if c["type"] == VALIDATED and c["status"] == "False":
                posts.append(("Warning", "InvalidSpec", c["message"]))
            elif c["type"] == REPLICAS_CONFLICT:
                uid = body["metadata"].get("uid", "")
                if c["status"] == "True" and self._conflict_posted.get(uid) != c["message"]:
                    self._conflict_posted[uid] = c["message"]
                    posts.append(("Warning", REPLICAS_CONFLICT, c["message"]))
            elif c["type"] == READY and c["reason"] == NAME_CONFLICT:
                posts.append(("Warning", NAME_CONFLICT, c["message"]))
            elif c["type"] in AVAILABLE.values() and c["status"] == "False" and (
                c["reason"] in STUCK_REASONS
            ):
                posts.append(("Warning", c["reason"], c["message"]))
            elif c["type"] == READY and c["status"] == "True" and (
                b is None or b.get("status") != "True"
            ):
                posts.append(("Normal", "Ready", c["message"]))
            elif c["type"] == DISAGGREGATED and c["status"] == "False" and (
                    b is not None and b.get("status") == "True"):
                # Every prefill lost after one was ready: said once per transition (a new
                # deployment whose prefills are not ready yet is no news).
                posts.append(("Warning", NO_PREFILL_READY, c["message"]))
        if all(c["type"] != REPLICAS_CONFLICT for c in new.get("conditions") or []):
            self._conflict_posted.pop(body["metadata"].get("uid", ""), None)
        self._post(body, posts)


def _autoscaled_replicas(status: Mapping[str, Any] | None) -> tuple[Any, ...]:
    auto = (status or {}).get("autoscaling") or {}
    return tuple((auto.get(r) or {}).get("desiredReplicas") for r in ROLES)


def _name(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def _gen(obj: Obj) -> int:
    try:
        return int(obj["metadata"].get("generation") or 0)
    except (TypeError, ValueError):
        return 0


def _roll_note(roll: Roll, infos: dict[str, list[PodInfo]]) -> str:
    surge = sorted(i.name for r in infos.values() for i in r if i.surge)
    if not roll.active and not surge:
        return ""
    parts = [f"routing plan roll ({roll.mode or 'finishing'})"]
    if surge:
        parts.append("surge pods " + ", ".join(surge))
    if roll.held:
        parts.append("old pods kept serving for now: " + ", ".join(roll.held))
    return ": ".join(parts[:1]) + ("; " + "; ".join(parts[1:]) if parts[1:] else "")


DRAINED_DELETES = ("ScaleDown", "Replace", "Surge")  # pods that may serve: finish first


def _drain_grace(spec: PDDeploymentSpec | None, pod: Obj) -> int | None:
    """The deletion's grace period: the role's drain time, less what passed since the pod was
    marked (drain.py)."""
    meta = pod.get("metadata") or {}
    role = (meta.get("labels") or {}).get(keys.LABEL_COMPONENT)
    if spec is None or role not in ("prefill", "decode"):
        return None
    since = (meta.get("annotations") or {}).get(keys.ANNOTATION_DRAINING_SINCE)
    return drain.grace_seconds(getattr(spec, role).drainSeconds, since,
                               datetime.now(UTC))


def _is_surge(pod: Obj) -> bool:
    return (pod["metadata"].get("labels") or {}).get(keys.LABEL_SURGE) == "true"


def _owned_by(obj: Obj, uid: str) -> bool:
    return any(r.get("uid") == uid for r in obj.get("metadata", {}).get("ownerReferences") or [])


def _comparable(status: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in status.items() if v is not None}
