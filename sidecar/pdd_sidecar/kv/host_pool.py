"""One rank's host pool of the host KV tier, and the copies between it and the device cache
(rank 0's index decides which, kv/host_tier.py).

Layout: ``host[num_slots, num_layers, block_size, latent]``, a device block's layout, so one
slot is one contiguous region and a run of consecutive slots is one too. On CUDA the pool is
pinned (55 GB/s each way on one H200, against 14-20 GB/s pageable) and every copy runs on the
pool's own stream, in command order: a load that reads a slot runs after the offload that
wrote it, an offload into a slot after the load that read it, with no host wait. On the CPU the
pool is a second tensor beside the cache and the same code runs synchronously.

Ordering against the forward passes (CUDA):
- a batch of copies first waits for the work queued on the compute streams (the default one
  and, on a prefill that overtakes, its high-priority one): an evicted block's last writes
  (a chunk enqueued, not yet run) come before the offload reads it, and a fresh block's last
  reader (a cancelled request's queued step) before a load writes it;
- the compute streams then wait for the batch (``follow``): the next write to an offloaded
  block, and the step that reads a loaded one, run after it;
- a KV READ is not stream-ordered (NIXL, or a pull thread's own stream): the worker waits
  for the batch on the host (``wait``) before it starts pulls into blocks of the same command.

Batching: a load copies each run of consecutive slots into one device staging tensor and
scatters it into the cache with one ``index_copy_``; with more than ``MAX_LOAD_RUNS`` runs it
gathers the slots on the host into one pinned staging buffer first and makes one copy (the host
gather waits for the pool's stream, since an offload may still be writing those slots). An
offload gathers its blocks on the device with one ``index_select`` and copies each run of
consecutive slots out of it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdd_sidecar.engine.device_queue import to_device
from pdd_sidecar.kv.cache import PagedKVCache, contiguous_runs

# Up to this many runs of consecutive slots a load copies one each; more are gathered on the
# host first (one copy of a few blocks costs about what a launch does).
MAX_LOAD_RUNS = 16
# Device staging of one batch of copies, at most (a batch larger goes in pieces of this size,
# one after the other on the pool's stream, which reuses the memory).
STAGE_BYTES = 128 << 20


def pin(t: torch.Tensor) -> None:
    """Page-lock ``t`` where it is. ``pin_memory=True`` would go through torch's caching host
    allocator, which rounds each allocation up to a power of two (100 GiB would lock 128)."""
    nbytes = t.numel() * t.element_size()
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of the host KV pool ({nbytes} bytes) failed with "
                           f"CUDA error {rc}: is the memory lock limit (ulimit -l) or the pod's "
                           "memory limit lower than PDD_HOST_KV_CACHE_GIB?")


@dataclass
class CopyStats:
    """Copies of one kind whose time is known: bytes moved and seconds taken."""

    bytes: int = 0
    seconds: float = 0.0
    blocks: int = 0


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first slot, index of its first row in ``slots``, count)`` of each run of consecutive
    slots, ``slots`` in the order given."""
    out: list[tuple[int, int, int]] = []
    i = 0
    for first, n in contiguous_runs(slots):
        out.append((first, i, n))
        i += n
    return out


