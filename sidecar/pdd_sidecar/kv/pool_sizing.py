"""How many KV blocks a rank's pool gets: pure arithmetic over what the start-up probe measured
(engine/memory_probe.py), so every branch is tested on a CPU against made-up reports.

The instance may fill ``utilization`` of its GPU's memory. What it needs besides the pool is
what the probe saw: torch's peak reservation while the weights sat loaded and the warm-up ran
(every CUDA graph captured, the largest step run) on a scratch cache, less that scratch cache,
plus this process's device memory outside torch's allocator (the CUDA context, NCCL's buffers).
The pool gets the rest, in whole blocks, and never more than what is free on the device now,
less what the real warm-up will take again and ``FREE_HEADROOM_BYTES``: another process on the
same GPU (a prefill beside a decode under ``pdd serve``) may have taken its share already.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20
# Left free on the device beyond everything the probe measured: what start-up adds after it
# (the NIXL agent's and UCX's device buffers, CUDA IPC mappings, allocator rounding).
FREE_HEADROOM_BYTES = 512 * MIB
# This process's device memory outside torch's allocator when NVML cannot say (no pynvml, no
# per-process accounting under MIG or in a container whose pids NVML does not see): a CUDA
# context with cuBLAS and Triton modules is about 0.5 GiB on an H200, NCCL adds its buffers.
NON_TORCH_FALLBACK_BYTES = 1 * GIB
# A CPU instance (or one told nothing else) keeps this many blocks per rank.
CPU_DEFAULT_BLOCKS = 1024
# The shortest sequence a pool sized from memory must hold: below it a deployment would
# refuse ordinary prompts (a chat turn with its history, a short document) at once.
MIN_USEFUL_TOKENS = 4096

UTILIZATION_SETTING = "PDD_GPU_MEMORY_UTILIZATION (pdd serve --gpu-memory-utilization)"


class SizingError(ValueError):
    """The pool cannot be sized from memory; the message names the setting and the numbers."""


@dataclass(frozen=True)
class MemoryReport:
    """One rank's device memory, in bytes, as the probe left it.

    ``total`` and ``free``: the device's (``cudaMemGetInfo``), ``free`` after the probe was
    freed. ``torch_peak``: torch's peak reservation during the probe (weights, warm-up
    activations, graph pools, the scratch cache). ``scratch``: the scratch cache's bytes.
    ``non_torch``: this process's bytes outside torch's allocator. ``resident``: torch's
    reservation before the probe (the weights), which stays. ``leftover``: what the freed probe
    still holds reserved (graph pools not released); it comes on top of the real warm-up's.
    """

    total: int
    free: int
    torch_peak: int
    scratch: int
    non_torch: int
    resident: int = 0
    leftover: int = 0

    @property
    def model_bytes(self) -> int:
        """Weights, activations and graphs: the probe's peak without its scratch cache."""
        return max(0, self.torch_peak - self.scratch)


