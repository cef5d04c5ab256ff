"""Prefixes under real load, through the router: a busy prefill keeps its prefix's requests
until the cache-aware policy's overload allowance is spent; a prompt that shares a prefix still
being computed waits for those blocks, never reads them early; a burst sharing an uncached
prefix computes it once. The prefills' steps are slowed (PDD_FAULT_STEP_DELAY_S) so that work
stays in flight; what is asserted comes from counters and answers, not from timing."""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
from runtime_fixtures import LocalCluster, Proc, http, plan_json, reference_tokens

pytestmark = pytest.mark.dataplane

BLOCK = 16


def _tokens(n: int, salt: int) -> list[int]:
    return [(i * 61 + salt * 37 + (i // 7) * salt + 3) % 256 for i in range(n)]


def _metric(url: str, name: str) -> float:
    _, text = http("GET", f"{url}/metrics")
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _complete(router: str, prompt: list[int], max_tokens: int = 3) -> dict[str, Any]:
    status, body = http("POST", f"{router}/v1/completions",
                        {"prompt": prompt, "temperature": 0, "max_tokens": max_tokens},
                        timeout=300)
    assert status == 200, body
    return body  # type: ignore[no-any-return]


def _stack(cluster: LocalCluster, prefills: int, **prefill_env: Any) -> dict[str, Any]:
    routing = cluster.plan_file(plan_json((1, 1), (1, 1), BLOCK))
    p = [cluster.instance("prefill", 1, 1, routing, BLOCK, replica=i, **prefill_env)
         for i in range(prefills)]
    d = cluster.instance("decode", 1, 1, routing, BLOCK,
                         PDD_PREFILL_URLS=",".join(x.url for x in p))
    router = cluster.router(p, [d], PDD_BLOCK_SIZE=BLOCK)
    for proc in (*p, d, router):
        proc.wait_ready()
    return {"prefill": p, "decode": d, "router": router}


def test_a_busy_prefill_keeps_its_prefix_until_the_overload_allowance_is_spent(
        cluster: LocalCluster) -> None:
    """Requests of one cached prefix, all in flight at once on its slowed prefill: the policy
    sends them there while its busy count exceeds the idle one's by at most `balance_abs`,
    then to the other (which, holding the prefix now too and less busy, takes the rest)."""
    from pdd_sidecar.serve.router.routing_policy import CacheAware

    allowance = CacheAware(BLOCK).balance_abs  # the router's default policy
    stack = _stack(cluster, 2, PDD_FAULT_STEP_DELAY_S=3)
    router = stack["router"].url
    prefix = _tokens(4 * BLOCK, 1)
    home = _complete(router, prefix + [1, 2, 3])["pdd"]["prefill"]
    (other,) = {p.url for p in stack["prefill"]} - {home}
    n = allowance + 4
    prompts = [prefix + _tokens(3 + i, 10 + i) for i in range(n)]
    start = threading.Barrier(n)

    def one(prompt: list[int]) -> dict[str, Any]:
        start.wait()
        return _complete(router, prompt)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        bodies = list(pool.map(one, prompts))
    went = [b["pdd"]["prefill"] for b in bodies]
    # Each is routed while the others are in flight (a step there takes 3 s): busy counts of
    # 0..allowance stay home, the next one goes, and the rest follow it to the less busy.
    assert went.count(home) == allowance + 1, went
    assert went.count(other) == n - allowance - 1, went
    for prompt, body in zip(prompts, bodies, strict=True):
        assert body["choices"][0]["token_ids"] == reference_tokens(prompt, 3, BLOCK)


@pytest.fixture
def slow_chunks(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """One prefill computing prompts a block at a time, each step half a second."""
    c = LocalCluster(tmp_path)
    try:
        yield _stack(c, 1, PDD_CHUNK_TOKENS=BLOCK, PDD_FAULT_STEP_DELAY_S=0.5)
    finally:
        c.close()


def _computed(prefill: Proc) -> float:
    return _metric(prefill.url, "pdd_prefill_computed_tokens_total")


def _mid_prefill(router: str, prefill: Proc, prompt: list[int]
                 ) -> tuple[concurrent.futures.Future[dict[str, Any]], float]:
    """Send ``prompt`` and return once its first chunk is computed (the prefill's counter
    says so), with the counter before it."""
    before = _computed(prefill)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(_complete, router, prompt)
    pool.shutdown(wait=False)
    deadline = time.monotonic() + 120
    while _computed(prefill) - before < BLOCK:
        assert time.monotonic() < deadline and not fut.done(), "the long prompt never started"
        time.sleep(0.02)
    return fut, before


def test_a_prompt_sharing_a_prefix_mid_prefill_waits_for_its_blocks(
        slow_chunks: dict[str, Any]) -> None:
    """A long prompt runs a block per step; a prompt sharing its first six blocks arrives after
    its first one: it waits for the shared blocks (taking all six from the cache), never reads
    one whose chunk has not run (its tokens are those of a run from scratch), and nothing is
    computed twice."""
    router, prefill = slow_chunks["router"].url, slow_chunks["prefill"][0]
    long = _tokens(12 * BLOCK + 3, 2)
    fut, before = _mid_prefill(router, prefill, long)
    assert _computed(prefill) - before <= 3 * BLOCK  # the shared part is still being computed
    shared = 6 * BLOCK
    short = long[:shared] + _tokens(5, 3)
    body = _complete(router, short)
    assert body["choices"][0]["token_ids"] == reference_tokens(short, 3, BLOCK)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
    first = fut.result(timeout=300)
    assert first["choices"][0]["token_ids"] == reference_tokens(long, 3, BLOCK)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _computed(prefill) - before == len(long) + len(short) - shared


def test_requests_arriving_together_compute_their_shared_prefix_once(
        slow_chunks: dict[str, Any]) -> None:
    """16 prompts of 4 blocks sharing their first 3, sent at once while the prefill is busy
    (so they are admitted together): the shared blocks are computed once, every prompt's own
    block once, and the tokens are those of runs from scratch."""
    router, prefill = slow_chunks["router"].url, slow_chunks["prefill"][0]
    blocker = _tokens(8 * BLOCK, 4)
    fut, before = _mid_prefill(router, prefill, blocker)
    system = _tokens(3 * BLOCK, 5)
    prompts = [system + _tokens(BLOCK, 100 + i) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        bodies = list(pool.map(lambda q: _complete(router, q), prompts))
    fut.result(timeout=300)
    distinct = len(system) + sum(len(q) - len(system) for q in prompts)
    computed = _computed(prefill) - before - len(blocker)
    assert distinct <= computed <= 1.05 * distinct, (computed, distinct)
    cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies]
    assert sorted(cached) == [0] + [len(system)] * 15, cached
    for prompt, body in zip(prompts, bodies, strict=True):
        assert body["choices"][0]["token_ids"] == reference_tokens(prompt, 3, BLOCK)
