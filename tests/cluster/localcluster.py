"""A local Kubernetes control plane for pdd's integration and e2e tests.

There is no kind, k3s or Docker on the machines this project runs on, so the tests start the
real components as plain processes on 127.0.0.1: etcd, kube-apiserver, kube-controller-manager
and kube-scheduler (built from the Go module proxy by ``make cluster-build``), and kwok, which
plays the kubelets of fake nodes with ``nvidia.com/gpu`` capacity so pods schedule and turn
Running without any GPU.

Usage (from the repository root)::

    python tests/cluster/localcluster.py up [--nodes 4] [--gpus 8]
    python tests/cluster/localcluster.py status
    python tests/cluster/localcluster.py down

Everything lives under ``.cluster/`` (kubeconfig, certificates, etcd data, one log per
component, ``state.json`` with pids and ports). Processes run in their own sessions, so the
cluster outlives the command that started it until ``down``.

Only the standard library and ``cryptography`` are needed.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import fcntl
import hashlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_STATE_DIR = REPO_ROOT / ".cluster"
DEFAULT_BIN_DIR = REPO_ROOT / ".cache" / "cluster" / "bin"
SERVICE_CIDR = "10.96.0.0/16"
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"
# Start order; ``down`` stops in reverse so nothing logs errors about a vanished dependency.
COMPONENTS = ("etcd", "apiserver", "controller-manager", "scheduler", "kwok")
# Opt-in (`up --lws`, CLUSTER_LWS=1, or ensure_lws): the LeaderWorkerSet controller.
LWS_COMPONENTS = ("lws",)
LWS_CRD_FILE = "lws-crd.yaml"  # copied next to the binary from the module by cluster.mk
KWOK_POD_STAGES_FILE = "kwok-pod-stages.yaml"  # kwok's fast pod stages, copied by cluster.mk
LWS_POD_LABEL = "leaderworkerset.sigs.k8s.io/name"
# How long kwok keeps a LeaderWorkerSet's terminating pod before it deletes it, as a kubelet
# takes its time to stop the containers. LWS recreates a group when it sees a worker pod
# terminating (RecreateGroupOnPodRestart); a pod deleted at once is gone from its cache before
# a busy controller looks, and the group is never recreated.
LWS_POD_TERMINATION_MS = 5000
LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
LWS_WEBHOOK_CONFIG = "pdd-local-lws"


class ClusterError(RuntimeError):
    """The control plane could not be started or is not healthy; the message says why."""


def _pod_delete_stage(name: str, label_operator: str, delay_ms: int) -> dict[str, Any]:
    """kwok's fast pod-delete stage (finalizers emptied, the pod deleted) for the terminating
    pods whose LeaderWorkerSet label matches ``label_operator``, after ``delay_ms``."""
    spec: dict[str, Any] = {
        "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
        "selector": {"matchExpressions": [
            {"key": ".metadata.deletionTimestamp", "operator": "Exists"},
            {"key": f'.metadata.labels["{LWS_POD_LABEL}"]', "operator": label_operator},
        ]},
        "next": {"finalizers": {"empty": True}, "delete": True},
    }
    if delay_ms:
        spec["delay"] = {"durationMilliseconds": delay_ms}
    return {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage",
            "metadata": {"name": name}, "spec": spec}


def _kwok_config(bin_dir: Path) -> str:
    """kwok's configuration: its fast pod stages, with pod-delete split in two (other pods
    deleted at once, a LeaderWorkerSet's after LWS_POD_TERMINATION_MS). A config that names
    any pod stage replaces all of kwok's built-in ones. JSON documents are YAML ones."""
    stages = bin_dir / KWOK_POD_STAGES_FILE
    if not stages.is_file():
        raise ClusterError(f"{stages} is missing: build it with `make cluster-build`")
    docs = [json.dumps({"apiVersion": "config.kwok.x-k8s.io/v1alpha1",
                        "kind": "KwokConfiguration", "options": {}}),
            stages.read_text().strip(),
            json.dumps(_pod_delete_stage("pod-delete", "DoesNotExist", 0)),
            json.dumps(_pod_delete_stage("pod-delete-lws", "Exists", LWS_POD_TERMINATION_MS))]
    return "\n---\n".join(docs) + "\n"


def _env_path(name: str, default: Path) -> Path:
    value = os.environ.get(name)
    return Path(value).resolve() if value else default


# --------------------------------------------------------------------------- certificates


