"""Operator at scale: 200 PDDeployments (1 prefill + 2 decode replicas, tp 2) applied at once
on the local control plane, against a baseline that creates the same 600 pods directly with the
Python client as fast as it can, in the same run on the same cluster.

    .venv/bin/python bench/operator_scale.py [--count 200] [--nodes 24] [--gpus 64] [--scale 50]
        [--repeat 3] [--no-webhook]

Prints, for the operator and the baseline: apply -> all pods of a set created (p50, p99) and
the total, apply -> Ready (p50, p99, total; for the baseline: all 3 pods Ready), the
operator/baseline ratios, how far `Ready=True` trails the pods' own readiness (p99 against
p99), then a planner decision while all are Ready, the operator's peak RSS and CPU seconds,
and the API server's requests of each side from apply to all Ready (its own
apiserver_request_duration_seconds: count and mean latency per verb and resource, and its
calls to the admission webhook), so the reader sees where the operator's time goes.
`--repeat N` runs baseline and operator N times on one cluster and ends with each figure's
median and every run's value (this box's runs vary by 2x); `--no-webhook` runs the operator
without its admission webhook; `--operator-root DIR`, repeated, runs each checkout's operator
after the same baseline (two versions compared in the same run conditions).

The planner decision goes the planner's whole way: the first --scale PDDeployments have decode
autoscaling on (2..3 replicas, sequencesPerReplica, metrics from a Prometheus stand-in in this
process, spec.autoscaling.prometheusURL), steady at 2; a load step on all of them at once makes
the planner decide 3 (status.autoscaling), and the operator's pass builds it. Timed: load step
-> decision in status (within one interval), decision -> new pod created, decision -> Ready=True
with 3 decode replicas Ready.

Uses its own control plane under .cache/bench-cluster (started and stopped here), never the
test cluster. The router is disabled so both sides create exactly the same pods (the operator
still writes the routing ConfigMap and two headless Services per PDDeployment).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "cluster"))
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from kubernetes import client, config, watch  # noqa: E402
from localcluster import DEFAULT_BIN_DIR, down, up  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from prometheus_stub import PrometheusStub  # noqa: E402

from pdd_api.autoscale import JUMP_NOISE_SAMPLES  # noqa: E402
from pdd_api.validation import parse_spec  # noqa: E402
from pdd_operator.builders import Owner, build  # noqa: E402

GROUP, VERSION, PLURAL = "serving.pdd.dev", "v1alpha1", "pddeployments"
SPEC: dict[str, Any] = {
    "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"},
    "image": "pdd:0.1.0",
    "prefill": {"replicas": 1, "tensorParallelSize": 2, "decodeContextParallelSize": 2},
    "decode": {"replicas": 2, "tensorParallelSize": 2, "decodeContextParallelSize": 1},
    "router": {"enabled": False},
}
PODS_PER_SET = 3
PER_REPLICA = 10  # decode's sequencesPerReplica under autoscaling


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


class _Watch:
    """A watch on its own thread; a broken stream is restarted (it re-lists)."""

    def __init__(self, api: Any, ns: str) -> None:
        self.api, self.ns = api, ns
        self.ready: dict[str, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self._stream()
            except Exception:  # noqa: BLE001
                time.sleep(0.2)

    def _stream(self) -> None:
        raise NotImplementedError


class PodWatch(_Watch):
    """Client-side times at which each pod was first seen and first seen Ready."""

    def __init__(self, api: client.CoreV1Api, ns: str) -> None:
        self.added: dict[str, float] = {}
        super().__init__(api, ns)

    def _stream(self) -> None:
        w = watch.Watch()
        for ev in w.stream(self.api.list_namespaced_pod, self.ns, timeout_seconds=30,
                           _request_timeout=60):
            now = time.monotonic()
            pod = ev["object"]
            name = pod.metadata.name
            self.added.setdefault(name, now)
            if any(c.type == "Ready" and c.status == "True"
                   for c in (pod.status.conditions or [])):
                self.ready.setdefault(name, now)
            if self.stop.is_set():
                w.stop()
                break


class PddWatch(_Watch):
    """Client-side times at which each PDDeployment was first seen Ready, first seen with each
    planner decision (status.autoscaling.decode.desiredReplicas) and first seen Ready=True with
    each count of decode replicas Ready."""

    def __init__(self, api: Any, ns: str) -> None:
        self.decided: dict[tuple[str, int], float] = {}
        self.why: dict[tuple[str, int], str] = {}  # the decision's message
        self.ready_decode: dict[tuple[str, int], float] = {}
        super().__init__(api, ns)

    def _stream(self) -> None:
        w = watch.Watch()
        for ev in w.stream(self.api.list_namespaced_custom_object, GROUP, VERSION, self.ns,
                           PLURAL, timeout_seconds=30, _request_timeout=60):
            now = time.monotonic()
            obj = ev["object"]
            name = obj["metadata"]["name"]
            gen = obj["metadata"].get("generation")
            status = obj.get("status") or {}
            desired = ((status.get("autoscaling") or {}).get("decode") or {}).get(
                "desiredReplicas")
            if desired is not None:
                self.decided.setdefault((name, int(desired)), now)
                self.why.setdefault((name, int(desired)), str(
                    ((status.get("autoscaling") or {}).get("decode") or {}).get("message")))
            for c in status.get("conditions") or []:
                if (c["type"] == "Ready" and c["status"] == "True"
                        and c.get("observedGeneration") == gen):
                    self.ready.setdefault(name, now)
                    ready = int((status.get("decode") or {}).get("readyReplicas") or 0)
                    self.ready_decode.setdefault((name, ready), now)
            if self.stop.is_set():
                w.stop()
                break


class LoadPrometheus(PrometheusStub):
    """The planner's decode queries for a PDDeployment: 2 instances holding PER_REPLICA
    sequences each, and 6 x PER_REPLICA sequences once it is in `loaded` (the planner wants 3,
    its maxReplicas, on one sample). Latency and KV queries have no data."""

    def __init__(self) -> None:
        self.loaded: set[str] = set()
        self.samples: dict[str, int] = {}  # the planner's decode samples asked, per name
        self.scraped: dict[str, float] = {}  # its first scrape of a name once loaded
        super().__init__()

    def answer(self, query: str) -> float | None:
        m = re.search(r'pod=~"(.+?)-decode-', query)
        if m is None:
            return None
        name = m.group(1).replace("\\", "")
        if query.startswith("count("):
            self.samples[name] = self.samples.get(name, 0) + 1
            if name in self.loaded:
                self.scraped.setdefault(name, time.monotonic())
            return 2
        if query.startswith("sum(pdd_running_sequences"):
            return (6 if name in self.loaded else 2) * PER_REPLICA
        if query.startswith("sum(pdd_waiting_sequences"):
            return 0
        return None


def autoscaled(url: str, interval: float) -> dict[str, Any]:
    """SPEC with decode autoscaled between its 2 replicas and 3, on sequences per replica."""
    return {**SPEC, "autoscaling": {
        "intervalSeconds": int(interval), "scaleDownStabilizationSeconds": 3600,
        "prometheusURL": url,
        "decode": {"minReplicas": 2, "maxReplicas": 3, "sequencesPerReplica": PER_REPLICA}}}


def wait_until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def set_pods(name: str, ns: str) -> list[str]:
    return [f"{name}-prefill-0", f"{name}-decode-0", f"{name}-decode-1"]


def summarize(starts: dict[str, float], done: dict[str, float]) -> dict[str, float]:
    lat = [done[n] - starts[n] for n in starts]
    return {"p50_s": pct(lat, 0.5), "p99_s": pct(lat, 0.99),
            "total_s": max(done.values()) - min(starts.values())}


def proc_usage(pid: int) -> tuple[float, float]:
    """(peak RSS MiB, CPU seconds) of a process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    hwm = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return hwm / 1024, (int(fields[11]) + int(fields[12])) / ticks


