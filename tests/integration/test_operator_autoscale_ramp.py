"""Issue 40's load ramp: prefill and decode scale up on real load, a re-apply of the manifest in
between changes nothing, and both come back down once the load stops, with zero failed
requests, the Autoscaling condition going ScaledUp then ScaledDown, Events carrying the metric
values, and Draining events for the replicas that go.

Why this tier. The e2e/realnode tier needs the sidecar image built and a real kubelet with
containerd; a PDDeployment of real instances there takes minutes to start and each scale-up
would start more CPU-model instances on a 2-core machine shared with other work, far past a
couple of minutes. So the test runs on the integration tier's control plane (real API server,
real operator process, kwok pods) and the planner's metrics come from a real data plane:

- real: the load (HTTP completions through a real `pdd serve`-style router to a real prefill and
  a real decode instance on the CPU model, every response checked), those instances' and the
  router's /metrics, the operator (its Prometheus source, planner, status, condition, Events,
  pod building and scale-down drain), `kubectl apply` / `kubectl diff` against a real API server;
- fed: `spec.autoscaling.prometheusURL` points at `RealMetricsPrometheus` below, a small
  Prometheus-compatible endpoint that scrapes the real instances on every query and answers the
  planner's PromQL (sum, count, difference of sums, histogram_quantile over the router's bucket
  increase in the query's window) as a PodMonitor-fed Prometheus would, the real prefill
  labelled `<name>-prefill-0`, the real decode `<name>-decode-0` and the router `<name>-router-0`;
- not real: the extra prefill and decode pods are kwok's and serve nothing, so a scale-up adds
  no capacity to the real data plane (the load stays on the one real instance of each role,
  which the planner measures as such) and the requests never cross a scaled pod. The
  data-plane half of scaling down under load (a drained instance finishes its work and takes no
  new) is tests/dataplane/test_scale_down_drain.py's.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_fixtures import (  # noqa: F401  (fixtures)
    Kubectl,
    Operator,
    conditions,
    kube,
    op_namespace,
    operator,
    pdd,
    pods_of,
    wait_for,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_stub import PrometheusStub

from pdd_operator.autoscale_metrics import bucket_delta, histogram_quantile, parse_histogram
from pdd_sidecar.serve.local_stack import LocalStack, StackConfig

pytestmark = pytest.mark.integration

NAME = "ramp"
# Two kinds of client, added in turn, so that each role's metric rises whichever role the
# machine makes the slower one (a single kind loads mostly the slower role: on one CPU decode
# held five sequences while prefill queued little, on another prefill queued while decode held
# one). Prompt clients send long prompts for 2 tokens: they sit in the prefill queue. Output
# clients send short prompts for 256 tokens: they sit in decode.
PROMPT_CLIENT = (320, 2)  # prompt tokens, max_tokens
OUTPUT_CLIENT = (96, 256)
MAX_CLIENTS = 6
# Small prefill steps: a long prompt takes 20 steps, so prompts queue up under concurrency and
# pdd_queued_prompt_tokens shows it between steps. 160 KV blocks of 16 tokens on the decode: an
# output client's sequence holds 22 of them (0.14), any two sequences are over the target, and
# all six clients' sequences fit at once.
STEP_TOKENS = 16
DECODE_BLOCKS = 160
QUEUED_PER_REPLICA = 64
KV_TARGET = 0.25
STABILIZATION_S = 15

SELECTOR = re.compile(r"(\w+)\{([^}]*)\}")
SLOPE = re.compile(r"(?:rate|deriv)\((\w+)\{([^}]*)\}\[(\w+)\]\)")

LABEL = re.compile(r'(\w+)(=~|=)"((?:[^"\\]|\\.)*)"')
QUANTILE = re.compile(r"histogram_quantile\(([\d.]+), sum by \(le\) \(rate\((\w+)_bucket"
                      r"\{([^}]*)\}\[(\d+)s\]\)\)\)")


def parse_window(w: str) -> float:
    return float(w[:-1]) * {"s": 1, "m": 60, "h": 3600}[w[-1]]


class RealMetricsPrometheus(PrometheusStub):
    """A Prometheus HTTP API over real /metrics endpoints: `targets` maps a pod name (the
    `pod` label a PodMonitor would add, with `namespace`) to the URL of a real process. Each
    query scrapes the targets its selector picks (cached for a fifth of a second: the planner
    asks several queries at once) and evaluates the few PromQL shapes the planner sends."""

    def __init__(self, namespace: str, targets: dict[str, str]) -> None:
        self.namespace = namespace
        self.targets = targets
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, str]] = {}
        self._buckets: dict[str, list[tuple[float, dict[float, float]]]] = {}
        self._series: dict[str, list[tuple[float, float]]] = {}
        super().__init__()

    def answer(self, query: str) -> float | None:
        try:
            return self.evaluate(query)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(f"{query}: {exc!r}")
            return None

    def _scrape(self, pod: str) -> str:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(pod)
            if hit is not None and now - hit[0] < 0.2:
                return hit[1]
        with urllib.request.urlopen(f"{self.targets[pod]}/metrics", timeout=3) as r:
            text = r.read().decode()
        with self._lock:
            self._cache[pod] = (now, text)
        return text

    def _pods(self, labels: str) -> tuple[list[str], dict[str, str]]:
        """The targets a selector picks, and its other (exact) label matchers."""
        pods = list(self.targets)
        rest: dict[str, str] = {}
        for key, op, value in LABEL.findall(labels):
            if key == "namespace":
                pods = pods if value == self.namespace else []
            elif key == "pod":
                pods = [p for p in pods if (re.fullmatch(value, p) if op == "=~" else p == value)]
            else:
                rest[key] = value
        return pods, rest

    def _samples(self, metric: str, labels: str) -> list[float] | None:
        """One value per picked target exposing the metric (its series summed), None when no
        target exposes it (an empty vector)."""
        pods, rest = self._pods(labels)
        out: list[float] = []
        for pod in pods:
            values = [s.value for fam in text_string_to_metric_families(self._scrape(pod))
                      for s in fam.samples
                      if s.name == metric and all(s.labels.get(k) == v for k, v in rest.items())]
            if values:
                out.append(sum(values))
        return out or None

    def _quantile(self, q: float, metric: str, labels: str, window: float) -> float | None:
        """histogram_quantile over the buckets' increase in the window, as `rate` would give
        it (the same ratio between buckets)."""
        pods, _ = self._pods(labels)
        now = time.monotonic()
        total: dict[float, float] = {}
        for pod in pods:
            cur = parse_histogram(self._scrape(pod), metric)
            if not cur:
                continue
            with self._lock:
                seen = self._buckets.setdefault(pod + metric, [])
                seen.append((now, cur))
                seen[:] = [(t, b) for t, b in seen if now - t <= window]
                oldest = seen[0][1]
            for le, v in bucket_delta(cur, oldest).items():
                total[le] = total.get(le, 0.0) + v
        return histogram_quantile(q, total) if total else None

    def _slope(self, metric: str, labels: str, window: float) -> float | None:
        """`rate` of a counter or `deriv` of a gauge, summed over the picked targets: the change
        per second between the oldest scrape in the window and now (None before two scrapes)."""
        pods, _ = self._pods(labels)
        now = time.monotonic()
        total, seen_any = 0.0, False
        for pod in pods:
            cur = self._samples(metric, f'pod="{pod}"')
            if cur is None:
                continue
            with self._lock:
                seen = self._series.setdefault(pod + metric, [])
                seen.append((now, cur[0]))
                seen[:] = [(t, v) for t, v in seen if now - t <= window]
                (t0, v0), (t1, v1) = seen[0], seen[-1]
            if t1 > t0:
                total += (v1 - v0) / (t1 - t0)
                seen_any = True
        return total if seen_any else None

    def evaluate(self, query: str) -> float | None:
        m = QUANTILE.fullmatch(query)
        if m:
            return self._quantile(float(m[1]), m[2], m[3], float(m[4]))
        terms = SLOPE.findall(query)
        if terms:  # sum(rate(A{..}[w])) + sum(deriv(B{..}[w])): empty if a term is
            parts = [self._slope(metric, labels, parse_window(w)) for metric, labels, w in terms]
            return None if any(v is None for v in parts) else sum(v or 0.0 for v in parts)
        if query.startswith("count("):
            metric, labels = SELECTOR.findall(query)[0]
            found = self._samples(metric, labels)
            return None if found is None else float(len(found))
        sums = [self._samples(metric, labels) for metric, labels in SELECTOR.findall(query)]
        if any(s is None for s in sums) or not sums:
            return None
        values = [sum(s or []) for s in sums]
        if " - " in query:
            assert len(values) == 2, query
            return values[0] - values[1]
        assert len(values) == 1, query
        return values[0]


class Ramp:
    """Clients sending completions through the router back to back; `more()` adds one, of
    each kind in turn.
    Every response is checked (status, token count); failures are kept."""

    def __init__(self, router: str) -> None:
        self.router = router
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def more(self) -> None:
        t = threading.Thread(target=self._client, args=(len(self._threads),), daemon=True)
        self._threads.append(t)
        t.start()

    @property
    def clients(self) -> int:
        return len(self._threads)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def _client(self, c: int) -> None:
        prompt_tokens, max_tokens = PROMPT_CLIENT if c % 2 == 0 else OUTPUT_CLIENT
        k = 0
        while not self._stop.is_set():
            k += 1
            body = {"prompt": [(c * 131 + k * 17 + j) % 250 + 1 for j in range(prompt_tokens)],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            req = urllib.request.Request(f"{self.router}/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            error = None
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    n = len(json.loads(resp.read())["choices"][0]["token_ids"])
                if n != max_tokens:
                    error = f"{n} tokens, not {max_tokens}"
            except urllib.error.HTTPError as exc:
                error = f"HTTP {exc.code}: {exc.read()[:300]!r}"
            except (OSError, KeyError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                if error is None:
                    self.ok += 1
                else:
                    self.failures.append(error)


class StatusLog:
    """Every Autoscaling condition reason the PDDeployment's status shows, in order, and every
    message its Events carried, read from two watches: a reason that lasts one pass is seen,
    and so is an Event message a later one of the same reason replaced (the operator keeps
    one Event per reason and bumps its count, as the kubelet's correlator does)."""

    def __init__(self, kubeconfig: str, namespace: str, name: str) -> None:
        from kubernetes import client, config, watch

        api = config.new_client_from_config(kubeconfig)
        self.reasons: list[str] = []
        self.events: list[tuple[str, str]] = []
        self._watches = [watch.Watch(), watch.Watch()]
        custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        streams = [
            (self._watches[0].stream(
                custom.list_namespaced_custom_object, "serving.pdd.dev", "v1alpha1", namespace,
                "pddeployments", field_selector=f"metadata.name={name}", timeout_seconds=600),
             self._on_object),
            (self._watches[1].stream(
                core.list_namespaced_event, namespace, timeout_seconds=600,
                field_selector=f"involvedObject.kind=PDDeployment,involvedObject.name={name}"),
             self._on_event)]
        for stream, on in streams:
            threading.Thread(target=self._run, args=(stream, on), daemon=True).start()

    def _on_object(self, obj: Any) -> None:
        reason = (conditions(obj).get("Autoscaling") or {}).get("reason")
        if reason and (not self.reasons or self.reasons[-1] != reason):
            self.reasons.append(reason)

    def _on_event(self, ev: Any) -> None:
        item = (ev.reason or "", ev.message or "")
        if item not in self.events:
            self.events.append(item)

    def _run(self, stream: Iterator[dict[str, Any]], on: Any) -> None:
        try:
            for change in stream:
                on(change["object"])
        except Exception:  # noqa: BLE001 - stopped by close(); the assertions say what is missing
            pass

    def messages(self, reason: str) -> dict[str, str]:
        """The messages of one reason by their head ("decode 1→2")."""
        return {m.split(":")[0]: m for r, m in self.events if r == reason}

    def close(self) -> None:
        for w in self._watches:
            w.stop()


def manifest(url: str) -> dict[str, Any]:
    return {
        "apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"}, "image": "pdd:0.1.0",
            "prefill": {"replicas": 1, "tensorParallelSize": 1, "drainSeconds": 5},
            "decode": {"replicas": 1, "tensorParallelSize": 1, "drainSeconds": 5},
            "autoscaling": {
                "intervalSeconds": 1, "scaleDownStabilizationSeconds": STABILIZATION_S,
                "prometheusURL": url,
                "prefill": {"minReplicas": 1, "maxReplicas": 2,
                            "queuedPromptTokensPerReplica": QUEUED_PER_REPLICA},
                "decode": {"minReplicas": 1, "maxReplicas": 2,
                           "kvCacheUtilization": KV_TARGET},
            },
        },
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # Every prompt through the prefill, whose queue the planner scales on.
    cfg = StackConfig(port=0, log_level="WARNING", decode_num_blocks=DECODE_BLOCKS,
                      max_step_tokens=STEP_TOKENS, chunk_tokens=STEP_TOKENS,
                      long_chunk_tokens=STEP_TOKENS, local_prefill_tokens=0)
    with LocalStack(cfg, tmp_path_factory.mktemp("ramp-stack")) as s:
        s.start(timeout_s=180)
        yield s


