"""What the planner reads, from the instances' and the router's own /metrics (or a Prometheus).

The parsing and arithmetic are pure (tests feed them real exposition text); the two fetchers are
thin I/O around them. Latency percentiles come from the router's histograms: the difference of
two scrapes' cumulative buckets is the interval's requests, read as Prometheus'
histogram_quantile reads buckets; prefill's prompt tokens per second are the same difference of
each instance's computed-prompt-token counter, plus the growth of its queue (what arrived, not
only what ran). The instance gauges (running and waiting sequences, queued
prompt tokens, free and total KV blocks) are summed over the role's ready instances. vLLM
instances (engine vllm) export their own names; the KV share then stands for blocks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdd_api import keys
from pdd_api.autoscale import Role, Sample
from pdd_api.models import PDDeploymentSpec

log = logging.getLogger("pdd_operator.autoscale")

Obj = dict[str, Any]
Buckets = dict[float, float]  # upper bound (le) -> cumulative count

TTFT, TPOT = "pdd_router_ttft_seconds", "pdd_router_tpot_seconds"
LATENCY_METRIC: dict[str, str] = {"prefill": TTFT, "decode": TPOT}
RUNNING, WAITING = "pdd_running_sequences", "pdd_waiting_sequences"
QUEUED_PROMPT_TOKENS = "pdd_queued_prompt_tokens"
COMPUTED_PROMPT_TOKENS = ("pdd_prefill_computed_tokens_total", "vllm:prompt_tokens_total")
BLOCKS_FREE, BLOCKS_TOTAL = "pdd_kv_blocks_free", "pdd_kv_blocks_total"
VLLM_RUNNING, VLLM_WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
VLLM_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
SCRAPE_TIMEOUT = 5.0


@dataclass
class InstanceGauges:
    running: float = 0.0
    waiting: float = 0.0
    queued_prompt_tokens: float | None = None
    computed_prompt_tokens: float | None = None  # a counter: prompt tokens run since start
    blocks_used: float | None = None
    blocks_total: float | None = None


def parse_instance(text: str) -> InstanceGauges:
    """One instance's gauges. KV blocks are per rank and the same on every rank (one block
    table per instance): rank 0's are the instance's."""
    out = InstanceGauges()
    free = total = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in (RUNNING, VLLM_RUNNING):
                out.running += s.value
            elif s.name in (WAITING, VLLM_WAITING):
                out.waiting += s.value
            elif s.name == QUEUED_PROMPT_TOKENS:
                out.queued_prompt_tokens = (out.queued_prompt_tokens or 0.0) + s.value
            elif s.name in COMPUTED_PROMPT_TOKENS:
                out.computed_prompt_tokens = (out.computed_prompt_tokens or 0.0) + s.value
            elif s.name == BLOCKS_FREE and s.labels.get("rank", "0") == "0":
                free = s.value
            elif s.name == BLOCKS_TOTAL and s.labels.get("rank", "0") == "0":
                total = s.value
            elif s.name in VLLM_KV_USAGE:
                out.blocks_used, out.blocks_total = s.value, 1.0
    if total is not None and free is not None and total > 0:
        out.blocks_used, out.blocks_total = max(0.0, total - free), total
    return out


def parse_histogram(text: str, name: str) -> Buckets:
    """The cumulative buckets of one histogram, summed over its label sets."""
    out: Buckets = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name == f"{name}_bucket":
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out


def bucket_delta(now: Buckets, before: Buckets | None) -> Buckets:
    """What was observed between two scrapes; a counter that went back (a restart) counts
    from zero."""
    if before is None:
        return {}
    if any(now.get(le, 0.0) < v for le, v in before.items()):
        return dict(now)
    return {le: v - before.get(le, 0.0) for le, v in now.items()}


def add_buckets(parts: Iterable[Buckets]) -> Buckets:
    out: Buckets = {}
    for b in parts:
        for le, v in b.items():
            out[le] = out.get(le, 0.0) + v
    return out


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets: linear within the bucket the
    rank falls in; the highest finite bound when it falls in +Inf; None without observations."""
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return None
    total = items[-1][1]
    rank = q * total
    lower_le, lower_count = 0.0, 0.0
    for le, count in items:
        if count >= rank:
            if math.isinf(le):
                return lower_le
            if count == lower_count:
                return le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = le, count
    return lower_le


def counter_delta(now: float, before: float | None) -> float:
    """A counter's growth between two scrapes; one that went back (a restart), or an instance
    new since the last scrape, counts from zero."""
    return now if before is None or now < before else now - before


def prompt_tokens_per_second(elapsed: float, computed: float, queued_now: float | None,
                             queued_before: float | None) -> float | None:
    """Prompt tokens that arrived per second over ``elapsed``: those run (``computed``, the
    counters' growth summed) plus the queue's growth (a backlog that builds is load that
    arrived but did not run)."""
    if elapsed <= 0:
        return None
    grown = (queued_now or 0.0) - (queued_before or 0.0)
    return max(0.0, (computed + grown) / elapsed)


