"""Which path a decode rank reads a prefill rank by: a pure function of two published records."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdd_sidecar.kv.transfer import ReadStats, join_paths
from pdd_sidecar.kv.transport import (
    CUDA_IPC,
    NIXL,
    TransportRecord,
    TransportUnavailable,
    choose_transport,
    describe,
)

HERE = TransportRecord(boot_id="b-1", hostname="node-a", ipc_namespace=4026531839,
                       device_type="cuda", device_uuid="GPU-0", cuda_ipc="aGFuZGxl")


def test_a_peer_on_this_host_namespace_and_cuda_is_read_by_device_copy() -> None:
    assert choose_transport(HERE, replace(HERE, cuda_ipc="b3RoZXI=")) == CUDA_IPC
    other_gpu = replace(HERE, device_uuid="GPU-1")
    assert choose_transport(HERE, other_gpu) == CUDA_IPC
    assert describe(CUDA_IPC, HERE, HERE) == "same device GPU-0"
    assert "GPU-0 and GPU-1" in describe(CUDA_IPC, HERE, other_gpu)


@pytest.mark.parametrize(("peer", "reason"), [
    (replace(HERE, boot_id="b-2"), "different hosts"),
    (replace(HERE, hostname="node-b"), "different hosts"),
    (replace(HERE, ipc_namespace=4026532000), "different IPC namespaces"),
    (replace(HERE, device_type="cpu", device_uuid="", cuda_ipc=""), "not cuda"),
    (replace(HERE, cuda_ipc=""), "no CUDA IPC handle"),
    (None, "no transport record"),
])
def test_anything_else_reads_over_nixl_and_a_forced_device_copy_says_why_not(
        peer: TransportRecord | None, reason: str) -> None:
    assert choose_transport(HERE, peer) == NIXL
    assert reason in describe(NIXL, HERE, peer)
    with pytest.raises(TransportUnavailable, match=f"PDD_KV_TRANSPORT=cuda_ipc.*{reason}"):
        choose_transport(HERE, peer, "cuda_ipc")


def test_a_cpu_rank_reads_over_nixl_even_from_its_own_host() -> None:
    cpu = replace(HERE, device_type="cpu", device_uuid="", cuda_ipc="")
    assert choose_transport(cpu, cpu) == NIXL
    assert choose_transport(cpu, HERE) == NIXL


def test_the_override_forces_nixl_and_an_unknown_one_is_refused_by_name() -> None:
    assert choose_transport(HERE, HERE, "nixl") == NIXL
    assert choose_transport(HERE, HERE, "cuda_ipc") == CUDA_IPC
    with pytest.raises(ValueError, match="PDD_KV_TRANSPORT.*'rdma'"):
        choose_transport(HERE, HERE, "rdma")


def test_an_unknown_boot_id_never_counts_as_the_same_host() -> None:
    blank = replace(HERE, boot_id="")
    assert choose_transport(blank, blank) == NIXL


def test_the_record_round_trips_through_its_dict() -> None:
    assert TransportRecord.from_dict(HERE.to_dict()) == HERE
    old = {k: v for k, v in HERE.to_dict().items() if k not in ("device_uuid", "cuda_ipc")}
    assert TransportRecord.from_dict(old).cuda_ipc == ""


def test_read_stats_name_every_path_they_took() -> None:
    stats = ReadStats(bytes=1)
    assert stats.path == "nixl"
    stats.add(ReadStats(bytes=2, path="cuda_ipc"))
    assert (stats.bytes, stats.path) == (3, "cuda_ipc+nixl")
    assert join_paths(["cuda_ipc", "cuda_ipc"]) == "cuda_ipc"
    assert join_paths([]) == "nixl"