def gpus_needed(count: int, scaled: int) -> int:
    """GPUs of `count` sets and of one more decode pod on `scaled` of them."""
    desired = build(Owner("x", "ns", "uid"), parse_spec(SPEC))

    def gpus(pod: dict[str, Any]) -> int:
        return sum(int((c.get("resources", {}).get("limits") or {}).get("nvidia.com/gpu", 0))
                   for c in pod["spec"]["containers"])
    per_set = sum(gpus(p) for role in ("prefill", "decode") for p in desired.pods[role].values())
    return count * per_set + scaled * gpus(desired.pods["decode"][0])


def names(count: int, prefix: str) -> list[str]:
    return [f"{prefix}-{i:03d}" for i in range(count)]


Counts = dict[tuple[str, str], list[float]]  # (verb, resource) -> [requests, seconds]


def apiserver_counts(kc: list[str]) -> tuple[Counts, list[float]]:
    """The API server's own request counters (apiserver_request_duration_seconds: count and
    sum by verb and resource, watches left out) and its calls to the admission webhook
    (apiserver_admission_webhook_admission_duration_seconds: count and sum)."""
    text = subprocess.run([*kc, "get", "--raw", "/metrics"], check=True, capture_output=True,
                          text=True).stdout
    out: Counts = {}
    hook = [0.0, 0.0]
    for fam in text_string_to_metric_families(text):
        if fam.name == "apiserver_request_duration_seconds":
            for smp in fam.samples:
                verb = smp.labels.get("verb", "")
                if verb in ("WATCH", "CONNECT") or smp.name.endswith("_bucket"):
                    continue
                key = (verb, smp.labels.get("resource", "") + (
                    "/" + smp.labels["subresource"] if smp.labels.get("subresource") else ""))
                slot = out.setdefault(key, [0.0, 0.0])
                slot[0 if smp.name.endswith("_count") else 1] += smp.value
        elif fam.name == "apiserver_admission_webhook_admission_duration_seconds":
            for smp in fam.samples:
                if smp.name.endswith("_count"):
                    hook[0] += smp.value
                elif smp.name.endswith("_sum"):
                    hook[1] += smp.value
    return out, hook


