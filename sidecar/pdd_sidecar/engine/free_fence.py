"""Blocks go back to the allocator only once no queued device step references them.

Why: a prefill's host enqueues steps without waiting for them (engine/device_queue.py), and a
prompt can be cancelled (or fail) while its chunk is still queued on the device. Freed at once,
its blocks could be handed to someone whose work does not wait for that chunk: a step of fresh
prompts that overtakes it on another stream (engine/overtaking.py knows the blocks a queued step
writes, not those it reads: the units of its earlier chunks), or a host-tier load on the copy
stream (kv/host_pool.py waits for no compute). The queued chunk would then read KV being
overwritten and cache units computed from it; or the new owner's KV would be overwritten by the
chunk's late writes. So the driver registers every step it enqueues with the blocks it
references and a mark the device passes once it ran (``queued``); a free that names a block of
a step not yet seen done is held, whole, until every such step is (``settle``). A held block
stays referenced: it is neither free nor evictable, so admission counts it as taken.

On the CPU every step is done when enqueued, and a free goes through at once. A decode waits for
each step's tokens before anything it frees, so it registers nothing.

Pure Python (no torch).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol


class Mark(Protocol):
    def done(self) -> bool: ...


class FreeFence:
    def __init__(self, free: Callable[[list[int]], None]) -> None:
        self._free = free
        self._steps: deque[tuple[Mark, frozenset[int]]] = deque()
        self._held: list[tuple[list[int], list[Mark]]] = []

    def queued(self, blocks: Iterable[int], mark: Mark) -> None:
        """A step that reads or writes ``blocks`` was enqueued; ``mark`` is done once it ran."""
        self._prune()
        self._steps.append((mark, frozenset(blocks)))

    def free(self, blocks: Sequence[int]) -> None:
        """Free ``blocks`` (one call of the allocator's ``free``) now, or, if a step not yet
        done references one of them, once every such step is done."""
        self._prune()
        waits = [m for m, refs in self._steps if not refs.isdisjoint(blocks)]
        if waits:
            self._held.append((list(blocks), waits))
        else:
            self._free(list(blocks))

    def settle(self) -> int:
        """Free what was held for steps now done, in the order it was freed; how many
        blocks."""
        self._prune()
        if not self._held:
            return 0
        freed = 0
        held, self._held = self._held, []
        for blocks, waits in held:
            waits = [m for m in waits if not m.done()]
            if waits:
                self._held.append((blocks, waits))
            else:
                self._free(blocks)
                freed += len(blocks)
        return freed

    @property
    def held_blocks(self) -> int:
        """Blocks freed but held for a queued step (a block freed twice counts twice)."""
        return sum(len(b) for b, _ in self._held)

    @property
    def pending_steps(self) -> int:
        """Registered steps not yet seen done."""
        self._prune()
        return len(self._steps)

    def _prune(self) -> None:
        """Drop the steps seen done: every one, not only the oldest (an overtaking step may
        finish before the in-order step queued ahead of it)."""
        if self._steps:
            self._steps = deque(s for s in self._steps if not s[0].done())