@dataclass
class _Pki:
    """Paths of the certificates and keys, all generated fresh by ``up``."""

    dir: Path

    def crt(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"


def _write_pki(
    pki_dir: Path, service_cidr: str = SERVICE_CIDR, node: tuple[str, str] | None = None
) -> _Pki:
    """Make a CA, the API server's serving cert, one client cert per identity and the
    service-account signing key. EC keys keep this well under a second. ``node`` (name, IP)
    adds the real node's identities: the kubelet's client and serving certs, kube-proxy's,
    and the API server's client cert for kubelets (logs, exec)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    pki_dir.mkdir(parents=True, exist_ok=True)
    pki = _Pki(pki_dir)
    now = datetime.datetime.now(datetime.UTC)
    not_before = now - datetime.timedelta(minutes=5)
    not_after = now + datetime.timedelta(days=30)

    def save_key(name: str, key: Any) -> None:
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        pki.key(name).write_bytes(pem)
        pki.key(name).chmod(0o600)

    def name_of(cn: str, org: str | None = None) -> x509.Name:
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org:
            attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        return x509.Name(attrs)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name_of("pdd-local-ca")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pki.crt("ca").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    save_key("ca", ca_key)

    def issue(name: str, subject: x509.Name, *, server: bool, ips: Sequence[str] = ()) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        usage = [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        )
        if server and ips:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.IPv4Address(ip)) for ip in ips]
                ),
                critical=False,
            )
        elif server:
            service_ip = next(ipaddress.IPv4Network(service_cidr).hosts())
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.DNSName("kubernetes"),
                        x509.DNSName("kubernetes.default"),
                        x509.DNSName("kubernetes.default.svc"),
                        x509.DNSName("kubernetes.default.svc.cluster.local"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        x509.IPAddress(service_ip),
                    ]
                ),
                critical=False,
            )
        cert = builder.sign(ca_key, hashes.SHA256())
        pki.crt(name).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        save_key(name, key)

    issue("apiserver", name_of("kube-apiserver"), server=True)
    issue("admin", name_of("kubernetes-admin", "system:masters"), server=False)
    issue("controller-manager", name_of("system:kube-controller-manager"), server=False)
    issue("scheduler", name_of("system:kube-scheduler"), server=False)
    # The aggregation layer's identity; also lets controller-manager and scheduler find the
    # request-header CA they look for at start (they log errors every second without it).
    issue("front-proxy-client", name_of("front-proxy-client"), server=False)
    if node is not None:
        node_name, node_ip = node
        issue("kubelet", name_of(f"system:node:{node_name}", "system:nodes"), server=False)
        issue("kubelet-serving", name_of(node_name), server=True, ips=[node_ip, "127.0.0.1"])
        issue("kube-proxy", name_of("system:kube-proxy"), server=False)
        issue(
            "apiserver-kubelet-client",
            name_of("kube-apiserver-kubelet-client", "system:masters"),
            server=False,
        )

    # Service-account tokens are signed with RSA, the algorithm every client verifies.
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    save_key("sa", sa_key)
    (pki_dir / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki


def _write_kubeconfig(path: Path, server: str, pki: _Pki, identity: str) -> None:
    """kubeconfig with embedded data, so it keeps working if copied elsewhere. JSON is YAML,
    so no YAML library is needed."""

    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "pdd-local",
                "cluster": {"server": server, "certificate-authority-data": b64(pki.crt("ca"))},
            }
        ],
        "users": [
            {
                "name": identity,
                "user": {
                    "client-certificate-data": b64(pki.crt(identity)),
                    "client-key-data": b64(pki.key(identity)),
                },
            }
        ],
        "contexts": [{"name": "pdd-local", "context": {"cluster": "pdd-local", "user": identity}}],
        "current-context": "pdd-local",
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


# --------------------------------------------------------------------------- processes


def _free_ports(count: int) -> list[int]:
    """Ask the kernel for distinct free ports; all are held open until the last is picked
    so the same port is never handed out twice."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _proc_start_time(pid: int) -> str | None:
    """Start time of a process (clock ticks since boot) to tell our process from a later one
    that reused its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses; fields follow the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie is as good as gone
        return None
    return fields[19]


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class Process:
    """One started component, as recorded in ``state.json``."""

    name: str
    pid: int
    start_time: str
    log: str

    def alive(self) -> bool:
        return _proc_start_time(self.pid) == self.start_time


@dataclass
class Cluster:
    """A running (or recorded) local control plane. ``os.fspath(cluster)`` is its kubeconfig,
    so it can be passed wherever a kubeconfig path is expected."""

    state_dir: Path
    kubeconfig: Path
    server: str
    ports: dict[str, int]
    processes: dict[str, Process] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)
    # "cli" (a person ran `make cluster-up`: never stopped by tests) or "fixture" (stopped
    # when the last test session using it ends).
    started_by: str = "cli"
    # The real node's facts ({"node_bin": ..., "ip": ...}) when it has one (`up --real-node`).
    real_node: dict[str, Any] | None = None
    # The LeaderWorkerSet controller's facts ({"webhook_port": ...}) once it runs.
    lws: dict[str, Any] | None = None

    @property
    def components(self) -> tuple[str, ...]:
        extra = LWS_COMPONENTS if self.lws is not None else ()
        if self.real_node is None:
            return COMPONENTS + extra
        import realnode

        return COMPONENTS + realnode.COMPONENTS + extra

    def __fspath__(self) -> str:
        return str(self.kubeconfig)

    @property
    def ca_file(self) -> Path:
        return self.state_dir / "pki" / "ca.crt"

    def env(self) -> dict[str, str]:
        """The current environment with KUBECONFIG pointing at this cluster."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster. On failure with ``check`` the error carries
        kubectl's stderr, which is what a failing test needs to show."""
        cmd = ["kubectl", "--kubeconfig", str(self.kubeconfig), *args]
        proc = subprocess.run(
            cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise ClusterError(
                f"{' '.join(cmd)} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc

    def kubectl_json(self, *args: str, timeout: float = 60) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json", timeout=timeout).stdout)

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.state_dir / f"{name}.log"
        return _tail(path, lines)

    def log_tails(self, lines: int = 40, names: Sequence[str] | None = None) -> str:
        return "\n".join(
            f"----- {self.state_dir / (n + '.log')} (last {lines} lines) -----\n"
            f"{self.log_tail(n, lines)}"
            for n in (names if names is not None else self.components)
        )

    def rss_kib(self) -> dict[str, int]:
        return {n: _rss_kib(p.pid) for n, p in self.processes.items() if p.alive()}

    def to_json(self) -> dict[str, Any]:
        return {
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            "ports": self.ports,
            "nodes": self.nodes,
            "started_by": self.started_by,
            "real_node": self.real_node,
            "lws": self.lws,
            "processes": {n: vars(p) for n, p in self.processes.items()},
        }

    @classmethod
    def load(cls, state_dir: Path) -> Cluster | None:
        try:
            data = json.loads((state_dir / "state.json").read_text())
        except (OSError, ValueError):
            return None
        return cls(
            state_dir=state_dir,
            kubeconfig=Path(data["kubeconfig"]),
            server=data["server"],
            ports=data["ports"],
            processes={n: Process(**p) for n, p in data["processes"].items()},
            nodes=data.get("nodes", []),
            started_by=data.get("started_by", "cli"),
            real_node=data.get("real_node"),
            lws=data.get("lws"),
        )

    def save(self) -> None:
        tmp = self.state_dir / "state.json.tmp"
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(self.state_dir / "state.json")


def _tail(path: Path, lines: int) -> str:
    try:
        data = path.read_bytes()[-64 * 1024 :].decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(data.splitlines()[-lines:])


# --------------------------------------------------------------------------- health


def _ssl_context(ca: Path | None, cert: tuple[Path, Path] | None) -> ssl.SSLContext:
    if ca is None:
        # kube-controller-manager and kube-scheduler serve with self-signed certificates.
        ctx = ssl._create_unverified_context()
    else:
        ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    return ctx


def _http(
    url: str,
    *,
    ctx: ssl.SSLContext | None = None,
    method: str = "GET",
    body: Any = None,
    timeout: float = 5,
) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        # No proxies: everything is on 127.0.0.1, and urllib would honour HTTP(S)_PROXY.
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx)
        )
        with opener.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class _Api:
    """Minimal authenticated API client for bootstrapping (the kubernetes package is an
    optional extra; ``make cluster-up`` should not need it)."""

    def __init__(self, server: str, pki: _Pki) -> None:
        self.server = server
        self.ctx = _ssl_context(pki.crt("ca"), (pki.crt("admin"), pki.key("admin")))

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        status, raw = _http(self.server + path, ctx=self.ctx, method=method, body=body)
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")


def _wait(
    what: str,
    check: Any,
    deadline: float,
    watched: Sequence[Process] = (),
    state_dir: Path | None = None,
) -> None:
    """Poll ``check`` until it returns true; fail early, with the log tail, if one of the
    watched processes dies, because waiting out the timeout would only hide the reason."""
    last_error = ""
    while True:
        for p in watched:
            if not p.alive():
                raise ClusterError(
                    f"{p.name} exited while waiting for {what}; last lines of {p.log}:\n"
                    f"{_tail(Path(p.log), 60)}"
                )
        try:
            if check():
                return
        except (OSError, ssl.SSLError, ValueError) as e:
            last_error = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            logs = ""
            for p in watched:
                logs += f"\n----- last lines of {p.log} -----\n{_tail(Path(p.log), 60)}"
            raise ClusterError(f"timed out waiting for {what} ({last_error}){logs}")
        time.sleep(0.25)


def _http_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    return _http(url, ctx=ctx, timeout=2)[0] == 200


# --------------------------------------------------------------------------- up / down


@contextlib.contextmanager
def _lock(state_dir: Path) -> Iterator[None]:
    """Serialise up/down so two test sessions or a test and a human never interleave."""
    # Outside the state dir (which `down` removes) and in an ignored folder.
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    lock_path = REPO_ROOT / ".cache" / "cluster" / f"state-{digest}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def healthy(cluster: Cluster, skip: Sequence[str] = ()) -> str | None:
    """None when every component (but ``skip``) is alive and answering, else what is wrong."""
    for name in cluster.components:
        if name in skip:
            continue
        proc = cluster.processes.get(name)
        if proc is None or not proc.alive():
            return f"{name} is not running"
    pki = _Pki(cluster.state_dir / "pki")
    try:
        api = _Api(cluster.server, pki)
        status, body = api.request("GET", "/readyz")
        if status != 200:
            return f"apiserver /readyz answered {status}: {body}"
    except (OSError, ssl.SSLError) as e:
        return f"apiserver unreachable: {e}"
    return None


def _start(name: str, argv: list[str], state_dir: Path) -> Process:
    log_path = state_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=state_dir,
            start_new_session=True,  # outlive `make cluster-up`; not hit by the terminal's ^C
            close_fds=True,
        )
    start_time = None
    for _ in range(100):
        start_time = _proc_start_time(popen.pid)
        if start_time is not None:
            break
        time.sleep(0.01)
    if start_time is None:
        raise ClusterError(f"{name} exited at once; log {log_path}:\n{_tail(log_path, 60)}")
    return Process(name=name, pid=popen.pid, start_time=start_time, log=str(log_path))