def role_sample(role: Role, now: float, instances: Sequence[InstanceGauges],
                latency: float | None, prompt_rate: float | None = None) -> Sample:
    """Sum the role's instances into one Sample (KV totals only when every instance says)."""
    kv = [(g.blocks_used, g.blocks_total) for g in instances]
    known = all(u is not None and t is not None for u, t in kv) and bool(kv)
    tokens = [g.queued_prompt_tokens for g in instances]
    return Sample(
        time=now, replicas=len(instances), latency=latency,
        queued_prompt_tokens=(sum(t for t in tokens if t is not None)
                              if role == "prefill" and any(t is not None for t in tokens)
                              else None),
        prompt_tokens_per_second=prompt_rate if role == "prefill" else None,
        kv_blocks_used=sum(u or 0.0 for u, _ in kv) if role == "decode" and known else None,
        kv_blocks_total=sum(t or 0.0 for _, t in kv) if role == "decode" and known else None,
        running_sequences=sum(g.running for g in instances),
        waiting_sequences=sum(g.waiting for g in instances),
    )


class Fetcher(Protocol):
    """Samples for one PDDeployment's roles at ``now``: a role with no usable metrics is
    absent (the planner holds it). Tests inject their own."""

    def __call__(self, body: Obj, spec: PDDeploymentSpec, roles: Sequence[Role],
                 now: float) -> Awaitable[dict[str, Sample]]: ...


# An instance spanning a LeaderWorkerSet group serves HTTP from its leader (worker 0) only.
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


def _ready(pod: Obj) -> bool:
    """A Ready pod that serves an instance's (or the router's) HTTP."""
    conds = (pod.get("status") or {}).get("conditions") or []
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool((pod.get("status") or {}).get("podIP")) and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conds) and (
        labels.get(LWS_WORKER_INDEX, "0") == "0")


def _percentile(spec: PDDeploymentSpec, role: Role) -> float:
    a = spec.autoscaling
    target = None
    if a is not None:
        target = a.prefill.ttft if role == "prefill" and a.prefill else (
            a.decode.tpot if role == "decode" and a.decode else None)
    return (target.percentile if target is not None else 90.0) / 100.0


ListPods = Callable[[str, str], Awaitable[list[Obj]]]  # (namespace, label selector) -> pods
Get = Callable[[str], Awaitable[str]]  # url -> body text


@dataclass
class DirectFetcher:
    """Scrapes each ready instance pod and router pod of the PDDeployment on its HTTP port.
    Histogram baselines are kept per router pod, so a router that restarts or is added only
    loses its first interval."""

    list_pods: ListPods
    get: Get
    port: int = keys.HTTP_PORT
    _before: dict[tuple[str, str, str], Buckets] = field(default_factory=dict)
    # (namespace, name) -> the last prefill scrape: its time, queued tokens, counter by pod
    _prefill_before: dict[tuple[str, str], tuple[float, float | None, dict[str, float]]] = (
        field(default_factory=dict))

    async def __call__(self, body: Obj, spec: PDDeploymentSpec, roles: Sequence[Role],
                       now: float) -> dict[str, Sample]:
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        pods = [p for p in await self.list_pods(ns, f"{keys.LABEL_INSTANCE}={name}")
                if _ready(p)]
        by_role: dict[str, list[Obj]] = {}
        for p in pods:
            comp = (p["metadata"].get("labels") or {}).get(keys.LABEL_COMPONENT, "")
            by_role.setdefault(comp, []).append(p)
        texts = await self._scrape([*(p for r in roles for p in by_role.get(r, [])),
                                    *by_role.get(keys.COMPONENT_ROUTER, [])])
        out: dict[str, Sample] = {}
        router_pods = by_role.get(keys.COMPONENT_ROUTER, [])
        router_up = [p for p in router_pods if texts.get(p["metadata"]["name"]) is not None]
        for role in roles:
            inst = [texts.get(p["metadata"]["name"]) for p in by_role.get(role, [])]
            if not inst or any(t is None for t in inst):
                continue  # an instance that did not answer: no sample rather than a wrong one
            latency = None
            metric = LATENCY_METRIC[role]
            if router_up:
                deltas = []
                for p in router_up:
                    key = (ns, p["metadata"]["name"], metric)
                    cur = parse_histogram(texts[p["metadata"]["name"]] or "", metric)
                    deltas.append(bucket_delta(cur, self._before.get(key)))
                    self._before[key] = cur
                latency = histogram_quantile(_percentile(spec, role), add_buckets(deltas))
            elif spec.router.enabled:
                continue  # the latency target cannot be read without the router
            gauges = [parse_instance(t or "") for t in inst]
            rate = None
            if role == "prefill":
                rate = self._prompt_rate((ns, name), now, by_role.get(role, []), gauges)
            out[role] = role_sample(role, now, gauges, latency, rate)
        return out

    def _prompt_rate(self, key: tuple[str, str], now: float, pods: list[Obj],
                     gauges: list[InstanceGauges]) -> float | None:
        counters = {p["metadata"]["name"]: g.computed_prompt_tokens
                    for p, g in zip(pods, gauges, strict=True)}
        queued = sum(g.queued_prompt_tokens or 0.0 for g in gauges)
        before = self._prefill_before.get(key)
        known = {k: v for k, v in counters.items() if v is not None}
        self._prefill_before[key] = (now, queued, known)
        if before is None or len(known) < len(counters):
            return None  # the first scrape, or an instance without the counter: no rate
        t0, q0, c0 = before
        computed = sum(counter_delta(v, c0.get(k)) for k, v in known.items())
        return prompt_tokens_per_second(now - t0, computed, queued, q0)

    async def _scrape(self, pods: list[Obj]) -> dict[str, str | None]:
        async def one(p: Obj) -> tuple[str, str | None]:
            url = f"http://{p['status']['podIP']}:{self.port}/metrics"
            try:
                return p["metadata"]["name"], await self.get(url)
            except Exception as exc:  # noqa: BLE001 - a missing scrape is a held decision
                log.debug("scrape of %s failed: %s", url, exc)
                return p["metadata"]["name"], None
        return dict(await asyncio.gather(*(one(p) for p in pods)))