def counts_between(before: tuple[Counts, list[float]],
                   after: tuple[Counts, list[float]]) -> dict[str, Any]:
    """Requests and mean latency per verb and resource between two snapshots (only those
    that moved), and the webhook calls'."""
    rows = {}
    for key, (n, secs) in after[0].items():
        n0, s0 = before[0].get(key, [0.0, 0.0])
        if n - n0 >= 1:
            rows[f"{key[0]} {key[1]}"] = {"requests": int(n - n0),
                                          "mean_ms": 1000 * (secs - s0) / (n - n0)}
    dn, ds = after[1][0] - before[1][0], after[1][1] - before[1][1]
    return {"requests": rows, "webhook_calls": int(dn),
            "webhook_mean_ms": 1000 * ds / dn if dn else 0.0}


def print_requests(base: dict[str, Any], op: dict[str, Any]) -> None:
    """The API server's requests of each run side by side: where the operator's time goes."""
    keys = sorted(set(base["requests"]) | set(op["requests"]),
                  key=lambda k: -(op["requests"].get(k, {}).get("requests", 0)
                                  + base["requests"].get(k, {}).get("requests", 0)))
    print(f"{'API server requests (apply -> Ready)':44}{'baseline':>10}{'ms mean':>9}"
          f"{'operator':>10}{'ms mean':>9}")
    for k in keys:
        b, o = base["requests"].get(k, {}), op["requests"].get(k, {})
        if b.get("requests", 0) + o.get("requests", 0) < 10:
            continue
        print(f"{k:44}{b.get('requests', 0):10d}{b.get('mean_ms', 0):9.1f}"
              f"{o.get('requests', 0):10d}{o.get('mean_ms', 0):9.1f}")
    print(f"{'admission webhook calls':44}{base['webhook_calls']:10d}"
          f"{base['webhook_mean_ms']:9.1f}{op['webhook_calls']:10d}{op['webhook_mean_ms']:9.1f}")


