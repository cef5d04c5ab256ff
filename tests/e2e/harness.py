"""The whole pdd stack on this machine, as a user meets it: local control plane, CRD, operator,
and a real node; then ``kubectl apply`` and requests through the router Service.

Shared by the e2e tier (tests/e2e/conftest.py) and ``make demo`` (hack/demo.py) so the demo
shows exactly what the tests prove. Nothing here talks to a sidecar except through the router
Service, and nothing starts a sidecar: the real node's kubelet, containerd and runc run the pods
as containers of the image ``make image`` built (imported into the node's containerd when it
lacks it), and the router is reached at its Service's ClusterIP through kube-proxy (the host
does not resolve cluster names). The operator runs on the host with the cluster's kubeconfig
(the API server listens on 127.0.0.1, out of the pods' reach).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tests" / "cluster"))

import localcluster  # noqa: E402
import realnode  # noqa: E402
from pod_logs import SELECTOR, PodLogs  # noqa: E402

# The committed CRD; PDD_CRD_FILE points elsewhere only to try an unreleased one.
CRD_FILE = Path(
    os.environ.get("PDD_CRD_FILE") or REPO_ROOT / "crds/serving.pdd.dev_pddeployments.yaml"
)
ROLE_SCALE_CRD_FILE = REPO_ROOT / "crds/serving.pdd.dev_pddrolescales.yaml"
EXAMPLES = REPO_ROOT / "manifests" / "examples"
VENV_PY = REPO_ROOT / ".venv" / "bin" / "python"
PYTHON = str(VENV_PY) if VENV_PY.exists() else sys.executable
ROUTER_PORT = 8000  # pdd_api.keys.HTTP_PORT: the router Service's port
NODE_GPUS = 16  # room for the reference examples and a surge pair of one of them


def image_tool() -> ModuleType:
    """hack/image.py (`make image`): image names, buildah's store, the import into the node."""
    spec = importlib.util.spec_from_file_location("pdd_image_tool", REPO_ROOT / "hack/image.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sidecar_image() -> str:
    """The data-plane image the node runs (PDD_IMAGE_TAG picks another build of it)."""
    tool = image_tool()
    return str(tool.image_name("sidecar", tool.DEFAULT_TAG))


class StackError(RuntimeError):
    """Something in the stack failed; the message carries the log tails that say why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 40) -> None:
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()


@dataclass
class Stack:
    """Control plane + real node + CRD + operator, all under ``work_dir``."""

    work_dir: Path
    say: Callable[[str], None] = print
    crd_file: Path = CRD_FILE
    cluster: localcluster.Cluster | None = None
    started_cluster: bool = False
    procs: dict[str, Proc] = field(default_factory=dict)
    _lock_file: Any = None
    pod_logs: PodLogs | None = None
    _service_ips: dict[tuple[str, str], str] = field(default_factory=dict)

    # ----------------------------------------------------------------- lifecycle

    @property
    def kubeconfig(self) -> Path:
        assert self.cluster is not None
        return self.cluster.kubeconfig

    def lock(self) -> None:
        """One stack per work dir at a time: two sessions (two engineers' `make test`, or a
        test and a demo in one dir) would share the control plane and the operator. The second
        waits here; the lock goes with the process."""
        self.work_dir.parent.mkdir(parents=True, exist_ok=True)
        path = self.work_dir.parent / f"{self.work_dir.name}.lock"
        self._lock_file = open(path, "w")  # held for the life of the process
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.say(f"another stack uses {self.work_dir}; waiting for it to finish")
            fcntl.flock(self._lock_file, fcntl.LOCK_EX)

    def _reap_leftovers(self) -> None:
        """A session killed hard (SIGKILL, a lost terminal) leaves its operator running in its
        own session, and its control plane and node; stop them before starting."""
        record = self.work_dir / "procs.json"
        with contextlib.suppress(OSError, ValueError):
            for pid in json.loads(record.read_text()).values():
                with contextlib.suppress(OSError):
                    # Ours only: we started it with KUBECONFIG inside this work dir.
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    mine = f"KUBECONFIG={self.work_dir / 'cluster' / 'kubeconfig'}".encode()
                    if mine in environ:
                        os.killpg(pid, signal.SIGTERM)
                        for _ in range(100):
                            if not Path(f"/proc/{pid}").exists():
                                break
                            time.sleep(0.2)
        record.unlink(missing_ok=True)
        localcluster.down(self.work_dir / "cluster", log=lambda _m: None)

    def start(self) -> None:
        self.lock()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._reap_leftovers()
        t0 = time.monotonic()
        # A control plane of its own with no kwok nodes: pods land only where a kubelet really
        # runs them.
        self.cluster, self.started_cluster = localcluster.up(
            self.work_dir / "cluster", nodes=0, log=lambda m: self.say(f"  cluster: {m}"),
            real_node=True, gpus=NODE_GPUS, timeout=240,
        )  # fmt: skip
        self.say(f"control plane up ({time.monotonic() - t0:.0f}s): {self.cluster.server}")
        for crd in (self.crd_file, ROLE_SCALE_CRD_FILE):
            self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
        self.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s",
            "crd/pddeployments.serving.pdd.dev", "crd/pddrolescales.serving.pdd.dev",
        )  # fmt: skip
        self.say(f"CRD installed from {self.crd_file}")
        self._prepare_real_node()
        webhook_port = free_port()
        self._spawn(
            "operator",
            [PYTHON, "-m", "pdd_operator", "--standalone",
             "--metrics-port", "0", "--liveness-port", "0",
             "--webhook-port", str(webhook_port), "--webhook-host", "127.0.0.1"],
        )  # fmt: skip
        self.wait("operator webhook", lambda: _tcp_open("127.0.0.1", webhook_port), 90,
                  procs=["operator"])  # fmt: skip
        self.say(f"operator up (python -m pdd_operator, webhook on 127.0.0.1:{webhook_port})")
        self.pod_logs = PodLogs(self.cluster, self.work_dir / "pod-logs")
        self.pod_logs.start()

    def _prepare_real_node(self) -> None:
        """The images into the node's containerd. The node's taint keeps the fake-node tests'
        pods off it in a shared cluster; this control plane has no other node, so it is removed
        and the examples apply unchanged."""
        tool = image_tool()
        for target in ("sidecar", "operator"):
            image = tool.image_name(target, tool.DEFAULT_TAG)
            if tool.image_id(image) is None:
                raise StackError(f"{image} is not built: run `make image`")
            took = tool.import_image(image)
            self.say(f"{image} in the real node's containerd"
                     + (f" (imported in {took:.0f}s)" if took is not None else ""))  # fmt: skip
        node = self.kubectl("get", "node", realnode.NODE_NAME, "-o", "json")
        taints = (json.loads(node).get("spec") or {}).get("taints") or []
        if any(f"{t['key']}={t.get('value', '')}:{t['effect']}" == realnode.TAINT
               for t in taints):  # fmt: skip
            self.kubectl("taint", "node", realnode.NODE_NAME, f"{realnode.TAINT}-")
        self.say(f"real node {realnode.NODE_NAME}: {NODE_GPUS} nvidia.com/gpu, untainted")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = self.work_dir / f"{name}.log"
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1"}
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd=REPO_ROOT, start_new_session=True,
            )  # fmt: skip
        self.procs[name] = Proc(name, popen, log)
        record = self.work_dir / "procs.json"
        record.write_text(json.dumps({n: p.popen.pid for n, p in self.procs.items()}))

    def stop(self) -> None:
        """Operator first (so it stops reconciling), then the control plane if we started it,
        with the node: its kubelet, containers, network and containerd."""
        proc = self.procs.get("operator")
        if proc is not None:
            proc.stop()
        if self.pod_logs is not None:
            self.pod_logs.stop()
        if self.started_cluster and os.environ.get("PDD_KEEP_CLUSTER") != "1":
            localcluster.down(self.work_dir / "cluster", log=lambda _m: None)
        self.say("stack stopped")

    def diagnostics(self, lines: int = 30) -> str:
        out = []
        for proc in self.procs.values():
            out.append(f"----- {proc.log} (last {lines} lines) -----\n{tail(proc.log, lines)}")
        if self.cluster is not None:
            out.append(self.cluster.log_tails(lines, ["kubelet"]))
            listed = self.cluster.kubectl("get", "pods", "-A", "-l", SELECTOR,
                                          "-o", "json", check=False)  # fmt: skip
            for pod in json.loads(listed.stdout)["items"] if listed.returncode == 0 else []:
                ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
                logs = self.cluster.kubectl("logs", "-n", ns, name, f"--tail={lines}",
                                            check=False)  # fmt: skip
                out.append(f"----- kubectl logs -n {ns} {name} (last {lines} lines) -----\n"
                           f"{logs.stdout or logs.stderr}")
        for path in self.pod_logs.gone() if self.pod_logs is not None else []:
            out.append(f"----- {path} (a pod gone since; last {lines} lines) -----\n"
                       f"{tail(path, lines)}")
        return "\n".join(out)

    def check_alive(self, names: Sequence[str] = ("operator",)) -> None:
        for name in names:
            proc = self.procs.get(name)
            if proc is not None and not proc.alive():
                raise StackError(
                    f"{name} exited ({proc.popen.returncode}); last lines of {proc.log}:\n"
                    f"{tail(proc.log, 40)}"
                )

    def wait(
        self,
        what: str,
        check: Callable[[], Any],
        timeout: float,
        procs: Sequence[str] = ("operator",),
        progress: Callable[[], str] | None = None,
        every: float = 10,
    ) -> Any:
        """Poll ``check`` until truthy; fail at once when a stack process died, else after
        ``timeout`` with the last progress line and the log tails."""
        deadline = time.monotonic() + timeout
        last_print = time.monotonic()
        last = ""
        while True:
            self.check_alive(procs)
            value = check()
            if value:
                return value
            if progress is not None:
                line = progress()
                if time.monotonic() - last_print >= every or line != last:
                    if line != last or time.monotonic() - last_print >= every:
                        self.say(f"  ... {line}")
                        last_print = time.monotonic()
                    last = line
            if time.monotonic() > deadline:
                raise StackError(
                    f"timed out after {timeout:.0f}s waiting for {what}; last: {last}\n"
                    f"{self.diagnostics()}"
                )
            time.sleep(0.5)

    # ----------------------------------------------------------------- kubectl

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        assert self.cluster is not None
        return self.cluster.kubectl(*args, input=input, check=check).stdout

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        assert self.cluster is not None
        proc = self.cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def create_namespace(self, name: str) -> None:
        self.kubectl("create", "namespace", name)
        self.wait(
            f"service account {name}/default",
            lambda: self.get("serviceaccount", "default", name) is not None,
            60,
        )

    # ----------------------------------------------------------------- PDDeployment

    def conditions(self, name: str, namespace: str) -> dict[str, dict[str, Any]]:
        obj = self.get("pddeployment", name, namespace) or {}
        return {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}

    def progress_line(self, name: str, namespace: str) -> str:
        assert self.cluster is not None
        proc = self.cluster.kubectl(
            "get", "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}",
            "-o", "json", check=False,
        )  # fmt: skip
        pods = json.loads(proc.stdout)["items"] if proc.returncode == 0 else []
        parts = []
        for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
            ready = any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in (p.get("status") or {}).get("conditions", [])
            )
            comp = p["metadata"]["labels"].get("app.kubernetes.io/component", "?")
            phase = (p.get("status") or {}).get("phase", "Pending")
            parts.append(f"{comp}:{phase}{'/Ready' if ready else ''}")
        conds = self.conditions(name, namespace)
        flags = " ".join(
            f"{t}={c['status']}"
            for t, c in conds.items()
            if t in ("RoutingReady", "PrefillAvailable", "DecodeAvailable", "Ready")
        )
        return f"pods [{', '.join(parts) or 'none yet'}] conditions [{flags or 'none yet'}]"

    def is_ready(self, name: str, namespace: str) -> bool:
        obj = self.get("pddeployment", name, namespace) or {}
        status = obj.get("status") or {}
        gen = obj.get("metadata", {}).get("generation")
        ready = {c["type"]: c for c in status.get("conditions", [])}.get("Ready", {})
        return (
            status.get("observedGeneration") == gen
            and ready.get("status") == "True"
            and ready.get("observedGeneration", gen) == gen
        )

    def wait_ready(self, name: str, namespace: str, timeout: float = 600) -> None:
        """Ready as the user sees it: the PDDeployment's Ready condition for the current
        generation, then the router answering /readyz through its Service (kube-proxy follows
        the EndpointSlice, which follows the router pod's readiness)."""
        self.wait(
            f"PDDeployment {namespace}/{name} Ready",
            lambda: self.is_ready(name, namespace),
            timeout,
            progress=lambda: self.progress_line(name, namespace),
        )
        self.wait(
            f"router Service {name}.{namespace}.svc ready",
            lambda: self.router_ready(name, namespace),
            120,
            progress=lambda: self.progress_line(name, namespace),
        )

    def free_gpus(self) -> float:
        """nvidia.com/gpu the real node (the stack's only one) has left, counted as the
        operator counts room for a surge pair (pdd_operator.rollout.free_by_node: a
        terminating pod holds its GPUs)."""
        from pdd_api.models import GPU_RESOURCE
        from pdd_operator.rollout import free_by_node

        node = json.loads(self.kubectl("get", "node", realnode.NODE_NAME, "-o", "json"))
        pods = json.loads(self.kubectl("get", "pods", "-A", "-o", "json"))["items"]
        return free_by_node([node], pods, GPU_RESOURCE)[realnode.NODE_NAME]

    # ----------------------------------------------------------------- the router Service

    def router_url(self, name: str, namespace: str) -> str:
        """The router Service as a client on the host reaches it: at its ClusterIP, through
        the node's kube-proxy."""
        key = (namespace, name)
        if key not in self._service_ips:
            svc = self.get("service", name, namespace)
            if svc is None:
                raise StackError(f"no Service {namespace}/{name}")
            self._service_ips[key] = svc["spec"]["clusterIP"]
        return f"http://{self._service_ips[key]}:{ROUTER_PORT}"

    def router_ready(self, name: str, namespace: str) -> bool:
        try:
            with urllib.request.urlopen(self.router_url(name, namespace) + "/readyz",
                                        timeout=5) as r:  # fmt: skip
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError, StackError):
            return False

    def complete(self, name: str, namespace: str, prompt_ids: list[int], max_tokens: int,
                 timeout: float = 120) -> dict[str, Any]:
        """One request through the router Service, the way a client in the cluster sends it."""
        body = json.dumps({"prompt": prompt_ids, "max_tokens": max_tokens,
                           "temperature": 0}).encode()  # fmt: skip
        req = urllib.request.Request(
            self.router_url(name, namespace) + "/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return dict(json.loads(resp.read()))
        except urllib.error.HTTPError as e:
            raise StackError(f"router answered {e.code}: {e.read().decode(errors='replace')}"
                             ) from e


def _tcp_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


_REFERENCE: dict[tuple[tuple[int, ...], int, str], list[int]] = {}


def reference(prompt_ids: list[int], max_tokens: int, dtype: str) -> list[int]:
    """The single-process reference (``python -m pdd_sidecar generate``: one instance, TP1),
    run as a separate process so the harness itself never loads torch."""
    key = (tuple(prompt_ids), max_tokens, dtype)
    if key not in _REFERENCE:
        proc = subprocess.run(
            [PYTHON, "-m", "pdd_sidecar", "generate", "--model", "builtin",
             "--prompt-ids", ",".join(map(str, prompt_ids)), "--max-tokens", str(max_tokens),
             "--dtype", dtype, "-o", "json"],
            capture_output=True, text=True, timeout=600, check=False, cwd=REPO_ROOT,
        )  # fmt: skip
        if proc.returncode != 0:
            raise StackError(f"reference generate failed:\n{proc.stderr[-3000:]}")
        _REFERENCE[key] = list(json.loads(proc.stdout)["token_ids"])
    return _REFERENCE[key]


def example(name: str) -> tuple[str, dict[str, Any]]:
    """(YAML text, parsed document) of one reference example, every request through a prefill
    and the KV hand-off these tests check (spec.router.localPrefillTokens 0: no prompt is
    prefilled on its decode), every request logged by every pod (PDD_ACCESS_LOG)."""
    import yaml

    from pdd_api import keys

    doc = dict(yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()))
    doc["spec"].setdefault("router", {}).setdefault("localPrefillTokens", 0)
    # A line for every request in each pod's log (the diagnostics of a failed request).
    for role, container in (("router", keys.ROUTER_CONTAINER_NAME),
                            ("prefill", keys.CONTAINER_NAME), ("decode", keys.CONTAINER_NAME)):
        doc["spec"].setdefault(role, {}).setdefault("template", {"spec": {"containers": [
            {"name": container, "env": [{"name": "PDD_ACCESS_LOG", "value": "1"}]}]}})
    return yaml.safe_dump(doc, sort_keys=False), doc


def spec_dtype(doc: dict[str, Any]) -> str:
    """The dtype the sidecars compute in: the spec's, with pdd_api's default filled in (the
    reference must use the same one, or near-tied logits flip)."""
    from pdd_api.models import PDDeploymentSpec

    return str(PDDeploymentSpec.model_validate(doc["spec"]).model.dtype)


def prompt_ids(text: str) -> list[int]:
    """The built-in model's tokenizer is byte-level (token id = UTF-8 byte)."""
    return list(text.encode("utf-8"))
