"""The pdd images on the local cluster's real node: the Dockerfile's images (``make image``) run
as containers by a real kubelet, containerd and runc; a PDDeployment applied with kubectl gets
its prefill, decode and router pods there, and a completion through the router Service (its
ClusterIP, from the host, through kube-proxy) equals the single-process reference.

Opt-in (marker ``realnode``, never part of ``make test``): it needs root, ``make image`` and the
real node (``make test-realnode-e2e``). A running ``make cluster-up NODE=real`` is reused and
left running; otherwise the module starts a cluster of its own (no fake nodes) in
``.cache/cluster/realnode-e2e`` and stops it at the end. The operator runs from outside the
cluster, on the host, with the cluster's kubeconfig (``python -m pdd_operator --standalone``,
its webhook on 127.0.0.1): pods cannot reach the API server, which listens on 127.0.0.1 only,
and nothing in a sidecar pod needs it.

What only a kubelet shows lives here (the image's entry points, containerd IDs, `kubectl logs` and
`exec`, a liveness restart). The e2e tier's scenarios (three reference configurations, a decode pod
deleted, decode DCP changed and decode scaled under traffic) run on the real node through the shared
harness: ``PDD_E2E_NODE=real pytest -m e2e tests/e2e``, which ``make test-realnode-e2e`` runs too.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import localcluster
import pytest
import realnode
import yaml

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(1800)]

REPO_ROOT = harness.REPO_ROOT
OWN_STATE_DIR = REPO_ROOT / ".cache" / "cluster" / "realnode-e2e"
WORK_DIR = REPO_ROOT / ".cache" / "realnode-e2e"
GPUS = 8
NAME = "p-tp1-to-d-tp1"
# 270 byte-tokens, the e2e tier's prompt: five 64-token blocks, the last one partial, so every
# rank of a DCP-4 decode holds KV.
PROMPT = harness.prompt_ids("The quick brown fox jumps over the lazy dog. " * 6)
MAX_TOKENS = 8
ON_REAL_NODE: dict[str, Any] = {
    "nodeSelector": {"pdd.dev/node": "real"},
    "tolerations": [
        {"key": "pdd.dev/node", "operator": "Equal", "value": "real", "effect": "NoSchedule"}
    ],
}


image_tool = harness.image_tool()
SIDECAR_IMAGE = image_tool.image_name("sidecar", image_tool.DEFAULT_TAG)
OPERATOR_IMAGE = image_tool.image_name("operator", image_tool.DEFAULT_TAG)


def wait_for(what: str, check: Callable[[], Any], timeout: float, why: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{why()}")
        time.sleep(1)


# --------------------------------------------------------------------------- fixtures


@dataclass
class Node:
    cluster: localcluster.Cluster
    started: bool
    figures: dict[str, float]

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        return self.cluster.kubectl(*args, input=input, check=check).stdout

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        proc = self.cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def describe(self, namespace: str) -> str:
        pods = self.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False)
        events = self.kubectl(
            "get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False
        )
        return f"{pods}\n{events[-4000:]}\n{self.cluster.log_tails(20, ['kubelet'])}"


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    """The real node with the pdd images in its containerd."""
    if os.geteuid() != 0:
        pytest.fail("the real node needs root", pytrace=False)
    missing = [n for n in (SIDECAR_IMAGE, OPERATOR_IMAGE) if image_tool.image_id(n) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not built: run `make image`", pytrace=False)
    state = localcluster._env_path("PDD_CLUSTER_DIR", localcluster.DEFAULT_STATE_DIR)
    default = localcluster.Cluster.load(state)
    figures: dict[str, float] = {}
    reuse = default is not None and default.real_node is not None
    if default is not None and reuse and localcluster.healthy(default) is None:
        cluster, started = default, False
    else:
        messages: list[str] = []
        t0 = time.monotonic()
        try:
            cluster, started = localcluster.up(
                OWN_STATE_DIR, nodes=0, gpus=GPUS, timeout=240, log=messages.append,
                real_node=True,
            )  # fmt: skip
        except localcluster.ClusterError as e:
            pytest.fail(f"the real node did not start: {e}\n" + "\n".join(messages), pytrace=False)
        figures["cluster_up_s"] = time.monotonic() - t0
    try:
        for image in (SIDECAR_IMAGE, OPERATOR_IMAGE):
            took = image_tool.import_image(image)
            if took is not None:
                figures[f"import {image} s"] = took
        yield Node(cluster, started, figures)
    finally:
        print(f"real-node e2e figures: {json.dumps(figures)}")
        if started and os.environ.get("PDD_KEEP_CLUSTER") != "1":
            localcluster.down(OWN_STATE_DIR, log=lambda _m: None)


@pytest.fixture
def namespace(node: Node) -> Iterator[str]:
    name = f"rn-{uuid.uuid4().hex[:6]}"
    node.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        node.kubectl("delete", "namespace", name, "--wait=false", check=False)


@dataclass
class Operator:
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 40) -> str:
        return harness.tail(self.log, lines)


@pytest.fixture(scope="module")
def operator(node: Node) -> Iterator[Operator]:
    """The CRD, and the operator as a host process with the cluster's kubeconfig."""
    node.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(harness.CRD_FILE))
    node.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        "crd/pddeployments.serving.pdd.dev",
    )  # fmt: skip
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    log = WORK_DIR / "operator.log"
    port = harness.free_port()
    env = {**os.environ, "KUBECONFIG": str(node.cluster.kubeconfig), "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [harness.PYTHON, "-m", "pdd_operator", "--standalone",
             "--metrics-port", "0", "--liveness-port", "0",
             "--webhook-port", str(port), "--webhook-host", "127.0.0.1"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            cwd=REPO_ROOT, start_new_session=True,
        )  # fmt: skip
    op = Operator(proc, log)
    try:
        wait_for(
            "the operator's webhook",
            lambda: proc.poll() is not None or harness._tcp_open("127.0.0.1", port),
            90,
            op.tail,
        )
        assert proc.poll() is None, f"the operator exited:\n{op.tail()}"
        yield op
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def manifest() -> dict[str, Any]:
    """P TP1 -> D TP1, every pod on the real node (its label and taint)."""
    role = {"replicas": 1, "tensorParallelSize": 1, "decodeContextParallelSize": 1, **ON_REAL_NODE}
    return {
        "apiVersion": "serving.pdd.dev/v1alpha1",
        "kind": "PDDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"},
            "image": SIDECAR_IMAGE,
            "blockSize": 64,
            "prefill": role,
            "decode": dict(role),
            "router": {"template": {"spec": dict(ON_REAL_NODE)}},
        },
    }