def run_baseline(core: client.CoreV1Api, ns: str, count: int, threads: int,
                 full: bool, kc: list[str]) -> dict[str, Any]:
    """`full`: also the routing ConfigMap and the two headless Services of each set (their
    endpoint updates load the control plane as much as the pods do)."""
    spec = parse_spec(SPEC)
    pods = PodWatch(core, ns)
    starts: dict[str, float] = {}

    def create_set(name: str) -> None:
        desired = build(Owner(name, ns, "baseline"), spec)
        bodies = [p for role in ("prefill", "decode") for p in desired.pods[role].values()]
        starts[name] = time.monotonic()
        for body in bodies:
            body["metadata"].pop("ownerReferences")
            core.create_namespaced_pod(ns, body, _preload_content=False)
        if full:
            desired.configmap["metadata"].pop("ownerReferences")
            core.create_namespaced_config_map(ns, desired.configmap, _preload_content=False)
            for svc in desired.services:
                svc["metadata"].pop("ownerReferences")
                core.create_namespaced_service(ns, svc, _preload_content=False)

    sets = names(count, "base")
    before = apiserver_counts(kc)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(create_set, sets))
    wait_until(lambda: all(p in pods.added for s in sets for p in set_pods(s, ns)), 600,
               "baseline pods created")
    wait_until(lambda: all(p in pods.ready for s in sets for p in set_pods(s, ns)), 900,
               "baseline pods Ready")
    after = apiserver_counts(kc)
    pods.stop.set()
    created = {s: max(pods.added[p] for p in set_pods(s, ns)) for s in sets}
    ready = {s: max(pods.ready[p] for p in set_pods(s, ns)) for s in sets}
    return {"created": summarize(starts, created), "ready": summarize(starts, ready),
            "api": counts_between(before, after)}


def run_planner(sets: list[str], prometheus: LoadPrometheus, pods: PodWatch,
                pdds: PddWatch, applied: float, interval: float) -> dict[str, Any]:
    """A load step on the autoscaled `sets` while every PDDeployment is Ready: the planner
    decides decode 2 -> 3 in status, the pass it kicks creates the pod. Timed from the load
    step to the decision, and from the decision to the new pod's creation and to Ready=True
    with 3 decode replicas Ready (the operator's share).

    The planner acts on one sample only when the jump stands out of the noise of at least
    JUMP_NOISE_SAMPLES samples before it (pdd_api.autoscale; fewer: it waits for a second
    sample, one more interval). The step comes once the sets have had that many steady
    samples (one per interval from their creation, at `applied`), so the decision is due
    within one interval; `warmup_s` says how long that wait was."""
    wait_until(lambda: all((s, 2) in pdds.decided for s in sets), 120,
               "the planner's first decisions (decode 2)")
    began = time.monotonic()
    wait_until(lambda: time.monotonic() >= applied + (JUMP_NOISE_SAMPLES + 1) * interval
               and min(prometheus.samples.get(s, 0) for s in sets) > JUMP_NOISE_SAMPLES,
               30 * interval, f"{JUMP_NOISE_SAMPLES + 1} steady samples of each")
    warmup = time.monotonic() - began
    asked = sorted(prometheus.samples.get(s, 0) for s in sets)
    print(f"planner: waited {warmup:.0f} s for steady samples before the load step "
          f"({JUMP_NOISE_SAMPLES} before a one-sample jump; asked {asked[0]}..{asked[-1]} "
          "per set)", file=sys.stderr)
    start = time.monotonic()
    prometheus.loaded.update(sets)
    wait_until(lambda: all((s, 3) in pdds.decided for s in sets), 300,
               "the planner's decisions (decode 3)")
    new_pod = {s: f"{s}-decode-2" for s in sets}
    wait_until(lambda: all(p in pods.added for p in new_pod.values()), 300,
               "scaled-up pods created")
    wait_until(lambda: all((s, 3) in pdds.ready_decode for s in sets), 300,
               "Ready=True with 3 decode replicas Ready")
    decided = {s: pdds.decided[(s, 3)] for s in sets}
    created = {s: pods.added[new_pod[s]] for s in sets}
    ready = {s: pdds.ready_decode[(s, 3)] for s in sets}
    scraped = {s: prometheus.scraped.get(s, start) for s in sets}
    slowest = max(sets, key=lambda s: decided[s] - start)
    return {"count": len(sets), "warmup_s": warmup, "slowest": slowest,
            "slowest_why": pdds.why.get((slowest, 3)),
            "decided": summarize(dict.fromkeys(sets, start), decided),
            "scrape_to_decided": summarize(scraped, decided),
            "created": summarize(decided, created), "ready": summarize(decided, ready),
            "step_to_created": summarize(dict.fromkeys(sets, start), created)}


