"""One request's KV hand-off over NIXL, against a plain copy of the same bytes in the same run.

A DeepSeek-V2-Lite-shaped cache (27 layers, 576 latent values per token, bfloat16, blockSize 64)
lives in a "prefill" process; the "decode" process READs one request's blocks into its own cache
through pdd_sidecar.kv.transfer (prepared lists, contiguous blocks coalesced), and, for comparison,
through one prepared descriptor per block and through per-request `initialize_xfer`.

    python bench/kv_transfer.py                   # CPU: DRAM -> DRAM over UCX
    python bench/kv_transfer.py --device cuda     # two GPUs: cuda:0 (prefill) -> cuda:1 (decode)
    python bench/kv_transfer.py --device cuda --same-device   # one GPU, two processes, CUDA IPC

The copy baseline is `dst.copy_(src)` of the same bytes: memcpy on the CPU, a torch
GPU-to-GPU copy cuda:0 -> cuda:1 on CUDA. Figures are medians over --repeat runs after a warm-up.

`--same-device` is the hand-off of `pdd serve` on one GPU: both processes on cuda:0, the decode
reading the prefill's cache through its CUDA IPC handle with the serving path's own
`DeviceCopier`, against an in-process copy of the same bytes. It reports the wall time (what
`pdd_kv_transfer_seconds` counts) beside the copies' device time, idle and in the two conditions
of a served read: the other process has just used the GPU, and other Python threads of the
decode process are busy (the GIL).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "sidecar"), str(ROOT / "operator")]

LAYERS, LATENT, BLOCK = 27, 576, 64
TARGET_TOKENS, TARGET_RATIO = 8192, 0.80


def _tensor(num_blocks: int, device: str) -> Any:
    import torch

    return torch.empty(num_blocks, LAYERS, BLOCK, LATENT, dtype=torch.bfloat16, device=device)


def _prefill_process(conn: Any, num_blocks: int, device: str) -> None:
    """Owns the source cache and its agent until told to stop."""
    try:
        import torch

        from pdd_sidecar.kv.transfer import KVTransferAgent

        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        kv = _tensor(num_blocks, device)
        # Block b holds the value b % 251 everywhere: cheap to check on the other side.
        for b in range(num_blocks):
            kv[b].fill_(float(b % 251))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        agent = KVTransferAgent("bench-prefill", kv)
        conn.send(("ok", agent.metadata(), agent.region.to_dict()))
        conn.recv()  # stop
        agent.close()
    except BaseException:
        conn.send(("error", traceback.format_exc(), None))


def _ipc_prefill_process(conn: Any, num_blocks: int) -> None:
    """The prefill side of --same-device: publishes its cache's CUDA IPC record, and on "touch"
    runs a kernel of its own (its context used the GPU last) before answering."""
    try:
        import torch

        from pdd_sidecar.kv.transport import local_record

        torch.cuda.set_device("cuda:0")
        kv = _tensor(num_blocks, "cuda:0")
        for b in range(num_blocks):
            kv[b].fill_(float(b % 251))
        scratch = torch.empty(1 << 24, device="cuda:0")
        torch.cuda.synchronize()
        conn.send(("ok", local_record(kv).to_dict(), None))
        while conn.recv() == "touch":
            scratch.mul_(1.0)
            torch.cuda.synchronize()
            conn.send("done")
    except BaseException:
        conn.send(("error", traceback.format_exc(), None))


BUSY_CONDITIONS = [(f"busy{n}@{i * 1e3:g}", n, i)
                   for n, i in ((1, 0.0005), (1, 0.0001), (1, 0.00005), (4, 0.0001))]


def _busy_threads(n: int, stop: Any) -> list[Any]:
    """Python threads that keep asking for the GIL, as a serving process's engine and HTTP
    threads do."""
    import threading

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    threads = [threading.Thread(target=spin, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def run_same_device(token_counts: list[int], repeat: int) -> dict[str, Any]:
    """Two processes on cuda:0; the decode reads through CUDA IPC (kv/transport.py)."""
    import threading

    import torch

    from pdd_sidecar.env import DEFAULT_GIL_SWITCH_INTERVAL_US
    from pdd_sidecar.kv.device_copy import DeviceCopier
    from pdd_sidecar.kv.transfer import ReadSpec, RegionInfo, Run
    from pdd_sidecar.kv.transport import TransportRecord, open_peer_cache

    max_blocks = max(-(-n // BLOCK) for n in token_counts)
    num_blocks = max_blocks + 8
    proc, parent, (record, _) = _start_prefill(_ipc_prefill_process, num_blocks)
    results: dict[str, Any] = {"device": "cuda", "same_device": True, "rows": []}
    serve_interval_s = DEFAULT_GIL_SWITCH_INTERVAL_US / 1e6  # what pdd serve sets
    sys.setswitchinterval(serve_interval_s)
    try:
        torch.cuda.set_device("cuda:0")
        src = open_peer_cache(TransportRecord.from_dict(record), torch.device("cuda:0"))
        kv = _tensor(num_blocks, "cuda:0")
        kv.zero_()
        region = RegionInfo.of_tensor(kv)
        copier = DeviceCopier("cuda:0")
        copy_src, copy_dst = _tensor(max_blocks, "cuda:0"), _tensor(max_blocks, "cuda:0")
        print(f"KV hand-off on one GPU, two processes, CUDA IPC (DeviceCopier.read): "
              f"DeepSeek-V2-Lite cache ({LAYERS} layers x {LATENT} values, bfloat16, blockSize "
              f"{BLOCK}); one request, medians of {repeat}; GB/s by wall time (device time)")
        conditions = ("idle", "after_peer", "new_thread", "new_thread_prepared",
                      *(c[0] for c in BUSY_CONDITIONS))
        print("conditions: idle; after_peer: the prefill process ran a kernel just before; "
              "new_thread(_prepared): each read on a thread that never used CUDA (that ran "
              "DeviceCopier.prepare_thread first, as the pull threads do); "
              "busyN@I: N other Python threads of this process busy, GIL switch interval I ms "
              f"(pdd serve: {serve_interval_s * 1e3:g} ms)")
        print(f"{'tokens':>7} {'MiB':>8} {'copy GB/s':>10} | "
              + " | ".join(f"{c:>20}" for c in conditions) + " | host ms | ok")
        for tokens in token_counts:
            n = -(-tokens // BLOCK)
            nbytes = n * region.bytes_per_block
            spec = ReadSpec(prefill_rank=0, runs=[Run(3, 5, n)])

            def copy(n: int = n) -> None:
                copy_dst[:n].copy_(copy_src[:n], non_blocking=True)
                torch.cuda.synchronize()

            def read(before: Any = None, spec: ReadSpec = spec) -> tuple[float, float]:
                if before is not None:
                    before()
                st = copier.read(kv, [(src, spec)], region)
                return st.seconds, st.device_seconds

            def touch() -> None:
                parent.send("touch")
                parent.recv()

            def in_new_thread(prepared: bool) -> tuple[float, float]:
                out: list[tuple[float, float]] = []

                def body() -> None:
                    if prepared:
                        copier.prepare_thread()
                    out.append(read())

                t = threading.Thread(target=body)
                t.start()
                t.join()
                return out[0]

            def medians(sample: Any) -> tuple[float, float]:
                sample()
                runs = [sample() for _ in range(repeat)]
                return (statistics.median(r[0] for r in runs),
                        statistics.median(r[1] for r in runs))

            copy_s = _median_seconds(copy, repeat)
            kv.zero_()
            torch.cuda.synchronize()
            measured = {"idle": medians(read), "after_peer": medians(lambda: read(touch)),
                        "new_thread": medians(lambda: in_new_thread(False)),
                        "new_thread_prepared": medians(lambda: in_new_thread(True))}
            for name, n_threads, interval in BUSY_CONDITIONS:
                stop = threading.Event()
                threads = _busy_threads(n_threads, stop)
                sys.setswitchinterval(interval)
                try:
                    measured[name] = medians(read)
                finally:
                    sys.setswitchinterval(serve_interval_s)
                    stop.set()
                    for t in threads:
                        t.join()
            got = kv[5:5 + n, :, :, 0].float().amax(dim=(1, 2)).cpu()
            expect = torch.tensor([float((3 + i) % 251) for i in range(n)])
            row: dict[str, Any] = {
                "tokens": tokens, "blocks": n, "bytes": nbytes,
                "copy_gbps": nbytes / copy_s / 1e9,
                **{name: {"gbps": nbytes / wall / 1e9, "device_gbps": nbytes / dev / 1e9,
                          "wall_s": wall, "device_s": dev}
                   for name, (wall, dev) in measured.items()},
                "verified": bool(torch.equal(got, expect)),
            }
            results["rows"].append(row)
            host_ms = (measured["idle"][0] - measured["idle"][1]) * 1e3

            def cell(m: dict[str, Any], copy_gbps: float = row["copy_gbps"]) -> str:
                return (f"{m['gbps']:>7.0f} {m['gbps'] / copy_gbps:>4.0%} "
                        f"({m['device_gbps']:>5.0f})")

            print(f"{tokens:>7} {nbytes / 2**20:>8.1f} {row['copy_gbps']:>10.0f} | "
                  + " | ".join(cell(row[c]) for c in conditions)
                  + f" | {host_ms:>7.3f} | {'yes' if row['verified'] else 'NO'}",
                  flush=True)
    finally:
        _stop_prefill(proc, parent)
    return results


def _start_prefill(target: Any, *args: Any) -> tuple[Any, Any, tuple[Any, Any]]:
    """The prefill side in a process of its own, once it answered what it publishes."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    status, first, second = parent.recv()
    if status != "ok":
        proc.join(5)
        raise SystemExit(f"prefill process failed:\n{first}")
    return proc, parent, (first, second)


