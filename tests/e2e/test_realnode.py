"""What only a kubelet shows, on the e2e stack's real node: the Dockerfile's images (``make
image``) run as containers by a real kubelet, containerd and runc, with the image's environment;
a PDDeployment's pods are containers of the sidecar image (containerd IDs), and a completion
through the router Service equals the single-process reference; ``kubectl logs`` and ``exec``
work; a hung router is restarted by its liveness probe. The e2e tier's scenarios (reference
configurations, pods deleted, DCP changed and scaling under traffic) are in test_e2e.py and
test_lws.py on the same stack.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import dockerfile
import harness
import pytest
import realnode
import yaml

pytestmark = pytest.mark.e2e

NAME = "p-tp1-to-d-tp1"
# 270 byte-tokens, the e2e tier's prompt.
PROMPT = harness.prompt_ids("The quick brown fox jumps over the lazy dog. " * 6)
MAX_TOKENS = 8

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


def describe(stack: harness.Stack, namespace: str) -> str:
    pods = stack.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False)
    events = stack.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp",
                           check=False)  # fmt: skip
    return f"{pods}\n{events[-4000:]}\n{stack.diagnostics(20)}"


def manifest() -> dict[str, Any]:
    """P TP1 -> D TP1: the smallest deployment that has a prefill, a decode and a router pod."""
    role = {"replicas": 1, "tensorParallelSize": 1, "decodeContextParallelSize": 1}
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
        },
    }


@dataclass
class Deployment:
    stack: harness.Stack
    namespace: str
    doc: dict[str, Any]
    name: str = NAME

    def why(self) -> str:
        return describe(self.stack, self.namespace)

    def complete(self) -> list[int]:
        result = self.stack.complete(self.name, self.namespace, PROMPT, MAX_TOKENS)
        return list(result["choices"][0]["token_ids"])

    def reference(self) -> list[int]:
        return harness.reference(PROMPT, MAX_TOKENS, harness.spec_dtype(self.doc))

    def pods(self) -> list[dict[str, Any]]:
        out = self.stack.kubectl(
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
def deployment(stack: harness.Stack) -> Iterator[Deployment]:
    ns = f"rn-ref-{uuid.uuid4().hex[:6]}"
    stack.create_namespace(ns)
    doc = manifest()
    try:
        stack.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
        stack.wait_ready(NAME, ns)
        yield Deployment(stack, ns, doc)
    finally:
        stack.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# --------------------------------------------------------------------------- tests


def _entry_pod(name: str, image: str, commands: dict[str, list[str]]) -> dict[str, Any]:
    """One container per command, run once; the examples mounted for ``pdd validate``."""
    examples = "/examples"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
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


ENV_COMMAND = ["python", "-c", "import json, os; print(json.dumps(dict(os.environ)))"]


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
                "env": ENV_COMMAND,
            },
        ),
        (
            OPERATOR_IMAGE,
            {
                "operator-help": ["python", "-m", "pdd_operator", "--help"],
                "validate": ["pdd", "validate", "-f", "/examples/good.yaml"],
                "validate-bad": ["pdd", "validate", "-f", "/examples/bad.yaml"],
                "runtime": ["python", "-c", "import os, kopf, kubernetes; print(os.getuid())"],
                "env": ENV_COMMAND,
            },
        ),
    ],
    ids=["sidecar", "operator"],
)
def test_image_entry_points_run_in_containers(
    stack: harness.Stack, namespace: str, image: str, commands: dict[str, list[str]]
) -> None:
    stack.kubectl(
        "create", "configmap", "examples", "-n", namespace,
        f"--from-literal=good.yaml={yaml.safe_dump(manifest())}",
        f"--from-literal=bad.yaml={yaml.safe_dump(BAD_DOC)}",
    )  # fmt: skip
    stack.kubectl("apply", "-n", namespace, "-f", "-",
                 input=json.dumps(_entry_pod("entry", image, commands)))  # fmt: skip

    def finished() -> dict[str, Any] | None:
        pod = stack.get("pod", "entry", namespace) or {}
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        done = [s for s in statuses if "terminated" in (s.get("state") or {})]
        return pod if len(done) == len(commands) else None

    pod = wait_for("the entry-point containers", finished, 180,
                   lambda: describe(stack, namespace))  # fmt: skip
    assert pod["spec"]["nodeName"] == realnode.NODE_NAME
    codes = {s["name"]: s["state"]["terminated"]["exitCode"]
             for s in pod["status"]["containerStatuses"]}  # fmt: skip
    logs = {c: stack.kubectl("logs", "-n", namespace, "entry", "-c", c) for c in commands}
    want = {c: (1 if c == "validate-bad" else 0) for c in commands}
    assert codes == want, logs
    help_name = next(c for c in commands if c.endswith("-help"))
    assert "usage:" in logs[help_name], logs[help_name]
    assert "1 document(s) valid" in logs["validate"], logs["validate"]
    assert "spec.prefill.decodeContextParallelSize" in logs["validate-bad"], logs["validate-bad"]
    assert logs["runtime"].split()[0] == "10001", logs["runtime"]  # the image's USER
    env = json.loads(logs["env"])
    want_env = dockerfile.runtime_env(harness.REPO_ROOT / "Dockerfile")
    assert want_env, "no ENV found in the Dockerfile's runtime stage"
    assert {k: env.get(k) for k in want_env} == want_env


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
    logs = deployment.stack.kubectl("logs", "-n", ns, decode)
    assert logs.strip(), "kubectl logs returned nothing"
    out = deployment.stack.kubectl(
        "exec", "-n", ns, decode, "--", "python", "-c",
        "import json, os; print(os.getuid(), os.environ['PDD_ROLE'], "
        "sorted(json.load(open(os.environ['PDD_ROUTING_FILE']))))",
    )  # fmt: skip
    uid, role, keys = out.split(" ", 2)
    assert (uid, role) == ("10001", "decode"), out
    cm = [v for v in deployment.pod("decode")["spec"]["volumes"] if v["name"] == "routing"]
    routing = deployment.stack.get("configmap", cm[0]["configMap"]["name"], ns)
    assert routing is not None
    assert keys.strip() == str(sorted(json.loads(routing["data"]["routing.json"])))


def test_liveness_probe_restarts_a_hung_router(deployment: Deployment) -> None:
    """The router's process is stopped (SIGSTOP through containerd, from the host): /healthz
    stops answering, the kubelet's liveness probe fails and the kubelet restarts the container;
    the router then serves the reference completion again."""
    stack, ns = deployment.stack, deployment.namespace
    pod = deployment.pod("router")
    name = pod["metadata"]["name"]
    status = pod["status"]["containerStatuses"][0]
    before = int(status["restartCount"])
    container_id = status["containerID"].removeprefix("containerd://")
    realnode.ctr("tasks", "kill", "--signal", "SIGSTOP", container_id)

    def restarted() -> bool:
        got = stack.get("pod", name, ns) or {}
        statuses = (got.get("status") or {}).get("containerStatuses") or []
        return bool(statuses) and int(statuses[0]["restartCount"]) > before

    wait_for("the kubelet to restart the stopped router", restarted, 180, deployment.why)
    events = stack.kubectl(
        "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name}",
        "-o", "json",
    )  # fmt: skip
    messages = [e.get("message", "") for e in json.loads(events)["items"]]
    assert any("Liveness probe failed" in m for m in messages), messages
    assert any("failed liveness probe, will be restarted" in m for m in messages), messages
    stack.wait_ready(deployment.name, ns, timeout=300)
    assert deployment.complete() == deployment.reference()
