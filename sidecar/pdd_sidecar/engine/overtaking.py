"""A short prefill step overtakes a long prompt's device work already queued.

Why: the host enqueues a prefill step without waiting for it (engine/device_queue.py), so a
short prompt that arrives while a long prompt's chunk is queued waits on the device for that
chunk too: on one H200 (run 27, docs/serving.md) a 1k prompt's 24 ms step sat behind up to
~135 ms of a 32k prompt's 8,192-token chunk. On a single-rank CUDA instance a step of fresh
prompts that a prefill graph bucket holds runs on a high-priority stream instead, while in-order
work is still queued: the GPU gives its kernels SMs ahead of the queued chunk's, and sampling it
waits for it alone. With nothing to overtake the step runs in order (run 29: a burst of 64
prompts in one step was 1.69x its bound on the high-priority stream, 1.35x in order).

Everything that depends on the host's order keeps it:
- the default stream waits (on the device) for each overtaking step, so every later step, copy
  and hand-off sees its KV as if it had run in order;
- an overtaking step waits for the default stream when one of its blocks may still be written
  there (a cancelled long prompt's blocks, handed to the short one): the blocks of each default
  step stay pending until that step is seen done (``BlockOrder``, pure Python). Until run 29 they
  stayed until the whole default stream was seen done at an overtaking step's start, so blocks
  written long ago by an earlier burst still counted, and a 1k prompt waited for a long chunk
  it shared nothing with;
- an overtaking step waits (on the device) for the last in-order graph replayed: every graph
  draws its scratch memory from one pool, which two graphs running at once would both write.

Several ranks keep the host's order throughout: their collectives must meet in one order.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import torch

from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.switch import switch

T = TypeVar("T")

# Listed in env.py with every other variable; named here so the engine needs nothing else.
PDD_OVERTAKING = "PDD_OVERTAKING"


def overtaking_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``PDD_OVERTAKING``: ``1`` (default) or ``0`` (every step in the host's order, as a
    baseline or a way out); anything else is a configuration error that names the variable."""
    return switch(os.environ if env is None else env, PDD_OVERTAKING, True)


class BlockOrder:
    """The KV blocks that default-stream steps may still be writing, step by step: a stream
    finishes its steps in order, so the oldest are dropped as soon as they are seen done."""

    def __init__(self) -> None:
        self._steps: deque[tuple[Callable[[], bool], frozenset[int]]] = deque()

    def written_in_order(self, blocks: Iterable[int], done: Callable[[], bool]) -> None:
        """An in-order step that writes ``blocks`` was enqueued; ``done`` says when it ran."""
        self._steps.append((done, frozenset(blocks)))

    def busy(self) -> bool:
        """Some in-order step is not yet seen done."""
        while self._steps and self._steps[0][0]():
            self._steps.popleft()
        return bool(self._steps)

    def must_wait(self, blocks: Iterable[int]) -> bool:
        """Whether a step that writes ``blocks`` must wait for the in-order work enqueued so
        far: one of them belongs to an in-order step not yet seen done."""
        if not self.busy():
            return False
        wanted = set(blocks)
        return any(not wanted.isdisjoint(written) for _, written in self._steps)

    @property
    def pending(self) -> int:
        """Blocks of the in-order steps not yet seen done."""
        return sum(len(written) for _, written in self._steps)


def steps_since(seen: tuple[int, int], now: tuple[int, int]) -> dict[str, int]:
    """The overtaking steps between two (steps, waited) counts, by whether they waited: what
    the ``pdd_overtaking_steps`` counter's ``waited`` labels gain."""
    return {"false": (now[0] - now[1]) - (seen[0] - seen[1]), "true": now[1] - seen[1]}


def written_blocks(chunks: Sequence[SeqChunk], block_size: int) -> list[int]:
    """The blocks a step of one rank (no DCP) writes: those of its tokens' positions, not the
    whole tables it reads (a decode step writes one block a sequence)."""
    return [b for c in chunks
            for b in c.block_ids[c.start // block_size:
                                 (c.start + len(c.tokens) - 1) // block_size + 1]]


def _default_stream_end(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class _InOrderStep:
    """Done once enqueued and then run by the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.end: torch.cuda.Event | None = None

    def enqueued(self) -> None:
        self.end = _default_stream_end(self.device)

    def done(self) -> bool:
        return self.end is not None and bool(self.end.query())


class Overtaking:
    """The high-priority stream of one device and the order kept around it."""

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device = device
        self.block_size = block_size
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        self.order = BlockOrder()
        self.steps = 0  # overtaking steps run
        self.waited = 0  # of those, the ones that waited for in-order work
        self._graph_end: torch.cuda.Event | None = None

    def in_order(self, chunks: Sequence[SeqChunk]) -> Callable[[], None]:
        """An in-order step is about to be enqueued on the default stream: its blocks count
        from now (steps may overtake it half-way through its launch, engine/launch_pacing.py)
        until the device has run it. Call what this returns once it is enqueued."""
        step = _InOrderStep(self.device)
        self.order.written_in_order(written_blocks(chunks, self.block_size), step.done)
        return step.enqueued

    def after_graph(self) -> None:
        """An in-order graph was replayed on the default stream."""
        self._graph_end = _default_stream_end(self.device)

    def run(self, chunks: Sequence[SeqChunk], step: Callable[[], T]) -> T:
        default = torch.cuda.current_stream(self.device)
        if self.order.must_wait(written_blocks(chunks, self.block_size)):
            self.stream.wait_stream(default)
            self.waited += 1
        elif self._graph_end is not None and not self._graph_end.query():
            self.stream.wait_event(self._graph_end)
            self.waited += 1
        with torch.cuda.stream(self.stream):
            out = step()
        default.wait_stream(self.stream)
        if isinstance(out, torch.Tensor):  # read in order too (not by the driver): kept till then
            out.record_stream(default)
        self.steps += 1
        return out