def run_operator(core: client.CoreV1Api, crd: client.CustomObjectsApi, ns: str, count: int,
                 threads: int, kubeconfig: str, log: Path, scale_count: int,
                 interval: float, webhook: bool, kc: list[str],
                 root: Path = ROOT) -> dict[str, Any]:
    # This checkout's operator (or --operator-root's), not whichever one the environment has
    # installed.
    path = os.pathsep.join(p for p in (str(root / "operator"), os.environ.get("PYTHONPATH"))
                           if p)
    env = {**os.environ, "KUBECONFIG": kubeconfig, "PYTHONPATH": path}
    prometheus = LoadPrometheus()
    if os.environ.get("BENCH_PROFILE"):
        env["PDD_PROFILE"] = os.environ["BENCH_PROFILE"]
    args = [sys.executable, "-m", "pdd_operator", "-n", ns, "--standalone",
            "--metrics-port", "0", "--liveness-port", "18581",
            "--webhook-port", "18543" if webhook else "0",
            "--webhook-config-name", f"pdd-bench-{ns}", "--resync-seconds", "120"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        import urllib.request

        def live() -> bool:
            try:
                with urllib.request.urlopen("http://127.0.0.1:18581/healthz", timeout=2):
                    return True
            except OSError:
                return proc.poll() is not None
        wait_until(live, 60, "operator start")
        if proc.poll() is not None:
            raise SystemExit(f"operator exited: {log.read_text()[-2000:]}")
        time.sleep(2)  # the webhook server starts right after the liveness endpoint
        rss0, cpu0 = proc_usage(proc.pid)
        before = apiserver_counts(kc)
        pods = PodWatch(core, ns)
        pdds = PddWatch(crd, ns)
        starts: dict[str, float] = {}
        stored: dict[str, float] = {}  # the create call answered (admitted and stored)
        sets = names(count, "pdd")
        planned = set(sets[:scale_count])
        planned_spec = autoscaled(prometheus.url, interval)

        def apply(name: str) -> None:
            body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PDDeployment",
                    "metadata": {"name": name},
                    "spec": planned_spec if name in planned else SPEC}
            starts[name] = time.monotonic()
            crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body,
                                                _preload_content=False)
            stored[name] = time.monotonic()

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(apply, sets))
        wait_until(lambda: all(p in pods.added for s in sets for p in set_pods(s, ns)), 600,
                   "operator pods created")
        wait_until(lambda: all(s in pdds.ready for s in sets), 900, "PDDeployments Ready")
        wait_until(lambda: all(p in pods.ready for s in sets for p in set_pods(s, ns)), 60,
                   "operator pods Ready")
        after = apiserver_counts(kc)
        cpu_ready = proc_usage(proc.pid)[1] - cpu0
        created = {s: max(pods.added[p] for p in set_pods(s, ns)) for s in sets}
        pods_ready = {s: max(pods.ready[p] for p in set_pods(s, ns)) for s in sets}
        planner = (run_planner(sets[:scale_count], prometheus, pods, pdds,
                               max(starts[s] for s in sets[:scale_count]), interval)
                   if scale_count else None)
        rss, cpu = proc_usage(proc.pid)
        pods.stop.set()
        pdds.stop.set()
        return {"created": summarize(starts, created), "ready": summarize(starts, pdds.ready),
                "applied": summarize(starts, stored),
                "stored_to_created": summarize(stored, created),
                "pods_ready": summarize(starts, pods_ready), "planner": planner,
                "operator_peak_rss_mib": rss, "operator_cpu_s": cpu - cpu0,
                "operator_cpu_to_ready_s": cpu_ready,
                "operator_idle_rss_mib": rss0, "api": counts_between(before, after)}
    finally:
        # Deleting the PDDeployments needs the operator (kopf's finalizer): leave the
        # namespace to the cluster's teardown instead.
        proc.terminate()
        proc.wait(timeout=30)
        prometheus.close()
        subprocess.run([*kc, "delete", "validatingwebhookconfiguration", f"pdd-bench-{ns}",
                        "--ignore-not-found"], capture_output=True)


# Quiet: fewer requests than this per second over a window (24 nodes' heartbeats and leases,
# the controllers' leases: a few per second).
SETTLE_RATE, SETTLE_WINDOW = 15.0, 4.0