@dataclass
class Deployment:
    node: Node
    operator: Operator
    namespace: str
    doc: dict[str, Any]
    name: str = NAME

    def why(self) -> str:
        return f"{self.node.describe(self.namespace)}\n--- operator\n{self.operator.tail()}"

    def service_url(self) -> str:
        svc = self.node.get("service", self.name, self.namespace)
        assert svc is not None, "no router Service"
        return f"http://{svc['spec']['clusterIP']}:{harness.ROUTER_PORT}"

    def router_ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.service_url() + "/readyz", timeout=5) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def is_ready(self) -> bool:
        obj = self.node.get("pddeployment", self.name, self.namespace) or {}
        status, gen = obj.get("status") or {}, obj.get("metadata", {}).get("generation")
        ready = {c["type"]: c for c in status.get("conditions", [])}.get("Ready", {})
        return status.get("observedGeneration") == gen and ready.get("status") == "True"

    def wait_ready(self, timeout: float = 600) -> None:
        wait_for(f"PDDeployment {self.name} Ready", self.is_ready, timeout, self.why)
        wait_for("the router Service's /readyz from the host", self.router_ready, 120, self.why)

    def complete(self, timeout: float = 120) -> list[int]:
        return list(self.complete_result(timeout)["choices"][0]["token_ids"])

    def complete_result(self, timeout: float = 120) -> dict[str, Any]:
        """One request through the router Service's ClusterIP, from the host (kube-proxy)."""
        body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
        req = urllib.request.Request(
            self.service_url() + "/v1/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return dict(json.loads(resp.read()))
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            raise AssertionError(f"router answered {e.code}: {detail}\n{self.why()}") from e

    def reference(self) -> list[int]:
        return harness.reference(PROMPT, MAX_TOKENS, harness.spec_dtype(self.doc))

    def pods(self) -> list[dict[str, Any]]:
        out = self.node.kubectl(
            "get", "pods", "-n", self.namespace, "-l", f"app.kubernetes.io/instance={self.name}",
            "-o", "json",
        )  # fmt: skip
        return list(json.loads(out)["items"])

    def pod(self, component: str) -> dict[str, Any]:
        found = [
            p for p in self.pods()
            if p["metadata"]["labels"].get("app.kubernetes.io/component") == component
            and not p["metadata"].get("deletionTimestamp")
        ]  # fmt: skip
        assert len(found) == 1, [p["metadata"]["name"] for p in found]
        return found[0]


@pytest.fixture(scope="module")
def deployment(node: Node, operator: Operator) -> Iterator[Deployment]:
    ns = f"rn-ref-{uuid.uuid4().hex[:6]}"
    node.kubectl("create", "namespace", ns)
    doc = manifest()
    dep = Deployment(node, operator, ns, doc)
    try:
        t0 = time.monotonic()
        node.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
        dep.wait_ready()
        node.figures["apply to Ready s"] = time.monotonic() - t0
        yield dep
    finally:
        node.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# --------------------------------------------------------------------------- tests


def _entry_pod(name: str, image: str, commands: dict[str, list[str]]) -> dict[str, Any]:
    """One container per command, run once; the examples mounted for ``pdd validate``."""
    examples = "/examples"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            **ON_REAL_NODE,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True},
            "volumes": [{"name": "examples", "configMap": {"name": "examples"}}],
            "containers": [
                {
                    "name": cname,
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": argv,
                    "volumeMounts": [{"name": "examples", "mountPath": examples}],
                }
                for cname, argv in commands.items()
            ],
        },
    }


