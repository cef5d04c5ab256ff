"""Runtime behaviour around the hand-off: router features, discovery, health, readiness, metrics."""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
import torch  # noqa: F401  (the tier needs it; never skip)
from runtime_fixtures import LocalCluster, Proc, error_text, http  # noqa: E402

from pdd_api.plan import SidePlan  # noqa: E402
from pdd_api.routing import plan_routing  # noqa: E402

pytestmark = pytest.mark.dataplane

BLOCK = 16


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    cluster = LocalCluster(tmp_path_factory.mktemp("runtime"))
    try:
        plan = plan_routing(SidePlan(tensor_parallel_size=2, decode_context_parallel_size=1),
                            SidePlan(tensor_parallel_size=1, decode_context_parallel_size=1),
                            BLOCK)
        routing = cluster.plan_file(plan.to_json())
        prefill = cluster.instance("prefill", 2, 1, routing, BLOCK)
        # decode-0 must handshake its prefill peer before it reports ready.
        d0 = cluster.instance("decode", 1, 1, routing, BLOCK, PDD_PREFILL_URLS=prefill.url)
        d1 = cluster.instance("decode", 1, 1, routing, BLOCK, replica=1,
                              PDD_PREFILL_URLS=prefill.url)
        prefill_port = prefill.url.rsplit(":", 1)[1]
        # Prefill replicas from DNS: "localhost" may also resolve to ::1, where nothing
        # listens; the router must skip that replica as unhealthy.
        router = cluster.router([], [d0, d1], PDD_PREFILL_URLS="",
                                PDD_PREFILL_SERVICE=f"localhost:{prefill_port}",
                                PDD_ROUTER_POLICY="round-robin")
        for p in (prefill, d0, d1, router):
            p.wait_ready()
        yield {"prefill": prefill, "d0": d0, "d1": d1, "router": router}
    finally:
        cluster.close()


def _reference(prompt: list[int], n: int) -> list[int]:
    from pdd_sidecar.engine.generate import generate

    return generate("builtin", prompt, n, block_size=BLOCK)


def test_text_prompt_goes_through_the_byte_tokenizer(deployment: dict[str, Proc]) -> None:
    from pdd_sidecar.serve.openai import tokenizer

    status, body = http("POST", f"{deployment['router'].url}/v1/completions",
                        {"prompt": "Disaggregated prefill and decode.", "max_tokens": 8,
                         "temperature": 0})
    assert status == 200, body
    want = _reference(tokenizer.encode("Disaggregated prefill and decode."), 8)
    assert body["choices"][0]["token_ids"] == want
    assert body["choices"][0]["text"] == tokenizer.decode(want)
    assert body["usage"]["prompt_tokens"] == len("Disaggregated prefill and decode.")


