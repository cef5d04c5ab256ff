"""One rank's host pool of the host KV tier, and the copies between it and the device cache
(rank 0's index decides which, kv/host_tier.py).

Layout: ``host[num_slots, num_layers, block_size, latent]``, a device block's layout, so one
slot is one contiguous region, a run of consecutive slots is one too, and a run of slots that
goes to a run of consecutive device blocks is one copy. On CUDA the pool is pinned (55 GB/s
each way on one H200, against 14-20 GB/s pageable) and every copy runs on the pool's own
stream. On the CPU the pool is a second tensor beside the cache and the same code runs
synchronously, or on a stream the caller gives (the tests give one that runs its copies on a
thread, so the order below is checked there too).

**Copies.** A command's offloads are one device → host copy per run of ``(block, slot)`` pairs
consecutive on both sides, straight into the pool; its loads one host → device copy per run of
``(slot, block)`` pairs, straight into the cache. No staging, no gather or scatter kernel, no
host wait: only the copy engine works, and the copies of a command are issued back to back.
A run is at least one whole block (a V2-Lite 64-token block is 1.9 MiB: ~35 us at 55 GB/s, long
enough for the copy engine's full rate); slots are handed out lowest first and a conversation's
units spill together, so a prefix is mostly a few long runs. Until run 43 a load went through a
device staging tensor and an ``index_copy_`` scatter, and a prefix scattered over more than 16
runs was gathered on the host first, after a host wait for the stream: 0.49 of the pinned copy
rate on one H200 (docs/kv-memory.md).

**Order (on a stream).** A batch of copies does not wait for the compute streams: nothing
queued there reads or writes a block it touches. A block a load writes was just allocated, and
the driver hands out a block only once every queued step that referenced it has run
(engine/free_fence.py: a cancelled prompt's blocks stay its own until its queued chunks are
done); a block an offload reads is a cached unit nobody references, whose last writer is done
for the same reason. So a load overlaps the device work queued before its command. Then:
- the compute streams wait for the batch (``follow``): the step that reads a loaded block and
  the next write to an offloaded one run after it;
- copies run in command order on one stream: a load reads a slot after the offload that wrote
  it, an offload overwrites a slot after the load that read it;
- a KV READ is not stream-ordered (NIXL, or a pull thread's own copy): the worker waits for the
  batch on the host (``wait``) before it starts pulls into blocks of the same command.

**Timing.** The seconds of ``pdd_host_kv_{load,offload}_seconds_total`` are the copies
themselves: on a stream the time between two events on it around a command's loads (or
offloads), which starts when the stream reaches them, not when the command was built (no queue
wait), and inline on the CPU the wall time of the copies.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdd_sidecar.kv.cache import PagedKVCache


def pin(t: torch.Tensor) -> None:
    """Page-lock ``t`` where it is. ``pin_memory=True`` would go through torch's caching host
    allocator, which rounds each allocation up to a power of two (100 GiB would lock 128)."""
    nbytes = t.numel() * t.element_size()
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of the host KV pool ({nbytes} bytes) failed with "
                           f"CUDA error {rc}: is the memory lock limit (ulimit -l) or the pod's "
                           "memory limit lower than PDD_HOST_KV_CACHE_GIB?")


def unpin(stream: Any, t: torch.Tensor) -> None:
    """Undo `pin` once the copies on ``stream`` (a `CudaCopyStream`) are done: a registration
    outliving its memory would make the next registration of those pages fail (several pools
    in one process)."""
    stream.synchronize()
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class CudaCopyStream:
    """The pool's own CUDA stream: copies issued on it, events recorded on it. A pool takes
    any object with these methods; the CPU tests give it one that runs copies on a thread,
    apart from the host and from compute, to check the order above without a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor,
             runs: Sequence[tuple[int, int, int]]) -> None:
        with torch.cuda.stream(self.stream):
            for s, d, n in runs:
                dst[d:d + n].copy_(src[s:s + n], non_blocking=True)

    def event(self, timing: bool = False) -> Any:
        """An event the stream reaches after everything issued on it so far."""
        e = torch.cuda.Event(enable_timing=timing)
        e.record(self.stream)
        return e

    def synchronize(self) -> None:
        self.stream.synchronize()


def pinned_copy_rate(nbytes: int, device: torch.device) -> float:
    """Bytes/s of one host → device copy of ``nbytes`` from memory pinned as a pool's is, timed
    as a pool times its copies (events on its stream around it, so no launch or host wait
    counts), best of five: the bound a load rate is held to."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    pin(src)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = CudaCopyStream(device)
    whole = [(0, 0, nbytes)]
    stream.copy(dst, src, whole)
    best = float("inf")
    for _ in range(5):
        began = stream.event(timing=True)
        stream.copy(dst, src, whole)
        ended = stream.event(timing=True)
        ended.synchronize()
        best = min(best, began.elapsed_time(ended) / 1000.0)
    unpin(stream, src)
    return nbytes / best


@dataclass
class CopyStats:
    """Copies of one kind whose time is known: bytes moved and seconds taken."""

    bytes: int = 0
    seconds: float = 0.0
    blocks: int = 0
    copies: int = 0


def pair_runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(first source, first destination, count)`` of each run of ``(source, destination)``
    pairs consecutive on both sides, in the order given: one copy each."""
    out: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if out:
            s, d, n = out[-1]
            if src == s + n and dst == d + n:
                out[-1] = (s, d, n + 1)
                continue
        out.append((src, dst, 1))
    return out


