"""A kubelet, CNI, kube-proxy and DNS in miniature, for the local control plane.

The local control plane (tests/cluster) has no kubelet: kwok's fake nodes mark every pod Ready
at once and run nothing. The e2e tier and ``make demo`` need the pods the operator writes to
really run, so this runner registers its own GPU nodes (not managed by kwok) and is their
kubelet. For every pod the scheduler binds to them it runs exactly what the pod spec says:

* **network**: each pod gets its own network namespace with a veth pair on a bridge and an IP
  from its node's ``spec.podCIDR``, so every pod binds the ports the operator wrote (8000,
  5600+rank, 0.0.0.0 included) without clashing with its neighbours; the host reaches pods
  over the bridge, as a node does.
* **files**: ConfigMap, Secret, emptyDir, downward-API and projected (service-account token)
  volumes are materialised under the pod's directory and bind-mounted at their ``mountPath``
  in a private mount namespace, so paths in the spec (``/etc/pdd/routing.json``) are the real
  paths the process opens. ConfigMap volumes are refreshed when the ConfigMap changes. Like the
  kubelet, the runner gives each pod its own /etc/hosts and /etc/resolv.conf.
* **process**: ``command`` + ``args`` with ``$(VAR)`` expansion, the pod's env (downward API,
  ConfigMap/Secret keys) on top of the image environment below, one process group per
  container, restarts per ``restartPolicy`` with back-off, SIGTERM then SIGKILL after the
  grace period on deletion.
* **readiness**: ``readinessProbe`` / ``livenessProbe`` / ``startupProbe`` (httpGet,
  tcpSocket, exec) against the pod IP; their results, not the runner's guess, set the pod's
  ``Ready`` condition and ``containerStatuses[].ready``.
* **services**: the runner writes ``<svc>.<ns>[.svc[.cluster.local]]`` and, for headless
  Services, ``<hostname>.<svc>.<ns>[...]`` into a marked block of /etc/hosts from the
  EndpointSlices kube-controller-manager maintains (ready endpoints only, as CoreDNS does,
  unless the Service publishes not-ready addresses), and proxies each ClusterIP:port to the
  ready endpoints (kube-proxy's userspace mode). The forms without ``.svc`` are what a pod's
  ``svc.cluster.local`` search domain resolves (LeaderWorkerSet's ``LWS_LEADER_ADDRESS`` is
  ``<leader>.<svc>.<ns>``).

Why not kwok's nodes: kwok's pod stage sets ``Ready=True`` the moment a pod is bound, with no
probe, and gives pod IPs that nothing on this machine answers on. A second writer of the same
status would race it. Only pods labelled ``app.kubernetes.io/name=pdd`` are run; anything else
bound to these nodes is failed with a reason. Images are not pulled: the installed package is
the image (see the Dockerfile, whose ENV and entry points this mirrors), and a pod naming any
other image waits with ``ErrImageNeverPull``.

Needs root (network namespaces, bind mounts, /etc/hosts), iproute2 and util-linux ``unshare``.

    python tests/e2e/podrunner.py --kubeconfig .cluster/kubeconfig [--nodes 2 --gpus 8]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import re
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("podrunner")

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = REPO_ROOT / ".venv" / "bin"
LABEL_NAME = "app.kubernetes.io/name"
APP_NAME = "pdd"
RUNNER_LABEL = "pdd.dev/pod-runner"
HOSTS_FILE = Path(os.environ.get("PDD_HOSTS_FILE", "/etc/hosts"))
HOSTS_LOCK = Path("/run/pdd-podrunner-hosts.lock")
CLUSTER_DOMAIN = "cluster.local"
# The image environment: what the Dockerfile's final stage sets with ENV. The packaging test
# (tests/unit/test_packaging.py) checks the two agree, so a pod here sees what it would see in
# the image. PATH puts the installed package's interpreter first, as the image does.
IMAGE_ENV: dict[str, str] = {
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
}
IMAGE_NAMES = ("pdd",)  # repository part of images this runner can "run" (the installed package)
# Restart back-off: the kubelet's 10s doubling to 300s would make a test wait minutes after a
# crash; same shape, shorter.
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 20.0
MAX_GRACE_S = 30.0


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a host command (ip, unshare); the error carries stderr, which says what broke."""
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


# --------------------------------------------------------------------------- network


class Network:
    """One bridge for this runner; one network namespace + veth per pod.

    The bridge carries the pod CIDR's first address, so host processes (probes, tests, the
    demo) reach pods directly; ClusterIPs are added to it as /32s so both the host and the
    pods (default route via the bridge) reach the runner's service proxies."""

    def __init__(self, runner_id: str, cidr: ipaddress.IPv4Network) -> None:
        self.id = runner_id
        self.cidr = cidr
        self.bridge = f"pddbr{runner_id}"[:15]
        self.gateway = next(cidr.hosts())
        self.service_ips: set[str] = set()
        self._lock = threading.Lock()

    def setup(self) -> None:
        self.teardown(quiet=True)  # leftovers of a crashed run with the same id
        # forward_delay 0: a new port would otherwise sit 15 s in the learning state and the
        # pod would be unreachable (and unready) for that long.
        run("ip", "link", "add", self.bridge, "type", "bridge", "forward_delay", "0")
        run("ip", "addr", "add", f"{self.gateway}/{self.cidr.prefixlen}", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")

    def netns(self, ip: str) -> str:
        return f"pdd{self.id}-{ip.replace('.', '-')}"

    def add_pod(self, ip: str) -> str:
        ns = self.netns(ip)
        tag = hashlib.sha1(ns.encode()).hexdigest()[:10]
        host_if, pod_if = f"pv{tag}", f"pc{tag}"
        run("ip", "netns", "del", ns, check=False)
        run("ip", "netns", "add", ns)
        run("ip", "link", "add", host_if, "type", "veth", "peer", "name", pod_if)
        run("ip", "link", "set", pod_if, "netns", ns)
        run("ip", "-n", ns, "link", "set", pod_if, "name", "eth0")
        run("ip", "-n", ns, "addr", "add", f"{ip}/{self.cidr.prefixlen}", "dev", "eth0")
        run("ip", "-n", ns, "link", "set", "eth0", "up")
        run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "-n", ns, "route", "add", "default", "via", str(self.gateway))
        run("ip", "link", "set", host_if, "master", self.bridge)
        run("ip", "link", "set", host_if, "up")
        return ns

    def del_pod(self, ip: str) -> None:
        # Deleting the namespace deletes its veth end, and with it the host end.
        run("ip", "netns", "del", self.netns(ip), check=False)

    def set_service_ips(self, ips: set[str]) -> None:
        with self._lock:
            for ip in sorted(ips - self.service_ips):
                run("ip", "addr", "add", f"{ip}/32", "dev", self.bridge, check=False)
            for ip in sorted(self.service_ips - ips):
                run("ip", "addr", "del", f"{ip}/32", "dev", self.bridge, check=False)
            self.service_ips = set(ips)

    def teardown(self, quiet: bool = False) -> None:
        listed = run("ip", "netns", "list", check=False).stdout
        for line in listed.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(f"pdd{self.id}-"):
                run("ip", "netns", "del", name, check=False)
        run("ip", "link", "del", self.bridge, check=False)
        self.service_ips = set()
        if not quiet:
            log.info("removed bridge %s and the pod network namespaces", self.bridge)