BAD_DOC = {
    "apiVersion": "serving.pdd.dev/v1alpha1",
    "kind": "PDDeployment",
    "metadata": {"name": "bad"},
    "spec": {"model": {"name": "m"}, "image": "pdd:0.1.0", "decode": {},
             "prefill": {"tensorParallelSize": 2, "decodeContextParallelSize": 3}},
}  # fmt: skip


@pytest.mark.parametrize(
    ("image", "commands"),
    [
        (
            SIDECAR_IMAGE,
            {
                "sidecar-help": ["python", "-m", "pdd_sidecar", "--help"],
                "validate": ["pdd", "validate", "-f", "/examples/good.yaml"],
                "validate-bad": ["pdd", "validate", "-f", "/examples/bad.yaml"],
                "runtime": ["python", "-c", "import os, torch, nixl, pdd_sidecar.engine; "
                            "print(os.getuid(), torch.__version__)"],
            },
        ),
        (
            OPERATOR_IMAGE,
            {
                "operator-help": ["python", "-m", "pdd_operator", "--help"],
                "validate": ["pdd", "validate", "-f", "/examples/good.yaml"],
                "validate-bad": ["pdd", "validate", "-f", "/examples/bad.yaml"],
                "runtime": ["python", "-c", "import os, kopf, kubernetes; print(os.getuid())"],
            },
        ),
    ],
    ids=["sidecar", "operator"],
)
def test_image_entry_points_run_in_containers(
    node: Node, namespace: str, image: str, commands: dict[str, list[str]]
) -> None:
    node.kubectl(
        "create", "configmap", "examples", "-n", namespace,
        f"--from-literal=good.yaml={yaml.safe_dump(manifest())}",
        f"--from-literal=bad.yaml={yaml.safe_dump(BAD_DOC)}",
    )  # fmt: skip
    node.kubectl("apply", "-n", namespace, "-f", "-",
                 input=json.dumps(_entry_pod("entry", image, commands)))  # fmt: skip

    def finished() -> dict[str, Any] | None:
        pod = node.get("pod", "entry", namespace) or {}
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        done = [s for s in statuses if "terminated" in (s.get("state") or {})]
        return pod if len(done) == len(commands) else None

    pod = wait_for("the entry-point containers", finished, 180, lambda: node.describe(namespace))
    assert pod["spec"]["nodeName"] == realnode.NODE_NAME
    codes = {s["name"]: s["state"]["terminated"]["exitCode"]
             for s in pod["status"]["containerStatuses"]}  # fmt: skip
    logs = {c: node.kubectl("logs", "-n", namespace, "entry", "-c", c) for c in commands}
    want = {c: (1 if c == "validate-bad" else 0) for c in commands}
    assert codes == want, logs
    help_name = next(c for c in commands if c.endswith("-help"))
    assert "usage:" in logs[help_name], logs[help_name]
    assert "1 document(s) valid" in logs["validate"], logs["validate"]
    assert "spec.prefill.decodeContextParallelSize" in logs["validate-bad"], logs["validate-bad"]
    assert logs["runtime"].split()[0] == "10001", logs["runtime"]  # the image's USER


