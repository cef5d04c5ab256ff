"""Fixtures and helpers for the operator's integration tests.

Each test module gets its own namespace and one `python -m pdd_operator` subprocess watching only
that namespace, with its validating webhook registered for that namespace alone, so modules (and
other engineers' tests on the same control plane) never see each other's objects.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from localcluster import Cluster
from polling import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = REPO_ROOT / "crds" / "serving.pdd.dev_pddeployments.yaml"
ROLE_SCALE_CRD_FILE = REPO_ROOT / "crds" / "serving.pdd.dev_pddrolescales.yaml"
PEERING_FILE = REPO_ROOT / "manifests" / "base" / "kopf-peering.yaml"
EXAMPLES = sorted((REPO_ROOT / "manifests" / "examples").glob("*.yaml"))
CRD_NAME = "pddeployments.serving.pdd.dev"
GROUP, VERSION, PLURAL = "serving.pdd.dev", "v1alpha1", "pddeployments"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_example(path: Path) -> dict[str, Any]:
    return next(d for d in yaml.safe_load_all(path.read_text()) if d)


def strip_cel(crd: dict[str, Any]) -> dict[str, Any]:
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    root.pop("x-kubernetes-validations", None)  # the name rule
    root["properties"]["spec"].pop("x-kubernetes-validations", None)
    return crd


class NodeHeartbeat:
    """Renews a Lease per fake node, as a kubelet does, unless kwok already holds it.

    Without node leases (kwok runs without --node-lease-duration-seconds) the node lifecycle
    controller marks the fake nodes NotReady about once a minute and sets every pod on them
    Ready=False, which kwok never sets back: a test waiting for Ready then waits forever.
    With kwok renewing its own leases this is a no-op."""

    HOLDER = "pdd-test-heartbeat"

    def __init__(self, kubeconfig: str, period: float = 5.0) -> None:
        from kubernetes import client, config

        api = config.new_client_from_config(kubeconfig)
        self.core = client.CoreV1Api(api)
        self.leases = client.CoordinationV1Api(api)
        self.period = period
        self.stop = threading.Event()
        nodes = self.core.list_node(label_selector="type=kwok").items
        self.nodes = [(n.metadata.name, n.metadata.uid) for n in nodes]
        held = [lease.spec.holder_identity for lease in
                self.leases.list_namespaced_lease("kube-node-lease").items]
        # kwok renewing its own leases (--node-lease-duration-seconds): nothing to do.
        self.needed = not any(h not in (None, self.HOLDER) for h in held)
        self.thread = threading.Thread(target=self._run, daemon=True)
        if self.needed:
            self.thread.start()

    def beat(self) -> None:
        """One PATCH per node (a renewal must stay cheap on a saturated API server: a slow
        beat is exactly the missed heartbeat this works around)."""
        from kubernetes.client.rest import ApiException

        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spec = {"holderIdentity": self.HOLDER, "leaseDurationSeconds": 40, "renewTime": now}
        for name, uid in self.nodes:
            try:
                self.leases.patch_namespaced_lease(name, "kube-node-lease", {"spec": spec},
                                                   _preload_content=False)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                self.leases.create_namespaced_lease("kube-node-lease", {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": name, "namespace": "kube-node-lease",
                                 "ownerReferences": [{"apiVersion": "v1", "kind": "Node",
                                                      "name": name, "uid": uid}]},
                    "spec": spec}, _preload_content=False)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - best effort; the next beat retries
                pass
            self.stop.wait(self.period)


_HEARTBEATS: dict[str, NodeHeartbeat] = {}


def node_heartbeat(kubeconfig: str) -> NodeHeartbeat:
    if kubeconfig not in _HEARTBEATS:
        _HEARTBEATS[kubeconfig] = NodeHeartbeat(kubeconfig)
    return _HEARTBEATS[kubeconfig]


class Kubectl:
    """kubectl and JSON reads against the test cluster (`Cluster.kubectl` with helpers)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def __call__(self, *args: str, input: str | None = None,
                 check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, input=input, check=check)

    def json(self, *args: str) -> Any:
        return self.cluster.kubectl_json(*args)

    def maybe(self, *args: str) -> Any:
        proc = self.cluster.kubectl(*args, "-o", "json", check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def apply(self, obj: dict[str, Any] | list[dict[str, Any]], *extra: str,
              check: bool = True) -> subprocess.CompletedProcess[str]:
        docs = obj if isinstance(obj, list) else [obj]
        return self("apply", *extra, "-f", "-", input=yaml.safe_dump_all(docs), check=check)


def install_crd(k: Kubectl, cel: bool = True) -> bool:
    """Install the committed CRD (CEL included); returns False when the API server refused it
    and the CEL-less variant was installed instead, so the operator tests still run."""
    crd = yaml.safe_load(CRD_FILE.read_text())
    ok = True
    if cel:
        ok = k("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE),
               check=False).returncode == 0
    if not cel or not ok:
        k("apply", "--server-side", "--force-conflicts", "-f", "-",
          input=yaml.safe_dump(strip_cel(crd)))
    role_scale = yaml.safe_load(ROLE_SCALE_CRD_FILE.read_text())
    if not cel or k("apply", "--server-side", "--force-conflicts", "-f", str(ROLE_SCALE_CRD_FILE),
                    check=False).returncode != 0:
        k("apply", "--server-side", "--force-conflicts", "-f", "-",
          input=yaml.safe_dump(strip_cel(role_scale)))
    for crd_name in (CRD_NAME, role_scale["metadata"]["name"]):
        k("wait", "--for=condition=Established", "--timeout=50s", f"crd/{crd_name}")
    for plural in ("pddeployments", "pddrolescales"):
        wait_for(f"discovery of {plural}",
                 lambda plural=plural: k("get", plural, "-A", check=False).returncode == 0)
    return ok


class Operator:
    """One operator process for a namespace. `stop(kill=True)` is a crash (SIGKILL)."""

    def __init__(self, cluster: Cluster, namespace: str, log_dir: Path, *,
                 webhook: bool = True, env: dict[str, str] | None = None,
                 priority: int | None = None, resync: float = 5.0,
                 standalone: bool = True) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.webhook = webhook
        self.metrics_port = free_port()
        self.liveness_port = free_port()
        self.webhook_port = free_port() if webhook else 0
        self.webhook_config = f"pdd-test-{namespace}"
        self.env = env or {}
        self.priority = priority
        self.standalone = standalone  # peering is the HA test's subject, a delay elsewhere
        self.resync = resync
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"operator-{self.namespace}-{self.metrics_port}-{self.runs}.log"

    def start(self, wait: bool = True, extra_env: dict[str, str] | None = None) -> Operator:
        self.runs += 1
        args = [sys.executable, "-m", "pdd_operator", "-n", self.namespace,
                "--metrics-port", str(self.metrics_port),
                "--liveness-port", str(self.liveness_port),
                "--webhook-port", str(self.webhook_port),
                "--webhook-config-name", self.webhook_config,
                "--resync-seconds", str(self.resync)]
        if self.priority is not None:
            args += ["--priority", str(self.priority)]
        if self.standalone:
            args.append("--standalone")
        env = {**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig), **self.env,
               **(extra_env or {})}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self) -> None:
        def live() -> bool:
            assert self.alive(), f"operator exited:\n{self.log()}"
            try:
                url = f"http://127.0.0.1:{self.liveness_port}/healthz"
                with urllib.request.urlopen(url, timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_for("operator liveness endpoint", live, timeout=60)
        if self.webhook:
            wait_for("operator webhook port", self._webhook_up, timeout=60)

    def _webhook_up(self) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        try:
            with socket.create_connection(("127.0.0.1", self.webhook_port), timeout=2) as s:
                with ctx.wrap_socket(s):
                    return True
        except OSError:
            return False

    def stop(self, kill: bool = False) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def log(self, tail: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-tail:])
        except OSError:
            return "<no log>"

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())


