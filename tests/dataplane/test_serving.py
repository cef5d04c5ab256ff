"""The serving engine behind the router: concurrent requests batched into one forward pass give
each the tokens it gets alone; admission by KV blocks (dcp = N holds N times the sequences);
a bounded queue (429); sampling reproducible by seed; stops; cancellation frees every block; a
request waiting for its KV does not stall the running batch."""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
from runtime_fixtures import (
    LocalCluster,
    Proc,
    error_text,
    http,
    pd_stack,
    plan_json,
    reference_tokens,
)

pytestmark = pytest.mark.dataplane

BLOCK = 16


def _plan(p: tuple[int, int], d: tuple[int, int]) -> str:
    return plan_json(p, d, BLOCK)


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 53 + salt * 29 + 7) % 256 for i in range(n)]


def _reference(prompt: list[int], max_tokens: int) -> list[int]:
    return reference_tokens(prompt, max_tokens, BLOCK)


def _stack(cluster: LocalCluster, p: tuple[int, int], d: tuple[int, int],
           **decode_env: Any) -> dict[str, Proc]:
    return pd_stack(cluster, p, d, BLOCK, decode_env=decode_env)


def _complete(router: str, body: dict[str, Any]) -> tuple[int, Any]:
    return http("POST", f"{router}/v1/completions", body, timeout=300)


def _metric(url: str, name: str) -> list[tuple[str, float]]:
    _, text = http("GET", f"{url}/metrics")
    return [(m.group(1) or "", float(m.group(2)))
            for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)]


def _free(url: str) -> tuple[list[int], int]:
    status, stats = http("GET", f"{url}/v1/stats")
    assert status == 200, stats
    return [r["free_blocks"] for r in stats["ranks"]], stats["num_blocks"]