def desired(k: Kubectl, ns: str) -> dict[str, int]:
    auto = (pdd(k, ns, NAME).get("status") or {}).get("autoscaling") or {}
    return {r: int((auto.get(r) or {}).get("desiredReplicas") or 0) for r in ("prefill", "decode")}


def live_uids(k: Kubectl, ns: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods_of(k, ns, NAME)
            if not p["metadata"].get("deletionTimestamp")}


def live(k: Kubectl, ns: str, role: str) -> list[str]:
    return [p["metadata"]["name"] for p in pods_of(k, ns, NAME, role)
            if not p["metadata"].get("deletionTimestamp")]


def test_a_load_ramp_scales_both_roles_up_and_back_down_losing_nothing(
        kube: Kubectl, operator: Operator, op_namespace: str, stack: LocalStack,
        tmp_path: Path) -> None:
    ns = op_namespace
    prom = RealMetricsPrometheus(ns, {f"{NAME}-prefill-0": stack.prefill_url,
                                      f"{NAME}-decode-0": stack.decode_url,
                                      f"{NAME}-router-0": stack.url})
    path = tmp_path / "ramp.yaml"
    path.write_text(yaml.safe_dump(manifest(prom.url)))
    kube("apply", "-n", ns, "-f", str(path))
    log = StatusLog(str(kube.cluster.kubeconfig), ns, NAME)
    ramp = Ramp(stack.url)
    try:
        wait_for("the planner's first decision (Stable on an idle data plane)",
                 lambda: desired(kube, ns) == {"prefill": 1, "decode": 1}, timeout=60)

        t0 = time.monotonic()
        # Rising concurrency until both roles have been scaled up.
        deadline = time.monotonic() + 120
        first_up: dict[str, int] = {}
        while (now := desired(kube, ns)) != {"prefill": 2, "decode": 2}:
            for role in (r for r, n in now.items() if n == 2 and r not in first_up):
                first_up[role] = round(time.monotonic() - t0)
            assert time.monotonic() < deadline, (
                f"not both scaled up with {ramp.clients} clients: {desired(kube, ns)}; "
                f"conditions {log.reasons}; operator log:\n{operator.log()}")
            if ramp.clients < MAX_CLIENTS:
                ramp.more()
            time.sleep(2)
        wait_for("2 prefill and 2 decode pods", lambda: (
            len(pods_of(kube, ns, NAME, "prefill")), len(pods_of(kube, ns, NAME, "decode")))
            == (2, 2), timeout=60)
        up = wait_for("ScaledUp events of both roles", lambda: (
            lambda m: m if {"prefill 1→2", "decode 1→2"} <= set(m) else None)(
            log.messages("ScaledUp")), timeout=10)
        assert re.search(r"queued prompt tokens \d+/replica > 64", up["prefill 1→2"]), up
        assert re.search(r"KV [01]\.\d\d > 0\.25", up["decode 1→2"]), up
        obj = pdd(kube, ns, NAME)
        t_up = time.monotonic() - t0

        # Under the same load, the original manifest applied again: nothing moves.
        generation, uids = obj["metadata"]["generation"], live_uids(kube, ns)
        assert "unchanged" in kube("apply", "-n", ns, "-f", str(path)).stdout
        time.sleep(4)  # several intervals and operator passes
        obj = pdd(kube, ns, NAME)
        assert obj["metadata"]["generation"] == generation
        assert obj["spec"]["prefill"]["replicas"] == obj["spec"]["decode"]["replicas"] == 1
        assert desired(kube, ns) == {"prefill": 2, "decode": 2}
        assert live_uids(kube, ns) == uids, "no pod rolled or went"
        diff = kube("diff", "-n", ns, "-f", str(path), check=False)
        assert diff.returncode == 0, diff.stdout

        # The load stops: both come back down, one at a time, each replica drained.
        ramp.stop()
        t1 = time.monotonic()
        wait_for("both back to 1", lambda: desired(kube, ns) == {"prefill": 1, "decode": 1},
                 timeout=90)
        t_down = time.monotonic() - t1
        wait_for("1 prefill and 1 decode pod", lambda: (
            len(live(kube, ns, "prefill")), len(live(kube, ns, "decode"))) == (1, 1), timeout=60)
        gone = sorted(n for n in set(uids) - set(live_uids(kube, ns))
                      if "-prefill-" in n or "-decode-" in n)
        assert len(gone) == 2 and {n.rsplit("-", 2)[1] for n in gone} == {"prefill", "decode"}
        down = wait_for("ScaledDown events of both roles", lambda: (
            lambda m: m if {"prefill 2→1", "decode 2→1"} <= set(m) else None)(
            log.messages("ScaledDown")), timeout=10)
        assert "prompt tokens queued" in down["prefill 2→1"], down
        assert re.search(r"KV 0\.\d\d", down["decode 2→1"]), down
        drained = [m for r, m in log.events if r == "Draining"]
        for pod in gone:
            assert any(f"Draining {pod} " in m and "within 5s" in m for m in drained), drained
        wait_for("ScaledDown after ScaledUp in the condition", lambda: (
            "ScaledUp" in log.reasons and "ScaledDown" in log.reasons[
                log.reasons.index("ScaledUp"):]), timeout=10)
    finally:
        ramp.stop()
        log.close()
        prom.close()
    assert not ramp.failures, f"{len(ramp.failures)} of {ramp.ok + len(ramp.failures)} " \
                              f"requests failed: {ramp.failures[:3]}"
    assert ramp.ok > 0
    assert not prom.errors, prom.errors[:3]
    assert any("histogram_quantile" in q for q in prom.asked)
    print(f"{ramp.ok} requests, none failed, {ramp.clients} clients at the peak, both up in "
          f"{t_up:.0f} s (first {first_up}), both down {t_down:.0f} s after the load stopped; "
          f"Autoscaling reasons {log.reasons}")
