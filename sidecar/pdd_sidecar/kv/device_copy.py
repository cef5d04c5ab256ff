"""The cuda_ipc path's copy (kv/transport.py picks the path): a peer's KV blocks moved on the
device, beside the forward passes.

Served on one H200 (P and D sharing it), the READ of an 8k prompt (255 MB, 0.12-0.17 ms on the
device) took 0.43-0.53 ms of wall time, nearly all of the rest on the pulling thread's CPU:
0.12-0.17 ms entering the device and stream contexts and making two timing events, 0.18-0.26 ms
launching one slice copy through torch (slicing both caches, then ``copy_``). The same code took
~0.02 ms for each when READs ran back to back: a pull thread wakes for one READ now and then, its
code cold. So each thread sets up its device and events once (`DeviceCopier.prepare_thread`),
and a request's runs of whole blocks go out as one ``cudaMemcpyAsync`` each, called in the CUDA
runtime torch loaded; rows of a block, a peer on another device and a table scattered wider than
`MAX_SLICE_RUNS` runs go through torch as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdd_sidecar.kv.transfer import ReadSpec, ReadStats, RegionInfo, Run, spec_bytes
from pdd_sidecar.kv.transport import CUDA_IPC

log = logging.getLogger(__name__)

# Runs up to this many are copied one each (a plain device-to-device copy at full bandwidth); a
# table scattered wider goes through one gather and one scatter instead.
MAX_SLICE_RUNS = 64

_MEMCPY_DEVICE_TO_DEVICE = 3  # cudaMemcpyKind

# (destination address, source address, bytes)
Memcpy = Callable[[int, int, int], Any]


def copy_blocks(dst: Any, src: Any, spec: ReadSpec) -> None:
    """One read spec through torch: each run of consecutive blocks as one slice copy (the blocks
    of a request mostly are a few runs), each chunk read in part as its row range, on the
    current stream. Both caches are [blocks, layers, block_size, latent]."""
    import torch

    if 0 < len(spec.runs) <= MAX_SLICE_RUNS:
        for r in spec.runs:
            dst[r.local_start:r.local_start + r.n].copy_(
                src[r.remote_start:r.remote_start + r.n], non_blocking=True)
    elif spec.runs:
        remote = [r.remote_start + i for r in spec.runs for i in range(r.n)]
        local = [r.local_start + i for r in spec.runs for i in range(r.n)]
        rows = src.index_select(0, torch.tensor(remote, device=src.device))
        dst.index_copy_(0, torch.tensor(local, device=dst.device),
                        rows.to(dst.device, non_blocking=True))
    for p in spec.partials:
        dst[p.local_block, :, p.lo:p.hi].copy_(src[p.remote_block, :, p.lo:p.hi],
                                               non_blocking=True)


def raw_copyable(dst: Any, src: Any, spec: ReadSpec) -> bool:
    """Whether ``spec`` is whole-block runs only, few enough, between two caches of one layout on
    one device, so that each run is one span of bytes in both."""
    return (not spec.partials and 0 < len(spec.runs) <= MAX_SLICE_RUNS
            and dst.device == src.device and dst.dtype == src.dtype
            and dst.shape[1:] == src.shape[1:] and dst.is_contiguous() and src.is_contiguous())


def block_spans(dst: Any, src: Any, runs: Sequence[Run]) -> list[tuple[int, int, int]]:
    """Each run of whole blocks as (destination address, source address, bytes), where
    `raw_copyable` said the caches allow it: on the device each is one ``cudaMemcpyAsync``
    (on the CPU, ``ctypes.memmove`` does the same with them)."""
    block_bytes = dst.stride(0) * dst.element_size()
    dst_base, src_base = dst.data_ptr(), src.data_ptr()
    return [(dst_base + r.local_start * block_bytes, src_base + r.remote_start * block_bytes,
             r.n * block_bytes) for r in runs]


def loaded_cuda_runtime(maps: str = "/proc/self/maps") -> str | None:
    """The path of the CUDA runtime library this process has mapped (torch loads it), if any:
    opening that same file again gives the runtime torch uses, not a second one."""
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) == 6:
                    path = fields[5].strip()
                    if os.path.basename(path).startswith("libcudart.so"):
                        return path
    except OSError:
        return None
    return None


class CudaRuntime:
    """``cudaMemcpyAsync`` of the CUDA runtime at ``path``, called holding the GIL: the call
    queues a copy in microseconds, and a thread that let the GIL go would wait for it back
    behind the engine's Python (up to a switch interval)."""

    def __init__(self, path: str) -> None:
        lib = ctypes.PyDLL(path)
        self._memcpy = lib.cudaMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.c_int, ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int
        self._error = lib.cudaGetErrorString
        self._error.argtypes = [ctypes.c_int]
        self._error.restype = ctypes.c_char_p

    def memcpy_on(self, stream: int) -> Memcpy:
        """A device-to-device ``memcpy`` queued on ``stream`` (a cudaStream_t)."""
        fn, error = self._memcpy, self._error

        def memcpy(dst: int, src: int, n: int) -> None:
            rc = fn(dst, src, n, _MEMCPY_DEVICE_TO_DEVICE, stream)
            if rc:
                raise RuntimeError(f"cudaMemcpyAsync of {n} bytes failed: "
                                   f"{(error(rc) or b'?').decode()} (error {rc})")
        return memcpy