def _all_blocks_back(*urls: str, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        states = [_free(u) for u in urls]
        if all(all(f == total for f in free) for free, total in states):
            return
        assert time.monotonic() < deadline, f"blocks still held: {states}"
        time.sleep(0.1)


@pytest.mark.parametrize("p,d", [((2, 2), (2, 2)), ((1, 1), (2, 2)), ((2, 2), (2, 1))])
def test_concurrent_requests_get_exactly_the_tokens_each_gets_alone(
        tmp_path: Path, p: tuple[int, int], d: tuple[int, int]) -> None:
    """Through `pdd serve` (its library: the same processes, ports and plan)."""
    from pdd_sidecar.serve.local_stack import LocalStack, StackConfig

    cfg = StackConfig(prefill_tp=p[0], prefill_dcp=p[1], decode_tp=d[0], decode_dcp=d[1],
                      port=0, block_size=BLOCK, log_level="WARNING")
    with LocalStack(cfg, tmp_path / "logs") as served:
        served.start(timeout_s=300)
        _batch_equals_alone(served.url, served.prefill_url, served.decode_url)


def _batch_equals_alone(router: str, prefill: str, decode: str) -> None:
    lengths = [3 + (i * 11) % 45 for i in range(32)]
    prompts = [_prompt(n, i) for i, n in enumerate(lengths)]
    max_tokens = [4 + i % 9 for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(
            lambda i: _complete(router, {"prompt": prompts[i], "temperature": 0,
                                         "max_tokens": max_tokens[i]}),
            range(32)))
    for i, (status, body) in enumerate(answers):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == _reference(prompts[i], max_tokens[i]), i
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == max_tokens[i]
    buckets = dict(_metric(decode, "pdd_batch_size_bucket"))
    steps = buckets['{le="+Inf"}']
    assert steps > buckets['{le="1.0"}'], "every decode step ran one sequence"
    _all_blocks_back(prefill, decode)


def test_admission_reserves_blocks_and_dcp_multiplies_what_fits() -> None:
    from pdd_sidecar.engine.scheduler import NeverFits, QueueFull, Scheduler, Sequence, State
    from pdd_sidecar.kv.cache import PagedKVCache

    def admitted(dcp: int) -> tuple[int, Scheduler, PagedKVCache]:
        cache = PagedKVCache(24, 1, BLOCK, 4)
        sched = Scheduler("decode", cache, BLOCK, dcp, 2, max_waiting=100)
        for i in range(40):  # 6 chunks of prompt + max_tokens each
            src = type("Src", (), {"num_tokens": 80})()
            sched.submit(Sequence(f"r{i}", [], 16, 96, source=src, first_token=1))
        plan = sched.plan()
        return len(plan.pulls), sched, cache

    one, _, _ = admitted(1)
    two, sched, cache = admitted(2)
    assert (one, two) == (4, 8)  # 24 blocks / 6 and 24 / 3: exactly twice
    assert cache.num_free == 0 and len(sched.waiting) == 32  # the rest wait, none refused
    for rank in (0, 1):
        sched.on_pulled("r0", rank, None)
    assert sched.running["r0"].state is State.RUNNING
    sched.cancel("r0")  # leaving frees its blocks at once; the head of the queue gets them
    assert cache.num_free == 3 and [s.id for s in sched.plan().pulls] == ["r8"]
    with pytest.raises(NeverFits, match="needs 25 KV blocks"):
        sched.submit(Sequence("huge", [], 8, 25 * 2 * BLOCK - 8))
    full = Scheduler("decode", PagedKVCache(4, 1, BLOCK, 4), BLOCK, 1, 1, max_running=1,
                     max_waiting=0)
    full.submit(Sequence("a", [], 4, 8, source=SRC))
    full.plan()
    with pytest.raises(QueueFull):
        full.submit(Sequence("b", [], 4, 8, source=SRC))


# Where a decode sequence pulls its prompt's KV from (one without a source is a prompt the decode
# prefills itself, engine/scheduler.py "Local prefill").
SRC = type("Src", (), {"num_tokens": 0})()


def test_the_queue_limit_counts_only_what_the_next_step_cannot_admit() -> None:
    from pdd_sidecar.engine.scheduler import QueueFull, Scheduler, Sequence
    from pdd_sidecar.kv.cache import PagedKVCache

    # A burst that arrives between two steps: 2 running slots, 1 waiting place.
    by_slots = Scheduler("decode", PagedKVCache(24, 1, BLOCK, 4), BLOCK, 1, 1, max_running=2,
                         max_waiting=1)
    for i in range(3):
        by_slots.submit(Sequence(f"r{i}", [], 4, 8, source=SRC))
    with pytest.raises(QueueFull, match="1 requests already waiting \\(limit 1\\)"):
        by_slots.submit(Sequence("r3", [], 4, 8, source=SRC))
    assert len(by_slots.plan().pulls) == 2 and len(by_slots.waiting) == 1
    # Blocks for two (3 each), slots for all: the third waits, the fourth is refused.
    by_blocks = Scheduler("decode", PagedKVCache(6, 1, BLOCK, 4), BLOCK, 1, 1, max_waiting=1)
    for i in range(3):
        by_blocks.submit(Sequence(f"r{i}", [], 4, 3 * BLOCK, source=SRC))
    with pytest.raises(QueueFull):
        by_blocks.submit(Sequence("r3", [], 4, 3 * BLOCK, source=SRC))
    assert len(by_blocks.plan().pulls) == 2 and len(by_blocks.waiting) == 1


def test_kv_capacity_bounds_the_running_batch_and_the_queue_answers_429(
        cluster: LocalCluster) -> None:
    # 12 blocks per rank, each request needs 3 chunks (dcp 1): at most 4 run at once (the
    # prefix cache off: one request's cached prompt would let a fifth share its blocks).
    stack = _stack(cluster, (1, 1), (1, 1), PDD_NUM_BLOCKS=12, PDD_MAX_WAITING=4,
                   PDD_PREFIX_CACHE="0")
    prompt = _prompt(20)
    peak = {"running": 0.0, "waiting": 0.0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for key in peak:
                for _, v in _metric(stack["decode"].url, f"pdd_{key}_sequences"):
                    peak[key] = max(peak[key], v)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(
                lambda _: _complete(stack["router"].url, {"prompt": prompt, "temperature": 0,
                                                          "max_tokens": 26}), range(16)))
    finally:
        stop.set()
        watcher.join()
    statuses = sorted(s for s, _ in answers)
    assert set(statuses) <= {200, 429}, answers
    assert statuses.count(429) >= 1 and statuses.count(200) >= 5, statuses
    for status, body in answers:
        if status == 200:
            assert body["choices"][0]["token_ids"] == _reference(prompt, 26)
        else:
            assert "waiting" in error_text(body), body
    assert peak["running"] <= 4 and peak["waiting"] >= 1, peak
    _all_blocks_back(stack["prefill"].url, stack["decode"].url)


def test_a_full_decode_queue_answers_429_with_retry_after(cluster: LocalCluster) -> None:
    stack = _stack(cluster, (1, 1), (1, 1), PDD_MAX_NUM_SEQS=1, PDD_MAX_WAITING=0)
    url = f"{stack['router'].url}/v1/completions"
    long_body = json.dumps({"prompt": _prompt(10), "max_tokens": 200, "stream": True,
                            "temperature": 0}).encode()
    req = urllib.request.Request(url, data=long_body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = 0
        while events < 2:  # the prefill's token, then the decode's first: the long one runs
            events += resp.readline().startswith(b"data:")
        refused = urllib.request.Request(url, method="POST",
                                         data=json.dumps({"prompt": [1, 2], "max_tokens": 5})
                                         .encode(), headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(refused, timeout=60)
            raise AssertionError("a second request was admitted past max_num_seqs 1")
        except urllib.error.HTTPError as exc:
            assert exc.code == 429
            assert int(exc.headers["Retry-After"]) >= 1
            assert "waiting" in error_text(json.loads(exc.read()))
    _all_blocks_back(stack["prefill"].url, stack["decode"].url)


def test_seeded_sampling_reproducible_and_stop_ids_end_with_stop(cluster: LocalCluster) -> None:
    stack = _stack(cluster, (2, 2), (2, 2))
    router = stack["router"].url
    prompt = _prompt(30, 5)
    hot = {"prompt": prompt, "max_tokens": 12, "temperature": 1.3, "top_p": 0.95,
           "top_k": 40}
    a = _complete(router, {**hot, "seed": 7})
    b = _complete(router, {**hot, "seed": 7})
    c = _complete(router, {**hot, "seed": 8})
    assert a[0] == b[0] == c[0] == 200
    ids = [x[1]["choices"][0]["token_ids"] for x in (a, b, c)]
    assert ids[0] == ids[1] and ids[0] != ids[2]
    greedy = _reference(prompt, 12)
    status, body = _complete(router, {"prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert body["choices"][0]["token_ids"] == greedy
    stop_at = next(i for i in range(2, 12) if greedy[i] not in greedy[:i])
    status, body = _complete(router, {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                      "stop_token_ids": [greedy[stop_at]]})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == greedy[:stop_at + 1] and choice["finish_reason"] == "stop"
    _all_blocks_back(stack["prefill"].url, stack["decode"].url)


def test_a_request_no_decode_can_hold_is_refused_before_any_prefill(
        cluster: LocalCluster) -> None:
    """8 blocks of 16 tokens on each of 2 DCP ranks hold 256 tokens of one sequence: 250
    prompt tokens + 8 is refused with a 400 naming max_tokens, and the prefill never ran it;
    + 7 fits exactly and is served."""
    stack = _stack(cluster, (1, 1), (2, 2), PDD_NUM_BLOCKS=8)
    router, prefill = stack["router"].url, stack["prefill"].url
    # Ready means the router's probe saw the decode ready, and with it its capacity.
    def prefills() -> float:  # the router's warm round trip ran one before ready
        return sum(v for labels, v in _metric(prefill, "pdd_requests_total")
                   if 'endpoint="prefill"' in labels)

    # The pools as set at start (the fixture's 256 blocks on the prefill); /v1/models serves
    # what the decode holds (every block of both DCP ranks, and the unfed last token).
    _, dec_info = http("GET", f"{stack['decode'].url}/v1/info")
    _, pre_info = http("GET", f"{prefill}/v1/info")
    assert dec_info["kv_pool"] == {"blocks": 8, "block_size": BLOCK, "dcp": 2, "tokens": 256,
                                   "bytes_per_rank": dec_info["kv_pool"]["bytes_per_rank"],
                                   "reserved_blocks": 0, "longest_sequence_tokens": 256,
                                   "sized_by": "explicit"}
    assert pre_info["kv_pool"]["blocks"] == pre_info["num_blocks"] == 256
    assert pre_info["kv_capacity_tokens"] == pre_info["kv_pool"]["tokens"] == 256 * BLOCK
    assert pre_info["kv_pool"]["bytes_per_rank"] == 32 * dec_info["kv_pool"]["bytes_per_rank"]
    assert dict(_metric(stack["decode"].url, "pdd_kv_pool_tokens")) == {"": 256.0}
    assert dict(_metric(stack["decode"].url, "pdd_kv_pool_longest_sequence_tokens")) == {
        "": 256.0}
    assert dict(_metric(stack["decode"].url, "pdd_kv_blocks_total")) == {
        '{rank="0"}': 8.0, '{rank="1"}': 8.0}
    assert dict(_metric(prefill, "pdd_kv_pool_bytes"))['{rank="0"}'] == pre_info["kv_pool"][
        "bytes_per_rank"]
    _, models = http("GET", f"{router}/v1/models")
    assert models["data"][0]["max_model_len"] == 257, models
    before = prefills()
    status, body = _complete(router, {"prompt": _prompt(250), "max_tokens": 8})
    assert status == 400, body
    assert body["error"]["param"] == "max_tokens", body
    assert "hold at most 256 tokens" in error_text(body) and "needs 257" in error_text(body)
    assert prefills() == before, "the prefill ran it"
    status, body = _complete(router, {"prompt": _prompt(250), "max_tokens": 7,
                                      "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == _reference(_prompt(250), 7)
    _all_blocks_back(prefill, stack["decode"].url)


def test_a_client_that_disconnects_frees_its_blocks_on_both_sides(
        cluster: LocalCluster) -> None:
    stack = _stack(cluster, (2, 2), (2, 2))
    host, port = stack["router"].url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": _prompt(40), "max_tokens": 400, "stream": True,
                       "temperature": 0}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while got.count(b"data:") < 3:
            got += s.recv(4096)
    # Gone after 3 tokens of 400: both sides give every block back long before 400 steps.
    _all_blocks_back(stack["prefill"].url, stack["decode"].url, within_s=5.0)
    generated = sum(v for _, v in _metric(stack["decode"].url, "pdd_tokens_total"))
    assert generated < 200, generated


def test_a_request_waiting_for_its_kv_does_not_stall_the_running_batch(
        cluster: LocalCluster) -> None:
    # Every KV pull of this decode takes 3 s more (a slow hand-off).
    stack = _stack(cluster, (1, 1), (1, 1), PDD_FAULT_PULL_DELAY_S=3)
    router = stack["router"].url
    req = urllib.request.Request(
        f"{router}/v1/completions", method="POST",
        data=json.dumps({"prompt": _prompt(10), "max_tokens": 2000, "stream": True,
                         "temperature": 0, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json"})
    stamps: list[float] = []
    late: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = 0
        while events < 2:  # the prefill's token, then the decode's first: running now
            events += resp.readline().startswith(b"data:")
        second = threading.Thread(target=lambda: late.update(answer=_complete(
            router, {"prompt": _prompt(12, 1), "max_tokens": 4, "temperature": 0})))
        start = time.monotonic()
        second.start()
        while time.monotonic() - start < 2.5:
            line = resp.readline()
            if line.startswith(b"data:"):
                stamps.append(time.monotonic() - start)
        second.join(60)
    status, body = late["answer"]
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == _reference(_prompt(12, 1), 4)
    # Tokens kept coming while the second request's pull was in flight (0.5 s to 2.5 s in).
    assert sum(1 for s in stamps if 0.5 < s < 2.5) >= 5, stamps


def test_late_reads_of_released_blocks_are_errors_never_wrong_tokens(
        cluster: LocalCluster) -> None:
    """Leases of 2 s against hand-offs slowed by up to 2 s: blocks are released and reused while
    decodes wait to read them. Every 200 carries the reference tokens; the rest are refused.
    Bursts repeat (at most three) until both outcomes were seen, so a slow machine that makes
    one burst all-late still tests both paths."""
    routing = cluster.plan_file(_plan((2, 2), (2, 1)))
    prefill = cluster.instance("prefill", 2, 2, routing, BLOCK, PDD_LEASE_SECONDS=2,
                               PDD_NUM_BLOCKS=48)
    decode = cluster.instance("decode", 2, 1, routing, BLOCK, PDD_PREFILL_URLS=prefill.url,
                              PDD_FAULT_PULL_DELAY_S="0:2")
    router = cluster.router([prefill], [decode])
    for proc in (prefill, decode, router):
        proc.wait_ready()
    outcomes: dict[int, int] = {}
    for burst in range(3):
        prompts = [_prompt(17 + (i * 7) % 40, i + 100 * burst) for i in range(32)]
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(
                lambda p: _complete(router.url, {"prompt": p, "max_tokens": 4, "temperature": 0}),
                prompts))
        for prompt, (status, body) in zip(prompts, answers, strict=True):
            outcomes[status] = outcomes.get(status, 0) + 1
            if status == 200:
                assert body["choices"][0]["token_ids"] == _reference(prompt, 4)
            else:
                assert status in (410, 429), body
                assert error_text(body), body
        if outcomes.get(200, 0) and outcomes.get(410, 0):
            break
    assert outcomes.get(200, 0) >= 1 and outcomes.get(410, 0) >= 1, outcomes
    _all_blocks_back(prefill.url, decode.url, within_s=30)


def _vllm_proxy(prefill: str, decode: str, request: dict[str, Any]) -> tuple[int, Any]:
    """vLLM's documented proxy flow: prefill with max_tokens 1 and do_remote_decode, then the
    original request to the decode with the returned kv_transfer_params, one X-Request-Id."""
    rid = f"proxy-{time.monotonic_ns()}"
    leg = {**request, "stream": False, "max_tokens": 1, "max_completion_tokens": 1,
           "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                  "remote_engine_id": None, "remote_block_ids": None,
                                  "remote_host": None, "remote_port": None}}
    leg.pop("stream_options", None)

    def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json",
                                                             "X-Request-Id": rid})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                raw = resp.read().decode()
                if body.get("stream"):
                    return resp.status, [json.loads(line[6:]) for line in raw.splitlines()
                                         if line.startswith("data: {")]
                return resp.status, json.loads(raw)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, pre = post(prefill, leg)
    if status != 200:
        return status, pre
    params = pre["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == rid
    assert {"remote_engine_id", "remote_block_ids", "remote_host", "remote_port",
            "tp_size"} <= params.keys()
    return post(decode, {**request, "kv_transfer_params": params})


def test_a_proxy_speaking_vllms_protocol_drives_pdd_instances(cluster: LocalCluster) -> None:
    stack = _stack(cluster, (2, 2), (2, 1))
    prefill, decode = stack["prefill"].url, stack["decode"].url
    prompt = _prompt(37, 9)
    status, body = _vllm_proxy(prefill, decode, {"prompt": prompt, "max_tokens": 7,
                                                 "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == _reference(prompt, 7)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 37, "completion_tokens": 7, "total_tokens": 44,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    status, events = _vllm_proxy(prefill, decode, {"prompt": prompt, "max_tokens": 7,
                                                   "temperature": 0, "stream": True})
    assert status == 200, events
    streamed = [t for e in events for t in e["choices"][0]["token_ids"]]
    assert streamed == _reference(prompt, 7)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    # A plain request without the P/D parameters, and stop strings, are refused clearly.
    for url, request, field in ((prefill, {"prompt": prompt}, "kv_transfer_params"),
                                (decode, {"prompt": prompt}, "kv_transfer_params")):
        status, answer = http("POST", f"{url}/v1/completions", request)
        assert status == 400 and field in error_text(answer), answer
    status, answer = _vllm_proxy(prefill, decode, {"prompt": prompt, "stop": ["x"]})
    assert status == 400 and "stop" in error_text(answer)
    # The sampling controls reach both legs; what pdd does not implement is refused.
    forced = next(t for t in range(1, 100) if t not in _reference(prompt, 7))
    status, body = _vllm_proxy(prefill, decode, {"prompt": prompt, "max_tokens": 7,
                                                 "temperature": 0,
                                                 "logit_bias": {str(forced): 100}})
    assert status == 200 and body["choices"][0]["token_ids"] == [forced] * 7, body
    status, answer = _vllm_proxy(prefill, decode, {"prompt": prompt, "min_p": 0.1})
    assert status == 400 and "min_p" in error_text(answer)
    for field, value in (("logprobs", 2), ("echo", True), ("prompt_logprobs", 0),
                         ("temprature", 0), ("store", True), ("guided_whitespace_pattern", " ")):
        status, answer = _vllm_proxy(prefill, decode, {"prompt": prompt, field: value})
        assert status == 400 and field in error_text(answer), answer
    # What the proxy sends beside the table is read: max_completion_tokens bounds the
    # completion, stream_options.include_usage ends the stream with the counts.
    status, body = _vllm_proxy(prefill, decode, {"prompt": prompt, "max_completion_tokens": 5,
                                                 "temperature": 0})
    assert status == 200 and body["choices"][0]["token_ids"] == _reference(prompt, 5), body
    status, events = _vllm_proxy(prefill, decode, {"prompt": prompt, "max_tokens": 4,
                                                   "temperature": 0, "stream": True,
                                                   "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1]["choices"] == [], events
    assert events[-1]["usage"] == {"prompt_tokens": 37, "completion_tokens": 4,
                                   "total_tokens": 41}
    assert all(e["usage"] is None for e in events[:-1])
    for request, says in (({"max_tokens": 4, "max_completion_tokens": 6}, "differ"),
                          ({"stream": True, "stream_options": {"usage": True}},
                           "stream_options.usage")):
        status, answer = _vllm_proxy(prefill, decode, {"prompt": prompt, **request})
        assert status == 400 and says in error_text(answer), answer
    _all_blocks_back(prefill, decode)


def test_the_router_speaks_vllms_protocol_to_its_upstreams(cluster: LocalCluster) -> None:
    routing = cluster.plan_file(_plan((2, 2), (2, 2)))
    prefill = cluster.instance("prefill", 2, 2, routing, BLOCK)
    decode = cluster.instance("decode", 2, 2, routing, BLOCK, PDD_PREFILL_URLS=prefill.url)
    router = cluster.router([prefill], [decode], PDD_ROUTER_UPSTREAM_PROTOCOL="vllm")
    for proc in (prefill, decode, router):
        proc.wait_ready()
    for n, max_tokens in ((33, 9), (5, 1)):
        prompt = _prompt(n, max_tokens)
        status, body = _complete(router.url, {"prompt": prompt, "max_tokens": max_tokens,
                                              "temperature": 0})
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == _reference(prompt, max_tokens)
        assert body["choices"][0]["finish_reason"] == "length"
    # Again: the prefill's cache has its first whole unit (2 x 16 tokens), and says so.
    status, body = _complete(router.url, {"prompt": _prompt(33, 9), "max_tokens": 9,
                                          "temperature": 0})
    assert body["choices"][0]["token_ids"] == _reference(_prompt(33, 9), 9)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    # Structured output reaches the instances as vLLM's structured_outputs field.
    for extra in ({"guided_choice": ["yes", "no"]}, {"guided_regex": "[a-c]{3}"}):
        status, body = _complete(router.url, {"prompt": _prompt(12), "max_tokens": 6,
                                              "temperature": 1.0, "seed": 3, **extra})
        assert status == 200, body
        text = body["choices"][0]["text"]
        assert (text in ("yes", "no") if "guided_choice" in extra
                else len(text) == 3 and set(text) <= set("abc")), body
    # Log-probabilities and echo need pdd's own instance API: refused, never ignored.
    for field, value in (("logprobs", 1), ("echo", True)):
        status, body = _complete(router.url, {"prompt": _prompt(20), field: value})
        assert status == 400 and body["error"]["param"] == field, body
    req = urllib.request.Request(
        f"{router.url}/v1/completions", method="POST",
        data=json.dumps({"prompt": _prompt(20), "max_tokens": 6, "temperature": 0,
                         "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                  if line.startswith("data: {")]
    assert [t for e in events for t in e["choices"][0].get("token_ids") or []] == _reference(
        _prompt(20), 6)
    _all_blocks_back(prefill.url, decode.url)


def test_the_router_pairs_a_prefill_only_with_decodes_of_its_routing_plan(
        cluster: LocalCluster) -> None:
    routing = cluster.plan_file(_plan((1, 1), (1, 1)))
    other = cluster.plan_file(_plan((2, 2), (1, 1)), "other.json")
    prefill = cluster.instance("prefill", 1, 1, routing, BLOCK)
    same = cluster.instance("decode", 1, 1, routing, BLOCK, PDD_PREFILL_URLS=prefill.url)
    stale = cluster.instance("decode", 1, 1, other, BLOCK, replica=1)  # another plan
    router = cluster.router([prefill], [same, stale])
    for proc in (prefill, same, stale, router):
        proc.wait_ready()
    for i in range(6):
        prompt = _prompt(10 + i, i)
        status, body = _complete(router.url, {"prompt": prompt, "max_tokens": 3,
                                              "temperature": 0})
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == _reference(prompt, 3)
        assert body["pdd"]["decode"] == same.url
    assert not [v for _, v in _metric(stale.url, "pdd_requests_total") if v]