def _binary(bin_dir: Path, name: str) -> str:
    path = bin_dir / name
    if not os.access(path, os.X_OK):
        raise ClusterError(
            f"{path} is missing: build the control plane first with `make cluster-build`"
        )
    return str(path)


def _node_body(name: str, gpus: int) -> dict[str, Any]:
    resources = {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        "nvidia.com/gpu": str(gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            # kwok manages exactly the nodes with this annotation (--manage-all-nodes=false).
            "annotations": {FAKE_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "nvidia.com/gpu.present": "true",
            },
        },
        # kwok keeps the capacity and allocatable written here, which is how the fake nodes
        # get GPUs the scheduler can count.
        "status": {"capacity": resources, "allocatable": dict(resources)},
    }


def up(
    state_dir: Path = DEFAULT_STATE_DIR,
    bin_dir: Path = DEFAULT_BIN_DIR,
    nodes: int = 4,
    gpus: int = 8,
    timeout: float = 120,
    log: Any = print,
    user: int | None = None,
    real_node: bool = False,
    lws: bool = False,
) -> tuple[Cluster, bool]:
    """Start the control plane, or return the running one. The flag says whether this call
    started it. ``user`` (a pid) registers a test session as a user of the cluster, which
    marks a cluster it starts as the fixture's; see :func:`release`. ``real_node`` adds
    the real node (``realnode.py``); a running cluster without one is not reused for it.
    ``lws`` adds the LeaderWorkerSet controller (to a running cluster too: :func:`ensure_lws`)."""
    cluster, started = _up_locked(state_dir, bin_dir, nodes, gpus, timeout, log, user,
                                  real_node)
    if lws:
        cluster = ensure_lws(state_dir, bin_dir, timeout, log)
    return cluster, started