def _selector(ns: str, pods: str) -> str:
    return f'{{namespace="{ns}",pod=~"{pods}"}}'


def prometheus_queries(ns: str, name: str, role: Role, percentile: float,
                       window_seconds: int) -> dict[str, str]:
    """The PromQL the Prometheus source asks, per role (docs/autoscaling.md lists them): the
    scrape config must keep the `namespace` and `pod` labels (a PodMonitor's default)."""
    inst = _selector(ns, f"{re.escape(name)}-{role}-.*")
    router = _selector(ns, f"{re.escape(name)}-.*")
    q = {
        "replicas": f"count({RUNNING}{inst})",
        "latency": f"histogram_quantile({percentile:g}, sum by (le) "
                   f"(rate({LATENCY_METRIC[role]}_bucket{router}[{window_seconds}s])))",
        "running": f"sum({RUNNING}{inst})",
        "waiting": f"sum({WAITING}{inst})",
    }
    if role == "prefill":
        q["queued"] = f"sum({QUEUED_PROMPT_TOKENS}{inst})"
        q["promptRate"] = (f"sum(rate({COMPUTED_PROMPT_TOKENS[0]}{inst}[{window_seconds}s])) + "
                           f"sum(deriv({QUEUED_PROMPT_TOKENS}{inst}[{window_seconds}s]))")
    else:
        r0 = inst[:-1] + ',rank="0"}'
        q["kvUsed"] = f"sum({BLOCKS_TOTAL}{r0}) - sum({BLOCKS_FREE}{r0})"
        q["kvTotal"] = f"sum({BLOCKS_TOTAL}{r0})"
    return q


def prometheus_value(answer: Mapping[str, Any]) -> float | None:
    """An instant query's scalar: the first series' value; None when empty or NaN."""
    data = answer.get("data") or {}
    result = data.get("result") or []
    if answer.get("status") != "success" or not result:
        return None
    value = result[0].get("value") if data.get("resultType") == "vector" else result
    try:
        x = float(value[1])
    except (TypeError, ValueError, IndexError):
        return None
    return None if math.isnan(x) else x


@dataclass
class PrometheusFetcher:
    """Asks a Prometheus (spec.autoscaling.prometheusURL) the same figures."""

    get_json: Callable[[str], Awaitable[Mapping[str, Any]]]

    async def __call__(self, body: Obj, spec: PDDeploymentSpec, roles: Sequence[Role],
                       now: float) -> dict[str, Sample]:
        a = spec.autoscaling
        assert a is not None and a.prometheusURL
        base = a.prometheusURL.rstrip("/")
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        out: dict[str, Sample] = {}
        for role in roles:
            queries = prometheus_queries(ns, name, role, _percentile(spec, role),
                                         max(2 * a.intervalSeconds, 30))
            try:
                answers = await asyncio.gather(*(
                    self.get_json(f"{base}/api/v1/query?query={quote(q)}")
                    for q in queries.values()))
            except Exception as exc:  # noqa: BLE001 - an unreachable Prometheus holds
                log.debug("Prometheus %s: %s", base, exc)
                continue
            v = dict(zip(queries, (prometheus_value(x) for x in answers), strict=True))
            n = int(v["replicas"] or 0)
            if n <= 0:
                continue
            out[role] = Sample(
                time=now, replicas=n, latency=v["latency"],
                queued_prompt_tokens=v.get("queued"),
                prompt_tokens_per_second=(None if v.get("promptRate") is None
                                          else max(0.0, v["promptRate"] or 0.0)),
                kv_blocks_used=v.get("kvUsed"),
                kv_blocks_total=v.get("kvTotal"), running_sequences=v["running"],
                waiting_sequences=v["waiting"])
        return out


class HttpGetter:
    """One aiohttp session for the scrapes (short timeouts: a slow pod must not delay the
    others' decisions)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT))
        return self._session

    async def text(self, url: str) -> str:
        async with self._open().get(url) as resp:
            resp.raise_for_status()
            return await resp.text()

    async def json(self, url: str) -> Mapping[str, Any]:
        async with self._open().get(url) as resp:
            resp.raise_for_status()
            out: Mapping[str, Any] = await resp.json()
            return out

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
