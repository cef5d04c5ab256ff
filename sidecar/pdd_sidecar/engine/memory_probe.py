"""The start-up memory probe of a CUDA rank: the I/O edge around kv/pool_sizing.py.

After the weights are loaded and before the real cache, NIXL agent and side channel exist, the
rank builds a scratch cache and engine and runs the warm-up the driver will run (the same
shapes, engine/warmup_shape.py: every CUDA graph captured, the largest step run), measures
torch's peak reservation, the device's free memory and this process's memory outside torch,
and frees it all again. The CUDA graphs go with the engine: each ``CUDAGraph`` releases its
private pool when destroyed, and ``empty_cache`` then returns the pool's segments; whatever
stays reserved is reported as ``leftover`` and counted against the pool.

Every rank of the instance probes at once (the warm-up's collectives need them all) and the
instance takes the smallest count (``agree``)."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

import torch

from pdd_sidecar.engine.comm import Comm
from pdd_sidecar.engine.scheduler import step_budget, whole_chunk
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.engine.warmup_shape import (
    largest_step_prompts,
    unbounded_warmup_blocks,
    warmup_shape,
)
from pdd_sidecar.env import InstanceSettings
from pdd_sidecar.kv.fp8_layout import token_bytes_for
from pdd_sidecar.kv.pool_sizing import (
    CPU_DEFAULT_BLOCKS,
    NON_TORCH_FALLBACK_BYTES,
    UTILIZATION_SETTING,
    MemoryReport,
    PoolSize,
    SizingError,
    agree,
    blocks_for,
    gib,
    min_sequence,
    non_torch_bytes,
    size_pool,
)
from pdd_sidecar.model.rank_model import RankModel

log = logging.getLogger(__name__)


def bytes_per_block(model: RankModel, block_size: int, kv_cache_dtype: str = "auto",
                    extra_layers: int = 0) -> int:
    """A block of every layer (``extra_layers``: the MTP module's, after the model's), in the
    cache's dtype: an FP8 token (kv/fp8_layout.py) is 656 bytes against 1,152 in bf16 for
    V2/V3, so the same bytes hold 1.756x the tokens."""
    cfg = model.config
    per_token = token_bytes_for(kv_cache_dtype, cfg.kv_lora_rank,
                                cfg.latent_dim - cfg.kv_lora_rank, model.dtype)
    return (cfg.num_hidden_layers + extra_layers) * block_size * per_token


def max_positions(settings: InstanceSettings, model: RankModel) -> int:
    """The longest sequence the instance serves (serve/instance/common.py's ``max_model_len``)."""
    return settings.max_model_len or model.config.max_position_embeddings


def oom_error(what: str, device: torch.device, free_before: int, total: int,
              settings: InstanceSettings) -> SizingError:
    return SizingError(
        f"CUDA out of memory while {what} on {device} ({gib(free_before)} of {gib(total)} free "
        f"when the rank started): another process may hold this GPU's memory (under pdd "
        f"serve a prefill and a decode share it: lower {UTILIZATION_SETTING}, now "
        f"{settings.gpu_memory_utilization:g}, or move the split with --prefill-memory-share), "
        f"or the model needs more GPUs (a larger tensor-parallel size)")


def nvml_process_bytes(device: torch.device) -> int | None:
    """This process's device memory as NVML counts it (everything: torch's allocator, the CUDA
    context, NCCL); None without pynvml (package nvidia-ml-py), under MIG, or when NVML does
    not list this pid (a container's pid namespace)."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVML missing or refusing: the fallback applies
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-"))
                                                  else f"GPU-{uuid}")
        pid = os.getpid()
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid and isinstance(proc.usedGpuMemory, int):
                return int(proc.usedGpuMemory)
        return None
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


class DeviceMemory(Protocol):
    """What the probe reads of a device's memory; ``CudaMemory`` on a GPU, a fake in the CPU
    tests that run the same probe."""

    def settle(self) -> None: ...  # work done, garbage collected, cached blocks returned

    def reserved(self) -> int: ...  # this process's torch reservation now

    def reset_peak(self) -> None: ...

    def peak(self) -> int: ...  # torch's peak reservation since reset_peak

    def free_total(self) -> tuple[int, int]: ...

    def process_used(self) -> int | None: ...  # everything this process holds (NVML)


class CudaMemory:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_reserved(self.device))

    def free_total(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def process_used(self) -> int | None:
        return nvml_process_bytes(self.device)


def probe(model: RankModel, comm: Comm, settings: InstanceSettings, device: torch.device,
          rank: int, memory: DeviceMemory | None = None) -> MemoryReport:
    """Run the warm-up on a scratch cache and measure; everything it made is freed after."""
    from pdd_sidecar.engine import rank_engine

    mem = CudaMemory(device) if memory is None else memory
    s = settings
    bs, dcp = s.block_size, s.dcp
    budget = step_budget(device.type, s.max_step_tokens, s.chunk_tokens, s.long_chunk_tokens)
    chunk = whole_chunk(budget.chunk, bs)
    extra = largest_step_prompts(s.role, budget.step, chunk)
    scratch_blocks = (unbounded_warmup_blocks(s.role, bs, dcp, chunk)
                      + sum(blocks_for(n, bs, dcp) for n in extra))
    mem.settle()
    resident = mem.reserved()
    mem.reset_peak()
    held: dict[str, Any] = {}
    try:
        cache = held["cache"] = rank_engine.new_cache(model, scratch_blocks, bs, device,
                                                      s.kv_cache_dtype)
        engine = held["engine"] = rank_engine.RankEngine(
            model, cache, comm, dcp, overtake=None if s.role == "prefill" else False,
            max_table_blocks=blocks_for(max_positions(s, model), bs, dcp))
        shape = warmup_shape(s.role, scratch_blocks, bs, dcp, chunk, s.max_num_seqs,
                             engine.buckets, engine.decode_mode == "eager")
        blocks = cache.allocate(shape.blocks)
        engine.warm_up(blocks, shape.prompt_tokens, chunk, shape.batch_sizes,
                       want_logits=rank == 0)
        if extra:
            vocab = model.config.vocab_size
            chunks = [SeqChunk([(7 * i + 3) % vocab for i in range(n)], 0,
                               cache.allocate(blocks_for(n, bs, dcp))) for n in extra]
            engine.step(chunks, want_logits=rank == 0)
        peak = mem.peak()
        scratch = cache.kv.numel() * cache.kv.element_size()
        used = mem.process_used()
        non_torch = non_torch_bytes(used, mem.reserved())
    finally:
        held.clear()
        cache = engine = None  # type: ignore[assignment]
        mem.settle()
    leftover = max(0, mem.reserved() - resident)
    free, total = mem.free_total()
    report = MemoryReport(total=total, free=free, torch_peak=peak, scratch=scratch,
                          non_torch=non_torch, resident=resident, leftover=leftover)
    log.info("rank %d memory probe on %s: total %s, free %s after it; torch peak %s (scratch "
             "cache %s of %d blocks, weights %s); outside torch %s (%s); left reserved %s",
             rank, device, gib(total), gib(free), gib(peak), gib(scratch), scratch_blocks,
             gib(resident), gib(non_torch),
             "NVML" if used is not None else
             f"fallback {gib(NON_TORCH_FALLBACK_BYTES)}: NVML did not report this process",
             gib(leftover))
    if leftover > 64 << 20:
        log.warning("rank %d: the memory probe left %s reserved after it was freed (CUDA graph "
                    "pools not released?); the pool is that much smaller", rank, gib(leftover))
    return report


def rank_blocks(model: RankModel, comm: Comm, settings: InstanceSettings,
                device: torch.device, rank: int, memory: DeviceMemory | None = None) -> int:
    """This rank's block count sized from memory (SizingError when it cannot be)."""
    s = settings
    report = probe(model, comm, s, device, rank, memory)
    longest = max_positions(s, model)
    min_tokens, why = min_sequence(longest)
    per_block = bytes_per_block(model, s.block_size, s.kv_cache_dtype, s.cache_extra_layers)
    return size_pool(report, s.gpu_memory_utilization, per_block, s.block_size, s.dcp,
                     min_tokens, why, longest).blocks


def size_rank_pool(model: RankModel, comm: Comm, settings: InstanceSettings,
                   device: torch.device, rank: int,
                   all_gather: Callable[[Any], list[Any]]) -> PoolSize:
    """The instance's pool as this rank makes it: ``PDD_NUM_BLOCKS`` when set, a fixed count on
    a CPU, else sized from memory with every rank agreeing on the smallest."""
    s = settings
    per_block = bytes_per_block(model, s.block_size, s.kv_cache_dtype, s.cache_extra_layers)
    longest = max_positions(s, model)

    def pool(blocks: int, source: str) -> PoolSize:
        return PoolSize(blocks, s.block_size, s.dcp, per_block, longest, source)

    if s.num_blocks is not None:
        return pool(s.num_blocks, "explicit")
    if device.type != "cuda":
        return pool(CPU_DEFAULT_BLOCKS, "cpu default")
    mine: tuple[int | None, str | None]
    try:
        mine = (rank_blocks(model, comm, s, device, rank), None)
    except SizingError as exc:
        mine = (None, str(exc))
    return pool(agree(all_gather(mine)), "memory")