@dataclass(frozen=True)
class PoolSize:
    """A rank's pool: ``blocks`` of ``block_size`` tokens, ``tokens`` over every DCP rank. One
    sequence may use every block but the ``reserved`` ones (the prefill's scratch for graphed
    prefix hits, engine/graphed_hits.py): ``sequence_tokens``; ``longest`` is that, capped by
    the model's length."""

    blocks: int
    block_size: int
    dcp: int
    bytes_per_block: int
    max_positions: int
    source: str  # "memory" | "explicit" | "cpu default"
    reserved: int = 0

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size * self.dcp

    @property
    def sequence_tokens(self) -> int:
        return max(0, self.blocks - self.reserved) * self.block_size * self.dcp

    @property
    def bytes(self) -> int:
        return self.blocks * self.bytes_per_block

    @property
    def longest(self) -> int:
        held = self.sequence_tokens
        return min(held, self.max_positions) if self.max_positions > 0 else held

    def describe(self) -> str:
        return (f"KV pool: {self.blocks} blocks of {self.block_size} tokens per rank "
                f"({self.source}), {self.tokens} tokens at dcp {self.dcp}, "
                f"{self.bytes / GIB:.2f} GiB per rank, longest sequence {self.longest} tokens")


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def blocks_for(tokens: int, block_size: int, dcp: int) -> int:
    """Table blocks per rank one sequence of ``tokens`` tokens needs (kv/cache.py's rule)."""
    chunks = -(-max(1, tokens) // block_size)
    return -(-chunks // dcp)


def non_torch_bytes(process_used: int | None, torch_reserved: int) -> int:
    """This process's device bytes outside torch: NVML's count for it less torch's reservation
    at the same moment; the documented fallback when NVML did not find the process."""
    if process_used is None:
        return NON_TORCH_FALLBACK_BYTES
    return max(0, process_used - torch_reserved)


def kv_budget(report: MemoryReport, utilization: float,
              setting: str = UTILIZATION_SETTING) -> tuple[int, int]:
    """``(share, room)``: bytes the pool may take by ``utilization`` (x total, less the model's
    bytes, the non-torch bytes and what the probe left behind) and by what is free now (less
    what the real warm-up takes again and the headroom); the pool gets the smaller. Refuses a
    utilization outside (0, 1] and weights plus warm-up that do not fit."""
    if not 0 < utilization <= 1:
        raise SizingError(f"{setting}: must be in (0, 1], got {utilization}")
    limit = utilization * report.total
    taken = report.model_bytes + report.non_torch + report.leftover
    share = int(limit - taken)
    if share <= 0:
        raise SizingError(
            f"{setting}={utilization:g}: the weights and warm-up take {gib(report.model_bytes)} "
            f"(torch peak {gib(report.torch_peak)} less the probe's scratch cache "
            f"{gib(report.scratch)}), {gib(report.non_torch)} more outside torch"
            + (f" and {gib(report.leftover)} the probe left reserved" if report.leftover
               else "")
            + f": {gib(taken)}, more than {utilization:g} x {gib(report.total)} = {gib(limit)}"
            " leaves room for; raise it, or use a GPU with more memory (or more TP ranks)")
    again = max(0, report.model_bytes - report.resident)
    room = max(0, report.free - again - FREE_HEADROOM_BYTES)
    return share, room


def size_pool(report: MemoryReport, utilization: float, bytes_per_block: int, block_size: int,
              dcp: int, min_tokens: int, why: str, max_positions: int = 0,
              setting: str = UTILIZATION_SETTING) -> PoolSize:
    """A rank's pool sized from memory; SizingError when it cannot hold one sequence of
    ``min_tokens`` tokens (``why`` says why that length). ``max_positions``: the model's
    length, which caps the longest sequence it reports."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be > 0, got {bytes_per_block}")
    share, room = kv_budget(report, utilization, setting)
    budget = min(share, room)
    blocks = budget // bytes_per_block
    need = blocks_for(min_tokens, block_size, dcp)
    if blocks < need:
        where = (f"{gib(report.free)} free on the device now, less "
                 f"{gib(FREE_HEADROOM_BYTES)} headroom and the warm-up's own memory: another "
                 "process holds the rest of the GPU" if room < share else
                 f"{utilization:g} x {gib(report.total)} less the weights and warm-up "
                 f"({gib(report.model_bytes)}) and {gib(report.non_torch)} outside torch")
        raise SizingError(
            f"{setting}={utilization:g}: the KV pool would get {blocks} blocks of {block_size} "
            f"tokens ({blocks * block_size * dcp} tokens, {gib(budget)}: {where}); one "
            f"sequence of {min_tokens} tokens ({why}) needs {need} blocks per rank at dcp "
            f"{dcp}; raise it, free the GPU, or set PDD_NUM_BLOCKS (pdd serve --num-blocks)")
    return PoolSize(blocks, block_size, dcp, bytes_per_block, max_positions, "memory")


def min_sequence(max_positions: int) -> tuple[int, str]:
    """The smallest useful sequence for a model of ``max_positions`` tokens, and why."""
    if 0 < max_positions < MIN_USEFUL_TOKENS:
        return max_positions, "the model's maximum length"
    return MIN_USEFUL_TOKENS, ("the shortest sequence worth serving: a chat turn with its "
                               "history, a short document")


def agree(results: list[tuple[int | None, str | None]]) -> int:
    """Every rank's ``(blocks, error)`` -> the instance's block count: the smallest (ranks
    share one block table); the first failing rank's error, named by rank, when any failed."""
    for rank, (_, error) in enumerate(results):
        if error:
            raise SizingError(f"rank {rank}: {error}")
    return min(int(b) for b, _ in results if b is not None)