def _up_locked(
    state_dir: Path,
    bin_dir: Path,
    nodes: int,
    gpus: int,
    timeout: float,
    log: Any,
    user: int | None,
    real_node: bool,
) -> tuple[Cluster, bool]:
    with _lock(state_dir):
        existing = Cluster.load(state_dir)
        if existing is not None:
            # A stopped LWS controller is restarted by ensure_lws, not a reason to replace a
            # control plane other sessions may be using.
            problem = healthy(existing, skip=LWS_COMPONENTS)
            if problem is None and real_node and existing.real_node is None:
                raise ClusterError(
                    f"the local cluster in {state_dir} runs without a real node; stop it "
                    "first (`make cluster-down`) or give this one its own PDD_CLUSTER_DIR"
                )
            if problem is None:
                if user is not None:
                    _add_user(existing, user)
                return existing, False
            log(f"found a broken local cluster in {state_dir} ({problem}); replacing it")
            _stop(existing, log=log)
        if state_dir.exists():
            shutil.rmtree(state_dir)
        cluster = _up(state_dir, bin_dir, nodes, gpus, timeout, log, real_node)
        if user is not None:
            cluster.started_by = "fixture"
            cluster.save()
            _add_user(cluster, user)
        return cluster, True


# --------------------------------------------------------------------------- LeaderWorkerSet