def make_namespace(kc: list[str], ns: str) -> None:
    subprocess.run([*kc, "create", "namespace", ns], check=True, capture_output=True)
    wait_until(lambda: subprocess.run([*kc, "get", "sa", "default", "-n", ns],
                                      capture_output=True).returncode == 0,
               60, "default service account")


def delete_namespace(kc: list[str], ns: str) -> None:
    """Waited for: the next run needs the GPUs its pods hold; then for the control plane to
    settle (the garbage collector still reads and deletes the owned objects after the
    namespace is gone), so the next side does not pay for this one's cleanup."""
    subprocess.run([*kc, "delete", "namespace", ns, "--wait=true", "--timeout=600s"],
                   capture_output=True)
    start = time.monotonic()
    last = apiserver_counts(kc)
    while time.monotonic() - start < 120:
        time.sleep(SETTLE_WINDOW)
        now = apiserver_counts(kc)
        moved = sum(v["requests"] for v in counts_between(last, now)["requests"].values())
        last = now
        if moved < SETTLE_RATE * SETTLE_WINDOW:
            break
    print(f"control plane settled {time.monotonic() - start:.0f} s after deleting {ns}",
          file=sys.stderr)


def one_run(args: argparse.Namespace, kc: list[str], kubeconfig: str, core: Any, crd: Any,
            run: int) -> list[dict[str, Any]]:
    """The baseline, then each --operator-root's operator in turn (the order alternates from
    run to run), against that baseline."""
    base_ns = f"bench-baseline-{run}"
    make_namespace(kc, base_ns)
    print(f"run {run + 1}: baseline ({args.baseline}): {args.count} x {PODS_PER_SET} pods "
          f"with the Python client, {args.threads} threads ...", file=sys.stderr)
    base = run_baseline(core, base_ns, args.count, args.threads, args.baseline == "full", kc)
    delete_namespace(kc, base_ns)
    out = []
    # Alternate the order run by run: the second operator does not always meet a busier box.
    order = list(enumerate(args.operator_root))
    for k, root in order if run % 2 == 0 else order[::-1]:
        op_ns = f"bench-operator-{run}-{k}"
        make_namespace(kc, op_ns)
        print(f"run {run + 1}: operator of {root}: {args.count} PDDeployments applied at once "
              f"(webhook {'off' if args.no_webhook else 'on'}) ...", file=sys.stderr)
        op = run_operator(core, crd, op_ns, args.count, args.threads, kubeconfig,
                          args.state_dir / f"operator-{run}-{k}.log", min(args.scale, args.count),
                          args.interval, not args.no_webhook, kc, root)
        delete_namespace(kc, op_ns)
        out.append({"operator_root": str(root), "baseline": base, "operator": op,
                    "ratio_created_total": op["created"]["total_s"] / base["created"]["total_s"],
                    "ratio_ready_total": op["ready"]["total_s"] / base["ready"]["total_s"],
                    "ratio_ready_p99_to_pods_ready_p99": (op["ready"]["p99_s"]
                                                          / op["pods_ready"]["p99_s"])})
    return out


def print_run(args: argparse.Namespace, r: dict[str, Any]) -> None:
    b, o = r["baseline"], r["operator"]
    print(f"{'':34}{'p50 s':>9}{'p99 s':>9}{'total s':>10}")
    for label, side in (("baseline apply->pods created", b["created"]),
                        ("operator apply->pods created", o["created"]),
                        ("baseline apply->pods Ready", b["ready"]),
                        ("operator apply->pods Ready", o["pods_ready"]),
                        ("operator apply->Ready=True", o["ready"])):
        print(f"{label:34}{side['p50_s']:9.3f}{side['p99_s']:9.3f}{side['total_s']:10.2f}")
    print(f"{'operator apply (create answered)':34}{o['applied']['p50_s']:9.3f}"
          f"{o['applied']['p99_s']:9.3f}{o['applied']['total_s']:10.2f}")
    print(f"{'operator answered->pods created':34}{o['stored_to_created']['p50_s']:9.3f}"
          f"{o['stored_to_created']['p99_s']:9.3f}{o['stored_to_created']['total_s']:10.2f}")
    print(f"operator/baseline total, pods created: {r['ratio_created_total']:.2f}x "
          f"(target <= 1.0x); Ready: {r['ratio_ready_total']:.2f}x")
    print(f"operator p99 apply->pods created: {o['created']['p99_s']:.3f} s")
    print(f"operator p99 apply->Ready=True / p99 apply->pods Ready: "
          f"{r['ratio_ready_p99_to_pods_ready_p99']:.2f}x (target <= 1.2x)")
    sc = o["planner"]
    if sc is not None:
        print_planner(args, sc)
    print(f"operator peak RSS {o['operator_peak_rss_mib']:.0f} MiB, CPU "
          f"{o['operator_cpu_to_ready_s']:.1f} s apply -> all Ready, "
          f"{o['operator_cpu_s']:.1f} s for the run")
    print_requests(b["api"], o["api"])