class HostKVPool:
    def __init__(self, cache: PagedKVCache, num_slots: int,
                 max_load_runs: int = MAX_LOAD_RUNS) -> None:
        if num_slots <= 0:
            raise ValueError(f"a host pool needs at least one slot, got {num_slots}")
        self.cache = cache
        self.num_slots = num_slots
        self.max_load_runs = max_load_runs
        self.cuda = cache.device.type == "cuda"
        # Never read before an offload wrote it: no need to touch every page now.
        self.host = torch.empty((num_slots, *cache.kv.shape[1:]), dtype=cache.kv.dtype)
        if self.cuda:
            pin(self.host)
        self.stage_blocks = max(1, STAGE_BYTES // max(1, cache.bytes_per_block))
        self.stream: Any = torch.cuda.Stream(cache.device) if self.cuda else None
        self._last: Any = None  # CUDA: the event of the last batch on ``stream``
        # CUDA: (kind, bytes, blocks, start event, end event) not yet seen done
        self._timing: list[tuple[str, int, int, Any, Any]] = []
        self.stats = {"offload": CopyStats(), "load": CopyStats()}

    @property
    def bytes_per_slot(self) -> int:
        return self.cache.bytes_per_block

    def run(self, offloads: Sequence[Sequence[int]], loads: Sequence[Sequence[int]],
            follow: Sequence[Any] = ()) -> None:
        """One command's copies: ``offloads`` ``(block, slot)`` then ``loads`` ``(slot,
        block)``. On CUDA, ``follow`` are the compute streams (the current one first): the
        copies wait for them, then they wait for the copies."""
        if not offloads and not loads:
            return
        k = self.stage_blocks
        with self._ordered(follow):
            pairs = sorted(offloads, key=lambda p: p[1])
            for a in range(0, len(pairs), k):
                blocks, slots = zip(*pairs[a:a + k], strict=True)
                self._timed("offload", len(slots),
                            lambda b=blocks, s=slots: self._offload(b, s))
            pairs = sorted(loads, key=lambda p: p[0])
            for a in range(0, len(pairs), k):
                slots, blocks = zip(*pairs[a:a + k], strict=True)
                self._timed("load", len(slots), lambda b=blocks, s=slots: self._load(s, b))

    def wait(self) -> None:
        """The host waits for every copy issued (before a READ that is not stream-ordered
        writes blocks of the same command)."""
        if self._last is not None:
            self._last.synchronize()

    def take_stats(self) -> dict[str, dict[str, float]]:
        """Bytes, blocks and seconds of the copies finished since the last call."""
        self._settle_timing()
        out = {k: {"bytes": v.bytes, "seconds": v.seconds, "blocks": v.blocks}
               for k, v in self.stats.items() if v.blocks}
        self.stats = {"offload": CopyStats(), "load": CopyStats()}
        return out

    # -- the copies

    def _offload(self, blocks: Sequence[int], slots: Sequence[int]) -> None:
        ids = to_device(list(blocks), torch.long, self.cache.device)
        rows = self.cache.kv.index_select(0, ids)
        for first, i, n in slot_runs(slots):
            self.host[first:first + n].copy_(rows[i:i + n], non_blocking=self.cuda)

    def _load(self, slots: Sequence[int], blocks: Sequence[int]) -> None:
        runs = slot_runs(slots)
        dev = self.cache.device
        if len(runs) <= self.max_load_runs:
            staged = torch.empty((len(slots), *self.host.shape[1:]), dtype=self.host.dtype,
                                 device=dev)
            for first, i, n in runs:
                staged[i:i + n].copy_(self.host[first:first + n], non_blocking=self.cuda)
        else:
            if self.cuda:  # an offload still on the stream (this batch's too) may write them
                self.stream.synchronize()
            pinned = torch.empty((len(slots), *self.host.shape[1:]), dtype=self.host.dtype,
                                 pin_memory=self.cuda)
            torch.index_select(self.host, 0, torch.tensor(list(slots), dtype=torch.long),
                               out=pinned)
            staged = pinned.to(dev, non_blocking=self.cuda)
        ids = to_device(list(blocks), torch.long, dev)
        self.cache.kv.index_copy_(0, ids, staged)

    # -- ordering and timing

    @contextlib.contextmanager
    def _ordered(self, follow: Sequence[Any]) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        for s in follow:
            self.stream.wait_stream(s)
        with torch.cuda.stream(self.stream):
            yield
        done = torch.cuda.Event()
        done.record(self.stream)
        self._last = done
        for s in follow:
            s.wait_event(done)

    def _timed(self, kind: str, n: int, copy: Any) -> None:
        nbytes = n * self.bytes_per_slot
        if not self.cuda:
            start = time.perf_counter()
            copy()
            st = self.stats[kind]
            st.bytes += nbytes
            st.blocks += n
            st.seconds += time.perf_counter() - start
            return
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record(self.stream)
        copy()
        ended.record(self.stream)
        self._timing.append((kind, nbytes, n, began, ended))

    def _settle_timing(self) -> None:
        left = []
        for kind, nbytes, n, began, ended in self._timing:
            if not ended.query():
                left.append((kind, nbytes, n, began, ended))
                continue
            st = self.stats[kind]
            st.bytes += nbytes
            st.blocks += n
            st.seconds += began.elapsed_time(ended) / 1000.0
        self._timing = left
