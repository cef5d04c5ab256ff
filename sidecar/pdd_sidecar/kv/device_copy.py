"""The cuda_ipc path's copy (kv/transport.py picks the path): a peer's KV blocks moved on the
device, beside the forward passes.

Served on one H200 (P and D sharing it), the READ of an 8k prompt (255 MB, 0.12-0.17 ms on the
device) took 0.43-0.53 ms of wall time, nearly all of the rest on the pulling thread's CPU:
0.12-0.17 ms entering the device and stream contexts and making two timing events, 0.18-0.26 ms
launching one slice copy through torch (slicing both caches, then ``copy_``). The same code took
~0.02 ms for each when READs ran back to back: a pull thread wakes for one READ now and then, its
code cold. So each thread sets up its device and events once (`DeviceCopier.prepare_thread`),
and a request's runs of whole blocks go out as one ``cudaMemcpyAsync`` each, and the rows of a
block a chunk fills in part (a prompt's last block, mostly) as one ``cudaMemcpy2DAsync`` over the
layers, called in the CUDA runtime torch loaded; a peer on another device and a table scattered
wider than `MAX_SLICE_RUNS` runs go through torch as before. The READ's event records and, for
copies shorter than a GIL switch interval, its wait are runtime calls too, made holding the GIL
(`CudaRuntime` says why).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pdd_sidecar.kv.transfer import ReadSpec, ReadStats, RegionInfo, spec_bytes
from pdd_sidecar.kv.transport import CUDA_IPC

log = logging.getLogger(__name__)

# Runs up to this many are copied one each (a plain device-to-device copy at full bandwidth); a
# table scattered wider goes through one gather and one scatter instead.
MAX_SLICE_RUNS = 64

_MEMCPY_DEVICE_TO_DEVICE = 3  # cudaMemcpyKind


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
    """Whether ``spec`` has something to copy, in few enough runs, between two caches of one
    layout on one device, so that each run and each chunk read in part is one `Span`."""
    return (not spec.empty and len(spec.runs) <= MAX_SLICE_RUNS
            and dst.device == src.device and dst.dtype == src.dtype
            and dst.shape[1:] == src.shape[1:] and dst.is_contiguous() and src.is_contiguous())


class Span(NamedTuple):
    """``height`` rows of ``width`` bytes, ``pitch`` bytes apart in both caches: a run of whole
    blocks is one row; a chunk read in part, its rows of the block in each layer."""

    dst: int
    src: int
    width: int
    height: int = 1
    pitch: int = 0


def spec_spans(dst: Any, src: Any, spec: ReadSpec) -> list[Span]:
    """``spec``'s copies as spans of bytes, where `raw_copyable` said the caches allow it: on the
    device each is one ``cudaMemcpyAsync`` (one row) or ``cudaMemcpy2DAsync``; on the CPU,
    ``ctypes.memmove`` row by row does the same with them."""
    size = dst.element_size()
    block_bytes, layer_bytes, row_bytes = (dst.stride(i) * size for i in range(3))
    dst_base, src_base = dst.data_ptr(), src.data_ptr()
    spans = [Span(dst_base + r.local_start * block_bytes, src_base + r.remote_start * block_bytes,
                  r.n * block_bytes) for r in spec.runs]
    layers = dst.shape[1]
    spans += [Span(dst_base + p.local_block * block_bytes + p.lo * row_bytes,
                   src_base + p.remote_block * block_bytes + p.lo * row_bytes,
                   p.n * row_bytes, layers, layer_bytes) for p in spec.partials]
    return spans


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
    """The calls of a READ in the CUDA runtime at ``path``, each made holding the GIL. torch's
    event record and wait let the GIL go; served, the pull thread then waited for it back
    behind another thread of the decode (up to a switch interval): in run 22 an event record
    took 0.57-0.58 ms once in each of the 1k and 8k levels, the wait after it 0.44 ms for a
    0.12 ms copy; `bench/kv_transfer.py`'s busy1@0.5 (one busy Python thread beside the READ)
    gets an 8k READ at 19 % of the copy rate. A call here queues work or reads a state in
    microseconds; the one that waits is `event_synchronize`, used only for copies shorter
    than a switch interval (`waits_holding_gil`)."""

    def __init__(self, path: str) -> None:
        lib = ctypes.PyDLL(path)
        p, i = ctypes.c_void_p, ctypes.c_int
        n = ctypes.c_size_t
        self._memcpy = self._bind(lib, "cudaMemcpyAsync", [p, p, n, i, p])
        self._memcpy_2d = self._bind(lib, "cudaMemcpy2DAsync", [p, n, p, n, n, n, i, p])
        self._record = self._bind(lib, "cudaEventRecord", [p, p])
        self._synchronize = self._bind(lib, "cudaEventSynchronize", [p])
        self._elapsed = self._bind(lib, "cudaEventElapsedTime",
                                   [ctypes.POINTER(ctypes.c_float), p, p])
        self._error = lib.cudaGetErrorString
        self._error.argtypes = [ctypes.c_int]
        self._error.restype = ctypes.c_char_p

    @staticmethod
    def _bind(lib: Any, name: str, argtypes: list[Any]) -> Any:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        return fn

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"{what} failed: {(self._error(rc) or b'?').decode()} "
                               f"(error {rc})")

    def memcpy(self, dst: int, src: int, n: int, stream: int) -> None:
        """A device-to-device copy of ``n`` bytes queued on ``stream`` (a cudaStream_t)."""
        self._check(self._memcpy(dst, src, n, _MEMCPY_DEVICE_TO_DEVICE, stream),
                    f"cudaMemcpyAsync of {n} bytes")

    def memcpy_2d(self, dst: int, src: int, width: int, height: int, pitch: int,
                  stream: int) -> None:
        """``height`` rows of ``width`` bytes, ``pitch`` apart on both sides, queued on
        ``stream``."""
        self._check(self._memcpy_2d(dst, pitch, src, pitch, width, height,
                                    _MEMCPY_DEVICE_TO_DEVICE, stream),
                    f"cudaMemcpy2DAsync of {height} x {width} bytes")

    def event_record(self, event: int, stream: int) -> None:
        self._check(self._record(event, stream), "cudaEventRecord")

    def event_synchronize(self, event: int) -> None:
        self._check(self._synchronize(event), "cudaEventSynchronize")

    def event_elapsed_s(self, began: int, ended: int) -> float:
        ms = ctypes.c_float()
        self._check(self._elapsed(ctypes.byref(ms), began, ended), "cudaEventElapsedTime")
        return ms.value / 1e3


# The rate at which a READ's copies are expected to run at the least (an H200 copies ~1,800
# GB/s within one device): copies expected to take no longer than a GIL switch interval are
# waited for holding the GIL, as letting it go could cost as long to get it back.
HOLD_GIL_COPY_RATE_BPS = 1e12


def waits_holding_gil(nbytes: int, switch_interval_s: float) -> bool:
    return nbytes <= switch_interval_s * HOLD_GIL_COPY_RATE_BPS


@dataclass
class CopyPlan:
    """One READ's copies into ``dst``, ready to launch."""

    dst: Any
    spans: list[Span] = field(default_factory=list)  # one runtime copy each
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
        self._runtime: CudaRuntime | None = None
        path = loaded_cuda_runtime()
        try:
            self._runtime = CudaRuntime(path) if path else None
        except (OSError, AttributeError) as exc:  # not loadable, or a call missing from it
            log.warning("the CUDA runtime at %s cannot be used (%s)", path, exc)
        if self._runtime is None:
            log.warning("the KV copies of cuda_ipc READs go through torch (no CUDA runtime "
                        "library of this process to call)")

    def prepare_thread(self) -> None:
        """A thread's first CUDA calls cost ~0.4 ms (measured served on an H200: entering the
        device and the stream 0.23 ms, launching the first copy 0.18 ms, as long as the copy
        of an 8k prompt itself); a pull thread pays that when it starts, not in a READ. The
        thread's device stays this copier's, and its two timing events are made here. The
        runtime's own calls are tried once here; should one fail, READs go through torch."""
        import torch

        torch.cuda.set_device(self.stream.device)
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record(self.stream)
        with torch.cuda.stream(self.stream):
            self._scratch[1:].copy_(self._scratch[:1], non_blocking=True)
        ended.record(self.stream)
        ended.synchronize()
        self._thread.events = (began, ended)
        if self._runtime is None:
            return
        try:
            self.run(CopyPlan(self._scratch, spans=[self._scratch_span()]))
        except Exception as exc:
            log.warning("the CUDA runtime's calls failed (%s); the KV copies of cuda_ipc READs "
                        "go through torch", exc)
            self._runtime = None

    def _scratch_span(self) -> Span:
        """A copy of one scratch value onto the other, to set up or wake the stream with."""
        n = self._scratch.element_size()
        return Span(self._scratch.data_ptr() + n, self._scratch.data_ptr(), n)

    def plan(self, dst: Any, work: list[tuple[Any, ReadSpec]], region: RegionInfo) -> CopyPlan:
        """What `run` launches: the raw spans and what goes through torch. Made while the
        claim is on its way (kv/puller.py), so a READ launches only copies; the stream is woken
        then too (`_wake`)."""
        out = CopyPlan(dst)
        self._events()  # the thread set up: whether the runtime's calls work is known
        raw = self._runtime is not None
        for src, spec in work:
            if spec.empty:
                continue
            if raw and raw_copyable(dst, src, spec):
                out.spans += spec_spans(dst, src, spec)
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
        if self._runtime is not None:
            span = self._scratch_span()
            self._runtime.memcpy(span.dst, span.src, span.width, self.stream.cuda_stream)
        else:
            with torch.cuda.stream(self.stream):
                self._scratch[1:].copy_(self._scratch[:1], non_blocking=True)

    def run(self, plan: CopyPlan, start: float | None = None) -> ReadStats:
        """Every copy of ``plan`` launched and waited for before returning (the decode may
        attend over the blocks as soon as this reports done); timed from ``start`` (default:
        now). Through the runtime's calls the GIL is held from the first to the last, the wait
        included when the copies are short (`CudaRuntime`)."""
        import torch

        start = time.monotonic() if start is None else start
        began, ended = self._events()
        rt, stream = self._runtime, self.stream.cuda_stream
        if rt is not None:
            rt.event_record(began.cuda_event, stream)
        else:
            began.record(self.stream)
        if plan.spans:
            assert rt is not None  # spans are planned only with the runtime
            for span in plan.spans:
                if span.height == 1:
                    rt.memcpy(span.dst, span.src, span.width, stream)
                else:
                    rt.memcpy_2d(span.dst, span.src, span.width, span.height, span.pitch,
                                 stream)
        if plan.through_torch:
            dst = plan.dst
            with torch.cuda.device(dst.device), torch.cuda.stream(self.stream):
                for src, spec in plan.through_torch:
                    copy_blocks(dst, src, spec)
        if rt is None:
            ended.record(self.stream)
            ended.synchronize()
        else:
            rt.event_record(ended.cuda_event, stream)
            if waits_holding_gil(plan.bytes, sys.getswitchinterval()):
                rt.event_synchronize(ended.cuda_event)
            else:
                ended.synchronize()
        for device in plan.other_devices:
            torch.cuda.synchronize(device)  # a peer on another GPU read on that GPU's stream
        seconds = time.monotonic() - start
        device_s = (rt.event_elapsed_s(began.cuda_event, ended.cuda_event) if rt is not None
                    else began.elapsed_time(ended) / 1e3)
        return ReadStats(bytes=plan.bytes, transfers=plan.transfers, seconds=seconds,
                         device_seconds=device_s, path=CUDA_IPC)

    def read(self, dst: Any, work: list[tuple[Any, ReadSpec]], region: RegionInfo) -> ReadStats:
        """`plan`, then `run`, timed together."""
        start = time.monotonic()
        return self.run(self.plan(dst, work, region), start)
