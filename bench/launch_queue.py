"""How far the host can run ahead of a CUDA stream, and how much of that one eager prefill step
takes: the figures behind the driver's ``IN_ORDER_AHEAD`` (engine/driver.py).

A stream holds a bounded number of pending launches; past it each launch waits for the device.
A host that has queued more than that is stuck inside a step's launches (holding the GIL) and
cannot take a new request until the device catches up. This prints the pending launches at
which enqueuing stalls behind a long kernel, and the kernels one eager step of the built-in
model launches per layer (a served model launches about that many per layer, times its layers).

    PYTHONPATH=sidecar python bench/launch_queue.py [--layers 27]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pdd_sidecar.engine.comm import SingleComm
from pdd_sidecar.engine.rank_engine import RankEngine, new_cache
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.model.rank_model import load_rank_model

SLEEP_CYCLES = 4_000_000_000  # a couple of seconds of device time ahead of the launches


def stall_point(limit: int = 20_000) -> tuple[int, float]:
    """Launches enqueued behind a long kernel before one takes over 1 ms, and the host time
    until then."""
    x = torch.zeros(1, device="cuda")
    x.add_(1)  # loaded once first: a kernel's first launch may wait for the device
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start = time.perf_counter()
    for i in range(limit):
        t = time.perf_counter()
        x.add_(1)
        if time.perf_counter() - t > 1e-3:
            took = time.perf_counter() - start
            torch.cuda.synchronize()
            return i, took
    torch.cuda.synchronize()
    return limit, time.perf_counter() - start


def kernels_per_step(tokens: int, cached: int) -> tuple[int, int]:
    """CUDA kernels of one eager step continuing a cached prompt, and the model's layers."""
    model = load_rank_model("builtin", 0, 1, torch.bfloat16, torch.device("cuda"))
    eng = RankEngine(model, new_cache(model, 1024, 16), SingleComm(), decode_mode="eager",
                     prefill_buckets=())
    vocab = model.config.vocab_size
    prompt = [(3 * i + 1) % vocab for i in range(cached + tokens)]
    blocks = list(range(-(-(cached + tokens) // 16)))
    eng.step([SeqChunk(prompt[:cached], 0, blocks)])
    step = [SeqChunk(prompt[cached:], cached, blocks)]
    eng.step(step)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.step(step)
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return kernels, len(model.weights.layers)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=27, help="a served model's layers")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--cached", type=int, default=4096)
    args = p.parse_args()
    n, took = stall_point()
    print(f"launch queue: the host stalled after {n} launches behind a long kernel "
          f"({took * 1e3:.1f} ms of enqueuing, {took / max(n, 1) * 1e6:.1f} us a launch)")
    k, layers = kernels_per_step(args.tokens, args.cached)
    per_layer = k / layers
    print(f"eager step ({args.tokens} tokens over {args.cached} cached, built-in model): {k} "
          f"kernels, {per_layer:.0f} a layer for {layers} layers; at {args.layers} layers "
          f"about {per_layer * args.layers:.0f} ({per_layer * args.layers / max(n, 1):.2f} of "
          "the queue)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