@dataclass
class CopyPlan:
    """One READ's copies into ``dst``, ready to launch."""

    dst: Any
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # one cudaMemcpyAsync each
    through_torch: list[tuple[Any, ReadSpec]] = field(default_factory=list)  # (source, spec)
    other_devices: set[int] = field(default_factory=set)  # peers' GPUs other than dst's
    bytes: int = 0
    transfers: int = 0


class DeviceCopier:
    """Reads peers' blocks as device copies on a stream of its own, beside the forward passes."""

    def __init__(self, device: Any) -> None:
        import torch

        self.stream = torch.cuda.Stream(device)
        self._scratch = torch.zeros(2, device=device)
        self._thread = threading.local()
        path = loaded_cuda_runtime()
        self._memcpy = CudaRuntime(path).memcpy_on(self.stream.cuda_stream) if path else None
        if self._memcpy is None:
            log.warning("the CUDA runtime library is not mapped in this process; the KV copies "
                        "of cuda_ipc READs go through torch")

    def prepare_thread(self) -> None:
        """A thread's first CUDA calls cost ~0.4 ms (measured served on an H200: entering the
        device and the stream 0.23 ms, launching the first copy 0.18 ms, as long as the copy
        of an 8k prompt itself); a pull thread pays that when it starts, not in a READ. The
        thread's device stays this copier's, and its two timing events are made here."""
        import torch

        torch.cuda.set_device(self.stream.device)
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record(self.stream)
        with torch.cuda.stream(self.stream):
            self._scratch[1:].copy_(self._scratch[:1], non_blocking=True)
        if self._memcpy is not None:
            try:
                itemsize = self._scratch.element_size()
                self._memcpy(self._scratch.data_ptr(), self._scratch.data_ptr() + itemsize,
                             itemsize)
            except Exception as exc:
                log.warning("cudaMemcpyAsync failed (%s); the KV copies of cuda_ipc READs go "
                            "through torch", exc)
                self._memcpy = None
        ended.record(self.stream)
        ended.synchronize()
        self._thread.events = (began, ended)

    def plan(self, dst: Any, work: list[tuple[Any, ReadSpec]], region: RegionInfo) -> CopyPlan:
        """What `run` launches: the raw spans and what goes through torch. Made while the
        claim is on its way (kv/puller.py), so a READ launches only copies; the stream is woken
        then too (`_wake`)."""
        out = CopyPlan(dst)
        memcpy = self._memcpy
        for src, spec in work:
            if spec.empty:
                continue
            if memcpy is not None and raw_copyable(dst, src, spec):
                out.spans += block_spans(dst, src, spec.runs)
            else:
                out.through_torch.append((src, spec))
            if src.get_device() != dst.get_device():
                out.other_devices.add(src.get_device())
            out.bytes += spec_bytes(spec, region)
            out.transfers += 1
        if out.spans or out.through_torch:
            self._wake()
        return out

    def _events(self) -> tuple[Any, Any]:
        events = getattr(self._thread, "events", None)
        if events is None:
            self.prepare_thread()
            events = self._thread.events
        return events

    def _wake(self) -> None:
        """The READ's first calls, on a copy of a few bytes, not waited for. Served on one H200,
        a READ of a 1k prompt waited 0.09-0.10 ms for a copy of 0.017 ms on the device, and an
        8k prompt's 0.20 for 0.12: the GPU switching to this process from the prefill's, which
        had just run its step (`bench/kv_transfer.py`'s after_peer: 51 % of the copy rate
        against 102 % idle); and the event record and the ``cudaMemcpyAsync`` took 0.045 and
        0.055 ms, against 0.004 and 0.011 when READs ran back to back. Made while the claim is
        away, the switch and those first calls happen before the READ."""
        import torch

        began, _ = self._events()
        began.record(self.stream)
        if self._memcpy is not None:
            n = self._scratch.element_size()
            self._memcpy(self._scratch.data_ptr() + n, self._scratch.data_ptr(), n)
        else:
            with torch.cuda.stream(self.stream):
                self._scratch[1:].copy_(self._scratch[:1], non_blocking=True)

    def run(self, plan: CopyPlan, start: float | None = None) -> ReadStats:
        """Every copy of ``plan`` launched and waited for before returning (the decode may
        attend over the blocks as soon as this reports done); timed from ``start`` (default:
        now)."""
        import torch

        start = time.monotonic() if start is None else start
        began, ended = self._events()
        began.record(self.stream)
        if plan.spans:
            memcpy = self._memcpy
            assert memcpy is not None
            for span in plan.spans:
                memcpy(*span)
        if plan.through_torch:
            dst = plan.dst
            with torch.cuda.device(dst.device), torch.cuda.stream(self.stream):
                for src, spec in plan.through_torch:
                    copy_blocks(dst, src, spec)
        ended.record(self.stream)
        ended.synchronize()
        for device in plan.other_devices:
            torch.cuda.synchronize(device)  # a peer on another GPU read on that GPU's stream
        return ReadStats(bytes=plan.bytes, transfers=plan.transfers,
                         seconds=time.monotonic() - start,
                         device_seconds=began.elapsed_time(ended) / 1e3, path=CUDA_IPC)

    def read(self, dst: Any, work: list[tuple[Any, ReadSpec]], region: RegionInfo) -> ReadStats:
        """`plan`, then `run`, timed together."""
        start = time.monotonic()
        return self.run(self.plan(dst, work, region), start)
