"""Programmatic dependent launch (PDL, Hopper and later) for the step's Triton kernels.

At decode batch sizes a layer is about fifteen kernels of a few microseconds each, and in a
CUDA graph the time between two of them (the last program's exit, the memory flush, the next
grid's launch and its first loads) was 11 % of a batch-1 step on an H100. Launched as a
programmatic dependent, a kernel's programs may start while the kernel before it finishes: each
program first loads what no kernel of the step writes (weights), then waits
(``griddepcontrol.wait``: the kernel before it complete, its writes visible) before it reads
activations or writes anything, and then lets the next kernel launch. Because every such kernel
waits before it lets the next one start, a kernel that starts early may also rely on everything
two kernels back being complete.

The arithmetic is unchanged: the outputs are bit-identical with and without it. On by default
for launches of up to ``MAX_ROWS`` rows (``PDD_PDL=0`` turns it off, ``model/fusion.py``); the
CPU, Triton's interpreter and older GPUs never use it.
"""

from __future__ import annotations

from typing import Any

import torch

from pdd_sidecar.model import fusion

try:
    import triton
    import triton.language as tl
except ImportError:  # machines without a GPU may have no Triton
    HAS_TRITON = False
else:
    HAS_TRITON = True

MIN_CAPABILITY = 9  # griddepcontrol: sm_90 and later
_capable: dict[int, bool] = {}


def supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch as programmatic dependents: a CUDA device of
    compute capability 9 or more, and a Triton that has the grid-dependency instructions."""
    if not (HAS_TRITON and device.type == "cuda"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        major = torch.cuda.get_device_capability(index)[0]
        cuda_extra = getattr(getattr(tl, "extra", None), "cuda", None)
        _capable[index] = major >= MIN_CAPABILITY and hasattr(cuda_extra, "gdc_wait")
    return _capable[index]


# An H100 step at 1k context (bench/engine.py --fusion on,on+pdl, one run): 2-3 % faster at 1
# and 2 rows, the same at 16 and 64; larger launches (prefill) were not measured with it
MAX_ROWS = 8


def launch(device: torch.device, rows: int) -> dict[str, Any]:
    """The keyword arguments of a kernel launch over ``rows`` tokens (or sequences): its ``PDL``
    constexpr, and Triton's ``launch_pdl`` where the launch is a programmatic dependent
    (``fusion.pdl()``, up to ``MAX_ROWS`` rows, on a device that supports it)."""
    if rows <= MAX_ROWS and fusion.pdl() and supported(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


if HAS_TRITON:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Where a kernel starts to read activations or write: the kernel before it complete,
        and the next one free to launch."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


__all__ = ["HAS_TRITON", "launch", "supported"]