def test_reference_tp1_completion_equals_reference(deployment: Deployment) -> None:
    pods = deployment.pods()
    components = sorted(p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods)
    assert components == ["decode", "prefill", "router"], components
    for pod in pods:
        assert pod["spec"]["nodeName"] == realnode.NODE_NAME
        status = pod["status"]["containerStatuses"][0]
        assert status["containerID"].startswith("containerd://"), status
        assert status["image"].endswith(SIDECAR_IMAGE), status
    assert deployment.complete() == deployment.reference()


def test_logs_and_exec_in_a_sidecar_pod(deployment: Deployment) -> None:
    decode = deployment.pod("decode")["metadata"]["name"]
    ns = deployment.namespace
    logs = deployment.node.kubectl("logs", "-n", ns, decode)
    assert logs.strip(), "kubectl logs returned nothing"
    out = deployment.node.kubectl(
        "exec", "-n", ns, decode, "--", "python", "-c",
        "import json, os; print(os.getuid(), os.environ['PDD_ROLE'], "
        "sorted(json.load(open(os.environ['PDD_ROUTING_FILE']))))",
    )  # fmt: skip
    uid, role, keys = out.split(" ", 2)
    assert (uid, role) == ("10001", "decode"), out
    cm = [v for v in deployment.pod("decode")["spec"]["volumes"] if v["name"] == "routing"]
    routing = deployment.node.get("configmap", cm[0]["configMap"]["name"], ns)
    assert routing is not None
    assert keys.strip() == str(sorted(json.loads(routing["data"]["routing.json"])))


def test_liveness_probe_restarts_a_hung_router(deployment: Deployment) -> None:
    """The router's process is stopped (SIGSTOP through containerd, from the host): /healthz
    stops answering, the kubelet's liveness probe fails and the kubelet restarts the container;
    the router then serves the reference completion again."""
    node, ns = deployment.node, deployment.namespace
    pod = deployment.pod("router")
    name = pod["metadata"]["name"]
    status = pod["status"]["containerStatuses"][0]
    before = int(status["restartCount"])
    container_id = status["containerID"].removeprefix("containerd://")
    realnode.ctr("tasks", "kill", "--signal", "SIGSTOP", container_id)

    def restarted() -> bool:
        got = node.get("pod", name, ns) or {}
        statuses = (got.get("status") or {}).get("containerStatuses") or []
        return bool(statuses) and int(statuses[0]["restartCount"]) > before

    wait_for("the kubelet to restart the stopped router", restarted, 180, deployment.why)
    events = node.kubectl(
        "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name}",
        "-o", "json",
    )  # fmt: skip
    messages = [e.get("message", "") for e in json.loads(events)["items"]]
    assert any("Liveness probe failed" in m for m in messages), messages
    assert any("failed liveness probe, will be restarted" in m for m in messages), messages
    deployment.wait_ready(timeout=300)
    assert deployment.complete() == deployment.reference()
