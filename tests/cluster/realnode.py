"""The local cluster's real node: kubelet, containerd, runc, the CNI bridge and kube-proxy.

``localcluster.py up --real-node`` (``make cluster-up NODE=real``) starts it next to the fake
nodes. Unlike the control plane, which only listens on 127.0.0.1, a node changes the host: a
bridge, network namespaces, iptables rules, mounts and cgroups. So there is at most one real
node per host (``HOST_MARK`` names the cluster that owns it), everything it writes lives under
``VAR_DIR`` and ``RUN_DIR``, and :func:`stop` removes every process, mount, network namespace,
veth and iptables rule it made, then :func:`leftovers` checks that nothing is left.

No registry is reachable, so the only image is made here from the static ``pause`` binary
(``tests/cluster/cmd/pause``) and imported into containerd: it is the sandbox image and the
container of the node's tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NODE_NAME = "real-node"
IMAGE = "pdd.local/pause:1"
# Not another local cluster's pod or service range (10.96.0.0/16 and kwok's), so the
# real node's bridge, masquerade and kube-proxy rules never catch their traffic.
POD_CIDR = "10.88.0.0/16"
SERVICE_CIDR = "10.112.0.0/16"
BRIDGE = "pddnode0"
CNI_NETWORK = "pdd-local"
VAR_DIR = Path("/var/lib/pdd-localcluster")
RUN_DIR = Path("/run/pdd-localcluster")
HOST_MARK = RUN_DIR / "owner"
CONTAINERD_SOCK = RUN_DIR / "containerd" / "containerd.sock"
CNI_BIN = Path("/usr/lib/cni")  # Debian's; containerd's default /opt/cni/bin is left alone
# Start order; stop goes the other way (kubelet first, so it does not restart what is removed).
COMPONENTS = ("containerd", "coredns", "kubelet", "kube-proxy")
# The cluster DNS Service (the kubelet's clusterDNS); its endpoint is CoreDNS on the node IP.
DNS_SERVICE_IP = "10.112.0.10"
TAINT = "pdd.dev/node=real:NoSchedule"
# What `leftovers` and the iptables sweep treat as this node's: chains made by the kubelet,
# kube-proxy and the CNI plugins (there is no other Kubernetes node or CNI user on the host).
CHAIN_PREFIXES = ("KUBE-", "CNI-")
PACKAGES = ("containerd", "runc", "ctr", "iptables", "iptables-save", "conntrack")


class RealNodeError(RuntimeError):
    """The real node cannot start here; the message says why."""


def node_ip() -> str:
    """The host's first global IPv4 address: the kubelet refuses a loopback node IP, and the
    API server reaches the kubelet (logs, exec) at its InternalIP."""
    out = _run(["ip", "-4", "-o", "addr", "show", "scope", "global"]).stdout
    for line in out.splitlines():
        m = re.search(r"^\d+:\s+(\S+)\s+inet (\S+)", line)
        if not m or m.group(1) == BRIDGE or m.group(1).startswith("pddbr"):
            continue
        return str(ipaddress.ip_interface(m.group(2)).ip)
    raise RealNodeError("no global IPv4 address on this host for the kubelet's node IP")


def check_host() -> None:
    """Fail early, with the fix, when a package is missing or the host cannot run a node."""
    missing = [
        p for p in PACKAGES if not any(Path(d, p).exists() for d in ("/usr/bin", "/usr/sbin"))
    ]
    if missing or not (CNI_BIN / "bridge").exists():
        raise RealNodeError(
            f"missing {', '.join(missing) or CNI_BIN / 'bridge'}: run `make cluster-node-deps` "
            "(apt-get install containerd runc containernetworking-plugins iptables conntrack)"
        )
    if os.geteuid() != 0:
        raise RealNodeError("the real node needs root (it mounts, makes namespaces, iptables)")


def claim_host(state_dir: Path, is_alive: Callable[[Path], bool], log: Any) -> None:
    """Make this cluster the host's only real node. A mark left by a cluster that is gone
    (crashed, or its state removed) is cleaned up first; a live one is an error."""
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    if HOST_MARK.exists():
        owner = Path(HOST_MARK.read_text().strip())
        if owner != state_dir and is_alive(owner):
            raise RealNodeError(
                f"the local cluster in {owner} already runs this host's real node; "
                f"stop it first (PDD_CLUSTER_DIR={owner} make cluster-down)"
            )
        log(f"cleaning up a real node left behind by {owner}")
        stop(None, log)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    HOST_MARK.write_text(f"{state_dir}\n")


# --------------------------------------------------------------------------- files


def image_tar(pause_binary: Path, out: Path) -> Path:
    """A docker-archive of one layer holding ``/pause``, for ``ctr images import``. Fixed
    timestamps, so the same binary gives the same image digest (a warm start imports nothing
    new)."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w", format=tarfile.USTAR_FORMAT) as layer:
        info = tarfile.TarInfo("pause")
        data = pause_binary.read_bytes()
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        layer.addfile(info, io.BytesIO(data))
    layer_bytes = layer_buf.getvalue()
    layer_sha = hashlib.sha256(layer_bytes).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {"Entrypoint": ["/pause"], "Env": ["PATH=/"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_sha}"]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [IMAGE], "Layers": [f"{layer_sha}/layer.tar"]}]
    with tarfile.open(out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, blob in (
            (f"{layer_sha}/layer.tar", layer_bytes),
            (config_name, config_bytes),
            ("manifest.json", json.dumps(manifest).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(blob), 0o644, 0
            tar.addfile(info, io.BytesIO(blob))
    return out


def containerd_config(state_dir: Path) -> Path:
    """containerd's own root, state and socket (never the host's /var/lib/containerd), the
    facts of these VMs (``restrict_oom_score_adj``, cgroupfs, a local sandbox image) and
    Debian's CNI plugin folder."""
    path = state_dir / "containerd.toml"
    path.write_text(
        f"""version = 2
root = "{VAR_DIR / "containerd"}"
state = "{RUN_DIR / "containerd"}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{CONTAINERD_SOCK}"

[ttrpc]
  address = "{RUN_DIR / "containerd" / "containerd.sock.ttrpc"}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{VAR_DIR / "opt"}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{IMAGE}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_cdi = false

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{state_dir / "cni"}"
    max_conf_num = 1
"""
    )
    cni = state_dir / "cni"
    cni.mkdir(exist_ok=True)
    (cni / "10-pdd-local.conflist").write_text(
        json.dumps(
            {
                "cniVersion": "1.0.0",
                "name": CNI_NETWORK,
                "plugins": [
                    {
                        "type": "bridge",
                        "bridge": BRIDGE,
                        "isGateway": True,
                        "ipMasq": True,
                        "hairpinMode": True,
                        "ipam": {
                            "type": "host-local",
                            "dataDir": str(VAR_DIR / "cni-ipam"),
                            "ranges": [[{"subnet": POD_CIDR}]],
                            "routes": [{"dst": "0.0.0.0/0"}],
                        },
                    },
                    {"type": "portmap", "capabilities": {"portMappings": True}},
                ],
            },
            indent=2,
        )
        + "\n"
    )
    return path


def corefile(state_dir: Path, ip: str, kubeconfig: Path, health: int, ready: int) -> Path:
    """CoreDNS as a process on the host, answering on the node IP (pods reach it through the
    kube-dns Service). It reads the API with the admin identity: a local test cluster's DNS,
    not a hardened one."""
    path = state_dir / "Corefile"
    path.write_text(
        f""".:53 {{
    bind {ip}
    errors
    health 127.0.0.1:{health}
    ready 127.0.0.1:{ready}
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} pdd-local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
    forward . /etc/resolv.conf
}}
"""
    )
    return path


def dns_objects(ip: str) -> list[tuple[str, dict[str, Any]]]:
    """(API collection path, object) for the kube-dns Service and its hand-made EndpointSlice
    (no selector: the endpoint is a host process, not a pod)."""
    ports = [
        {"name": "dns", "port": 53, "protocol": "UDP"},
        {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
    ]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "kube-dns", "namespace": "kube-system"},
        "spec": {"clusterIP": DNS_SERVICE_IP, "ports": [dict(p, targetPort=53) for p in ports]},
    }
    endpoints = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "kube-dns-host",
            "namespace": "kube-system",
            "labels": {
                "kubernetes.io/service-name": "kube-dns",
                "endpointslice.kubernetes.io/managed-by": "localcluster.pdd.dev",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
        "ports": ports,
    }
    return [
        ("/api/v1/namespaces/kube-system/services", service),
        ("/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices", endpoints),
    ]


def kubelet_config(state_dir: Path, pki_dir: Path, ip: str, port: int, healthz_port: int) -> Path:
    """KubeletConfiguration for these VMs: cgroup v1 with the cgroupfs driver, swap allowed,
    client certificates only (anonymous off; AlwaysAllow for holders of the cluster CA's
    certificates, which only the API server and admin have), and no eviction or image GC
    from a busy shared disk."""
    path = state_dir / "kubelet.yaml"
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": ip,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "tlsCertFile": str(pki_dir / "kubelet-serving.crt"),
        "tlsPrivateKeyFile": str(pki_dir / "kubelet-serving.key"),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(pki_dir / "ca.crt")},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCK}",
        "clusterDomain": "cluster.local",
        "clusterDNS": [DNS_SERVICE_IP],
        "resolvConf": "/etc/resolv.conf",
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "serializeImagePulls": False,
        "registerNode": True,
        "rotateCertificates": False,
        "syncFrequency": "10s",
        "nodeStatusUpdateFrequency": "5s",
        "fileCheckFrequency": "5s",
        "shutdownGracePeriod": "0s",
        "maxPods": 50,
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def kube_proxy_config(state_dir: Path, kubeconfig: Path, healthz: int, metrics: int) -> Path:
    """iptables mode, the real node's name, and no conntrack sysctl changes (these VMs may
    refuse them, and the defaults are fine for tests)."""
    path = state_dir / "kube-proxy.yaml"
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "hostnameOverride": NODE_NAME,
        "clusterCIDR": POD_CIDR,
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "bindAddress": "0.0.0.0",
        "healthzBindAddress": f"127.0.0.1:{healthz}",
        "metricsBindAddress": f"127.0.0.1:{metrics}",
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
        "iptables": {"localhostNodePorts": False, "syncPeriod": "10s", "minSyncPeriod": "1s"},
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def kubelet_argv(node_bin: str, state_dir: Path, config: Path, ip: str, gpus: int) -> list[str]:
    return [
        node_bin,
        "kubelet",
        f"--config={config}",
        f"--kubeconfig={state_dir / 'kubelet.kubeconfig'}",
        f"--root-dir={VAR_DIR / 'kubelet'}",
        f"--cert-dir={state_dir / 'kubelet-certs'}",
        f"--hostname-override={NODE_NAME}",
        f"--node-ip={ip}",
        f"--node-labels=pdd.dev/node=real,nvidia.com/gpu.present={'true' if gpus else 'false'}",
        # Tainted: pods of the fake-node tests, which use images this node does not have,
        # must not land here; pods meant for it tolerate the taint.
        f"--register-with-taints={TAINT}",
        "--v=1",
    ]


# --------------------------------------------------------------------------- start


def host_setup() -> None:
    """Forwarding for pod traffic, and bridged traffic through iptables so a pod reaches a
    Service whose endpoint is on the same bridge. Both stay on after ``down`` (other local
    networks may rely on them too)."""
    for key, value in (
        ("net/ipv4/ip_forward", "1"),
        ("net/bridge/bridge-nf-call-iptables", "1"),
    ):
        path = Path("/proc/sys") / key
        if not path.exists() and "bridge" in key:
            _run(["modprobe", "br_netfilter"], check=False)
        try:
            path.write_text(value)
        except OSError as e:
            raise RealNodeError(f"cannot set {key}={value}: {e}") from e
    for d in (VAR_DIR, RUN_DIR):
        d.mkdir(parents=True, exist_ok=True)


def ctr(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return _run(
        ["ctr", "--address", str(CONTAINERD_SOCK), "--namespace", "k8s.io", *args],
        timeout=timeout,
    )


def import_image(tar: Path) -> bool:
    """Import the local image unless containerd already holds this exact one. True if it
    imported."""
    manifest = json.loads(_tar_member(tar, "manifest.json"))
    config_digest = "sha256:" + manifest[0]["Config"].removesuffix(".json")
    listed = ctr("images", "ls").stdout
    for line in listed.splitlines()[1:]:
        cols = line.split()
        if cols and cols[0] == IMAGE:
            with contextlib.suppress(subprocess.CalledProcessError):
                info = ctr("content", "get", cols[2]).stdout
                if config_digest in info:
                    return False
    ctr("images", "import", str(tar))
    return True


def _tar_member(tar: Path, name: str) -> bytes:
    with tarfile.open(tar) as t:
        member = t.extractfile(name)
        assert member is not None
        return member.read()


def gpu_patch(gpus: int) -> list[dict[str, Any]]:
    """JSON patch for the node's status subresource: the documented way to advertise an
    extended resource; the kubelet then copies it into allocatable."""
    return [{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": str(gpus)}]


# --------------------------------------------------------------------------- stop


def stop(processes: dict[str, Any] | None, log: Any, node_bin: str | None = None) -> None:
    """Take the node apart, in an order where each step still has what it needs: the kubelet
    goes first (it would restart what is removed), then every pod sandbox is stopped through
    CRI (the CNI DEL removes veths, IP leases, portmap and masquerade rules, and the network
    namespace), then kube-proxy's rules, containerd and its shims; last a sweep for anything
    a crash may have left: mounts under our folders, namespaces, the bridge, iptables chains
    and cgroups. ``processes`` (name -> object with ``pid`` and ``alive()``) may be None when
    only leftovers are cleaned up."""
    procs = processes or {}
    _term(procs.get("kubelet"), log)
    if node_bin and CONTAINERD_SOCK.exists() and _alive(procs.get("containerd")):
        res = _run([node_bin, "cri-cleanup", f"unix://{CONTAINERD_SOCK}"], check=False, timeout=150)
        if res.returncode != 0:
            log(f"cri-cleanup: {res.stdout.strip()} {res.stderr.strip()[-2000:]}")
    _term(procs.get("kube-proxy"), log)
    _term(procs.get("coredns"), log)
    if node_bin:
        # It also tries the ipvs mode's ipsets and fails without the ipset tool (not
        # installed, ipvs not used); the sweep below reports any chain it really left.
        _run([node_bin, "proxy", "--cleanup", "--v=0"], check=False, timeout=60)
    _term(procs.get("containerd"), log)
    _kill_shims(log)
    _sweep_mounts(log)
    _sweep_netns(log)
    _run(["ip", "link", "del", BRIDGE], check=False)
    _sweep_iptables(log)
    _sweep_cgroups()
    _reap()
    if not node_mounts():
        shutil.rmtree(RUN_DIR, ignore_errors=True)  # sockets and state of the stopped node


def _alive(proc: Any) -> bool:
    return bool(proc is not None and proc.alive())


def _term(proc: Any, log: Any, grace: float = 15) -> None:
    if not _alive(proc):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while proc.alive() and time.monotonic() < deadline:
        _reap()
        time.sleep(0.1)
    if proc.alive():
        log(f"{proc.name} (pid {proc.pid}) ignored SIGTERM; killing it")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        while proc.alive() and time.monotonic() < deadline + 5:
            _reap()
            time.sleep(0.1)


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass


def node_processes() -> list[tuple[int, str]]:
    """Processes of this node that outlive their parent: containerd's shims (their command
    line names our containerd socket) and anything running from our folders."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(RUN_DIR) in cmdline or str(VAR_DIR) in cmdline:
            found.append((int(entry.name), cmdline.strip()))
    return found


def _kill_shims(log: Any) -> None:
    me = os.getpid()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        procs = [(pid, cmd) for pid, cmd in node_processes() if pid != me]
        if not procs:
            return
        for pid, cmd in procs:
            if sig == signal.SIGKILL:
                log(f"killing leftover pid {pid}: {cmd[:200]}")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(
            Path(f"/proc/{pid}").exists() for pid, _ in procs
        ):
            _reap()
            time.sleep(0.1)


def node_mounts() -> list[str]:
    """Mount points under our folders, deepest first (the order to unmount them)."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point.startswith((f"{VAR_DIR}/", f"{RUN_DIR}/")) or point in (
            str(VAR_DIR),
            str(RUN_DIR),
        ):
            points.append(point)
    return sorted(set(points), key=lambda p: (-p.count("/"), p))


def _sweep_mounts(log: Any) -> None:
    for _ in range(3):
        points = node_mounts()
        if not points:
            return
        for point in points:
            if _run(["umount", point], check=False).returncode != 0:
                _run(["umount", "-l", point], check=False)
    if node_mounts():
        log(f"still mounted: {node_mounts()}")


def _sweep_netns(log: Any) -> None:
    """containerd keeps pod namespaces under its state folder (netns_mounts_under_state_dir);
    an older run may have used /var/run/netns/cni-*, which only containerd's CRI creates."""
    netns_dir = Path("/var/run/netns")
    if netns_dir.is_dir():
        for ns in netns_dir.glob("cni-*"):
            _run(["ip", "netns", "del", ns.name], check=False)
    for veth in node_veths():
        log(f"removing leftover veth {veth}")
        _run(["ip", "link", "del", veth], check=False)


def node_veths() -> list[str]:
    """Host ends of veths on our bridge."""
    out = _run(["ip", "-o", "link", "show", "master", BRIDGE], check=False).stdout
    return [m.group(1) for m in re.finditer(r"^\d+:\s+([^@:\s]+)", out, re.M)]


def node_chains() -> dict[str, list[str]]:
    """``{"iptables:<table>": [chain, ...]}`` for the chains the node made, IPv4 and IPv6."""
    found: dict[str, list[str]] = {}
    for tool in ("iptables", "ip6tables"):
        out = _run([f"{tool}-save"], check=False).stdout
        table = ""
        for line in out.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":") and line[1:].startswith(CHAIN_PREFIXES):
                found.setdefault(f"{tool}:{table}", []).append(line[1:].split()[0])
    return found


def _sweep_iptables(log: Any) -> None:
    """Remove the jumps from built-in chains into our chains, then flush and delete those."""
    for tool in ("iptables", "ip6tables"):
        out = _run([f"{tool}-save"], check=False).stdout
        table = ""
        jumps: list[tuple[str, str]] = []
        chains: dict[str, list[str]] = {}
        for line in out.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":") and line[1:].startswith(CHAIN_PREFIXES):
                chains.setdefault(table, []).append(line[1:].split()[0])
            elif line.startswith("-A "):
                words = line.split()
                chain = words[1]
                target = words[words.index("-j") + 1] if "-j" in words else ""
                if not chain.startswith(CHAIN_PREFIXES) and target.startswith(CHAIN_PREFIXES):
                    jumps.append((table, line))
        for table, rule in jumps:
            # iptables-save quotes comments; a shell-like split keeps them whole.
            words = shlex.split(rule)
            words[0] = "-D"
            _run([tool, "-w", "-t", table, *words], check=False)
        for table, names in chains.items():
            for name in names:
                _run([tool, "-w", "-t", table, "-F", name], check=False)
            for name in names:
                _run([tool, "-w", "-t", table, "-X", name], check=False)
    left = node_chains()
    if left:
        log(f"iptables chains left: {left}")


def _sweep_cgroups() -> None:
    """The kubelet's QoS cgroups (``kubepods``), empty once every container is gone."""
    root = Path("/sys/fs/cgroup")
    for controller in root.iterdir() if root.is_dir() else []:
        top = controller / "kubepods"
        if not top.is_dir():
            continue
        for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: -t[0].count("/")):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


def leftovers() -> list[str]:
    """Everything of a real node still on the host; empty after a clean ``down``."""
    found = [f"process {pid}: {cmd[:160]}" for pid, cmd in node_processes()]
    found += [f"mount {p}" for p in node_mounts()]
    netns_dir = Path("/var/run/netns")
    if netns_dir.is_dir():
        found += [f"netns {p.name}" for p in netns_dir.glob("cni-*")]
    if _run(["ip", "link", "show", BRIDGE], check=False).returncode == 0:
        found.append(f"bridge {BRIDGE}")
    found += [f"veth {v}" for v in node_veths()]
    found += [f"{k} chain {c}" for k, cs in node_chains().items() for c in cs]
    return found


def _run(
    argv: list[str], check: bool = True, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as e:
        raise RealNodeError(f"{argv[0]} is not installed: run `make cluster-node-deps`") from e
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, argv, proc.stdout, proc.stderr)
    return proc
