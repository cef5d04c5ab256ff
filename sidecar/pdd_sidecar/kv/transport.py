"""How a decode rank reads one prefill rank: NIXL, or a device copy through CUDA IPC.

A NIXL READ between two processes on the same GPU ran at 0.46 GB/s under UCX (DESIGN.md), while
a device copy moves ~2,000 GB/s. So each rank publishes a `TransportRecord` on its side channel
(its host identity, IPC namespace, device and, on CUDA, an IPC handle of its KV cache tensor),
and the reader picks the path per peer with `choose_transport`, a pure function of the two
records and PDD_KV_TRANSPORT.

CUDA IPC needs one kernel and one IPC namespace: the host identity is the kernel's boot_id plus
the hostname (pods have hostnames, and /dev/shm, of their own: torch keeps the handle's reference
counts there, so two pods on a node still read over NIXL), and the IPC namespace is compared by
inode. Notifications and claims stay on NIXL and HTTP whatever
the path, so the prefill's lease logic is the same for both.

The IPC handle is the argument tuple of torch's `reduce_tensor`, pickled; it is unpickled only
through an allow-list of the few torch types that tuple holds, never as arbitrary pickle.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import pickle
import socket
from dataclasses import asdict, dataclass
from typing import Any

from pdd_sidecar.kv.compat import CompatError

log = logging.getLogger(__name__)

NIXL = "nixl"
CUDA_IPC = "cuda_ipc"
CHOICES = ("auto", NIXL, CUDA_IPC)


class TransportUnavailable(CompatError):
    """PDD_KV_TRANSPORT asks for a path that cannot work with this peer; the message says why."""


@dataclass(frozen=True)
class TransportRecord:
    """What a reader needs to know whether it can copy a rank's KV on the device directly."""

    boot_id: str
    hostname: str
    ipc_namespace: int
    device_type: str  # cuda | cpu
    device_uuid: str = ""  # cuda only
    cuda_ipc: str = ""  # cuda only: base64 pickle of reduce_tensor's arguments

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransportRecord:
        return cls(
            boot_id=str(data["boot_id"]),
            hostname=str(data["hostname"]),
            ipc_namespace=int(data["ipc_namespace"]),
            device_type=str(data["device_type"]),
            device_uuid=str(data.get("device_uuid", "")),
            cuda_ipc=str(data.get("cuda_ipc", "")),
        )


def host_identity() -> tuple[str, str, int]:
    """(boot_id, hostname, IPC namespace inode) of this process."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    try:
        ipc = os.stat("/proc/self/ns/ipc").st_ino
    except OSError:
        ipc = 0
    return boot_id, socket.gethostname(), ipc


def local_record(kv: Any) -> TransportRecord:
    """This rank's record, with an IPC handle of ``kv`` when it lives on a CUDA device."""
    boot_id, hostname, ipc = host_identity()
    if kv.device.type != "cuda":
        return TransportRecord(boot_id, hostname, ipc, kv.device.type)
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(kv.device).uuid)
    try:
        _, args = reduce_tensor(kv)
        handle = base64.b64encode(pickle.dumps(args)).decode()
    except Exception as exc:  # no handle: readers fall back to NIXL
        log.warning("no CUDA IPC handle for the KV cache (%s); peers read it over NIXL", exc)
        handle = ""
    return TransportRecord(boot_id, hostname, ipc, "cuda", uuid, handle)


def cuda_ipc_obstacle(local: TransportRecord, peer: TransportRecord | None) -> str | None:
    """Why a device copy from ``peer`` cannot work here; None when it can."""
    if peer is None:
        return "the peer publishes no transport record"
    if not local.boot_id or (local.boot_id, local.hostname) != (peer.boot_id, peer.hostname):
        return (f"different hosts ({local.hostname} boot {local.boot_id or '?'}, "
                f"{peer.hostname} boot {peer.boot_id or '?'})")
    if not local.ipc_namespace or local.ipc_namespace != peer.ipc_namespace:
        return (f"different IPC namespaces ({local.ipc_namespace} and "
                f"{peer.ipc_namespace})")
    if (local.device_type, peer.device_type) != ("cuda", "cuda"):
        return f"devices are {local.device_type} here and {peer.device_type} there, not cuda"
    if not peer.cuda_ipc:
        return "the peer publishes no CUDA IPC handle"
    return None


def choose_transport(local: TransportRecord, peer: TransportRecord | None,
                     override: str = "auto") -> str:
    """``cuda_ipc`` for a peer on this host, IPC namespace and CUDA, else ``nixl``;
    ``override`` (PDD_KV_TRANSPORT) forces one, and a forced cuda_ipc that cannot work raises
    TransportUnavailable naming the reason."""
    if override not in CHOICES:
        raise ValueError(f"PDD_KV_TRANSPORT: must be one of {', '.join(CHOICES)}, "
                         f"got {override!r}")
    if override == NIXL:
        return NIXL
    obstacle = cuda_ipc_obstacle(local, peer)
    if obstacle is None:
        return CUDA_IPC
    if override == CUDA_IPC:
        raise TransportUnavailable(f"PDD_KV_TRANSPORT=cuda_ipc, but CUDA IPC cannot work: "
                                   f"{obstacle}")
    return NIXL


def describe(path: str, local: TransportRecord, peer: TransportRecord | None) -> str:
    """Why ``path`` was chosen, for the log."""
    if path == CUDA_IPC and peer is not None:
        if peer.device_uuid == local.device_uuid:
            return f"same device {peer.device_uuid}"
        return f"same host, devices {local.device_uuid} and {peer.device_uuid}"
    return cuda_ipc_obstacle(local, peer) or "PDD_KV_TRANSPORT=nixl"


# ------------------------------------------------------------------ the handle


_ALLOWED = {("torch", "Tensor"), ("torch", "Size"), ("torch.storage", "TypedStorage"),
            ("torch.storage", "UntypedStorage")}


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"CUDA IPC handle: {module}.{name} is not allowed")


def handle_args(handle: str) -> tuple[Any, ...]:
    """reduce_tensor's arguments from a published handle (allow-listed types only)."""
    args = _HandleUnpickler(io.BytesIO(base64.b64decode(handle))).load()
    if not isinstance(args, tuple):
        raise pickle.UnpicklingError("CUDA IPC handle: not an argument tuple")
    return args


_STORAGE_DEVICE = 6  # in reduce_tensor's argument tuple: the device index, in the peer's numbering


def open_peer_cache(peer: TransportRecord, device: Any) -> Any:
    """The peer's KV cache tensor, mapped into this process from ``device``'s context. The
    peer numbers its devices by its own CUDA_VISIBLE_DEVICES; the tensor is placed on the local
    device with the peer's UUID when this process sees it."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(handle_args(peer.cuda_ipc))
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == peer.device_uuid:
            args[_STORAGE_DEVICE] = i
            break
    torch.cuda.set_device(device)  # the handle opens in the current device's context
    return rebuild_cuda_tensor(*args)
