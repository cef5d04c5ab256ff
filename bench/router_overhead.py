"""The router's own CPU time per request, with upstreams that answer at once.

Served on one H200 the router is one event loop in one process, and under a burst its
per-request Python is what a request waits for (64:32:2's `to_client` and `decode_to_client`
stages, the router's `/readyz` at the start of 256 streams; docs/serving.md). This runs the
real router (`python -m pdd_sidecar router`) against a stub prefill and decode in a process of
their own (immediate answers, no engine), sends bursts of streaming completions, and reads the
router process's CPU time from /proc: milliseconds of router CPU per request, and per streamed
token, against the stubs' CPU for the same HTTP exchanges (bare aiohttp handlers: the baseline).
No GPU, no model weights (the built-in model's text tables). /proc counts each thread's
nanoseconds (schedstat) where the kernel keeps them, else clock ticks (10 ms): then a figure
needs hundreds of requests (`--rounds`) to mean something.

    python bench/router_overhead.py --bursts 64:32:2,64:32:32,256:1024:8 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sidecar"))
sys.path.insert(0, str(ROOT / "bench"))

from stream_client import stream_completion  # noqa: E402

from pdd_sidecar.processes import tree_cpu_seconds  # noqa: E402
from pdd_sidecar.serve.local_stack import StackConfig, pick_ports, router_env  # noqa: E402

VOCAB = 200  # below the built-in model's vocabulary
PLAN = "stub-plan"


def _stub_app(role: str, pace_s: float = 0.0) -> web.Application:
    """A prefill or decode that answers at once, in the shapes the router reads; the decode's
    tokens all in one write, or one every ``pace_s`` (as a decode's steps send them)."""

    async def readyz(request: web.Request) -> web.Response:
        return web.json_response({"ready": True, "plan_digest": PLAN,
                                  "kv_capacity_tokens": 1 << 20,
                                  "load": {"running": 0, "waiting": 0, "free_blocks": 1 << 16,
                                           "num_blocks": 1 << 16}})

    async def prefill(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"request_id": body["request_id"], "first_token": 1,
                                  "finish_reason": None, "cached_tokens": 0,
                                  "kv_transfer_params": {"stub": body["request_id"]},
                                  "timing": None})

    async def release(request: web.Request) -> web.Response:
        return web.json_response({"released": True})

    async def decode(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body["max_new_tokens"])
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        lines = [json.dumps({"token": 2, "timing": None}).encode() + b"\n",
                 *(b'{"token": %d}\n' % (3 + i % 90) for i in range(n - 1))][:n]
        if pace_s:
            for line in lines:
                await response.write(line)
                await asyncio.sleep(pace_s)
        elif lines:
            await response.write(b"".join(lines))
        await response.write(json.dumps({"done": True, "finish_reason": "length",
                                         "transfer": None}).encode() + b"\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/readyz", readyz)
    if role == "prefill":
        app.router.add_post("/v1/prefill", prefill)
        app.router.add_post("/v1/release", release)
    else:
        app.router.add_post("/v1/decode", decode)
    return app


def _run_stubs(prefill_port: int, decode_port: int, pace_s: float) -> None:
    async def main() -> None:
        for role, port in (("prefill", prefill_port), ("decode", decode_port)):
            runner = web.AppRunner(_stub_app(role, pace_s), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(main())


async def _ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(f"{url}/readyz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready in {timeout_s:.0f}s")
            await asyncio.sleep(0.1)


async def _bursts(url: str, pid: int, stubs_pid: int, n: int, prompt: int, max_tokens: int,
                  rounds: int) -> dict[str, Any]:
    rng = random.Random(n * 7919 + prompt)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:

        async def burst() -> list[Any]:
            prompts = [[rng.randrange(VOCAB) for _ in range(prompt)] for _ in range(n)]
            return await asyncio.gather(*(stream_completion(session, url, p, max_tokens)
                                          for p in prompts))

        await burst()  # connections up, first-use costs paid
        cpu0, base0, t0 = tree_cpu_seconds(pid), tree_cpu_seconds(stubs_pid), time.perf_counter()
        errors = 0
        for _ in range(rounds):
            errors += sum(isinstance(r, str) for r in await burst())
        cpu, wall = tree_cpu_seconds(pid) - cpu0, time.perf_counter() - t0
        base = tree_cpu_seconds(stubs_pid) - base0
    requests = n * rounds
    return {"burst": f"{n}:{prompt}:{max_tokens}", "requests": requests, "errors": errors,
            "router_cpu_ms_per_request": 1e3 * cpu / requests,
            "router_cpu_us_per_token": 1e6 * cpu / (requests * max_tokens),
            # The baseline: the same HTTP exchanges answered by bare aiohttp handlers.
            "stubs_cpu_ms_per_request": 1e3 * base / requests,
            "router_over_stubs": cpu / base if base > 0 else float("nan"),
            "wall_ms_per_burst": 1e3 * wall / rounds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bursts", default="64:32:2,64:32:32,256:1024:8",
                   help="concurrency:prompt:max_tokens, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pace-ms", type=float, default=0.0,
                   help="the stub decode writes one token per this many ms (0: all at once)")
    p.add_argument("--workers", type=int, default=1,
                   help="router processes sharing its port (PDD_ROUTER_WORKERS)")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--stubs", nargs=3, type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stubs:
        _run_stubs(int(args.stubs[0]), int(args.stubs[1]), args.stubs[2])
        return 0
    bursts = [tuple(int(x) for x in b.split(":")) for b in args.bursts.split(",")]
    # The router as `pdd serve` configures it, its upstreams the stubs.
    # Every request through the (stub) prefill: the hand-off's router work is what is counted.
    cfg = StackConfig(port=0, log_level="WARNING", router_workers=args.workers,
                      local_prefill_tokens=0)
    ports = pick_ports(cfg)
    stubs = subprocess.Popen([sys.executable, __file__, "--stubs", str(ports.prefill[0].http),
                              str(ports.decode[0].http), str(args.pace_ms / 1e3)])
    env = {**os.environ, "PYTHONPATH": str(ROOT / "sidecar"), **router_env(cfg, ports)}
    router = subprocess.Popen([sys.executable, "-m", "pdd_sidecar", "router"], env=env)
    url = f"http://127.0.0.1:{ports.router}"
    results = []
    try:
        asyncio.run(_ready(url))
        print(f"{'burst':>14} {'reqs':>5} {'err':>4} {'router CPU ms/req':>18} "
              f"{'µs/token':>9} {'stubs CPU ms/req':>17} {'router/stubs':>13} "
              f"{'wall ms/burst':>14}", flush=True)
        for n, prompt, max_tokens in bursts:
            r = asyncio.run(_bursts(url, router.pid, stubs.pid, n, prompt, max_tokens,
                                    args.rounds))
            results.append(r)
            print(f"{r['burst']:>14} {r['requests']:>5} {r['errors']:>4} "
                  f"{r['router_cpu_ms_per_request']:>18.3f} {r['router_cpu_us_per_token']:>9.1f} "
                  f"{r['stubs_cpu_ms_per_request']:>17.3f} {r['router_over_stubs']:>13.2f} "
                  f"{r['wall_ms_per_burst']:>14.1f}", flush=True)
    finally:
        for proc in (router, stubs):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if args.json:
        Path(args.json).write_text(json.dumps({"pace_ms": args.pace_ms, "workers": args.workers,
                                               "bursts": results}, indent=1))
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
