"""The local cluster's real node (``make cluster-up NODE=real``): a kubelet with containerd,
runc, the CNI bridge and kube-proxy runs real containers of the locally imported image.

Marker ``realnode``: it needs root, Debian packages and the node binaries, and it changes the
host's network while it runs. ``make test-integration`` runs it with the tier (``-m 'integration
or realnode'``), ``make test-realnode`` alone (``pytest tests/integration -m realnode``). A
running cluster with a real node (``make cluster-up NODE=real``) is reused and left running;
otherwise the module starts its own in ``.cache/cluster/realnode-test`` and the last test
stops it and checks, without the cluster code's help, that nothing of the node is left on the
host.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from localcluster import (
    DEFAULT_BIN_DIR,
    DEFAULT_STATE_DIR,
    REPO_ROOT,
    Cluster,
    ClusterError,
    _env_path,
    down,
    healthy,
    up,
)

from pdd_api import keys
from pdd_api.validation import parse_spec
from pdd_operator.builders import Owner, Scraper, build_network_policies

pytestmark = pytest.mark.realnode

NODE = "real-node"
IMAGE = "pdd.local/pause:1"
GPUS = 8
OWN_STATE_DIR = REPO_ROOT / ".cache" / "cluster" / "realnode-test"


class _Run:
    """The cluster under test, whether this module started it, and the host ends of the
    pod veths seen while it ran (checked gone after ``down``)."""

    def __init__(self, cluster: Cluster, started: bool) -> None:
        self.cluster = cluster
        self.started = started
        self.veths: set[str] = set()
        self.pids: list[int] = []


@pytest.fixture(scope="module")
def real() -> Iterator[_Run]:
    if os.geteuid() != 0:
        pytest.fail("the real node needs root", pytrace=False)
    default = Cluster.load(_env_path("PDD_CLUSTER_DIR", DEFAULT_STATE_DIR))
    if default is not None and default.real_node is not None and healthy(default) is None:
        yield _Run(default, started=False)
        return
    messages: list[str] = []
    try:
        cluster, started = up(
            OWN_STATE_DIR,
            _env_path("PDD_CLUSTER_BIN", DEFAULT_BIN_DIR),
            nodes=1,
            gpus=GPUS,
            timeout=240,
            log=messages.append,
            real_node=True,
        )
    except ClusterError as e:
        pytest.fail(f"the real node did not start: {e}\n" + "\n".join(messages), pytrace=False)
    run = _Run(cluster, started)
    run.pids = [p.pid for p in cluster.processes.values()]
    try:
        yield run
    finally:
        if run.started:
            down(OWN_STATE_DIR, log=lambda _m: None)


def _wait(what: str, check: Any, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def _pod(name: str, command: list[str], *, gpus: int = 0, restart: str = "Always",
         labels: dict[str, str] | None = None) -> str:
    spec: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name} if labels is None else labels},
        "spec": {
            "nodeSelector": {"pdd.dev/node": "real"},
            "tolerations": [{"key": "pdd.dev/node", "value": "real", "effect": "NoSchedule"}],
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "main",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": command,
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {},
                }
            ],
        },
    }
    return json.dumps(spec)


@pytest.fixture
def namespace(real: _Run) -> Iterator[str]:
    name = f"realnode-{uuid.uuid4().hex[:6]}"
    real.cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        real.cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _phase(cluster: Cluster, ns: str, pod: str) -> dict[str, Any]:
    got: dict[str, Any] = cluster.kubectl_json("get", "pod", pod, "-n", ns)
    return got


def _running(cluster: Cluster, ns: str, pod: str) -> dict[str, Any] | None:
    obj = _phase(cluster, ns, pod)
    statuses = obj.get("status", {}).get("containerStatuses") or []
    if statuses and statuses[0].get("ready"):
        return obj
    return None


def test_node_registers_ready_with_gpus_and_containerd(real: _Run) -> None:
    node = real.cluster.kubectl_json("get", "node", NODE)
    conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert conditions["Ready"] == "True", node["status"]["conditions"]
    info = node["status"]["nodeInfo"]
    assert info["containerRuntimeVersion"].startswith("containerd://"), info
    assert info["kubeletVersion"] == "v1.33.13", info
    assert node["status"]["capacity"]["nvidia.com/gpu"] == str(GPUS)
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(GPUS)
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert not ipaddress.ip_address(addresses["InternalIP"]).is_loopback, addresses
    taints = [(t["key"], t.get("value"), t["effect"]) for t in node["spec"].get("taints", [])]
    assert ("pdd.dev/node", "real", "NoSchedule") in taints


def test_gpu_pod_runs_in_a_container_with_logs_and_exec(real: _Run, namespace: str) -> None:
    cluster = real.cluster
    cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=_pod("hello", ["/pause", "serve", ":8080", "hello from a container"], gpus=1),
    )
    obj = _wait("pod hello ready", lambda: _running(cluster, namespace, "hello"))
    assert obj["spec"]["nodeName"] == NODE
    assert ipaddress.ip_address(obj["status"]["podIP"]) in ipaddress.ip_network("10.88.0.0/16")
    assert obj["status"]["containerStatuses"][0]["containerID"].startswith("containerd://")

    logs = cluster.kubectl("logs", "-n", namespace, "hello").stdout
    assert logs.strip() == "hello from a container"
    out = cluster.kubectl("exec", "-n", namespace, "hello", "--", "/pause", "echo", "in", "pod")
    assert out.stdout.strip() == "in pod"
    # The container sees its own file system (the image's one file), not the host's.
    hosts = cluster.kubectl(
        "exec", "-n", namespace, "hello", "--", "/pause", "cat", "/etc/hostname"
    )
    assert hosts.stdout.strip() == "hello"
    missing = cluster.kubectl(
        "exec", "-n", namespace, "hello", "--", "/pause", "cat", "/usr/bin/env", check=False
    )
    assert missing.returncode != 0

    # The host reaches the pod on the bridge; remember its veth for the clean-up check.
    with urllib.request.urlopen(f"http://{obj['status']['podIP']}:8080/", timeout=10) as resp:
        assert resp.read().decode().strip() == "hello from a container from hello"
    out = subprocess.run(
        ["ip", "-o", "link", "show", "master", "pddnode0"], capture_output=True, text=True
    ).stdout
    real.veths.update(re.findall(r"^\d+:\s+([^@:\s]+)", out, re.M))
    assert real.veths


def test_service_reaches_a_pod_through_kube_proxy(real: _Run, namespace: str) -> None:
    cluster = real.cluster
    cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=_pod("server", ["/pause", "serve", ":8080", "served"]),
    )
    _wait("pod server ready", lambda: _running(cluster, namespace, "server"))
    cluster.kubectl("expose", "pod", "server", "-n", namespace, "--port=80", "--target-port=8080")
    ip = cluster.kubectl_json("get", "service", "server", "-n", namespace)["spec"]["clusterIP"]

    def from_host() -> str | None:
        try:
            with urllib.request.urlopen(f"http://{ip}/", timeout=3) as resp:
                return str(resp.read().decode())
        except OSError:
            return None

    assert _wait("the Service from the host", from_host).strip() == "served from server"
    # From other pods: by the ClusterIP, and by name through the cluster DNS (CoreDNS behind
    # the kube-dns Service; the short name needs the pod's search path).
    for pod, url in (("client-ip", f"http://{ip}/"), ("client-dns", "http://server/")):
        cluster.kubectl(
            "apply",
            "-n",
            namespace,
            "-f",
            "-",
            input=_pod(pod, ["/pause", "get", url], restart="Never"),
        )
    for pod in ("client-ip", "client-dns"):

        def finished(pod: str = pod) -> dict[str, Any] | None:
            obj = _phase(cluster, namespace, pod)
            return obj if obj["status"].get("phase") in ("Succeeded", "Failed") else None

        done = _wait(f"pod {pod} to finish", finished)
        logs = cluster.kubectl("logs", "-n", namespace, pod).stdout
        assert done["status"]["phase"] == "Succeeded", (pod, logs)
        assert logs.strip() == "served from server", pod


def _reaches(cluster: Cluster, ns: str, labels: dict[str, str], ip: str) -> bool:
    """Whether a pod with these labels in namespace `ns` gets an answer from ip:8000."""
    pod = f"client-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=_pod(
        pod, ["/pause", "get", f"http://{ip}:{keys.HTTP_PORT}/"], restart="Never",
        labels=labels))
    done = _wait(f"pod {pod} to finish", lambda: (
        (obj := _phase(cluster, ns, pod))["status"].get("phase") in ("Succeeded", "Failed")
        and obj))
    return bool(done["status"]["phase"] == "Succeeded")


def _serving(cluster: Cluster, ns: str, pod: str, labels: dict[str, str]) -> str:
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=_pod(
        pod, ["/pause", "serve", f":{keys.HTTP_PORT}", "metrics"], labels=labels))
    return str(_wait(f"pod {pod} ready", lambda: _running(cluster, ns, pod))["status"]["podIP"])


def test_the_scrape_rule_refuses_a_look_alike_operator_in_another_namespace(
        real: _Run, namespace: str) -> None:
    """The data-plane NetworkPolicy as the builders write it, on a stand-in instance (a server
    with an instance's labels): a pod labelled as the operator is admitted from the operator's
    namespace and refused from a tenant's. Only a network that enforces NetworkPolicy can show
    that; a deny-all canary finds out first, and the test skips saying so otherwise."""
    cluster = real.cluster
    ops, tenant = f"{namespace}-ops", f"{namespace}-tenant"
    for ns in (ops, tenant):
        cluster.kubectl("create", "namespace", ns)
    try:
        canary = _serving(cluster, namespace, "canary", {"canary": "yes"})
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "deny-canary"},
            "spec": {"podSelector": {"matchLabels": {"canary": "yes"}},
                     "policyTypes": ["Ingress"], "ingress": []}}))
        if _reaches(cluster, tenant, {}, canary):
            pytest.skip("the node's network (the CNI bridge plugin) does not enforce "
                        "NetworkPolicy: a deny-all policy let a connection through, so "
                        "nothing here can refuse the look-alike")
        spec = parse_spec({"model": {"name": "m"}, "image": IMAGE,
                           "prefill": {"replicas": 1}, "decode": {"replicas": 1},
                           "autoscaling": {"decode": {"maxReplicas": 2}}})
        owner = Owner("netpol", namespace, "no-such-owner")
        policy = next(p for p in build_network_policies(owner, spec, Scraper(ops))
                      if p["metadata"]["name"] == "netpol-dataplane")
        policy["metadata"].pop("ownerReferences")  # no such owner: the collector would delete
        target = _serving(cluster, namespace, "netpol-decode-0", {
            keys.LABEL_NAME: keys.APP_NAME, keys.LABEL_INSTANCE: "netpol",
            keys.LABEL_COMPONENT: "decode"})
        cluster.kubectl("apply", "-f", "-", input=json.dumps(policy))
        operator = {keys.LABEL_NAME: keys.OPERATOR_APP_NAME}
        assert _reaches(cluster, ops, operator, target), "the operator's own pods are admitted"
        assert not _reaches(cluster, tenant, operator, target), "a look-alike elsewhere is not"
        assert not _reaches(cluster, ops, {keys.LABEL_NAME: "another-app"}, target)
    finally:
        for ns in (ops, tenant):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _host_leftovers(state_dir: Path, pids: list[int], veths: set[str]) -> list[str]:
    """What the node could leave, looked up directly on the host."""
    found = []
    # The components are this process's children (``up`` ran here): reap them, and give an
    # exiting one a moment, before calling it left behind.
    deadline = time.monotonic() + 10
    while True:
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in alive:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        found.append(f"process {pid} ({stat[stat.rindex(')') + 2]}): {cmd[:160]}")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "pdd-localcluster" in cmd or str(state_dir) in cmd:
                found.append(f"process {entry.name}: {cmd[:120]!r}")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if "pdd-localcluster" in line or str(state_dir) in line:
            found.append(f"mount {line.split()[4]}")
    netns = Path("/var/run/netns")
    found += [f"netns {p.name}" for p in netns.glob("cni-*")] if netns.is_dir() else []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    names = set(re.findall(r"^\d+:\s+([^@:\s]+)", links, re.M))
    found += [f"link {n}" for n in sorted(names & (veths | {"pddnode0"}))]
    for tool in ("iptables-save", "ip6tables-save"):
        rules = subprocess.run([tool], capture_output=True, text=True).stdout
        found += [
            f"{tool}: {line}"
            for line in rules.splitlines()
            if re.search(r"KUBE-|CNI-|10\.88\.|10\.112\.", line)
        ]
    found += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob("*/kubepods")]
    return found


def test_down_leaves_nothing_behind(real: _Run) -> None:
    """Runs last in this module: stops the cluster it started (never a person's)."""
    if not real.started:
        pytest.skip("the real node belongs to a running `make cluster-up NODE=real`; not stopped")
    assert real.veths, "the pod test did not run first; it records the veths to check"
    assert down(OWN_STATE_DIR, log=lambda _m: None)
    real.started = False
    assert _host_leftovers(OWN_STATE_DIR, real.pids, real.veths) == []