# --------------------------------------------------------------------------- /etc/hosts


class HostsBlock:
    """The runner's DNS: a marked block of /etc/hosts, rewritten in place under a lock (the
    file may be a bind mount, so it is never replaced) and removed on exit."""

    def __init__(self, runner_id: str, path: Path = HOSTS_FILE) -> None:
        self.path = path
        self.begin = f"# BEGIN pdd-podrunner {runner_id} (managed; removed when it exits)"
        self.end = f"# END pdd-podrunner {runner_id}"
        self.current: list[tuple[str, str]] | None = None

    def write(self, records: list[tuple[str, str]]) -> None:
        if records == self.current:
            return
        HOSTS_LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(HOSTS_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            text = self.path.read_text() if self.path.exists() else ""
            lines = text.splitlines()
            kept: list[str] = []
            inside = False
            for line in lines:
                if line == self.begin:
                    inside = True
                elif line == self.end:
                    inside = False
                elif not inside:
                    kept.append(line)
            if records:
                kept.append(self.begin)
                kept.extend(f"{ip} {name}" for ip, name in records)
                kept.append(self.end)
            with open(self.path, "r+" if self.path.exists() else "w") as f:
                f.seek(0)
                f.write("\n".join(kept) + "\n")
                f.truncate()
        self.current = list(records)

    def remove(self) -> None:
        self.current = None
        self.write([])


# --------------------------------------------------------------------------- service proxy


class ServiceProxy:
    """kube-proxy's userspace mode for one ClusterIP:port: accept, pick a ready endpoint
    round-robin, splice bytes both ways. Nothing listens when no endpoint is ready, so clients
    see a refused connection, as with an iptables REJECT."""

    def __init__(self, ip: str, port: int) -> None:
        self.ip, self.port = ip, port
        self.endpoints: list[tuple[str, int]] = []
        self._next = 0
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.ip, self.port))
        sock.listen(128)
        sock.settimeout(0.5)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name=f"proxy-{self.ip}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            eps = list(self.endpoints)
            if not eps:
                client.close()
                continue
            target = eps[self._next % len(eps)]
            self._next += 1
            threading.Thread(target=_splice, args=(client, target), daemon=True).start()


def _splice(client: socket.socket, target: tuple[str, int]) -> None:
    try:
        upstream = socket.create_connection(target, timeout=5)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    client.settimeout(None)
    sel = selectors.DefaultSelector()
    sel.register(client, selectors.EVENT_READ, upstream)
    sel.register(upstream, selectors.EVENT_READ, client)
    try:
        open_ends = 2
        while open_ends:
            for key, _ in sel.select():
                src: socket.socket = key.fileobj  # type: ignore[assignment]
                dst: socket.socket = key.data
                data = src.recv(65536)
                if not data:
                    sel.unregister(src)
                    open_ends -= 1
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                else:
                    dst.sendall(data)
    except OSError:
        pass
    finally:
        sel.close()
        client.close()
        upstream.close()


# --------------------------------------------------------------------------- pods