def make_namespace(k: Kubectl, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    k("create", "namespace", name)
    wait_for(f"service account {name}/default",
             lambda: k("get", "sa", "default", "-n", name, check=False).returncode == 0)
    return name


def teardown_namespace(k: Kubectl, ns: str, op: Operator | None) -> None:
    """PDDeployments carry kopf's finalizer (the periodic timer): delete them while the
    operator runs, then the namespace."""
    if op is not None and op.alive():
        k("delete", "pddeployments", "--all", "-n", ns, "--timeout=50s", check=False)
    else:
        for item in (k.maybe("get", "pddeployments", "-n", ns) or {}).get("items", []):
            k("patch", "pddeployment", item["metadata"]["name"], "-n", ns, "--type=merge",
              "-p", '{"metadata":{"finalizers":null}}', check=False)
    if op is not None:
        op.stop()
        k("delete", "validatingwebhookconfiguration", op.webhook_config, "--ignore-not-found",
          check=False)
    k("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="module")
def kube(cluster: Cluster) -> Kubectl:
    node_heartbeat(str(cluster.kubeconfig))
    k = Kubectl(cluster)
    install_crd(k)
    k("apply", "--server-side", "--force-conflicts", "-f", str(PEERING_FILE))
    return k


@pytest.fixture(scope="module")
def op_namespace(kube: Kubectl, request: pytest.FixtureRequest) -> Iterator[str]:
    ns = make_namespace(kube, "op")
    yield ns


@pytest.fixture(scope="module")
def operator(cluster: Cluster, kube: Kubectl, op_namespace: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(cluster, op_namespace, tmp_path_factory.mktemp("operator"))
    op.start()
    yield op
    teardown_namespace(kube, op_namespace, op)


# ----------------------------------------------------------------------------- reads


def pdd(k: Kubectl, ns: str, name: str) -> dict[str, Any]:
    return k.json("get", "pddeployment", name, "-n", ns)  # type: ignore[no-any-return]


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def pods_of(k: Kubectl, ns: str, name: str, role: str | None = None) -> list[dict[str, Any]]:
    sel = f"app.kubernetes.io/instance={name},app.kubernetes.io/managed-by=pdd-operator"
    if role:
        sel += f",app.kubernetes.io/component={role}"
    items = k.json("get", "pods", "-n", ns, "-l", sel)["items"]
    return sorted(items, key=lambda p: p["metadata"]["name"])


def ready_current(k: Kubectl, ns: str, name: str) -> dict[str, Any] | None:
    """The PDDeployment once Ready=True for its current generation, else None."""
    obj = pdd(k, ns, name)
    gen = obj["metadata"].get("generation")
    c = conditions(obj).get("Ready")
    ok = (c is not None and c["status"] == "True" and c.get("observedGeneration") == gen
          and obj["status"].get("observedGeneration") == gen)
    return obj if ok else None


def wait_ready(k: Kubectl, ns: str, name: str, op: Operator | None = None,
               timeout: float = 90) -> dict[str, Any]:
    try:
        return wait_for(f"{ns}/{name} Ready", lambda: ready_current(k, ns, name),  # type: ignore[no-any-return]
                        timeout=timeout)
    except AssertionError as exc:
        detail = json.dumps((pdd(k, ns, name).get("status") or {}), indent=1)
        log = op.log() if op is not None else ""
        raise AssertionError(f"{exc}\nstatus: {detail}\noperator log:\n{log}") from None


def events_of(k: Kubectl, ns: str, name: str) -> list[dict[str, Any]]:
    items = k.json("get", "events", "-n", ns, "--field-selector",
                   f"involvedObject.kind=PDDeployment,involvedObject.name={name}")["items"]
    return items  # type: ignore[no-any-return]


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom"))
            for e in pod["spec"]["containers"][0]["env"]}


def routing_cm(k: Kubectl, ns: str, name: str) -> dict[str, Any]:
    """The routing ConfigMap of the current plan (`<name>-routing-<plan hash>`), found by the
    hash its PDDeployment's spec gives."""
    from pdd_api.validation import parse_spec
    from pdd_operator.builders import configmap_name, plan_hash, plan_of

    spec = parse_spec(pdd(k, ns, name)["spec"])
    return k.json("get", "configmap",  # type: ignore[no-any-return]
                  configmap_name(name, plan_hash(plan_of(spec))), "-n", ns)


def routing_cm_name(spec: dict[str, Any], name: str) -> str:
    from pdd_api.validation import parse_spec
    from pdd_operator.builders import configmap_name, plan_hash, plan_of

    return configmap_name(name, plan_hash(plan_of(parse_spec(spec))))