def _stop_prefill(proc: Any, parent: Any) -> None:
    parent.send("stop")
    proc.join(30)
    if proc.is_alive():
        proc.kill()


def _median_seconds(fn: Any, repeat: int) -> float:
    fn()  # warm-up: connections, registration caches, page faults
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(device: str, token_counts: list[int], repeat: int) -> dict[str, Any]:
    import torch

    from pdd_sidecar.kv.transfer import KVTransferAgent, ReadSpec, RegionInfo, Run

    cuda = device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit(f"--device cuda needs two GPUs, found {torch.cuda.device_count()}")
    src_dev, dst_dev = ("cuda:0", "cuda:1") if cuda else ("cpu", "cpu")
    max_blocks = max(-(-n // BLOCK) for n in token_counts)
    # Offset the decode blocks so the two sides' block ids differ, as in real block tables.
    num_blocks = max_blocks + 8
    proc, parent, (metadata, region) = _start_prefill(_prefill_process, num_blocks, src_dev)
    results: dict[str, Any] = {"device": device, "rows": []}
    try:
        if cuda:
            torch.cuda.set_device(dst_dev)
        kv = _tensor(num_blocks, dst_dev)
        kv.zero_()
        agent = KVTransferAgent("bench-decode", kv)
        peer = agent.connect("bench-prefill", metadata, RegionInfo.from_dict(region))
        copy_src = _tensor(max_blocks, src_dev)
        copy_dst = _tensor(max_blocks, dst_dev)
        copy_src.fill_(1.0)

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize(src_dev)
                torch.cuda.synchronize(dst_dev)

        bpb = agent.region.bytes_per_block
        results["bytes_per_block"] = bpb
        for tokens in token_counts:
            n = -(-tokens // BLOCK)
            nbytes = n * bpb
            remote0, local0 = 3, 5
            spec = ReadSpec(prefill_rank=0, runs=[Run(remote0, local0, n)])
            stats: dict[str, Any] = {}

            def ours(spec: ReadSpec = spec, stats: dict[str, Any] = stats) -> None:
                st = agent.read([(peer, spec)], timeout_s=120)
                stats["descriptors"] = st.descriptors

            def per_block_prepared(n: int = n, local0: int = local0,
                                   remote0: int = remote0) -> None:
                idx_l = [agent.layout.index(0, local0 + i) for i in range(n)]
                idx_r = [agent.layout.index(0, remote0 + i) for i in range(n)]
                h = agent.agent.make_prepped_xfer("READ", agent._local, idx_l, peer.prepped, idx_r)
                _complete(agent, h)

            def per_block_initialize(n: int = n, local0: int = local0,
                                     remote0: int = remote0) -> None:
                reg = agent.region
                rreg = peer.region
                loc = [(reg.addr + (local0 + i) * bpb, bpb, reg.device_id) for i in range(n)]
                rem = [(rreg.addr + (remote0 + i) * bpb, bpb, rreg.device_id) for i in range(n)]
                h = agent.agent.initialize_xfer(
                    "READ", agent.agent.get_xfer_descs(loc, reg.mem_type),
                    agent.agent.get_xfer_descs(rem, rreg.mem_type), peer.agent_name)
                _complete(agent, h)

            def copy(n: int = n) -> None:
                copy_dst[:n].copy_(copy_src[:n], non_blocking=cuda)
                sync()

            copy_s = _median_seconds(copy, repeat)
            kv.zero_()
            sync()
            ours_s = _median_seconds(ours, repeat)
            sync()
            expect = torch.tensor([float((remote0 + i) % 251) for i in range(n)])
            got = kv[local0:local0 + n, :, :, 0].float().amax(dim=(1, 2)).cpu()
            lowest = kv[local0:local0 + n, :, :, 0].float().amin(dim=(1, 2)).cpu()
            verified = bool(torch.equal(got, expect) and torch.equal(lowest, expect))
            pb_s = _median_seconds(per_block_prepared, repeat)
            init_s = _median_seconds(per_block_initialize, repeat)
            row = {
                "tokens": tokens, "blocks": n, "bytes": nbytes,
                "copy_gbps": nbytes / copy_s / 1e9,
                "ours": {"descriptors": stats["descriptors"], "gbps": nbytes / ours_s / 1e9},
                "per_block_prepared": {"descriptors": n, "gbps": nbytes / pb_s / 1e9},
                "per_block_initialize": {"descriptors": n, "gbps": nbytes / init_s / 1e9},
                "verified": verified,
            }
            results["rows"].append(row)
            _print_row(row)
        agent.close()
    finally:
        _stop_prefill(proc, parent)
    return results


def _complete(agent: Any, handle: Any) -> None:
    state = agent.agent.transfer(handle)
    while state == "PROC":
        state = agent.agent.check_xfer_state(handle)
    agent.agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"transfer ended in state {state}")


def _print_header(device: str, bpb: int | None = None) -> None:
    what = "DRAM -> DRAM (UCX)" if device == "cpu" else "VRAM cuda:0 -> VRAM cuda:1 (UCX)"
    print(f"KV hand-off, {what}: DeepSeek-V2-Lite cache ({LAYERS} layers x {LATENT} values, "
          f"bfloat16, blockSize {BLOCK}); one request, medians")
    print(f"{'tokens':>7} {'blocks':>6} {'MiB':>8} {'copy GB/s':>10} | "
          f"{'pdd (prepared, coalesced)':>33} | {'1 prepared desc/block':>29} | "
          f"{'initialize_xfer/block':>29} | ok")
    sub = f"{'descs':>7} {'GB/s':>8} {'vs copy':>8}"
    print(f"{'':>7} {'':>6} {'':>8} {'':>10} | {sub}       | {sub}   | {sub}   |")


def _print_row(row: dict[str, Any]) -> None:
    copy = row["copy_gbps"]

    def cell(m: dict[str, Any], pad: int) -> str:
        return f"{m['descriptors']:>7} {m['gbps']:>8.2f} {m['gbps'] / copy:>7.0%}" + " " * pad

    print(f"{row['tokens']:>7} {row['blocks']:>6} {row['bytes'] / 2**20:>8.1f} {copy:>10.2f} | "
          f"{cell(row['ours'], 7)}| {cell(row['per_block_prepared'], 3)}| "
          f"{cell(row['per_block_initialize'], 3)}| {'yes' if row['verified'] else 'NO'}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tokens", default="1024,8192,32768",
                        help="comma-separated request lengths in tokens")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--same-device", action="store_true",
                        help="one GPU, two processes: the CUDA IPC hand-off of pdd serve")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    if args.same_device:
        if args.device != "cuda":
            parser.error("--same-device: needs --device cuda")
        results = run_same_device(tokens, max(1, args.repeat))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return 0 if all(r["verified"] for r in results["rows"]) else 1
    _print_header(args.device)
    results = run(args.device, tokens, max(1, args.repeat))
    rows = {r["tokens"]: r for r in results["rows"]}
    if TARGET_TOKENS in rows:
        r = rows[TARGET_TOKENS]
        ratio = r["ours"]["gbps"] / r["copy_gbps"]
        verdict = "meets" if ratio >= TARGET_RATIO else "misses"
        print(f"at {TARGET_TOKENS} tokens pdd moves KV at {ratio:.0%} of the same-run copy "
              f"({verdict} the {TARGET_RATIO:.0%} target set for two H200s)")
    if not all(r["verified"] for r in results["rows"]):
        print("ERROR: the decode cache does not hold the prefill's blocks", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
