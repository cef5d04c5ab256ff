"""The serving benchmarks' client side: one streaming completion through the router, timed per
token, the median of each TTFT stage it reports, an instance's /metrics as numbers and its KV
pool, and a probe sampler's process (bench/serving.py, bench/serve_path.py,
bench/prefix_cache.py). The benches put sidecar/ on sys.path before importing it."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdd_sidecar.engine.timing import LOCAL_STAGES, PREFILL_DETAIL, STAGES

# The keys of a completion's `pdd.timing`: the hand-off path's, then a local prefill's.
TIMING_NAMES = tuple(dict.fromkeys((*STAGES, "ttft", "second_token", *LOCAL_STAGES,
                                    *(f"local_{k}" for k in PREFILL_DETAIL))))

_SAMPLE = re.compile(r"^(pdd_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN|[+-]Inf)$")


@dataclass
class Streamed:
    start: float  # perf_counter when the request was sent
    times: list[float]  # perf_counter when each token arrived
    pdd: dict[str, Any] = field(default_factory=dict)  # the last chunk's `pdd` object
    tokens: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None  # with include_usage: the usage chunk
    finish_reason: str | None = None
    logprob_tokens: int = 0  # tokens that came with their log-probability (logprobs asked)


async def stream_completion(session: aiohttp.ClientSession, url: str, prompt: list[int],
                            max_tokens: int, include_usage: bool = False,
                            extra: Mapping[str, Any] | None = None,
                            exact: bool = True) -> Streamed | str:
    """Greedy, `ignore_eos`, streamed: exactly `max_tokens` tokens, or why not (a string).
    ``extra`` adds request fields; with ``exact=False`` fewer tokens are an answer too (a
    grammar may end a request before `max_tokens`)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True, **(extra or {})}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    out = Streamed(time.perf_counter(), [])
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            return f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                return f"stream error: {str(msg['error'])[:200]}"
            for choice in msg.get("choices") or ():
                ids = choice.get("token_ids") or []
                out.times.extend([time.perf_counter()] * len(ids))
                out.tokens.extend(ids)
                lp = choice.get("logprobs")
                if isinstance(lp, dict):
                    out.logprob_tokens += sum(v is not None
                                              for v in lp.get("token_logprobs") or ())
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            if isinstance(msg.get("pdd"), dict):
                out.pdd = msg["pdd"]
            if msg.get("usage"):
                out.usage = msg["usage"]
    if exact and len(out.times) != max_tokens:
        return f"{len(out.times)} tokens"
    if include_usage and out.usage is None:
        return "no usage chunk"
    return out


def rotated_rounds(items: list[str], rounds: int) -> list[tuple[int, str]]:
    """``(round, item)`` for each of ``rounds`` rounds of every item, the order rotated each
    round: stacks of one run differ by several % (which CPUs, the first one on a cold device),
    so a bench that starts one per setting never lets one setting always go first."""
    return [(r, items[(r + i) % len(items)]) for r in range(rounds) for i in range(len(items))]


def stage_medians(timings: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The median of each `pdd.timing` stage (and the TTFT) over the requests that report it."""
    timings = list(timings)
    return {k: statistics.median(vals) for k in TIMING_NAMES
            if (vals := [t[k] for t in timings if k in t])}


def instance_pool(url: str) -> dict[str, Any]:
    """The KV pool an instance sized at start (its /v1/info ``kv_pool``): blocks, block_size,
    dcp, tokens, bytes_per_rank, longest_sequence_tokens, sized_by."""
    with urllib.request.urlopen(f"{url}/v1/info", timeout=10) as resp:
        pool: dict[str, Any] = json.loads(resp.read())["kv_pool"]
    return pool


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value for the pdd_* samples of a Prometheus exposition."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def sample_probes(urls: dict[str, str], interval_s: float, stop: Any, results: Any,
                  polling: Any) -> None:
    """A probe sampler's process (bench/serve_path.py ``ProbeSampler``): polls ``urls`` every
    ``interval_s`` (``polling`` set after the first round) until ``stop``, then puts what it
    saw on ``results``."""
    latencies: list[float] = []
    worst: dict[str, float] = {}
    worst_at: dict[str, float] = {}  # seconds after the first round: a burst's or steady?
    failures = 0
    start = 0.0

    async def run() -> None:
        nonlocal failures, start
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not stop.is_set():
                for url, name in urls.items():
                    t = time.perf_counter()
                    try:
                        async with session.get(url) as resp:
                            await resp.read()
                            ok = resp.status == 200
                    except (aiohttp.ClientError, TimeoutError):
                        ok = False
                    ms = (time.perf_counter() - t) * 1e3
                    latencies.append(ms)
                    if ms > worst.get(name, -1.0):
                        worst[name] = ms
                        worst_at[name] = t - start if start else 0.0
                    failures += not ok
                if not polling.is_set():
                    start = time.perf_counter()
                polling.set()
                await asyncio.sleep(interval_s)

    asyncio.run(run())
    results.put({"latencies_ms": latencies, "worst_ms": worst, "worst_at_s": worst_at,
                 "failures": failures})