class HostKVPool:
    def __init__(self, cache: PagedKVCache, num_slots: int, stream: Any = None) -> None:
        """``stream``: where the copies run apart from the host (a `CudaCopyStream`'s
        methods); on CUDA the pool's own by default, on the CPU none: copies run inline."""
        if num_slots <= 0:
            raise ValueError(f"a host pool needs at least one slot, got {num_slots}")
        if not cache.kv.is_contiguous():
            raise ValueError("the host pool copies whole blocks: the cache must be contiguous")
        self.cache = cache
        self.num_slots = num_slots
        self.cuda = cache.device.type == "cuda"
        # Never read before an offload wrote it: no need to touch every page now.
        self.host = torch.empty((num_slots, *cache.kv.shape[1:]), dtype=cache.kv.dtype)
        if stream is None and self.cuda:
            stream = CudaCopyStream(cache.device)
        self.stream: Any = stream
        if self.cuda:
            pin(self.host)
            # With the pool; not at exit, where the CUDA context may already be gone.
            weakref.finalize(self, unpin, self.stream, self.host).atexit = False
        self._last: Any = None  # the event of the last batch on ``stream``
        # (kind, stats, start event, end event) not yet seen done
        self._timing: list[tuple[str, CopyStats, Any, Any]] = []
        self.stats = {"offload": CopyStats(), "load": CopyStats()}
        self.copies = {"offload": 0, "load": 0}  # copies issued (one per run), ever

    @property
    def bytes_per_slot(self) -> int:
        return self.cache.bytes_per_block

    def run(self, offloads: Sequence[Sequence[int]], loads: Sequence[Sequence[int]],
            follow: Sequence[Any] = ()) -> None:
        """One command's copies: ``offloads`` ``(block, slot)`` then ``loads`` ``(slot,
        block)``. On a stream, ``follow`` are the compute streams (the current one first):
        they wait for the copies."""
        if not offloads and not loads:
            return
        kv, host = self.cache.kv, self.host
        if offloads:  # by slot (stable: a slot spilled to twice keeps the later block)
            pairs = sorted(((b, s) for b, s in offloads), key=lambda p: p[1])
            self._timed("offload", len(pairs), host, kv, pair_runs(pairs))
        if loads:
            pairs = sorted(((s, b) for s, b in loads), key=lambda p: p[0])
            self._timed("load", len(pairs), kv, host, pair_runs(pairs))
        self._followed(follow)

    def wait(self) -> None:
        """The host waits for every copy issued (before a READ that is not stream-ordered
        writes blocks of the same command)."""
        if self._last is not None:
            self._last.synchronize()

    def take_stats(self) -> dict[str, dict[str, float]]:
        """Bytes, blocks and seconds of the copies finished since the last call."""
        self._settle_timing()
        out = {k: {"bytes": v.bytes, "seconds": v.seconds, "blocks": v.blocks,
                   "copies": v.copies} for k, v in self.stats.items() if v.blocks}
        self.stats = {"offload": CopyStats(), "load": CopyStats()}
        return out

    # -- the copies, ordering and timing

    def _followed(self, follow: Sequence[Any]) -> None:
        """The batch just issued is ``wait``'s, and ``follow`` wait for it on the device."""
        if self.stream is None:
            return
        done = self.stream.event()
        self._last = done
        for s in follow:
            s.wait_event(done)

    def _timed(self, kind: str, n: int, dst: torch.Tensor, src: torch.Tensor,
               runs: Sequence[tuple[int, int, int]]) -> None:
        done = CopyStats(n * self.bytes_per_slot, 0.0, n, len(runs))
        self.copies[kind] += len(runs)
        if self.stream is None:
            start = time.perf_counter()
            for s, d, c in runs:
                dst[d:d + c].copy_(src[s:s + c])
            done.seconds = time.perf_counter() - start
            self._count(kind, done)
            return
        began = self.stream.event(timing=True)
        self.stream.copy(dst, src, runs)
        ended = self.stream.event(timing=True)
        self._timing.append((kind, done, began, ended))

    def _count(self, kind: str, done: CopyStats) -> None:
        st = self.stats[kind]
        st.bytes += done.bytes
        st.blocks += done.blocks
        st.copies += done.copies
        st.seconds += done.seconds

    def _settle_timing(self) -> None:
        left = []
        for kind, done, began, ended in self._timing:
            if not ended.query():
                left.append((kind, done, began, ended))
                continue
            done.seconds = began.elapsed_time(ended) / 1000.0
            self._count(kind, done)
        self._timing = left
