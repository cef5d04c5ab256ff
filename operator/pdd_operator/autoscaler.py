"""The autoscaling loop: every interval, per PDDeployment with spec.autoscaling, fetch each
autoscaled role's sample, ask the planner (pdd_api.autoscale.plan), record its decision in
status.autoscaling with the `Autoscaling` condition, post an Event, and kick a reconcile pass,
which builds the planner's replicas (never written to spec, so GitOps syncs leave them be).

Only the fetch and the status write are I/O; `status_update` is pure. The status write holds the
reconciler's lock for the PDDeployment, as a pass does, so the two never undo each other.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdd_api.autoscale import (
    JUMP_NOISE_INTERVALS,
    METRICS_PARTIAL,
    METRICS_UNAVAILABLE,
    SCALED_DOWN,
    SCALED_UP,
    Decision,
    Role,
    Sample,
    effective_replicas,
    plan,
    role_autoscaling,
)
from pdd_api.models import KIND, ROLES, PDDeploymentSpec
from pdd_api.validation import InvalidSpecError, parse_spec
from pdd_operator import metrics
from pdd_operator.autoscale_metrics import (
    DirectFetcher,
    Fetcher,
    HttpGetter,
    PrometheusFetcher,
)
from pdd_operator.conditions import AUTOSCALING, autoscaling_condition
from pdd_operator.kube import Kube

log = logging.getLogger("pdd_operator.autoscale")

Obj = dict[str, Any]
Key = tuple[str, str]
# A status whose only change is fresher metric values is rewritten at most this often.
REFRESH_SECONDS = 60.0


def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def last_scale_times(status: Mapping[str, Any] | None) -> dict[str, float | None]:
    auto = (status or {}).get("autoscaling") or {}
    return {r: parse_time((auto.get(r) or {}).get("lastScaleTime")) for r in ROLES}


def status_update(decisions: Mapping[str, Decision], status: Mapping[str, Any] | None,
                  generation: int, now: float) -> dict[str, Any]:
    """The merge patch of status for these decisions: status.autoscaling per role and the
    conditions list with `Autoscaling` set (the other conditions as they are; a decision on a
    partial sample reads MetricsPartial there, its own reason in status.autoscaling)."""
    prev = status or {}
    prev_auto = prev.get("autoscaling") or {}
    auto: dict[str, Any] = {r: None for r in ROLES if r in prev_auto}
    for role, d in decisions.items():
        before = prev_auto.get(role) or {}
        auto[role] = {
            "desiredReplicas": d.desired,
            "lastScaleTime": (rfc3339(now) if d.desired != d.current
                              else before.get("lastScaleTime")),
            "reason": d.reason,
            "message": d.message,
            "metrics": {k: round(v, 6) for k, v in d.metrics.items()},
        }
    conds = [c for c in prev.get("conditions") or [] if c.get("type") != AUTOSCALING]
    old = next((c for c in prev.get("conditions") or [] if c.get("type") == AUTOSCALING), None)
    conds.append(autoscaling_condition(
        [(METRICS_PARTIAL if d.partial else d.reason, d.message) for d in decisions.values()],
        generation, old, rfc3339(now)))
    return {"autoscaling": auto, "conditions": conds}


def events_for(decisions: Mapping[str, Decision],
               status: Mapping[str, Any] | None) -> list[tuple[str, str, str, str]]:
    """An Event per change of replicas, and per change of a role's reason (so AtMaximum or
    MetricsUnavailable is said once, not every interval), as (type, reason, message, role)."""
    prev = (status or {}).get("autoscaling") or {}
    out = []
    for role, d in decisions.items():
        before = prev.get(role) or {}
        if d.direction != "none" or before.get("reason") != d.reason:
            kind = "Warning" if d.reason == METRICS_UNAVAILABLE else "Normal"
            out.append((kind, d.reason, d.message, role))
    return out


@dataclass
class _State:
    history: dict[str, deque[Sample]] = field(default_factory=dict)
    next_at: float = 0.0
    written_at: float = 0.0


class Autoscaler:
    """Runs beside the reconciler (same leader, same lock). ``fetch`` is injectable: tests and
    bench/autoscale_sim.py feed samples without pods."""

    def __init__(self, rec: Any, kube: Kube, fetch: Fetcher | None = None,
                 clock: Callable[[], float] = time.time, tick: float = 1.0) -> None:
        self.rec = rec
        self.kube = kube
        self.clock = clock
        self.tick = tick
        self._http = HttpGetter()
        self._fetch = fetch
        self._direct = DirectFetcher(self._list_pods, self._http.text)
        self._prometheus = PrometheusFetcher(self._http.json)
        self._state: dict[Key, _State] = {}
        self._specs: dict[Key, tuple[tuple[str, int], PDDeploymentSpec | None]] = {}

    async def _list_pods(self, namespace: str, selector: str) -> list[Obj]:
        out: list[Obj] = await self.kube.list_objects("Pod", namespace, selector)
        return out

    def fetcher(self, spec: PDDeploymentSpec) -> Fetcher:
        if self._fetch is not None:
            return self._fetch
        a = spec.autoscaling
        return self._prometheus if a is not None and a.prometheusURL else self._direct

    async def run_forever(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.tick)
                if not getattr(self.rec, "paused", False):
                    await self.step_all(self.clock())
        finally:
            await self._http.close()

    def _spec(self, key: Key, body: Obj) -> PDDeploymentSpec | None:
        """The parsed spec, once per generation (None: invalid)."""
        meta = body["metadata"]
        version = (str(meta.get("uid")), int(meta.get("generation") or 0))
        cached = self._specs.get(key)
        if cached is not None and cached[0] == version:
            return cached[1]
        try:
            spec: PDDeploymentSpec | None = parse_spec(body.get("spec"))
        except InvalidSpecError:
            spec = None
        self._specs[key] = (version, spec)
        return spec

    async def step_all(self, now: float) -> None:
        """One decision for every PDDeployment whose interval has passed."""
        due = []
        for key in [k for k in self._specs if k not in self.rec.pdds]:
            self._specs.pop(key, None)
            self._forget(key)
        for key, body in list(self.rec.pdds.items()):
            raw = body.get("spec")
            if not (isinstance(raw, dict) and raw.get("autoscaling")):
                self._forget(key)  # most PDDeployments: no parse, nothing kept
                continue
            if body["metadata"].get("deletionTimestamp"):
                continue
            spec = self._spec(key, body)
            roles = [r for r in ROLES if spec is not None and role_autoscaling(spec, r)]
            if spec is None or spec.autoscaling is None or not roles:
                self._forget(key)
                continue
            st = self._state.setdefault(key, _State())
            if now >= st.next_at:
                st.next_at = now + spec.autoscaling.intervalSeconds
                due.append(self.step(key, spec, roles, now))
        for result in await asyncio.gather(*due, return_exceptions=True):
            if isinstance(result, Exception):
                log.warning("autoscaling step failed: %s", result)

    def _forget(self, key: Key) -> None:
        if self._state.pop(key, None) is not None:
            for role in ROLES:
                try:
                    metrics.AUTOSCALE_DESIRED.remove(key[0], key[1], role)
                except KeyError:
                    pass

    async def step(self, key: Key, spec: PDDeploymentSpec, roles: Sequence[Role],
                   now: float) -> dict[str, Decision]:
        body = self.rec.pdds.get(key)
        if body is None:
            return {}
        st = self._state.setdefault(key, _State())
        assert spec.autoscaling is not None
        a = spec.autoscaling
        samples = await self.fetcher(spec)(body, spec, roles, now)
        keep = (max(a.scaleDownStabilizationSeconds, JUMP_NOISE_INTERVALS * a.intervalSeconds)
                + 4 * a.intervalSeconds)
        for role in roles:
            h = st.history.setdefault(role, deque())
            if role in samples:
                h.append(samples[role])
            while h and h[0].time < now - keep:
                h.popleft()
        async with self.rec.lock(key):
            body = self.rec.pdds.get(key)
            if body is None:
                return {}
            status = body.get("status") or {}
            current = effective_replicas(spec, status)
            decisions = plan(a, current, {r: list(st.history.get(r, ())) for r in roles}, now,
                             last_scale_times(status))
            patch = status_update(decisions, status, int(body["metadata"].get("generation")
                                                         or 0), now)
            moved = any(d.direction != "none" for d in decisions.values())
            prev_auto = status.get("autoscaling") or {}
            reasons_changed = any((prev_auto.get(r) or {}).get("reason") != d.reason
                                  for r, d in decisions.items())
            if moved or reasons_changed or now - st.written_at >= REFRESH_SECONDS or any(
                    r not in decisions for r in prev_auto):
                meta = body["metadata"]
                out = await self.kube.patch_status(KIND, meta["namespace"], meta["name"], patch)
                self.rec.observe_pdd(out)
                st.written_at = now
        if moved:
            # Before the events: they go last at the API server's gate, and the pass that
            # builds the decision must not wait on them (the status write's own watch event
            # starts no pass: handlers.is_echo).
            self.rec.kick(*key)
        for kind, reason, message, subject in events_for(decisions, status):
            await self.kube.post_event(body, kind, reason, message, series=subject)
        for d in decisions.values():
            metrics.AUTOSCALE_DESIRED.labels(key[0], key[1], d.role).set(d.desired)
            metrics.AUTOSCALE_DECISIONS.labels(
                d.role, {"up": "up", "down": "down"}.get(d.direction, "hold"), d.reason).inc()
            if d.reason in (SCALED_UP, SCALED_DOWN) or d.direction != "none":
                log.info("%s/%s %s", key[0], key[1], d.message)
        return decisions
