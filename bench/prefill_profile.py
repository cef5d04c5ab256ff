"""Where a short prefill step's time goes: one prompt through ``RankEngine.step`` under the torch
profiler, the ops that cost the most device and host time, and the host syncs.

A 1k-token prefill on one H200 took ~50 ms eager where its matmuls need ~7: this prints what
fills the rest (host-side launches, syncs that leave the device idle, small kernels). On CUDA the
engine now replays steps of fresh prompts up to 2,048 tokens from CUDA graphs (24 ms for 1k);
``PDD_CUDA_GRAPHS=0`` profiles the eager step.

``--trend S`` instead steps the first length for S seconds and prints, every 15 steps, the wall
and the process's CPU time per step (equal when the step is host-bound) and its voluntary
context switches (a thread giving the GIL up); ``--nixl-agent`` then registers the KV cache with
a NIXL agent, as a serving rank does, and goes on for S/2 seconds with its progress thread
running every millisecond, then S/2 at its idle pace (kv/transfer.py ProgressPace).

    python bench/prefill_profile.py --model /dev/shm/pdd-random-v2lite-27 --tokens 1024
    python bench/prefill_profile.py --model /dev/shm/pdd-random-v2lite-27 --trend 8 --nixl-agent
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from pdd_sidecar.engine.comm import SingleComm  # noqa: E402
from pdd_sidecar.engine.rank_engine import RankEngine, new_cache  # noqa: E402
from pdd_sidecar.engine.seq_chunk import SeqChunk  # noqa: E402
from pdd_sidecar.model.rank_model import load_rank_model  # noqa: E402

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
         "cudaEventSynchronize", "aten::item", "aten::_local_scalar_dense", "aten::nonzero")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--tokens", default="1024", help="comma list of prompt lengths")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trend", type=float, default=0.0, metavar="S",
                   help="step for S seconds and print wall and CPU time per step as it goes")
    p.add_argument("--nixl-agent", action="store_true",
                   help="with --trend: then a NIXL agent on the KV cache, progressed every 1 ms "
                   "and at its idle pace, S/2 seconds each")
    a = p.parse_args(argv)
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    dev = "cuda:0" if a.device == "cuda" else "cpu"
    model = load_rank_model(a.model, 0, 1, dtype, dev)
    lengths = [int(t) for t in a.tokens.split(",")]
    cache = new_cache(model, max(lengths) // a.block_size + 8, a.block_size, dev)
    eng = RankEngine(model, cache, SingleComm())
    vocab = model.config.vocab_size

    def sync() -> None:
        if a.device == "cuda":
            torch.cuda.synchronize()

    if a.trend:
        n = lengths[0]
        table = cache.allocate(-(-n // a.block_size))
        chunk = [SeqChunk([(7 * i + 3) % vocab for i in range(n)], 0, table)]

        def one() -> None:
            eng.step(chunk)
            sync()

        for _ in range(5):
            one()
        trend(one, a.trend, f"{n} tokens")
        if a.nixl_agent:
            from pdd_sidecar.kv.transfer import KVTransferAgent

            agent = KVTransferAgent("prefill-profile", cache.kv)
            trend(one, a.trend / 2, f"{n} tokens, NIXL agent progressed every 1 ms")
            agent.pace.adaptive = True  # as a serving prefill's rank 0 with no READ claimed
            trend(one, a.trend / 2, f"{n} tokens, NIXL agent at its idle pace")
            agent.close()
        return 0
    for n in lengths:
        table = cache.allocate(-(-n // a.block_size))
        chunk = [SeqChunk([(7 * i + 3) % vocab for i in range(n)], 0, table)]
        for _ in range(3):
            eng.step(chunk)
        sync()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            eng.step(chunk)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if a.device == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            eng.step(chunk)
            sync()
        ka = prof.key_averages()
        print(f"\n== prefill {n} tokens: best {min(times):.2f} ms, median "
              f"{sorted(times)[2]:.2f} ms")
        sort = "self_cuda_time_total" if a.device == "cuda" else "self_cpu_time_total"
        print(ka.table(sort_by=sort, row_limit=a.top, max_name_column_width=60))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=a.top,
                       max_name_column_width=60))
        for name in SYNCS:
            hits = [e for e in ka if e.key == name]
            if hits:
                print(f"  {name}: {hits[0].count} calls, {hits[0].cpu_time_total / 1e3:.2f} ms "
                      "host")
        cache.free(table)
    return 0


def trend(step: Callable[[], None], seconds: float, label: str, per_line: int = 15) -> None:
    """Wall against CPU time per step over time: a host-bound step moves with the host's speed."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        before = resource.getrusage(resource.RUSAGE_SELF)
        walls = []
        for _ in range(per_line):
            t0 = time.perf_counter()
            step()
            walls.append((time.perf_counter() - t0) * 1e3)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1e3
        print(f"{label}: wall median {statistics.median(walls):6.1f} ms, min {min(walls):6.1f}; "
              f"CPU {cpu / per_line:6.1f} ms a step; "
              f"{(after.ru_nvcsw - before.ru_nvcsw) / per_line:5.0f} voluntary switches a step",
              flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