def expand_refs(value: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: known names are replaced, ``$$`` escapes, unknown
    references stay as written."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, value)


def field_value(pod: dict[str, Any], path: str, node_ip: str) -> str:
    """The downward API's fieldRef paths the kubelet supports."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""),
        "status.podIPs": status.get("podIP", ""),
        "status.hostIP": node_ip,
        "status.hostIPs": node_ip,
    }
    if path in simple:
        return str(simple[path])
    if path == "metadata.labels":
        return "\n".join(f'{k}="{v}"' for k, v in sorted((meta.get("labels") or {}).items()))
    if path == "metadata.annotations":
        items = sorted((meta.get("annotations") or {}).items())
        return "\n".join(f'{k}="{v}"' for k, v in items)
    raise ValueError(f"unsupported fieldRef {path!r}")


def parse_quantity(q: str) -> float:
    units = {
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "m": 1e-3,
    }
    for suffix, mult in units.items():
        if q.endswith(suffix):
            return float(q[: -len(suffix)]) * mult
    return float(q)


@dataclass
class Probe:
    """One probe's spec and its running state, as the kubelet's prober keeps it."""

    spec: dict[str, Any]
    started_at: float
    successes: int = 0
    failures: int = 0
    result: bool | None = None  # None: not yet decided
    next_at: float = 0.0

    @property
    def period(self) -> float:
        return float(self.spec.get("periodSeconds", 10))

    def due(self, now: float) -> bool:
        if now < self.started_at + float(self.spec.get("initialDelaySeconds", 0)):
            return False
        return now >= self.next_at

    def record(self, ok: bool, now: float) -> bool:
        """Fold one outcome in; True when the decided result changed."""
        self.next_at = now + self.period
        before = self.result
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.spec.get("successThreshold", 1)):
                self.result = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= int(self.spec.get("failureThreshold", 3)):
                self.result = False
        return before != self.result


@dataclass
class Container:
    spec: dict[str, Any]
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    started_iso: str = ""
    restart_count: int = 0
    last_exit: dict[str, Any] | None = None
    backoff_until: float = 0.0
    backoff: float = BACKOFF_START_S
    waiting_reason: str | None = None
    waiting_message: str = ""
    done: bool = False  # exited and will not restart
    readiness: Probe | None = None
    liveness: Probe | None = None
    startup: Probe | None = None

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def ready(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        if self.startup is not None and self.startup.result is not True:
            return False
        if self.readiness is None:
            return True
        return self.readiness.result is True


class PodWorker(threading.Thread):
    """The kubelet's pod worker for one pod: sets up its network and files, runs its
    containers, probes them and writes the pod's status. ``terminate`` stops everything."""

    def __init__(self, runner: Runner, pod: dict[str, Any], ip: str) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.runner = runner
        self.pod = pod
        self.ns_name = meta["namespace"]
        self.pod_name = meta["name"]
        self.uid = meta["uid"]
        self.ip = ip
        self.netns = ""
        self.root = runner.state_dir / "pods" / f"{self.ns_name}_{self.pod_name}_{self.uid[:8]}"
        self.containers = [Container(c) for c in pod["spec"].get("containers", [])]
        self.stop_event = threading.Event()
        self.grace = min(float(pod["spec"].get("terminationGracePeriodSeconds", 30)), MAX_GRACE_S)
        self.finished = threading.Event()
        self.mounts: dict[str, list[tuple[Path, str, bool]]] = {}  # container -> (src, dst, ro)
        self.volume_dirs: dict[str, Path] = {}
        self.configmap_versions: dict[str, str] = {}
        self.hosts_file: Path | None = None
        self.dns_mounts: list[tuple[Path, str, bool]] = []
        self.phase = "Pending"
        self.failed_reason = ""
        self._last_status: str = ""

    # ----------------------------------------------------------------- set-up

    def _prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.netns = self.runner.network.add_pod(self.ip)
        self.pod.setdefault("status", {})["podIP"] = self.ip
        for vol in self.pod["spec"].get("volumes", []):
            vdir = self.root / "volumes" / vol["name"]
            vdir.mkdir(parents=True, exist_ok=True)
            self.volume_dirs[vol["name"]] = vdir
            self._fill_volume(vol, vdir)
        self.hosts_file = self.root / "etc-hosts"
        self.write_hosts(self.runner.hosts.current or [])
        # Names resolve from /etc/hosts alone. The host's nameserver is out of a pod's reach,
        # so a lookup that missed there (c10d's reverse lookups of peers) waited 10 s for the
        # resolver's timeouts; nothing answers on the pod's own 127.0.0.1:53, so it fails at once.
        resolv = self.root / "etc-resolv.conf"
        resolv.write_text("# pdd pod runner: names come from /etc/hosts\nnameserver 127.0.0.1\n")
        self.dns_mounts = [
            (self.hosts_file, "/etc/hosts", False),
            (resolv, "/etc/resolv.conf", False),
        ]
        for c in self.containers:
            # The kubelet's per-pod /etc/hosts: the pod's own name resolves to its IP (torch's
            # Gloo and c10d look it up); the runner's service records follow.
            mounts: list[tuple[Path, str, bool]] = list(self.dns_mounts)
            for vm in c.spec.get("volumeMounts", []):
                src = self.volume_dirs.get(vm["name"])
                if src is None:
                    raise RuntimeError(f"volumeMount {vm['name']!r} names no volume")
                if vm.get("subPath"):
                    src = src / vm["subPath"]
                mounts.append((src, vm["mountPath"], bool(vm.get("readOnly", False))))
            self.mounts[c.name] = mounts

    def write_hosts(self, records: list[tuple[str, str]]) -> None:
        """Rewritten in place: the bind mount pins the inode, so a rename would go unseen."""
        spec = self.pod["spec"]
        hostname = spec.get("hostname") or self.pod_name
        names = [hostname]
        if spec.get("subdomain"):
            short = f"{hostname}.{spec['subdomain']}.{self.ns_name}"
            names = [f"{short}.svc.{CLUSTER_DOMAIN}", f"{short}.svc", short, hostname]
        lines = [
            "# Kubernetes-managed hosts file (pdd pod runner).",
            "127.0.0.1\tlocalhost",
            "::1\tlocalhost ip6-localhost ip6-loopback",
            f"{self.ip}\t{' '.join(names)}",
            *(f"{ip}\t{name}" for ip, name in records),
        ]
        text = "\n".join(lines) + "\n"
        assert self.hosts_file is not None
        with open(self.hosts_file, "a+") as f:
            f.seek(0)
            if f.read() == text:
                return
        # Written over, then cut: a lookup at that moment never finds the file empty.
        with open(self.hosts_file, "r+") as f:
            f.write(text)
            f.flush()
            f.truncate()

    def _fill_volume(self, vol: dict[str, Any], vdir: Path) -> None:
        api = self.runner.core
        if "configMap" in vol:
            self._write_configmap(vol["configMap"], vdir)
        elif "secret" in vol:
            sec = api.read_namespaced_secret(vol["secret"]["secretName"], self.ns_name)
            data = {k: base64.b64decode(v) for k, v in (sec.data or {}).items()}
            self._write_items(data, vol["secret"].get("items"), vdir)
        elif "emptyDir" in vol:
            pass
        elif "downwardAPI" in vol:
            self._write_downward(vol["downwardAPI"].get("items", []), vdir)
        elif "projected" in vol:
            for source in vol["projected"].get("sources", []):
                if "configMap" in source:
                    self._write_configmap(source["configMap"], vdir)
                elif "downwardAPI" in source:
                    self._write_downward(source["downwardAPI"].get("items", []), vdir)
                elif "serviceAccountToken" in source:
                    self._write_token(source["serviceAccountToken"], vdir)
                elif "secret" in source:
                    sec = api.read_namespaced_secret(source["secret"]["name"], self.ns_name)
                    data = {k: base64.b64decode(v) for k, v in (sec.data or {}).items()}
                    self._write_items(data, source["secret"].get("items"), vdir)
        else:
            raise RuntimeError(f"volume {vol['name']!r}: unsupported kind {sorted(vol)}")

    def _write_configmap(self, ref: dict[str, Any], vdir: Path) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            cm = self.runner.core.read_namespaced_config_map(ref["name"], self.ns_name)
        except ApiException as e:
            if e.status == 404 and ref.get("optional"):
                return
            raise
        data: dict[str, bytes] = {k: v.encode() for k, v in (cm.data or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (cm.binary_data or {}).items()})
        self.configmap_versions[ref["name"]] = cm.metadata.resource_version
        self._write_items(data, ref.get("items"), vdir)

    def _write_items(
        self, data: dict[str, bytes], items: list[dict[str, Any]] | None, vdir: Path
    ) -> None:
        wanted = [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]
        for key, rel in wanted:
            if key not in data:
                continue
            dest = vdir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.tmp")
            tmp.write_bytes(data[key])
            tmp.replace(dest)  # readers see the old or the new file, never half of one

    def _write_downward(self, items: list[dict[str, Any]], vdir: Path) -> None:
        for item in items:
            if "fieldRef" in item:
                value = field_value(self.pod, item["fieldRef"]["fieldPath"], self.runner.node_ip)
                self._write_items({"v": value.encode()}, [{"key": "v", "path": item["path"]}], vdir)

    def _write_token(self, src: dict[str, Any], vdir: Path) -> None:
        from kubernetes import client

        sa = self.pod["spec"].get("serviceAccountName", "default")
        body = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=[src["audience"]] if src.get("audience") else [],
                expiration_seconds=int(src.get("expirationSeconds", 3607)),
                bound_object_ref=client.V1BoundObjectReference(
                    api_version="v1", kind="Pod", name=self.pod_name, uid=self.uid
                ),
            )
        )
        tok = self.runner.core.create_namespaced_service_account_token(sa, self.ns_name, body)
        self._write_items(
            {"t": tok.status.token.encode()}, [{"key": "t", "path": src.get("path", "token")}], vdir
        )

    def refresh_configmaps(self) -> None:
        """Kubelet's ConfigMap volume sync: rewrite the files when the ConfigMap changed."""
        for vol in self.pod["spec"].get("volumes", []):
            ref = vol.get("configMap")
            if not ref or vol["name"] not in self.volume_dirs:
                continue
            try:
                cm = self.runner.core.read_namespaced_config_map(ref["name"], self.ns_name)
            except Exception:  # noqa: BLE001 - deleted or API hiccup: keep the old files
                continue
            if cm.metadata.resource_version != self.configmap_versions.get(ref["name"]):
                self._write_configmap(ref, self.volume_dirs[vol["name"]])

    # ----------------------------------------------------------------- env

    def _env(self, c: Container) -> dict[str, str]:
        core = self.runner.core
        pod_env: dict[str, str] = {}
        for src in c.spec.get("envFrom", []):
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                cm = core.read_namespaced_config_map(src["configMapRef"]["name"], self.ns_name)
                pod_env.update({prefix + k: v for k, v in (cm.data or {}).items()})
            if "secretRef" in src:
                sec = core.read_namespaced_secret(src["secretRef"]["name"], self.ns_name)
                pod_env.update(
                    {prefix + k: base64.b64decode(v).decode() for k, v in (sec.data or {}).items()}
                )
        for e in c.spec.get("env", []):
            name = e["name"]
            if "value" in e:
                pod_env[name] = expand_refs(str(e["value"]), pod_env)
            elif "valueFrom" in e:
                vf = e["valueFrom"]
                if "fieldRef" in vf:
                    pod_env[name] = field_value(
                        self.pod, vf["fieldRef"]["fieldPath"], self.runner.node_ip
                    )
                elif "configMapKeyRef" in vf:
                    ref = vf["configMapKeyRef"]
                    cm = core.read_namespaced_config_map(ref["name"], self.ns_name)
                    pod_env[name] = (cm.data or {})[ref["key"]]
                elif "secretKeyRef" in vf:
                    ref = vf["secretKeyRef"]
                    sec = core.read_namespaced_secret(ref["name"], self.ns_name)
                    pod_env[name] = base64.b64decode((sec.data or {})[ref["key"]]).decode()
                elif "resourceFieldRef" in vf:
                    ref = vf["resourceFieldRef"]
                    kind, _, res = ref["resource"].partition(".")
                    q = (c.spec.get("resources", {}).get(kind) or {}).get(res, "0")
                    div = parse_quantity(str(ref.get("divisor", "1")))
                    pod_env[name] = str(int(-(-parse_quantity(str(q)) // div)))
            else:
                pod_env[name] = ""
        base = {
            **IMAGE_ENV,
            "PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOSTNAME": self.pod["spec"].get("hostname") or self.pod_name,
            "HOME": "/root",
        }
        return {**base, **pod_env}

    # ----------------------------------------------------------------- processes

    def _start(self, c: Container) -> None:
        env = self._env(c)
        command = [expand_refs(a, env) for a in c.spec.get("command", [])]
        args = [expand_refs(a, env) for a in c.spec.get("args", [])]
        argv = command + args
        if not command:
            raise RuntimeError(
                f"container {c.name!r} has no command; this runner does not know image "
                "entrypoints (the pdd image's ENTRYPOINT is the CLI; name it in the spec)"
            )
        hostname = (self.pod["spec"].get("hostname") or self.pod_name)[:63]
        script = ["set -e"]
        for src, dst, ro in self.mounts[c.name]:
            self.runner.ensure_mount_target(Path(dst), src.is_dir())
            script.append(f"mount --bind {shlex.quote(str(src))} {shlex.quote(dst)}")
            if ro:
                script.append(f"mount -o remount,bind,ro {shlex.quote(dst)}")
        script.append(f"hostname {shlex.quote(hostname)}")
        workdir = c.spec.get("workingDir") or str(self.root)
        script.append(f"cd {shlex.quote(workdir)}")
        script.append('exec "$@"')
        wrapper = [
            "ip", "netns", "exec", self.netns,
            "unshare", "--mount", "--uts", "--propagation", "private", "--",
            "/bin/sh", "-c", "; ".join(script), "sh", *argv,
        ]  # fmt: skip
        log_path = self.root / f"{c.name}.log"
        with open(log_path, "ab") as out:
            out.write(f"==== {now_iso()} start: {shlex.join(argv)}\n".encode())
            out.flush()
            c.proc = subprocess.Popen(
                wrapper, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True,
            )  # fmt: skip
        c.started_at = time.monotonic()
        c.started_iso = now_iso()
        c.waiting_reason = None
        now = time.monotonic()
        for attr, key in (
            ("readiness", "readinessProbe"),
            ("liveness", "livenessProbe"),
            ("startup", "startupProbe"),
        ):
            spec = c.spec.get(key)
            setattr(c, attr, Probe(spec, started_at=now) if spec else None)
        log.info(
            "%s/%s: started %s (pid %d, ip %s)",
            self.ns_name,
            self.pod_name,
            c.name,
            c.proc.pid,
            self.ip,
        )

    def _kill(self, c: Container, grace: float) -> None:
        if c.proc is None or c.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.proc.pid, signal.SIGTERM)
        try:
            c.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait()
        # Children that left the group (none should) die with the network namespace's users.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.proc.pid, signal.SIGKILL)

    def _probe(self, c: Container, probe: Probe) -> bool:
        spec, timeout = probe.spec, float(probe.spec.get("timeoutSeconds", 1))
        try:
            if "httpGet" in spec:
                h = spec["httpGet"]
                port = self._port(c, h["port"])
                host = h.get("host") or self.ip
                url = f"{h.get('scheme', 'HTTP').lower()}://{host}:{port}{h.get('path', '/')}"
                req = urllib.request.Request(url, headers={"User-Agent": "kube-probe/1.33"})
                for hdr in h.get("httpHeaders", []):
                    req.add_header(hdr["name"], hdr["value"])
                try:
                    with urllib.request.urlopen(req, timeout=timeout) as resp:
                        return 200 <= resp.status < 400
                except urllib.error.HTTPError as e:
                    return 200 <= e.code < 400
            if "tcpSocket" in spec:
                port = self._port(c, spec["tcpSocket"]["port"])
                with socket.create_connection(
                    (spec["tcpSocket"].get("host") or self.ip, port), timeout=timeout
                ):
                    return True
            if "exec" in spec:
                cmd = ["ip", "netns", "exec", self.netns, *spec["exec"]["command"]]
                proc = subprocess.run(
                    cmd, env=self._env(c), capture_output=True, timeout=timeout, check=False
                )
                return proc.returncode == 0
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return False
        return False

    def _port(self, c: Container, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.spec.get("ports", []):
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f"no container port named {port!r}")

    # ----------------------------------------------------------------- status

    def _status(self) -> dict[str, Any]:
        statuses = []
        for c in self.containers:
            st: dict[str, Any] = {
                "name": c.name,
                "image": c.spec.get("image", ""),
                "imageID": f"pdd-podrunner://{c.spec.get('image', '')}",
                "ready": c.ready(),
                "restartCount": c.restart_count,
                "started": c.proc is not None and c.proc.poll() is None,
            }
            if c.proc is not None and c.proc.poll() is None:
                st["state"] = {"running": {"startedAt": c.started_iso}}
                st["containerID"] = f"pdd-podrunner://{c.proc.pid}"
            elif c.waiting_reason:
                st["state"] = {
                    "waiting": {"reason": c.waiting_reason, "message": c.waiting_message}
                }
            elif c.last_exit is not None:
                st["state"] = {"terminated": c.last_exit}
            else:
                st["state"] = {"waiting": {"reason": "ContainerCreating"}}
            if (
                c.last_exit is not None
                and "running" in st["state"]
                or (c.last_exit is not None and "waiting" in st["state"])
            ):
                st["lastState"] = {"terminated": c.last_exit}
            statuses.append(st)
        all_ready = bool(self.containers) and all(c.ready() for c in self.containers)
        initialized = self.phase != "Pending" or self.failed_reason != ""

        def cond(kind: str, ok: bool, reason: str = "") -> dict[str, Any]:
            d: dict[str, Any] = {"type": kind, "status": "True" if ok else "False"}
            if reason and not ok:
                d["reason"] = reason
            return d

        conditions = [
            cond("PodReadyToStartContainers", bool(self.netns)),
            cond("Initialized", initialized),
            cond("ContainersReady", all_ready, "ContainersNotReady"),
            cond("Ready", all_ready, "ContainersNotReady"),
        ]
        status: dict[str, Any] = {
            "phase": self.phase,
            "conditions": conditions,
            "containerStatuses": statuses,
            "hostIP": self.runner.node_ip,
            "hostIPs": [{"ip": self.runner.node_ip}],
        }
        if self.netns:
            status["podIP"] = self.ip
            status["podIPs"] = [{"ip": self.ip}]
        if self.failed_reason:
            status["reason"], status["message"] = self.failed_reason, self._failed_message
        return status

    _failed_message = ""

    def _publish(self, force: bool = False) -> None:
        status = self._status()
        key = json.dumps(status, sort_keys=True)
        if key == self._last_status and not force:
            return
        # lastTransitionTime only when a condition's status flips, as the kubelet does.
        previous = {c["type"]: c for c in self.pod.get("status", {}).get("conditions", []) or []}
        for c in status["conditions"]:
            old = previous.get(c["type"])
            c["lastTransitionTime"] = (
                old["lastTransitionTime"]
                if old and old.get("status") == c["status"] and old.get("lastTransitionTime")
                else now_iso()
            )
        if "startTime" not in self.pod.get("status", {}):
            status["startTime"] = now_iso()
        try:
            result = self.runner.core.patch_namespaced_pod_status(
                self.pod_name, self.ns_name, {"status": status}
            )
            self.pod["status"] = self.runner.core.api_client.sanitize_for_serialization(
                result.status
            )
            self._last_status = key
        except Exception as e:  # noqa: BLE001 - pod gone: the main loop tears us down
            log.debug("%s/%s: status update failed: %s", self.ns_name, self.pod_name, e)

    # ----------------------------------------------------------------- loop

    def fail(self, reason: str, message: str) -> None:
        self.failed_reason, self._failed_message = reason, message
        self.phase = "Failed"
        log.warning("%s/%s: %s: %s", self.ns_name, self.pod_name, reason, message)
        self._publish(force=True)

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - report it on the pod rather than die quietly
            log.exception("%s/%s: pod worker failed", self.ns_name, self.pod_name)
            self.fail("PodRunnerError", f"{type(e).__name__}: {e}")
            self.stop_event.wait()
        finally:
            for c in self.containers:
                self._kill(c, self.grace)
            self.finished.set()

    def _run(self) -> None:
        bad = [c for c in self.containers if not self.runner.image_ok(c.spec.get("image", ""))]
        if bad:
            for c in bad:
                c.waiting_reason = "ErrImageNeverPull"
                c.waiting_message = (
                    f"image {c.spec.get('image')!r} is not the installed pdd package; this "
                    f"runner runs only images of {', '.join(IMAGE_NAMES)}"
                )
            self._publish()
            self.stop_event.wait()
            return
        for ic in self.pod["spec"].get("initContainers", []):
            if ic.get("restartPolicy") == "Always":
                raise RuntimeError("sidecar init containers are not supported")
        self._prepare()
        self._publish()
        init = [Container(s) for s in self.pod["spec"].get("initContainers", [])]
        for ic in init:
            self.mounts.setdefault(ic.name, list(self.dns_mounts))
            for vm in ic.spec.get("volumeMounts", []):
                self.mounts[ic.name].append(
                    (self.volume_dirs[vm["name"]], vm["mountPath"], bool(vm.get("readOnly")))
                )
            self._start(ic)
            assert ic.proc is not None
            while ic.proc.poll() is None:
                if self.stop_event.wait(0.2):
                    self._kill(ic, self.grace)
                    return
            if ic.proc.returncode != 0:
                self.fail("InitContainerFailed", f"{ic.name} exited {ic.proc.returncode}")
                self.stop_event.wait()
                return
        self.phase = "Running"
        for c in self.containers:
            self._start(c)
        self._publish()
        policy = self.pod["spec"].get("restartPolicy", "Always")
        last_cm_check = time.monotonic()
        while not self.stop_event.wait(0.2):
            now = time.monotonic()
            for c in self.containers:
                self._supervise(c, policy, now)
            if all(c.done for c in self.containers):
                failed = any((c.last_exit or {}).get("exitCode", 0) != 0 for c in self.containers)
                self.phase = "Failed" if failed else "Succeeded"
                self._publish()
                self.stop_event.wait()
                return
            if now - last_cm_check > 2:
                self.refresh_configmaps()
                last_cm_check = now
            self._publish()

    def _supervise(self, c: Container, policy: str, now: float) -> None:
        if c.done:
            return
        if c.proc is not None and c.proc.poll() is not None:
            code = c.proc.returncode
            c.last_exit = {
                "exitCode": code if code >= 0 else 128 - code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": c.started_iso,
                "finishedAt": now_iso(),
            }
            c.proc = None
            log.warning(
                "%s/%s: %s exited %s; log %s",
                self.ns_name,
                self.pod_name,
                c.name,
                code,
                self.root / f"{c.name}.log",
            )
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                c.done = True
                return
            c.backoff_until = now + c.backoff
            c.backoff = min(c.backoff * 2, BACKOFF_MAX_S)
            c.waiting_reason = "CrashLoopBackOff"
            c.waiting_message = f"back-off {c.backoff_until - now:.0f}s restarting {c.name}"
            return
        if c.proc is None:
            if now >= c.backoff_until:
                c.restart_count += 1
                self._start(c)
            return
        for probe in (c.startup, c.liveness, c.readiness):
            if probe is None:
                continue
            if probe is not c.startup and c.startup is not None and c.startup.result is not True:
                continue  # startup probe gates the others
            if probe.due(now):
                ok = self._probe(c, probe)
                probe.record(ok, time.monotonic())
                if probe is c.readiness and probe.result is None and not ok:
                    probe.result = False  # not ready until proven ready
        dead = (c.liveness is not None and c.liveness.result is False) or (
            c.startup is not None and c.startup.result is False
        )
        if dead:
            log.warning(
                "%s/%s: %s failed its liveness/startup probe; restarting",
                self.ns_name,
                self.pod_name,
                c.name,
            )
            self._kill(c, self.grace)

    def terminate(self) -> None:
        self.stop_event.set()

    def cleanup(self) -> None:
        self.runner.network.del_pod(self.ip)
        shutil.rmtree(self.root, ignore_errors=True)


# --------------------------------------------------------------------------- runner


@dataclass
class Runner:
    kubeconfig: str
    state_dir: Path
    runner_id: str
    node_names: list[str]
    gpus: int
    cidr: ipaddress.IPv4Network
    workers: dict[str, PodWorker] = field(default_factory=dict)
    proxies: dict[tuple[str, int], ServiceProxy] = field(default_factory=dict)
    free_ips: dict[str, list[str]] = field(default_factory=dict)
    created_dirs: list[Path] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        from kubernetes import client, config

        api_client = config.new_client_from_config(config_file=self.kubeconfig)
        self.core = client.CoreV1Api(api_client)
        self.discovery = client.DiscoveryV1Api(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self.network = Network(self.runner_id, self.cidr)
        self.hosts = HostsBlock(self.runner_id)
        self.node_ip = str(self.network.gateway)
        subnets = list(self.cidr.subnets(new_prefix=24))
        # Node i owns the i-th /24 (after the one holding the gateway); pods get its hosts.
        self.node_cidrs = {n: subnets[i + 1] for i, n in enumerate(self.node_names)}
        for n, net in self.node_cidrs.items():
            self.free_ips[n] = [str(ip) for ip in net.hosts()]
        self._mount_lock = threading.Lock()

    # ----------------------------------------------------------------- helpers

    def image_ok(self, image: str) -> bool:
        repo = image.rsplit("/", 1)[-1].split("@")[0].split(":")[0]
        return repo in IMAGE_NAMES

    def ensure_mount_target(self, path: Path, is_dir: bool) -> None:
        """A bind mount needs its target to exist. Missing targets (/etc/pdd) are created
        empty on the host, remembered, and removed when the runner exits."""
        with self._mount_lock:
            if path.exists():
                return
            missing = []
            p = path if is_dir else path.parent
            while not p.exists():
                missing.append(p)
                p = p.parent
            for d in reversed(missing):
                d.mkdir()
                self.created_dirs.append(d)
            if not is_dir:
                path.touch()
                self.created_dirs.append(path)

    # ----------------------------------------------------------------- nodes

    def register_nodes(self) -> None:
        from kubernetes.client.exceptions import ApiException

        resources = {
            "cpu": "64",
            "memory": "512Gi",
            "pods": "110",
            "ephemeral-storage": "1Ti",
            "nvidia.com/gpu": str(self.gpus),
        }
        for name in self.node_names:
            body = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": {
                        RUNNER_LABEL: self.runner_id,
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "nvidia.com/gpu.present": "true",
                    },
                },
                "spec": {
                    "podCIDR": str(self.node_cidrs[name]),
                    "podCIDRs": [str(self.node_cidrs[name])],
                },
            }
            with contextlib.suppress(ApiException):
                self.core.delete_node(name)
            for _ in range(50):
                try:
                    self.core.create_node(body)
                    break
                except ApiException as e:
                    if e.status != 409:
                        raise
                    time.sleep(0.2)
            self.core.patch_node_status(
                name,
                {
                    "status": {
                        "capacity": resources,
                        "allocatable": dict(resources),
                        "addresses": [
                            {"type": "InternalIP", "address": self.node_ip},
                            {"type": "Hostname", "address": name},
                        ],
                        "nodeInfo": {
                            "kubeletVersion": "v1.33.13-pdd-podrunner",
                            "containerRuntimeVersion": "pdd-podrunner://0.1.0",
                            "operatingSystem": "linux",
                            "architecture": "amd64",
                            "osImage": "",
                            "kernelVersion": os.uname().release,
                            "kubeProxyVersion": "",
                            "machineID": "",
                            "systemUUID": "",
                            "bootID": "",
                        },
                    }
                },
            )
        self.heartbeat()

    def heartbeat(self) -> None:
        """Node status and Lease renewal: what keeps the node lifecycle controller from
        marking the nodes unreachable and evicting their pods."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        ts = now_iso()
        conditions = [
            {
                "type": t,
                "status": "False",
                "reason": "PodRunner",
                "lastHeartbeatTime": ts,
                "lastTransitionTime": ts,
            }
            for t in ("MemoryPressure", "DiskPressure", "PIDPressure")
        ]
        conditions.append(
            {
                "type": "Ready",
                "status": "True",
                "reason": "PodRunnerReady",
                "message": "pdd pod runner is posting ready status",
                "lastHeartbeatTime": ts,
                "lastTransitionTime": ts,
            }
        )
        for name in self.node_names:
            try:
                node = self.core.read_node_status(name)
                old = {c.type: c for c in (node.status.conditions or [])}
                for c in conditions:
                    o = old.get(c["type"])
                    if o is not None and o.status == c["status"] and o.last_transition_time:
                        c["lastTransitionTime"] = o.last_transition_time.strftime(
                            "%Y-%m-%dT%H:%M:%SZ"
                        )
                self.core.patch_node_status(name, {"status": {"conditions": conditions}})
                micro = datetime.now(UTC)
                try:
                    self.coordination.patch_namespaced_lease(
                        name, "kube-node-lease", {"spec": {"renewTime": micro.isoformat()}}
                    )
                except ApiException as e:
                    if e.status != 404:
                        raise
                    owner = client.V1OwnerReference(
                        api_version="v1", kind="Node", name=name, uid=node.metadata.uid
                    )
                    self.coordination.create_namespaced_lease(
                        "kube-node-lease",
                        client.V1Lease(
                            metadata=client.V1ObjectMeta(name=name, owner_references=[owner]),
                            spec=client.V1LeaseSpec(
                                holder_identity=name, lease_duration_seconds=40, renew_time=micro
                            ),
                        ),
                    )
            except ApiException as e:
                log.warning("heartbeat of node %s failed: %s", name, e.reason)

    # ----------------------------------------------------------------- pods

    def sync_pods(self) -> None:
        pods = self.core.list_pod_for_all_namespaces(
            field_selector="spec.nodeName!=", _preload_content=False
        )
        items = json.loads(pods.data)["items"]
        seen: set[str] = set()
        for pod in items:
            node = pod["spec"].get("nodeName")
            if node not in self.node_names:
                continue
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            worker = self.workers.get(uid)
            if pod["metadata"].get("deletionTimestamp"):
                if worker is None:
                    self._delete_pod(pod)
                elif not worker.stop_event.is_set():
                    log.info(
                        "%s/%s: deleting (grace %.0fs)",
                        worker.ns_name,
                        worker.pod_name,
                        worker.grace,
                    )
                    worker.terminate()
                continue
            if worker is not None:
                continue
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                continue
            labels = pod["metadata"].get("labels") or {}
            free = self.free_ips[node]
            worker = PodWorker(self, pod, free.pop(0))
            self.workers[uid] = worker
            if labels.get(LABEL_NAME) != APP_NAME:
                worker.fail(
                    "NotAPddPod", f"this node runs only pods labelled {LABEL_NAME}={APP_NAME}"
                )
                continue
            worker.start()
        for uid, worker in list(self.workers.items()):
            if uid not in seen:
                worker.terminate()  # force-deleted: nothing to wait for on the API side
            if worker.stop_event.is_set() and (worker.finished.is_set() or not worker.is_alive()):
                self._finish(uid, worker)

    def _finish(self, uid: str, worker: PodWorker) -> None:
        worker.cleanup()
        node = worker.pod["spec"]["nodeName"]
        self.free_ips[node].append(worker.ip)
        del self.workers[uid]
        self._delete_pod(worker.pod)
        log.info("%s/%s: stopped and removed", worker.ns_name, worker.pod_name)

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        """The kubelet's last word on a terminating pod: delete it for good, bound to its uid
        so a recreated pod of the same name is never hit."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        meta = pod["metadata"]
        if not meta.get("deletionTimestamp"):
            return
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_pod(
                meta["name"],
                meta["namespace"],
                body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=meta["uid"])
                ),
            )

    # ----------------------------------------------------------------- services

    def sync_services(self) -> None:
        svcs = json.loads(self.core.list_service_for_all_namespaces(_preload_content=False).data)[
            "items"
        ]
        slices = json.loads(
            self.discovery.list_endpoint_slice_for_all_namespaces(_preload_content=False).data
        )["items"]
        by_svc: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for s in slices:
            svc = (s["metadata"].get("labels") or {}).get("kubernetes.io/service-name")
            if svc:
                by_svc.setdefault((s["metadata"]["namespace"], svc), []).append(s)
        records: list[tuple[str, str]] = []
        wanted: dict[tuple[str, int], list[tuple[str, int]]] = {}
        # Endpoints of pods this node is already stopping leave at once, before the
        # EndpointSlice says so: no new connection is sent to a process getting SIGTERM.
        stopping = {w.ip for w in self.workers.values() if w.stop_event.is_set()}
        for svc in svcs:
            ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
            if ns == "default" and name == "kubernetes":
                continue  # the API server is reached through the kubeconfig, not a proxy
            spec = svc["spec"]
            publish_all = bool(spec.get("publishNotReadyAddresses"))
            eps: list[tuple[str, str | None, dict[str, int]]] = []  # ip, hostname, port map
            for s in by_svc.get((ns, name), []):
                ports = {p.get("name") or "": int(p["port"]) for p in s.get("ports") or []}
                for ep in s.get("endpoints") or []:
                    ready = (ep.get("conditions") or {}).get("ready", True)
                    if not (ready or publish_all):
                        continue
                    if cluster_ip_of(spec) and set(ep.get("addresses", [])) & stopping:
                        continue
                    for addr in ep.get("addresses", []):
                        eps.append((addr, ep.get("hostname"), ports))
            # The last form is what the search domain svc.cluster.local completes.
            fqdns = [f"{name}.{ns}.svc", f"{name}.{ns}.svc.{CLUSTER_DOMAIN}", f"{name}.{ns}"]
            cluster_ip = spec.get("clusterIP")
            if cluster_ip and cluster_ip != "None":
                records.extend((cluster_ip, f) for f in fqdns)
                for p in spec.get("ports", []):
                    wanted[(cluster_ip, int(p["port"]))] = [
                        (ip, pm[p.get("name") or ""])
                        for ip, _h, pm in eps
                        if (p.get("name") or "") in pm
                    ]
            else:
                for ip, hostname, _pm in eps:
                    records.extend((ip, f) for f in fqdns)
                    if hostname:
                        records.extend((ip, f"{hostname}.{f}") for f in fqdns)
        records = sorted(set(records))
        self.hosts.write(records)
        for worker in list(self.workers.values()):
            if worker.hosts_file is not None and worker.hosts_file.parent.exists():
                worker.write_hosts(records)
        self.network.set_service_ips({ip for ip, _port in wanted})
        for key, endpoints in wanted.items():
            proxy = self.proxies.get(key)
            if proxy is None:
                proxy = ServiceProxy(*key)
                try:
                    proxy.start()
                except OSError as e:
                    log.warning("cannot proxy %s:%d: %s", key[0], key[1], e)
                    continue
                self.proxies[key] = proxy
            proxy.endpoints = endpoints
        for key in set(self.proxies) - set(wanted):
            self.proxies.pop(key).stop()

    # ----------------------------------------------------------------- main loop

    def serve(self, ready_file: Path | None = None) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.network.setup()
        try:
            self.register_nodes()
            log.info(
                "nodes %s registered (%d nvidia.com/gpu each, pod CIDR %s, bridge %s)",
                ", ".join(self.node_names),
                self.gpus,
                self.cidr,
                self.network.bridge,
            )
            if ready_file is not None:
                ready_file.write_text(
                    json.dumps(
                        {
                            "pid": os.getpid(),
                            "nodes": self.node_names,
                            "bridge": self.network.bridge,
                        }
                    )
                    + "\n"
                )
            last_beat = time.monotonic()
            while not self.stop.is_set():
                try:
                    self.sync_pods()
                    self.sync_services()
                    if time.monotonic() - last_beat > 10:
                        self.heartbeat()
                        last_beat = time.monotonic()
                except Exception as e:  # noqa: BLE001 - API hiccups must not kill the node
                    log.warning("sync failed: %s: %s", type(e).__name__, e)
                self.stop.wait(0.3)
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        log.info("shutting down: stopping %d pods", len(self.workers))
        for w in self.workers.values():
            w.terminate()
        for w in self.workers.values():
            w.finished.wait(MAX_GRACE_S + 5)
            w.cleanup()
        for p in self.proxies.values():
            p.stop()
        self.proxies.clear()
        with contextlib.suppress(Exception):
            self.hosts.remove()
        self.network.teardown()
        for d in reversed(self.created_dirs):
            with contextlib.suppress(OSError):
                d.unlink() if d.is_file() else d.rmdir()
        for name in self.node_names:
            with contextlib.suppress(Exception):
                self.core.delete_node(name)