def print_planner(args: argparse.Namespace, sc: dict[str, Any]) -> None:
    print(f"planner decision on {sc['count']} of {args.count} at once (decode 2 -> 3, interval "
          f"{args.interval} s): load step -> decision in status p50 "
          f"{sc['decided']['p50_s']:.3f} s, p99 {sc['decided']['p99_s']:.3f} s (its first "
          f"scrape after the step -> decision p50 {sc['scrape_to_decided']['p50_s']:.3f} s, "
          f"p99 {sc['scrape_to_decided']['p99_s']:.3f} s); decision -> "
          f"new pod created p50 {sc['created']['p50_s']:.3f} s, p99 "
          f"{sc['created']['p99_s']:.3f} s; decision -> Ready=True with 3 decode Ready p50 "
          f"{sc['ready']['p50_s']:.3f} s, p99 {sc['ready']['p99_s']:.3f} s; load step -> all "
          f"new pods created {sc['step_to_created']['total_s']:.2f} s (target: decision "
          f"within one interval, {args.interval} s); the slowest decision: "
          f"{sc['slowest']}: {sc['slowest_why']}")


def _planner(r: dict[str, Any], what: str) -> float:
    sc = r["operator"]["planner"]
    return float("nan") if sc is None else float(sc[what]["p99_s"])


SUMMARY = (
    ("pods created, operator/baseline total (x)", lambda r: r["ratio_created_total"]),
    ("operator pods created total (s)", lambda r: r["operator"]["created"]["total_s"]),
    ("baseline pods created total (s)", lambda r: r["baseline"]["created"]["total_s"]),
    ("operator pods created p99 (s)", lambda r: r["operator"]["created"]["p99_s"]),
    ("operator applying all (create answered) total (s)",
     lambda r: r["operator"]["applied"]["total_s"]),
    ("operator create answered -> pods created p99 (s)",
     lambda r: r["operator"]["stored_to_created"]["p99_s"]),
    ("baseline pods created p99 (s)", lambda r: r["baseline"]["created"]["p99_s"]),
    ("Ready=True p99 / pods Ready p99 (x)", lambda r: r["ratio_ready_p99_to_pods_ready_p99"]),
    ("planner: load step -> decision p99 (s)",
     lambda r: _planner(r, "decided")),
    ("planner: its scrape after the step -> decision p99 (s)",
     lambda r: _planner(r, "scrape_to_decided")),
    ("planner: decision -> pod created p99 (s)",
     lambda r: _planner(r, "created")),
    ("planner: decision -> Ready=True p99 (s)",
     lambda r: _planner(r, "ready")),
    ("operator peak RSS (MiB)", lambda r: r["operator"]["operator_peak_rss_mib"]),
    ("operator CPU apply -> all Ready (s)", lambda r: r["operator"]["operator_cpu_to_ready_s"]),
)


