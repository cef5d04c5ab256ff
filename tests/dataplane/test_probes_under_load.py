"""Probes stay true under load: while an instance serves 256 concurrent streams, /readyz and
/metrics of the router, the prefill and the decode keep answering 200 (ready), since they are
answered off the engine's path. The latencies are printed; bench/serve_path.py reports them
against the 100 ms target."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import aiohttp
import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest

from pdd_sidecar.serve.local_stack import LocalStack, StackConfig

pytestmark = pytest.mark.dataplane

STREAMS = 256
MAX_TOKENS = 12


async def _load_and_poll(stack: LocalStack) -> tuple[list[float], list[str], int]:
    probes = [f"{u}/readyz" for u in (stack.url, stack.prefill_url, stack.decode_url)]
    probes += [f"{stack.prefill_url}/metrics", f"{stack.decode_url}/metrics"]
    latencies: list[float] = []
    bad: list[str] = []
    done = 0
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def stream(i: int) -> None:
            nonlocal done
            body = {"prompt": [(i * 31 + k) % 250 + 1 for k in range(16)],
                    "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            async with session.post(f"{stack.url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                text = (await resp.read()).decode()
            assert text.rstrip().endswith("data: [DONE]"), text[-300:]
            done += 1

        async def poll() -> None:
            while done < STREAMS:
                for url in probes:
                    t = time.perf_counter()
                    async with session.get(url) as resp:
                        await resp.read()
                        if resp.status != 200:
                            bad.append(f"{url}: {resp.status}")
                    latencies.append((time.perf_counter() - t) * 1e3)
                await asyncio.sleep(0.05)

        poller = asyncio.create_task(poll())
        await asyncio.gather(*(stream(i) for i in range(STREAMS)))
        await poller
    return latencies, bad, done


def test_probes_answer_200_while_256_streams_run(tmp_path: Path) -> None:
    cfg = StackConfig(port=0, num_blocks=1024, max_num_seqs=256, max_waiting=512,
                      log_level="WARNING", drain_s=1.0)
    with LocalStack(cfg, tmp_path / "logs") as stack:
        stack.start()
        latencies, bad, done = asyncio.run(_load_and_poll(stack))
        stack.raise_if_dead()
    assert done == STREAMS
    assert bad == []
    assert len(latencies) >= 10  # the probes ran during the load, not only after it
    print(f"probe latency under {STREAMS} streams: median {statistics.median(latencies):.1f} "
          f"ms, max {max(latencies):.1f} ms over {len(latencies)} probes")