def _issue_local_serving_cert(pki: _Pki, name: str) -> None:
    """A serving certificate for 127.0.0.1 signed by the cluster's CA, so the API server
    (which trusts that CA for webhooks through caBundle) reaches a webhook on 127.0.0.1."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(pki.crt("ca").read_bytes())
    ca_key = serialization.load_pem_private_key(pki.key("ca").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pki.crt(name).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pki.key(name).write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    pki.key(name).chmod(0o600)


def _lws_webhooks(port: int, ca_pem: bytes) -> list[tuple[str, dict[str, Any]]]:
    """LWS's own webhook configurations (config/webhook in its module: defaulting and
    validation of LeaderWorkerSets; the pod webhook that sets each group's labels and the
    LWS_* env), pointed at the controller on 127.0.0.1. The pod webhooks see only pods of a
    LeaderWorkerSet, as upstream's patch selects them, so a stopped controller never blocks
    other pods."""
    ca = base64.b64encode(ca_pem).decode()
    only_lws_pods = {
        "matchExpressions": [{"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]
    }

    def hook(name: str, path: str, group: str, resource: str, ops: list[str],
             selector: dict[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": name,
            "admissionReviewVersions": ["v1"],
            "clientConfig": {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca},
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "timeoutSeconds": 10,
            "rules": [{"apiGroups": [group], "apiVersions": ["v1"], "operations": ops,
                       "resources": [resource]}],
        }
        if selector is not None:
            out["objectSelector"] = selector
        return out

    group = "leaderworkerset.x-k8s.io"
    mutating = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": LWS_WEBHOOK_CONFIG},
        "webhooks": [
            hook("mleaderworkerset.kb.io", "/mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset",
                 group, "leaderworkersets", ["CREATE", "UPDATE"]),
            hook("mpod.kb.io", "/mutate--v1-pod", "", "pods", ["CREATE", "UPDATE"],
                 only_lws_pods),
        ],
    }
    validating = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": LWS_WEBHOOK_CONFIG},
        "webhooks": [
            hook("vleaderworkerset.kb.io",
                 "/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset",
                 group, "leaderworkersets", ["CREATE", "UPDATE"]),
            hook("vpod.kb.io", "/validate--v1-pod", "", "pods", ["CREATE", "UPDATE"],
                 only_lws_pods),
        ],
    }
    return [
        ("/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations", mutating),
        ("/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations", validating),
    ]


def ensure_lws(
    state_dir: Path = DEFAULT_STATE_DIR,
    bin_dir: Path = DEFAULT_BIN_DIR,
    timeout: float = 120,
    log: Any = print,
) -> Cluster:
    """Start the LeaderWorkerSet controller on the running cluster unless it runs already:
    its CRD (server-side apply: 1.2 MB is too large for client-side apply's annotation), a
    serving certificate from the cluster's CA, the controller (admin identity, no leader
    election, no metrics, its own certificate management off) and, once its webhook server
    answers, its webhook configurations. ``down`` stops it with the rest."""
    with _lock(state_dir):
        cluster = Cluster.load(state_dir)
        if cluster is None or healthy(cluster, skip=LWS_COMPONENTS) is not None:
            raise ClusterError(f"no healthy local cluster in {state_dir} to add LeaderWorkerSet to")
        proc = cluster.processes.get("lws")
        if cluster.lws is not None and proc is not None and proc.alive():
            return cluster
        t0 = time.monotonic()
        deadline = t0 + timeout
        binary = _binary(bin_dir, "lws")
        crd = bin_dir / LWS_CRD_FILE
        if not crd.is_file():
            raise ClusterError(f"{crd} is missing: build it with `make cluster-build`")
        pki = _Pki(state_dir / "pki")
        api = _Api(cluster.server, pki)
        # A dead controller's webhooks would refuse every LWS write: gone until it serves.
        for collection, obj in _lws_webhooks(0, b""):
            api.request("DELETE", f"{collection}/{obj['metadata']['name']}")
        applied = cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd),
                                  check=False, timeout=120)
        if applied.returncode != 0:
            raise ClusterError(f"applying the LeaderWorkerSet CRD failed:\n{applied.stderr}")

        def established() -> bool:
            _, body = api.request(
                "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{LWS_CRD}")
            conditions = ((body or {}).get("status") or {}).get("conditions") or []
            return any(c.get("type") == "Established" and c.get("status") == "True"
                       for c in conditions)

        _wait(f"CRD {LWS_CRD} Established", established, deadline)
        cert_dir = state_dir / "lws-certs"
        cert_dir.mkdir(exist_ok=True)
        _issue_local_serving_cert(pki, "lws-webhook")
        shutil.copyfile(pki.crt("lws-webhook"), cert_dir / "tls.crt")
        shutil.copyfile(pki.key("lws-webhook"), cert_dir / "tls.key")
        webhook_port, health_port = _free_ports(2)
        config = state_dir / "lws-config.yaml"
        config.write_text(json.dumps({
            "apiVersion": "config.lws.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
            "metrics": {"bindAddress": "0"},
        }, indent=2) + "\n")
        proc = _start("lws", [binary, f"--config={config}",
                              f"--kubeconfig={state_dir / 'admin.kubeconfig'}",
                              "--zap-log-level=info"], state_dir)
        cluster.processes["lws"] = proc
        cluster.lws = {"webhook_port": webhook_port, "health_port": health_port}
        cluster.save()
        ca_ctx = _ssl_context(pki.crt("ca"), None)
        try:
            _wait("LeaderWorkerSet controller /healthz",
                  lambda: _http_ok(f"http://127.0.0.1:{health_port}/healthz"), deadline, [proc])
            # Any HTTP answer over TLS verified against the CA: the webhook server is up.
            _wait("LeaderWorkerSet webhook server",
                  lambda: _http(f"https://127.0.0.1:{webhook_port}/mutate--v1-pod", ctx=ca_ctx,
                                method="POST", body={}, timeout=2)[0] > 0,
                  deadline, [proc])
            for collection, obj in _lws_webhooks(webhook_port, pki.crt("ca").read_bytes()):
                status, body = api.request("POST", collection, obj)
                if status not in (200, 201):
                    raise ClusterError(f"registering {obj['kind']} failed ({status}): {body}")
        except BaseException:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            cluster.processes.pop("lws", None)
            cluster.lws = None
            cluster.save()
            raise
        log(f"LeaderWorkerSet controller ready ({time.monotonic() - t0:.1f}s)")
        return cluster


def _add_user(cluster: Cluster, pid: int) -> None:
    users = cluster.state_dir / "users"
    users.mkdir(exist_ok=True)
    (users / str(pid)).write_text(_proc_start_time(pid) or "")


def _live_users(cluster: Cluster) -> list[int]:
    live = []
    for entry in (cluster.state_dir / "users").glob("*"):
        pid = int(entry.name)
        if _proc_start_time(pid) == entry.read_text() and entry.read_text():
            live.append(pid)
        else:
            entry.unlink(missing_ok=True)
    return live


def release(state_dir: Path, user: int, log: Any = print) -> bool:
    """A test session is done with the cluster. Several sessions (engineers, tiers) can share
    one working tree and so one cluster: it is stopped only when the last of them leaves, and
    only if a test session started it; a cluster from `make cluster-up` stays. True if this
    call stopped it."""
    with _lock(state_dir):
        cluster = Cluster.load(state_dir)
        if cluster is None:
            return False
        (state_dir / "users" / str(user)).unlink(missing_ok=True)
        if cluster.started_by != "fixture" or _live_users(cluster):
            return False
        _stop(cluster, log=log)
        return True


def _up(
    state_dir: Path,
    bin_dir: Path,
    nodes: int,
    gpus: int,
    timeout: float,
    log: Any,
    real_node: bool = False,
) -> Cluster:
    t0 = time.monotonic()
    deadline = t0 + timeout
    bins = {
        "kube": _binary(bin_dir, "kube"),
        "etcd": _binary(bin_dir, "etcd"),
        "kwok": _binary(bin_dir, "kwok"),
    }
    service_cidr = SERVICE_CIDR
    node: tuple[str, str] | None = None
    if real_node:
        import realnode

        bins["node"] = _binary(bin_dir, "node")
        bins["pause"] = _binary(bin_dir, "pause")
        bins["coredns"] = _binary(bin_dir, "coredns")
        try:
            realnode.check_host()
            node = (realnode.NODE_NAME, realnode.node_ip())
        except realnode.RealNodeError as e:
            raise ClusterError(str(e)) from e
        service_cidr = realnode.SERVICE_CIDR
    state_dir.mkdir(parents=True)
    pki = _write_pki(state_dir / "pki", service_cidr, node)
    names = ["etcd-client", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok"]
    if real_node:
        names += ["kubelet", "kubelet-healthz", "kube-proxy-healthz", "kube-proxy-metrics"]
        names += ["coredns-health", "coredns-ready"]
    ports = dict(zip(names, _free_ports(len(names)), strict=True))
    server = f"https://127.0.0.1:{ports['apiserver']}"
    kubeconfig = state_dir / "kubeconfig"
    cluster = Cluster(state_dir=state_dir, kubeconfig=kubeconfig, server=server, ports=ports)
    if node is not None:
        cluster.real_node = {"node_bin": bins["node"], "ip": node[1], "name": node[0]}
        for identity in ("kubelet", "kube-proxy"):
            _write_kubeconfig(state_dir / f"{identity}.kubeconfig", server, pki, identity)
    for identity in ("admin", "controller-manager", "scheduler"):
        _write_kubeconfig(state_dir / f"{identity}.kubeconfig", server, pki, identity)
    shutil.copyfile(state_dir / "admin.kubeconfig", kubeconfig)
    kubeconfig.chmod(0o600)

    def start(name: str, argv: list[str]) -> Process:
        proc = _start(name, argv, state_dir)
        cluster.processes[name] = proc
        cluster.save()  # record every pid at once, so `down` finds it even if `up` fails
        return proc

    try:
        etcd_url = f"http://127.0.0.1:{ports['etcd-client']}"
        peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
        etcd = start(
            "etcd",
            [
                bins["etcd"],
                "--name=pdd-local",
                f"--data-dir={state_dir / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=pdd-local={peer_url}",
                "--initial-cluster-state=new",
                # Test data is thrown away: skip fsync, which dominates on slow disks.
                "--unsafe-no-fsync",
                "--auto-compaction-retention=1",
                "--quota-backend-bytes=2147483648",
                "--log-level=warn",
            ],
        )
        _wait("etcd /health", lambda: _http_ok(f"{etcd_url}/health"), deadline, [etcd])
        log(f"etcd ready ({time.monotonic() - t0:.1f}s)")

        p = pki.dir
        apiserver = start(
            "apiserver",
            [
                bins["kube"],
                "apiserver",
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={ports['apiserver']}",
                f"--cert-dir={state_dir / 'apiserver-certs'}",
                f"--tls-cert-file={pki.crt('apiserver')}",
                f"--tls-private-key-file={pki.key('apiserver')}",
                f"--client-ca-file={pki.crt('ca')}",
                f"--service-account-key-file={p / 'sa.pub'}",
                f"--service-account-signing-key-file={pki.key('sa')}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={service_cidr}",
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                "--endpoint-reconciler-type=none",
                f"--requestheader-client-ca-file={pki.crt('ca')}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki.crt('front-proxy-client')}",
                f"--proxy-client-key-file={pki.key('front-proxy-client')}",
                *(
                    [
                        # Reach kubelets (logs, exec) at the node's IP, not its name.
                        "--kubelet-preferred-address-types=InternalIP",
                        f"--kubelet-client-certificate={pki.crt('apiserver-kubelet-client')}",
                        f"--kubelet-client-key={pki.key('apiserver-kubelet-client')}",
                    ]
                    if node is not None
                    else []
                ),
                "--profiling=false",
                "--v=1",
            ],
        )
        api = _Api(server, pki)
        _wait(
            "kube-apiserver /readyz",
            lambda: api.request("GET", "/readyz")[0] == 200,
            deadline,
            [etcd, apiserver],
        )
        log(f"kube-apiserver ready ({time.monotonic() - t0:.1f}s)")

        start(
            "controller-manager",
            [
                bins["kube"],
                "controller-manager",
                f"--kubeconfig={state_dir / 'controller-manager.kubeconfig'}",
                f"--authentication-kubeconfig={state_dir / 'controller-manager.kubeconfig'}",
                f"--authorization-kubeconfig={state_dir / 'controller-manager.kubeconfig'}",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['controller-manager']}",
                f"--cert-dir={state_dir / 'controller-manager-certs'}",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki.key('sa')}",
                f"--root-ca-file={pki.crt('ca')}",
                f"--cluster-signing-cert-file={pki.crt('ca')}",
                f"--cluster-signing-key-file={pki.key('ca')}",
                f"--service-cluster-ip-range={service_cidr}",
                "--leader-elect=false",
                "--profiling=false",
                "--v=1",
            ],
        )
        start(
            "scheduler",
            [
                bins["kube"],
                "scheduler",
                f"--kubeconfig={state_dir / 'scheduler.kubeconfig'}",
                f"--authentication-kubeconfig={state_dir / 'scheduler.kubeconfig'}",
                f"--authorization-kubeconfig={state_dir / 'scheduler.kubeconfig'}",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['scheduler']}",
                f"--cert-dir={state_dir / 'scheduler-certs'}",
                "--leader-elect=false",
                "--profiling=false",
                "--v=1",
            ],
        )
        kwok_config = state_dir / "kwok.yaml"
        kwok_config.write_text(_kwok_config(bin_dir))
        start(
            "kwok",
            [
                bins["kwok"],
                f"--config={kwok_config}",  # not ~/.kwok/kwok.yaml: the host's must not leak in
                f"--kubeconfig={state_dir / 'admin.kubeconfig'}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}=fake",
                f"--server-address=127.0.0.1:{ports['kwok']}",
                "--node-ip=127.0.0.1",
                "--cidr=10.244.0.1/16",
                # Without node leases the node lifecycle controller marks every fake node
                # NotReady about once a minute, and kwok never sets its pods Ready again.
                "--node-lease-duration-seconds=40",
            ],
        )
        everything = list(cluster.processes.values())
        unverified = _ssl_context(None, None)
        for name, url in (
            ("kube-controller-manager", f"https://127.0.0.1:{ports['controller-manager']}"),
            ("kube-scheduler", f"https://127.0.0.1:{ports['scheduler']}"),
        ):
            _wait(
                f"{name} /healthz",
                lambda url=url: _http_ok(url + "/healthz", unverified),
                deadline,
                everything,
            )
        _wait(
            "kwok /healthz",
            lambda: _http_ok(f"http://127.0.0.1:{ports['kwok']}/healthz"),
            deadline,
            everything,
        )
        log(f"controller-manager, scheduler, kwok healthy ({time.monotonic() - t0:.1f}s)")

        for i in range(nodes):
            name = f"gpu-node-{i}"
            status, body = api.request("POST", "/api/v1/nodes", _node_body(name, gpus))
            if status not in (200, 201):
                raise ClusterError(f"creating node {name} failed ({status}): {body}")
            cluster.nodes.append(name)
        cluster.save()

        def nodes_ready() -> bool:
            status, body = api.request("GET", "/api/v1/nodes?labelSelector=type%3Dkwok")
            if status != 200:
                return False
            ready = 0
            for node in body["items"]:
                conditions = node.get("status", {}).get("conditions", [])
                alloc = node.get("status", {}).get("allocatable", {})
                if alloc.get("nvidia.com/gpu") != str(gpus):
                    continue
                if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                    ready += 1
            return ready == nodes

        _wait(f"{nodes} fake GPU nodes Ready", nodes_ready, deadline, everything)

        # Pods are refused until the service-account controller made "default"; tests (and
        # people) should be able to create pods as soon as `up` returns.
        _wait(
            "service account default/default",
            lambda: (
                api.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200
            ),
            deadline,
            everything,
        )
        log(f"{nodes} nodes x {gpus} nvidia.com/gpu Ready ({time.monotonic() - t0:.1f}s)")
        if node is not None:
            _up_real_node(cluster, bins, pki, api, gpus, deadline + 120, start, log, t0)
        return cluster
    except BaseException:
        # Leave nothing running; keep the logs so the caller can show them.
        _stop(cluster, log=log, keep_logs=True)
        raise


def _up_real_node(
    cluster: Cluster,
    bins: dict[str, str],
    pki: _Pki,
    api: _Api,
    gpus: int,
    deadline: float,
    start: Any,
    log: Any,
    t0: float,
) -> None:
    """containerd (with the local image), the kubelet, kube-proxy; then the node's GPUs.
    Called inside ``_up``'s cleanup guard, so a failure here stops everything."""
    import realnode

    state_dir, ports = cluster.state_dir, cluster.ports
    assert cluster.real_node is not None
    ip = cluster.real_node["ip"]
    try:
        realnode.claim_host(
            state_dir,
            lambda owner: (c := Cluster.load(owner)) is not None and healthy(c) is None,
            log,
        )
        realnode.host_setup()
    except realnode.RealNodeError as e:
        raise ClusterError(str(e)) from e
    containerd = start(
        "containerd",
        ["containerd", f"--config={realnode.containerd_config(state_dir)}", "--log-level=warn"],
    )
    _wait(
        "containerd",
        lambda: realnode.ctr("version", timeout=10).returncode == 0,
        deadline,
        [containerd],
    )
    tar = realnode.image_tar(Path(bins["pause"]), state_dir / "pause-image.tar")
    imported = realnode.import_image(tar)
    log(
        f"containerd ready, image {realnode.IMAGE} "
        f"{'imported' if imported else 'already there'} ({time.monotonic() - t0:.1f}s)"
    )
    for collection, obj in realnode.dns_objects(ip):
        status, body = api.request("POST", collection, obj)
        if status not in (200, 201):
            raise ClusterError(f"creating {collection}/{obj['metadata']['name']}: {status} {body}")
    corefile = realnode.corefile(
        state_dir,
        ip,
        state_dir / "admin.kubeconfig",
        ports["coredns-health"],
        ports["coredns-ready"],
    )
    coredns = start("coredns", [bins["coredns"], "-conf", str(corefile)])
    kubelet_config = realnode.kubelet_config(
        state_dir, pki.dir, ip, ports["kubelet"], ports["kubelet-healthz"]
    )
    kubelet = start(
        "kubelet", realnode.kubelet_argv(bins["node"], state_dir, kubelet_config, ip, gpus)
    )
    proxy_config = realnode.kube_proxy_config(
        state_dir,
        state_dir / "kube-proxy.kubeconfig",
        ports["kube-proxy-healthz"],
        ports["kube-proxy-metrics"],
    )
    proxy = start("kube-proxy", [bins["node"], "proxy", f"--config={proxy_config}", "--v=1"])
    everything = list(cluster.processes.values())
    path = f"/api/v1/nodes/{realnode.NODE_NAME}"

    def node_ready() -> bool:
        status, body = api.request("GET", path)
        if status != 200:
            return False
        conditions = body.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    _wait(f"real node {realnode.NODE_NAME} Ready", node_ready, deadline, everything)
    cluster.nodes.append(realnode.NODE_NAME)
    cluster.save()
    log(f"real node {realnode.NODE_NAME} Ready at {ip} ({time.monotonic() - t0:.1f}s)")
    if gpus:
        status, body = _json_patch(api, path + "/status", realnode.gpu_patch(gpus))
        if status != 200:
            raise ClusterError(f"advertising nvidia.com/gpu on {path} failed ({status}): {body}")

        def gpus_allocatable() -> bool:
            status, body = api.request("GET", path)
            alloc = body.get("status", {}).get("allocatable", {}) if status == 200 else {}
            return bool(alloc.get("nvidia.com/gpu") == str(gpus))

        _wait("nvidia.com/gpu allocatable on the real node", gpus_allocatable, deadline, everything)
    _wait(
        "kube-proxy /healthz",
        lambda: _http_ok(f"http://127.0.0.1:{ports['kube-proxy-healthz']}/healthz"),
        deadline,
        [kubelet, proxy, containerd, coredns],
    )
    _wait(
        "CoreDNS /ready",
        lambda: _http_ok(f"http://127.0.0.1:{ports['coredns-ready']}/ready"),
        deadline,
        [kubelet, proxy, containerd, coredns],
    )
    log(f"real node: {gpus} nvidia.com/gpu, kube-proxy healthy ({time.monotonic() - t0:.1f}s)")