def test_streaming_returns_the_same_tokens_one_event_each(deployment: dict[str, Proc]) -> None:
    prompt = [(i * 7) % 256 for i in range(40)]
    req = urllib.request.Request(
        f"{deployment['router'].url}/v1/completions",
        data=json.dumps({"prompt": prompt, "max_tokens": 10, "stream": True,
                         "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    events: list[Any] = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]"
    tokens = [e["choices"][0]["token_ids"][0] for e in events[:-1] if "choices" in e]
    assert tokens == _reference(prompt, 10)
    assert not [e for e in events[:-1] if "error" in e]


def test_single_token_request_releases_the_prefill_blocks(deployment: dict[str, Proc]) -> None:
    status, body = http("POST", f"{deployment['router'].url}/v1/completions",
                        {"prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0})
    assert status == 200 and body["choices"][0]["token_ids"] == _reference([5, 6, 7], 1)
    assert body["pdd"]["decode"] is None
    held = None
    for _ in range(100):
        status, stats = http("GET", f"{deployment['prefill'].url}/v1/stats")
        held = [r["held_requests"] for r in stats["ranks"]]
        if held == [0, 0]:
            break
        threading.Event().wait(0.05)
    assert held == [0, 0] and stats["leases"]["expired_total"] == 0


def test_bad_requests_are_refused_with_a_reason(deployment: dict[str, Proc]) -> None:
    router = deployment["router"].url
    for body, fragment in (({"prompt": [], "max_tokens": 4}, "prompt"),
                           ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
                           ({"prompt": [1, -2]}, "prompt")):
        status, answer = http("POST", f"{router}/v1/completions", body)
        assert status == 400 and fragment in error_text(answer)
    status, answer = http("POST", f"{deployment['d0'].url}/v1/decode", {"first_token": 1})
    assert status == 400 and "kv_transfer_params" in error_text(answer)


def _metric(text: str, name: str, labels: str = "") -> float:
    label = re.escape("{" + labels + "}") if labels else ""
    pattern = r"(?m)^" + re.escape(name) + label + r" (\S+)"
    found = re.search(pattern, text)
    assert found, f"{name}{{{labels}}} not in /metrics"
    return float(found.group(1))


def test_metrics_count_requests_bytes_and_descriptors(deployment: dict[str, Proc]) -> None:
    router = deployment["router"].url

    def counters() -> tuple[float, float]:
        total_bytes = total_descs = 0.0
        for d in ("d0", "d1"):
            _, text = http("GET", f"{deployment[d].url}/metrics")
            if "pdd_kv_transfer_bytes_total{" in text:
                total_bytes += _metric(text, "pdd_kv_transfer_bytes_total", 'rank="0"')
                total_descs += _metric(text, "pdd_kv_transfer_descriptors_total", 'rank="0"')
                assert _metric(text, "pdd_kv_transfer_seconds_count", 'rank="0"') >= 1
                assert _metric(text, "pdd_requests_total",
                               'endpoint="decode",outcome="ok",role="decode"') >= 1
        return total_bytes, total_descs

    before_bytes, before_descs = counters()
    moved = descs = 0
    for n in (3, 33):
        status, body = http("POST", f"{router}/v1/completions",
                            {"prompt": list(range(n)), "max_tokens": 3, "temperature": 0})
        assert status == 200, body
        moved += body["pdd"]["transfer"]["bytes"]
        descs += body["pdd"]["transfer"]["descriptors"]
        # Prefill and decode on the CPU: no device copy is possible, every rank reads over NIXL.
        assert body["pdd"]["transfer"]["path"] == "nixl"
        assert {r["path"] for r in body["pdd"]["transfer"]["ranks"]} == {"nixl"}
    assert moved == (3 + 33) * 3 * 40 * 4  # tokens x layers x latent x float32
    total_bytes, total_descs = counters()
    total_bytes -= before_bytes
    total_descs -= before_descs
    assert total_bytes == moved and total_descs == descs
    paths = 0.0
    for d in ("d0", "d1"):
        _, text = http("GET", f"{deployment[d].url}/metrics")
        assert 'pdd_kv_transfer_path_total{path="cuda_ipc"}' not in text
        if 'pdd_kv_transfer_path_total{path="nixl"}' in text:
            paths += _metric(text, "pdd_kv_transfer_path_total", 'path="nixl"')
    assert paths >= 2
    _, text = http("GET", f"{deployment['prefill'].url}/metrics")
    assert _metric(text, "pdd_lease_expiries_total") == 0
    # What the autoscaling planner reads from an instance, through the operator's own parser.
    from pdd_operator.autoscale_metrics import parse_instance
    gauges = parse_instance(text)
    assert gauges.queued_prompt_tokens == _metric(text, "pdd_queued_prompt_tokens") == 0
    assert gauges.blocks_total == _metric(text, "pdd_kv_blocks_total", 'rank="0"') > 0
    assert _metric(text, "pdd_requests_total",
                   'endpoint="prefill",outcome="ok",role="prefill"') >= 2
    _, text = http("GET", f"{router}/metrics")
    assert _metric(text, "pdd_router_requests_total", 'outcome="ok"') >= 2
    for p in deployment.values():
        assert http("GET", f"{p.url}/healthz")[0] == 200


def test_router_round_robins_and_skips_a_dead_decode_replica(
    deployment: dict[str, Proc]
) -> None:
    router = deployment["router"].url
    used = set()
    for _ in range(4):
        status, body = http("POST", f"{router}/v1/completions",
                            {"prompt": [1, 2, 3, 4], "max_tokens": 2, "temperature": 0})
        assert status == 200, body
        used.add(body["pdd"]["decode"])
    assert used == {deployment["d0"].url, deployment["d1"].url}
    deployment["d1"].kill()
    for _ in range(200):
        _, ready = http("GET", f"{router}/readyz")
        if ready["decode"].get(deployment["d1"].url) is False:
            break
        threading.Event().wait(0.05)
    for _ in range(4):
        status, body = http("POST", f"{router}/v1/completions",
                            {"prompt": [1, 2, 3, 4], "max_tokens": 2, "temperature": 0})
        assert status == 200, body
        assert body["pdd"]["decode"] == deployment["d0"].url


def test_decode_is_not_ready_until_its_prefill_peer_answers(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path)
    try:
        plan = plan_routing(SidePlan(tensor_parallel_size=1, decode_context_parallel_size=1),
                            SidePlan(tensor_parallel_size=1, decode_context_parallel_size=1),
                            BLOCK)
        routing = cluster.plan_file(plan.to_json())
        from runtime_fixtures import free_ports

        future = f"http://127.0.0.1:{free_ports(1)}"
        decode = cluster.instance("decode", 1, 1, routing, BLOCK, PDD_PREFILL_URLS=future)
        reason = ""
        for _ in range(600):
            try:
                status, body = http("GET", f"{decode.url}/readyz")
            except OSError:
                status, body = 0, {}
            reason = body.get("reason", "") if isinstance(body, dict) else ""
            if future in reason:
                break
            threading.Event().wait(0.1)
        assert status == 503 and future in reason
        port = future.rsplit(":", 1)[1]
        prefill = cluster.instance("prefill", 1, 1, routing, BLOCK, PDD_HTTP_PORT=port)
        prefill.url = future
        prefill.wait_ready()
        body = decode.wait_ready()
        assert body["peers"] == {future: "ok"}
    finally:
        cluster.close()


def test_sigterm_drains_held_kv_before_exiting(tmp_path: Path) -> None:
    import os
    import signal

    cluster = LocalCluster(tmp_path)
    try:
        plan = plan_routing(SidePlan(tensor_parallel_size=2, decode_context_parallel_size=2),
                            SidePlan(tensor_parallel_size=1, decode_context_parallel_size=1),
                            BLOCK)
        routing = cluster.plan_file(plan.to_json())
        prefill = cluster.instance("prefill", 2, 2, routing, BLOCK, PDD_LEASE_SECONDS=300,
                                   PDD_DRAIN_S=120)
        prefill.wait_ready()
        status, pre = http("POST", f"{prefill.url}/v1/prefill",
                           {"request_id": "held", "prompt_ids": list(range(40))})
        assert status == 200, pre
        os.kill(prefill.process.pid, signal.SIGTERM)
        body: Any = {}
        for _ in range(200):
            status, body = http("GET", f"{prefill.url}/readyz")
            if status == 503:
                break
            threading.Event().wait(0.05)
        assert status == 503 and "draining" in body["reason"]
        # Still holding KV for a decode: it must not have gone away, nor take new work.
        assert prefill.alive()
        status, refused = http("POST", f"{prefill.url}/v1/prefill",
                               {"request_id": "late", "prompt_ids": [1, 2]})
        assert status == 503 and "draining" in error_text(refused)
        status, refused = http("POST", f"{prefill.url}/v1/release", {"request_id": "held"})
        assert status == 403 and "kv_transfer_params" in error_text(refused)  # needs the grant
        status, released = http("POST", f"{prefill.url}/v1/release",
                                {"kv_transfer_params": pre["kv_transfer_params"]})
        assert status == 200 and released == {"released": True}
        prefill.process.join(60)
        assert prefill.process.exitcode == 0
    finally:
        cluster.close()