def print_summary(runs: list[dict[str, Any]], root: str) -> dict[str, Any]:
    """Median and spread (min .. max) of each figure over the runs."""
    out = {}
    print(f"\n{len(runs)} runs of the operator of {root}:")
    print(f"{'':9}{'figure':56}{'median':>9}   runs")
    for label, get in SUMMARY:
        values = [get(r) for r in runs]
        out[label] = {"median": statistics.median(values), "runs": values}
        print(f"{'':9}{label:56}{statistics.median(values):9.2f}   "
              + " ".join(f"{v:.2f}" for v in values))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--nodes", type=int, default=24)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--scale", type=int, default=50,
                    help="this many PDDeployments have decode autoscaling on; a load step "
                    "makes the planner scale all of them 2 -> 3 at once (0: no planner "
                    "phase)")
    ap.add_argument("--interval", type=int, default=15,
                    help="their spec.autoscaling.intervalSeconds (its default)")
    ap.add_argument("--baseline", choices=["pods", "full"], default="pods",
                    help="pods: the same 600 pods; full: plus each set's ConfigMap and "
                    "headless Services, as the operator writes them")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs (baseline, then operator) on the same cluster; the summary "
                    "gives each figure's median and every run's value")
    ap.add_argument("--no-webhook", action="store_true",
                    help="run the operator without its admission webhook (its cost apart)")
    ap.add_argument("--operator-root", type=Path, action="append", default=None,
                    help="the checkout whose operator runs (default: this one); repeated: "
                    "each in turn after the same baseline, to compare two versions in the "
                    "same run conditions")
    ap.add_argument("--state-dir", type=Path, default=ROOT / ".cache" / "bench-cluster")
    ap.add_argument("--keep", action="store_true", help="leave the bench cluster running")
    args = ap.parse_args()
    args.operator_root = [p.resolve() for p in args.operator_root or [ROOT]]

    need = gpus_needed(args.count, min(args.scale, args.count))
    if need > args.nodes * args.gpus:
        raise SystemExit(f"{args.count} PDDeployments and {args.scale} scaled up need {need} "
                         f"GPUs, more than --nodes {args.nodes} x --gpus {args.gpus}: pods would "
                         "stay Pending")
    cluster, started = up(args.state_dir, DEFAULT_BIN_DIR, nodes=args.nodes, gpus=args.gpus,
                          log=lambda m: print(m, file=sys.stderr))
    kubeconfig = str(cluster.kubeconfig)
    # In its own process: this one's threads would starve it of the GIL, and a late
    # heartbeat turns every pod NotReady for good (see operator_fixtures.NodeHeartbeat).
    heartbeat = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path[:0] = sys.argv[1:4]\n"
        "from operator_fixtures import NodeHeartbeat\n"
        "NodeHeartbeat(sys.argv[4])\n"
        "time.sleep(86400)"), str(ROOT / "tests" / "integration"),
        str(ROOT / "tests" / "cluster"), str(ROOT / "tests"), kubeconfig])
    runs: list[dict[str, Any]] = []
    try:
        time.sleep(2)
        if heartbeat.poll() is not None:
            raise SystemExit("the node heartbeat exited (its traceback is above): without it "
                             "the fake nodes, and every pod on them, turn NotReady")
        kc = ["kubectl", "--kubeconfig", kubeconfig]
        subprocess.run([*kc, "apply", "--server-side", "--force-conflicts", "-f",
                        str(ROOT / "crds" / "serving.pdd.dev_pddeployments.yaml"), "-f",
                        str(ROOT / "crds" / "serving.pdd.dev_pddrolescales.yaml"), "-f",
                        str(ROOT / "manifests" / "base" / "kopf-peering.yaml")],
                       check=True, capture_output=True)
        subprocess.run([*kc, "wait", "--for=condition=Established", "--timeout=60s",
                        "crd/pddeployments.serving.pdd.dev"], check=True, capture_output=True)
        api = config.new_client_from_config(kubeconfig)
        api.configuration.connection_pool_maxsize = args.threads * 2
        core, crd = client.CoreV1Api(api), client.CustomObjectsApi(api)
        for run in range(args.repeat):
            for r in one_run(args, kc, kubeconfig, core, crd, run):
                runs.append(r)
                print(f"\n--- run {run + 1} of {args.repeat}, operator of {r['operator_root']}")
                print_run(args, r)
            sys.stdout.flush()
    finally:
        heartbeat.kill()
        if started and not args.keep:
            down(args.state_dir, log=lambda _m: None)

    result: dict[str, Any] = {"count": args.count, "pods": args.count * PODS_PER_SET,
                              "baseline_kind": args.baseline, "webhook": not args.no_webhook,
                              "nodes": args.nodes, "gpus_per_node": args.gpus, "runs": runs}
    if args.repeat > 1:
        result["summary"] = {str(root): print_summary(
            [r for r in runs if r["operator_root"] == str(root)], str(root))
            for root in args.operator_root}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