def _json_patch(api: _Api, path: str, patch: Any) -> tuple[int, Any]:
    data = json.dumps(patch).encode()
    req = urllib.request.Request(api.server + path, data=data, method="PATCH")
    req.add_header("Content-Type", "application/json-patch+json")
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=api.ctx)
    )
    try:
        with opener.open(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _stop(cluster: Cluster, log: Any = print, keep_logs: bool = False) -> None:
    """SIGTERM each component (reverse start order), then SIGKILL what is left; each one was
    started in its own session, so its whole process group goes. The real node goes first,
    while the API server can still see its pods go."""
    if cluster.real_node is not None:
        import realnode

        realnode.stop(cluster.processes, log, cluster.real_node.get("node_bin"))
    procs = [cluster.processes[n] for n in (*LWS_COMPONENTS, *reversed(COMPONENTS))
             if n in cluster.processes]
    for p in procs:
        if p.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while any(p.alive() for p in procs) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.1)
    for p in procs:
        if p.alive():
            log(f"{p.name} (pid {p.pid}) ignored SIGTERM; killing it")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    while any(p.alive() for p in procs) and time.monotonic() < deadline + 5:
        _reap()
        time.sleep(0.1)
    _reap()  # the last ones are zombies until then when `up` ran in this process
    if keep_logs:
        (cluster.state_dir / "state.json").unlink(missing_ok=True)
    elif cluster.state_dir.exists():
        shutil.rmtree(cluster.state_dir, ignore_errors=True)


