"""Collectives between the ranks of one instance (the TP group, which is also the DCP group).

Ranks talk only through :class:`Comm`. ``ThreadGroup`` simulates a group inside one process (one
thread per rank) so tests and ``--launcher inproc`` need no sockets; ``TorchDistComm`` runs over
``torch.distributed`` (gloo on CPU, NCCL on GPU) for real multi-process ranks. Both reduce in rank
order on every rank, so every rank sees bit-identical results and takes identical greedy tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

T = TypeVar("T")


class Comm(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks; returns a new tensor."""
        ...

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenation of every rank's ``t`` along ``dim`` in rank order."""
        ...

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over ranks, then this rank's equal slice along ``dim``."""
        ...

    def barrier(self) -> None: ...


class SingleComm:
    """The trivial group of one rank."""

    rank = 0
    world_size = 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return t

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return t

    def barrier(self) -> None:
        pass


class ThreadGroup:
    """Shared state of ``world_size`` thread-ranks; a failing rank aborts the barrier so the
    others raise instead of hanging."""

    def __init__(self, world_size: int, timeout_s: float | None = 300.0) -> None:
        self.world_size = world_size
        self._slots: list[torch.Tensor | None] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)

    def abort(self) -> None:
        self._barrier.abort()

    def exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = t
        self._barrier.wait()
        vals = [v.to(t.device) for v in self._slots if v is not None]
        self._barrier.wait()
        return vals


class ThreadComm:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        vals = self.group.exchange(self.rank, t)
        acc = vals[0].float()  # accumulate in fp32 like gloo below: one rounding, not world_size
        for v in vals[1:]:
            acc = acc + v.float()
        return acc.to(t.dtype)

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return torch.cat(self.group.exchange(self.rank, t), dim=dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self.all_reduce(t).chunk(self.world_size, dim=dim)[self.rank].contiguous()

    def barrier(self) -> None:
        self.group.exchange(self.rank, torch.empty(0))


def run_threads(world_size: int, fn: Callable[[int, Comm], T]) -> list[T]:
    """Run ``fn(rank, comm)`` on one thread per rank; re-raises the first rank failure."""
    if world_size == 1:
        return [fn(0, SingleComm())]
    group = ThreadGroup(world_size)
    results: list[T | None] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, group.comm(rank))
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors[rank] = e
            group.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    failed = [e for e in errors if e is not None]
    if failed:
        # A BrokenBarrierError is only the echo of another rank's failure.
        failed.sort(key=lambda e: isinstance(e, threading.BrokenBarrierError))
        raise failed[0]
    return results  # type: ignore[return-value]


class TorchDistComm:
    """Over an initialised ``torch.distributed`` process group. Gloo has no reduce-scatter and
    patchy bf16 support, so on gloo those go through fp32 all-reduce."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._gloo = dist.get_backend(group) == "gloo"

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        if self._gloo and t.dtype in (torch.bfloat16, torch.float16):
            return t.float()
        return t.contiguous().clone()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        w = self._wire(t)
        self._dist.all_reduce(w, group=self.group)
        return w.to(t.dtype)

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        w = self._wire(t)
        outs = [torch.empty_like(w) for _ in range(self.world_size)]
        self._dist.all_gather(outs, w, group=self.group)
        return torch.cat(outs, dim=dim).to(t.dtype)

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if self._gloo:
            return self.all_reduce(t).chunk(self.world_size, dim=dim)[self.rank].contiguous()
        src = t.movedim(dim, 0).contiguous()
        out = src.new_empty(src.shape[0] // self.world_size, *src.shape[1:])
        self._dist.reduce_scatter_tensor(out, src, group=self.group)
        return out.movedim(0, dim).contiguous()

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)