def cluster_ip_of(spec: dict[str, Any]) -> str | None:
    ip = spec.get("clusterIP")
    return ip if ip and ip != "None" else None


def pick_cidr(candidates: Iterable[str]) -> ipaddress.IPv4Network:
    """The first candidate /16 no interface on this machine uses, so two runners (a demo and
    a test session) never share addresses."""
    used = []
    out = run("ip", "-o", "-4", "addr", "show", check=False).stdout
    for line in out.splitlines():
        m = re.search(r"inet (\S+)", line)
        if m:
            used.append(ipaddress.ip_interface(m.group(1)).network)
    for c in candidates:
        net = ipaddress.ip_network(c)
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free pod CIDR among the candidates")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--state-dir", type=Path, default=REPO_ROOT / ".cache" / "podrunner")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--node-prefix", default="pdd-node")
    parser.add_argument("--ready-file", type=Path, help="written once the nodes are registered")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s podrunner %(levelname)s %(message)s",
    )
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    if os.geteuid() != 0:
        log.error("the pod runner needs root (network namespaces, bind mounts, /etc/hosts)")
        return 2
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            log.error("%s is not installed", tool)
            return 2
    runner_id = hashlib.sha1(str(args.state_dir.resolve()).encode()).hexdigest()[:6]
    cidr = pick_cidr(f"10.{i}.0.0/16" for i in range(240, 255))
    runner = Runner(
        kubeconfig=args.kubeconfig,
        state_dir=args.state_dir.resolve(),
        runner_id=runner_id,
        node_names=[f"{args.node_prefix}-{i}" for i in range(args.nodes)],
        gpus=args.gpus,
        cidr=cidr,
    )

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        runner.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    runner.serve(args.ready_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