def _reap() -> None:
    """Collect exited children when ``up`` and ``down`` run in one process (tests)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass


def down(state_dir: Path = DEFAULT_STATE_DIR, log: Any = print) -> bool:
    """Stop every recorded component and remove the state. True if something was running."""
    with _lock(state_dir):
        cluster = Cluster.load(state_dir)
        if cluster is None:
            if state_dir.exists():
                shutil.rmtree(state_dir, ignore_errors=True)
            return False
        _stop(cluster, log=log)
        return True


def status(state_dir: Path = DEFAULT_STATE_DIR) -> tuple[Cluster | None, str | None]:
    cluster = Cluster.load(state_dir)
    if cluster is None:
        return None, "no local cluster recorded"
    return cluster, healthy(cluster)


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--state-dir", type=Path, default=_env_path("PDD_CLUSTER_DIR", DEFAULT_STATE_DIR)
    )
    parser.add_argument(
        "--bin-dir", type=Path, default=_env_path("PDD_CLUSTER_BIN", DEFAULT_BIN_DIR)
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="start the control plane (or report the running one)")
    p_up.add_argument("--nodes", type=int, default=int(os.environ.get("CLUSTER_NODES", 4)))
    p_up.add_argument("--gpus", type=int, default=int(os.environ.get("CLUSTER_GPUS", 8)))
    p_up.add_argument("--timeout", type=float, default=120)
    p_up.add_argument(
        "--real-node",
        action="store_true",
        default=os.environ.get("NODE") == "real",
        help="also start a real node: kubelet, containerd, runc, CNI, kube-proxy (root)",
    )
    p_up.add_argument(
        "--lws",
        action="store_true",
        default=os.environ.get("CLUSTER_LWS") == "1",
        help="also run the LeaderWorkerSet controller (multi-node instances, docs/lws.md)",
    )
    sub.add_parser("down", help="stop every component and remove the state")
    sub.add_parser("status", help="say whether the control plane runs and is healthy")
    args = parser.parse_args(argv)
    state_dir: Path = args.state_dir.resolve()

    def log(msg: str) -> None:
        print(f"localcluster: {msg}", file=sys.stderr, flush=True)

    if args.command == "up":
        t0 = time.monotonic()
        try:
            cluster, started = up(
                state_dir,
                args.bin_dir.resolve(),
                args.nodes,
                args.gpus,
                args.timeout,
                log,
                real_node=args.real_node,
                lws=args.lws,
            )
        except ClusterError as e:
            log(f"cluster-up FAILED: {e}")
            log(f"component logs are in {state_dir}/; run `make cluster-down` to clean up")
            return 1
        rel = os.path.relpath(cluster.kubeconfig)
        if not started:
            pids = ", ".join(f"{n} {p.pid}" for n, p in cluster.processes.items())
            log(
                f"a local cluster is ALREADY RUNNING ({cluster.server}; {pids}); "
                f"reusing it. Run `make cluster-down` first for a fresh one."
            )
        else:
            log(f"cluster up in {time.monotonic() - t0:.1f}s: {cluster.server}")
        print(f"export KUBECONFIG={rel}")
        return 0
    if args.command == "down":
        if down(state_dir, log):
            log("stopped the local cluster and removed its state")
        else:
            log("no local cluster was running")
        return 0
    recorded, problem = status(state_dir)
    if recorded is None:
        log(problem or "")
        return 1
    rss = recorded.rss_kib()
    print(
        json.dumps(
            {
                **recorded.to_json(),
                "healthy": problem is None,
                "problem": problem,
                "rss_kib": rss,
                "rss_total_mib": round(sum(rss.values()) / 1024, 1),
            },
            indent=2,
        )
    )
    return 0 if problem is None else 1


if __name__ == "__main__":
    # realnode.py imports this module by name: let it find this one, not load a second copy.
    sys.modules.setdefault("localcluster", sys.modules[__name__])
    sys.exit(main())
