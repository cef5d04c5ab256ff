"""What the planner reads, from the instances' and the router's own /metrics (or a Prometheus).

The parsing and arithmetic are pure (tests feed them real exposition text); the two fetchers are
thin I/O around them. Latency percentiles come from the router's histograms: the difference of
two scrapes' cumulative buckets is the interval's requests, read as Prometheus'
histogram_quantile reads buckets; prefill's prompt tokens per second are the same difference of
each instance's computed-prompt-token counter, plus the growth of its queue (what arrived, not
only what ran), each over the time since that pod's own last scrape. The instance gauges
(running and waiting sequences, queued prompt tokens, free and total KV blocks) are summed over
the role's ready instances that answered; when some did not, but at least MIN_ANSWERED_SHARE of
them, the sums are scaled up to the ready count and the sample is marked partial. vLLM
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
# A role gets a sample when at least this share of its ready instances (and at least one)
# answered its scrape: at hundreds of replicas some always time out under the very load that
# calls for more, and a role that waited for all of them would never scale then.
MIN_ANSWERED_SHARE = 0.5


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


def counter_delta(now: float, before: float) -> float:
    """A counter's growth between two scrapes of one pod; one that went back (the pod's
    process restarted) counts from zero, as Prometheus' rate() does: never negative, and no more
    than the pod ran since."""
    return now if now < before else now - before


def prompt_tokens_per_second(elapsed: float, computed: float, queued_now: float | None,
                             queued_before: float | None) -> float | None:
    """Prompt tokens that arrived per second at one pod over ``elapsed``: those run
    (``computed``, its counter's growth) plus its queue's growth (a backlog that builds is load
    that arrived but did not run). Not clamped: the two are read a moment apart, so one pod's
    reading may dip below zero; the role's sum is clamped."""
    if elapsed <= 0:
        return None
    return (computed + (queued_now or 0.0) - (queued_before or 0.0)) / elapsed


def enough_answered(answered: int, ready: int) -> bool:
    """Whether a role whose ``ready`` instances were scraped gets a sample from ``answered``."""
    return answered >= max(1, math.ceil(ready * MIN_ANSWERED_SHARE))


def role_sample(role: Role, now: float, instances: Sequence[InstanceGauges],
                latency: float | None, prompt_rate: float | None = None,
                ready: int | None = None) -> Sample:
    """Sum the role's instances that answered into one Sample (KV totals only when every one
    says). With ``ready`` above their count, the sums (``prompt_rate`` included, which those
    instances' counters gave) are scaled to ``ready``: the planner reads the load of all the
    ready instances, and the answering ones are the best estimate of the others."""
    n = len(instances)
    total = n if ready is None else max(ready, n)
    k = total / n if n else 1.0

    def scaled(x: float | None) -> float | None:
        return None if x is None else x * k

    kv = [(g.blocks_used, g.blocks_total) for g in instances]
    known = all(u is not None and t is not None for u, t in kv) and bool(kv)
    tokens = [g.queued_prompt_tokens for g in instances]
    return Sample(
        time=now, replicas=total, latency=latency,
        queued_prompt_tokens=(scaled(sum(t for t in tokens if t is not None))
                              if role == "prefill" and any(t is not None for t in tokens)
                              else None),
        prompt_tokens_per_second=scaled(prompt_rate) if role == "prefill" else None,
        kv_blocks_used=(scaled(sum(u or 0.0 for u, _ in kv)) if role == "decode" and known
                        else None),
        kv_blocks_total=(scaled(sum(t or 0.0 for _, t in kv)) if role == "decode" and known
                         else None),
        running_sequences=scaled(sum(g.running for g in instances)),
        waiting_sequences=scaled(sum(g.waiting for g in instances)),
        answered=n if total > n else None,
    )


class Fetcher(Protocol):
    """Samples for one PDDeployment's roles at ``now``: a role with no usable metrics is
    absent (the planner holds it). Tests inject their own."""

    def __call__(self, body: Obj, spec: PDDeploymentSpec, roles: Sequence[Role],
                 now: float) -> Awaitable[dict[str, Sample]]: ...


# An instance spanning a LeaderWorkerSet group serves HTTP from its leader (worker 0) only.
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


def _pod_key(pod: Obj) -> str:
    """A pod's identity for its counter baseline: a pod recreated under the same name is a new
    one (its counters start again)."""
    meta = pod.get("metadata") or {}
    return str(meta.get("uid") or meta.get("name"))


def _serves(pod: Obj) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(LWS_WORKER_INDEX, "0") == "0"


def _ready(pod: Obj) -> bool:
    """A Ready pod that serves an instance's (or the router's) HTTP."""
    conds = (pod.get("status") or {}).get("conditions") or []
    return bool((pod.get("status") or {}).get("podIP")) and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conds) and _serves(pod)


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
    loses its first interval. Prefill's counter baselines are kept per pod while the pod exists,
    Ready or not: a pod that leaves Ready for a while and comes back is read against its own
    last scrape, over the time since (counting it from zero would add its whole lifetime's
    tokens to one interval); a pod with no baseline yet adds nothing that interval."""

    list_pods: ListPods
    get: Get
    port: int = keys.HTTP_PORT
    _before: dict[tuple[str, str, str], Buckets] = field(default_factory=dict)
    # (namespace, name) -> pod (uid) -> its last answered prefill scrape: time, computed-token
    # counter, queued prompt tokens
    _counters: dict[tuple[str, str], dict[str, tuple[float, float, float]]] = (
        field(default_factory=dict))

    async def __call__(self, body: Obj, spec: PDDeploymentSpec, roles: Sequence[Role],
                       now: float) -> dict[str, Sample]:
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        listed = await self.list_pods(ns, f"{keys.LABEL_INSTANCE}={name}")
        by_role: dict[str, list[Obj]] = {}
        for p in listed:
            if _ready(p):
                comp = (p["metadata"].get("labels") or {}).get(keys.LABEL_COMPONENT, "")
                by_role.setdefault(comp, []).append(p)
        texts = await self._scrape([*(p for r in roles for p in by_role.get(r, [])),
                                    *by_role.get(keys.COMPONENT_ROUTER, [])])
        out: dict[str, Sample] = {}
        router_pods = by_role.get(keys.COMPONENT_ROUTER, [])
        router_up = [p for p in router_pods if texts.get(p["metadata"]["name"]) is not None]
        for role in roles:
            ready = by_role.get(role, [])
            up = [(p, t) for p in ready if (t := texts.get(p["metadata"]["name"])) is not None]
            if not enough_answered(len(up), len(ready)):
                continue  # too few answered: no sample rather than a guess
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
            gauges = [parse_instance(t) for _, t in up]
            rate = None
            if role == "prefill":
                alive = {_pod_key(p) for p in listed}
                rate = self._prompt_rate((ns, name), now, alive,
                                         [(_pod_key(p), g) for (p, _), g in zip(up, gauges,
                                                                               strict=True)])
            out[role] = role_sample(role, now, gauges, latency, rate, ready=len(ready))
        return out

    def _prompt_rate(self, key: tuple[str, str], now: float, alive: set[str],
                     answered: list[tuple[str, InstanceGauges]]) -> float | None:
        """Prompt tokens per second that arrived at the pods that answered, each read against
        its own baseline; None on the first scrape or while a pod lacks the counter."""
        base = self._counters.setdefault(key, {})
        for gone in [k for k in base if k not in alive]:
            del base[gone]
        if any(g.computed_prompt_tokens is None for _, g in answered):
            return None
        rates = []
        for pod, g in answered:
            computed, queued = g.computed_prompt_tokens or 0.0, g.queued_prompt_tokens or 0.0
            before = base.get(pod)
            base[pod] = (now, computed, queued)
            if before is not None:
                t0, c0, q0 = before
                r = prompt_tokens_per_second(now - t0, counter_delta(computed, c0), queued, q0)
                if r is not None:
                    rates.append(r)
        return max(0.0, sum(rates)) if rates else None

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
