"""The same-host hand-off path: a decode process maps a prefill process's KV cache through the
CUDA IPC handle the prefill publishes, and copies exactly the plan's blocks (run by hand on a
CUDA machine; skipped without one).

    PYTHONPATH=sidecar python -m pytest tests/gpu/test_cuda_ipc.py -q
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from pdd_sidecar.kv.device_copy import DeviceCopier  # noqa: E402
from pdd_sidecar.kv.transfer import RegionInfo, plan_read_specs  # noqa: E402
from pdd_sidecar.kv.transport import (  # noqa: E402
    CUDA_IPC,
    TransportRecord,
    choose_transport,
    local_record,
    open_peer_cache,
)

BLOCKS, LAYERS, BLOCK, LATENT = 64, 3, 16, 576


def _prefill_cache(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BLOCKS, LAYERS, BLOCK, LATENT, generator=g).to(torch.bfloat16)


def _producer(seed: int, device: int, conn: Any) -> None:
    torch.cuda.set_device(device)
    kv = _prefill_cache(seed).cuda(device)
    torch.cuda.synchronize()
    conn.send(local_record(kv).to_dict())
    conn.recv()  # keep the cache alive until the reader is done


@pytest.mark.parametrize("peer_device", [0, 1])
def test_a_decode_maps_a_prefills_cache_and_copies_exactly_the_plans_blocks(
        peer_device: int) -> None:
    if peer_device >= torch.cuda.device_count():
        pytest.skip("needs a second CUDA device")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(7, peer_device, child), daemon=True)
    proc.start()
    try:
        peer = TransportRecord.from_dict(parent.recv())
        dst = torch.zeros(BLOCKS, LAYERS, BLOCK, LATENT, dtype=torch.bfloat16, device="cuda:0")
        here = local_record(dst)
        assert choose_transport(here, peer) == CUDA_IPC
        src = open_peer_cache(peer, dst.device)
        assert src.shape == dst.shape and src.device.index == peer_device

        every_chunk = [SimpleNamespace(prefill_rank=0, chunk_modulus=1, chunk_residue=0)]
        num_tokens = 9 * BLOCK + 5
        pblocks, dblocks = [40, 41, 42, 3, 7, 8, 9, 60, 2, 30], [0, 1, 2, 3, 10, 11, 5, 6, 7, 8]
        specs = plan_read_specs(every_chunk, num_tokens, BLOCK, 1, 1, pblocks, dblocks)
        copier = DeviceCopier(dst.device)
        done: list[Any] = []

        planned: list[Any] = []
        busy = threading.Event()

        def pull_thread() -> None:  # as a decode rank's pull thread: set up, plan, then READ
            copier.prepare_thread()
            plan = copier.plan(dst, [(src, s) for s in specs], RegionInfo.of_tensor(dst))
            planned.append(plan)
            done.append(copier.run(plan))

        def other_thread() -> None:  # Python beside the READ, as the decode's other threads
            while not busy.is_set():
                sum(range(1000))

        other = threading.Thread(target=other_thread)
        other.start()
        t = threading.Thread(target=pull_thread)
        t.start()
        t.join()
        busy.set()
        other.join()
        (stats,), (plan,) = done, planned
        # On one device the runs go out as raw copies (the runtime torch loaded), across two
        # through torch.
        assert bool(plan.spans) == (peer_device == 0) and bool(plan.through_torch) == (
            peer_device != 0)
        assert stats.path == CUDA_IPC and stats.bytes == num_tokens * LAYERS * LATENT * 2

        want = torch.zeros_like(dst, device="cpu")
        ref = _prefill_cache(7)
        for g in range(10):
            rows = 5 if g == 9 else BLOCK
            want[dblocks[g], :, :rows] = ref[pblocks[g], :, :rows]
        assert torch.equal(dst.cpu(), want)
        print(f"\ncuda_ipc from cuda:{peer_device}: {stats.bytes / stats.seconds / 1e9:.1f} GB/s "
              f"({stats.bytes} bytes, first call)")
    finally:
        parent.send("done")
        proc.join(30)
