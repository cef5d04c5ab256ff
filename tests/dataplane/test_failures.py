"""Failure behaviour of the runtime: dead or silent peers, abandoned requests, bad configuration.

Every test checks the failure is reported with the name of what failed, and that the surviving
instance gave back everything it allocated and still serves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
import torch  # noqa: F401  (the tier needs it; never skip)
from runtime_fixtures import (  # noqa: E402
    LocalCluster,
    error_text,
    free_ports,
    http,
    plan_json,
    unready_reason,
)

pytestmark = pytest.mark.dataplane

BLOCK = 16
NUM_BLOCKS = 64
REPO = Path(__file__).resolve().parents[2]


def _plan(p: tuple[int, int], d: tuple[int, int]) -> str:
    return plan_json(p, d, BLOCK)


def _prompt(n: int) -> list[int]:
    return [(i * 53 + 7) % 256 for i in range(n)]


def _all_free(url: str) -> list[int]:
    status, stats = http("GET", f"{url}/v1/stats")
    assert status == 200, stats
    return [r["free_blocks"] for r in stats["ranks"]]


def _reference(n: int, max_tokens: int) -> list[int]:
    from pdd_sidecar.engine.generate import generate

    return generate("builtin", _prompt(n), max_tokens, block_size=BLOCK)


def test_forged_or_foreign_grants_are_refused_and_a_dead_prefill_is_named(
    cluster: LocalCluster,
) -> None:
    routing = cluster.plan_file(_plan((2, 2), (2, 2)))
    prefill = cluster.instance("prefill", 2, 2, routing, BLOCK)
    decode = cluster.instance("decode", 2, 2, routing, BLOCK, PDD_NUM_BLOCKS=NUM_BLOCKS,
                              PDD_HANDSHAKE_TIMEOUT_S=1, PDD_PREFILL_URLS=prefill.url)
    prefill.wait_ready()
    decode.wait_ready()
    status, pre = http("POST", f"{prefill.url}/v1/prefill",
                       {"request_id": "r-forge", "prompt_ids": _prompt(40)})
    assert status == 200, pre
    grant = pre["kv_transfer_params"]
    from pdd_sidecar.kv.grants import sign

    dead = free_ports(2)
    forged = [
        ({k: v for k, v in grant.items() if k != "signature"}, "not signed"),
        ({**grant, "block_ids": [0, 1, 2]}, "signature does not match"),
        ({**grant, "host": "10.1.2.3"}, "signature does not match"),
        (sign({**grant, "side_channel_port": dead}, b"another deployment's key!"),
         "signature does not match"),
        (sign({**grant, "instance_id": "elsewhere"}, cluster.key),
         "not a prefill peer of this decode"),
        (sign({**grant, "expires_at": 1.0}, cluster.key), "expired"),
    ]
    for params, message in forged:
        status, body = http("POST", f"{decode.url}/v1/decode", {
            "request_id": "r-forge", "first_token": 1, "max_new_tokens": 4,
            "kv_transfer_params": params})
        assert status in (403, 410), body
        assert message in error_text(body), (message, body)
    assert _all_free(decode.url) == [NUM_BLOCKS, NUM_BLOCKS]
    # The genuine grant, after its prefill died: the claim names the prefill.
    prefill.kill()
    status, body = http("POST", f"{decode.url}/v1/decode", {
        "request_id": "r-forge", "first_token": pre["first_token"], "max_new_tokens": 4,
        "kv_transfer_params": grant}, timeout=60)
    assert status == 502, body
    assert prefill.url in error_text(body) and "unreachable" in error_text(body)
    assert _all_free(decode.url) == [NUM_BLOCKS, NUM_BLOCKS]
    status, text = http("GET", f"{decode.url}/metrics")
    assert 'pdd_kv_transfer_failures_total{reason="transfer"} 1.0' in text
    # By cause: the prefill was gone (its claim unreachable), not a failure on the wire.
    assert 'pdd_kv_handoff_failures_total{cause="peer_gone",role="decode"} 1.0' in text
    assert 'pdd_kv_handoff_failures_total{cause="transport_error",role="decode"} 0.0' in text
    # ... and it still serves a healthy prefill where the dead one was.
    fresh = cluster.instance("prefill", 2, 2, routing, BLOCK,
                             PDD_HTTP_PORT=prefill.env["PDD_HTTP_PORT"])
    router = cluster.router([fresh], [decode])
    fresh.wait_ready()
    router.wait_ready()
    status, body = http("POST", f"{router.url}/v1/completions",
                        {"prompt": _prompt(40), "max_tokens": 6, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == _reference(40, 6)


def test_prefill_killed_in_the_middle_of_a_transfer(cluster: LocalCluster,
                                                    tmp_path: Path) -> None:
    # P tp2/dcp2 -> D tp2/dcp1: every decode rank reads from both prefill ranks, so each
    # hand-off is two READs; the prefill instance dies between them.
    routing = cluster.plan_file(_plan((2, 2), (2, 1)))
    gate = tmp_path / "gate"
    prefill = cluster.instance("prefill", 2, 2, routing, BLOCK)
    decode = cluster.instance("decode", 2, 1, routing, BLOCK, PDD_NUM_BLOCKS=NUM_BLOCKS,
                              PDD_FAULT_READ_GATE=gate, PDD_TRANSFER_TIMEOUT_S=15,
                              PDD_PREFILL_URLS=prefill.url)
    prefill.wait_ready()
    decode.wait_ready()
    status, pre = http("POST", f"{prefill.url}/v1/prefill",
                       {"request_id": "r-kill", "prompt_ids": _prompt(70)})
    assert status == 200, pre
    result: dict[str, Any] = {}

    def run_decode() -> None:
        result["answer"] = http("POST", f"{decode.url}/v1/decode", {
            "request_id": "r-kill", "first_token": pre["first_token"], "max_new_tokens": 4,
            "kv_transfer_params": pre["kv_transfer_params"]}, timeout=120)

    thread = threading.Thread(target=run_decode)
    thread.start()
    reached = [Path(f"{gate}.reached.{r}") for r in range(2)]
    for _ in range(1200):
        if all(p.exists() for p in reached) or not thread.is_alive():
            break
        thread.join(0.05)
    assert all(p.exists() for p in reached), "decode ranks never finished their first READ"
    prefill.kill()
    gate.touch()
    thread.join(120)
    status, body = result["answer"]
    assert status == 502, body
    assert "NIXL READ failed" in error_text(body), body
    status, text = http("GET", f"{decode.url}/metrics")
    assert 'pdd_kv_handoff_failures_total{cause="transport_error",role="decode"} 1.0' in text
    side = pre["kv_transfer_params"]["side_channel_port"]
    assert f"127.0.0.1:{side}" in error_text(body) or f"127.0.0.1:{side + 1}" in error_text(body)
    assert _all_free(decode.url) == [NUM_BLOCKS, NUM_BLOCKS]
    # The decode instance keeps serving, from a new prefill instance.
    os.remove(gate)
    # Restarted where the decode looks for its peer (same address, a new instance).
    fresh = cluster.instance("prefill", 2, 2, routing, BLOCK, replica=1,
                             PDD_HTTP_PORT=prefill.env["PDD_HTTP_PORT"])
    fresh.wait_ready()
    status, pre = http("POST", f"{fresh.url}/v1/prefill",
                       {"request_id": "r-after", "prompt_ids": _prompt(30)})
    assert status == 200, pre
    gate.touch()  # let the gated ranks through at once
    status, body = http("POST", f"{decode.url}/v1/decode", {
        "request_id": "r-after", "first_token": pre["first_token"], "max_new_tokens": 5,
        "kv_transfer_params": pre["kv_transfer_params"]})
    assert status == 200, body
    assert [pre["first_token"], *body["token_ids"]] == _reference(30, 6)
    assert _all_free(decode.url) == [NUM_BLOCKS, NUM_BLOCKS]


def test_lease_frees_a_thousand_abandoned_requests(cluster: LocalCluster) -> None:
    routing = cluster.plan_file(_plan((2, 2), (1, 1)))
    prefill = cluster.instance("prefill", 2, 2, routing, BLOCK, PDD_NUM_BLOCKS=NUM_BLOCKS,
                               PDD_LEASE_SECONDS=0.3, PDD_NOTIF_POLL_S=0.05)
    prefill.wait_ready()
    errors: list[Any] = []

    def client(k: int) -> None:
        for i in range(k, 1000, 4):
            status, body = http("POST", f"{prefill.url}/v1/prefill",
                                {"request_id": f"abandoned-{i}", "prompt_ids": _prompt(20)})
            if status != 200:
                errors.append((i, status, body))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    stats: dict[str, Any] = {}
    for _ in range(300):
        status, stats = http("GET", f"{prefill.url}/v1/stats")
        if stats["leases"]["held"] == 0 and all(r["held_requests"] == 0 for r in stats["ranks"]):
            break
        threading.Event().wait(0.1)
    assert stats["leases"] == {"held": 0, "expired_total": 1000, "released_total": 0}
    assert _all_free(prefill.url) == [NUM_BLOCKS, NUM_BLOCKS]
    assert all(r["held_requests"] == 0 for r in stats["ranks"])
    status, text = http("GET", f"{prefill.url}/metrics")
    assert "pdd_lease_expiries_total 1000.0" in text
    # Nobody claimed them: expired, not a decode gone mid-READ.
    assert 'pdd_kv_handoff_failures_total{cause="lease_expired",role="prefill"} 1000.0' in text
    assert 'pdd_kv_handoff_failures_total{cause="peer_gone",role="prefill"} 0.0' in text


def _serve(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": f"{REPO / 'sidecar'}:{REPO / 'operator'}", **env}
    return subprocess.run([sys.executable, "-m", "pdd_sidecar", "serve"], env=full,
                          capture_output=True, text=True, timeout=120)


def _base_env(routing: Path, **extra: Any) -> dict[str, str]:
    env = {"PDD_ROLE": "decode", "PDD_REPLICA": "0", "PDD_TP_SIZE": "2", "PDD_DCP_SIZE": "2",
           "PDD_BLOCK_SIZE": str(BLOCK), "PDD_ROUTING_FILE": str(routing),
           "PDD_SIDE_CHANNEL_PORT": str(free_ports(2)), "PDD_HTTP_PORT": str(free_ports(1)),
           "POD_IP": "127.0.0.1", "PDD_BIND_HOST": "127.0.0.1"}
    key = routing.parent / "grant.key"
    if not key.exists():
        key.write_bytes(os.urandom(32).hex().encode())
    env["PDD_GRANT_KEY_FILE"] = str(key)
    env.update({k: str(v) for k, v in extra.items()})
    return {k: v for k, v in env.items() if v != ""}


def test_malformed_or_mismatched_routing_file_refuses_to_start(tmp_path: Path) -> None:
    routing = tmp_path / "routing.json"
    cases: list[tuple[str, dict[str, Any], str]] = []
    cases.append(("{not json", {}, "malformed routing plan"))
    good = json.loads(_plan((4, 4), (2, 2)))
    cases.append((json.dumps({**good, "blockSize": "big"}), {}, "blockSize"))
    unsound = json.loads(json.dumps(good))
    unsound["decodeRanks"][0]["reads"] = unsound["decodeRanks"][0]["reads"][:1]
    cases.append((json.dumps(unsound), {}, "decode rank 0 must read each chunk it holds"))
    cases.append((json.dumps(good), {"PDD_TP_SIZE": "4", "PDD_DCP_SIZE": "4"},
                  "decode.tensorParallelSize is 2, PDD_TP_SIZE is 4"))
    cases.append((json.dumps(good), {"PDD_BLOCK_SIZE": "64"},
                  "blockSize is 16, PDD_BLOCK_SIZE is 64"))
    cases.append((json.dumps(good), {"PDD_DCP_SIZE": "3"}, "PDD_DCP_SIZE: must be 1 or"))
    cases.append((json.dumps(good), {"PDD_EVENT_LOOP": "trio"},
                  "PDD_EVENT_LOOP: must be one of auto, uvloop, asyncio, got 'trio'"))
    for text, extra, message in cases:
        routing.write_text(text)
        done = _serve(_base_env(routing, **extra))
        assert done.returncode == 2, (message, done.stderr)
        assert message in done.stderr, (message, done.stderr)
        assert "refusing to start" in done.stderr
    done = _serve(_base_env(tmp_path / "missing.json"))
    assert done.returncode == 2 and "missing.json: cannot read" in done.stderr
    routing.write_text(json.dumps(good))
    done = _serve(_base_env(routing, PDD_GRANT_KEY_FILE=""))
    assert done.returncode == 2 and "PDD_GRANT_KEY_FILE: required" in done.stderr
    (tmp_path / "short.key").write_bytes(b"tiny")
    done = _serve(_base_env(routing, PDD_GRANT_KEY_FILE=tmp_path / "short.key"))
    assert done.returncode == 2 and "has 4 bytes; at least 16" in done.stderr


def test_metadata_mismatch_is_refused_naming_both_values(cluster: LocalCluster) -> None:
    routing = cluster.plan_file(_plan((1, 1), (2, 1)))
    prefill = cluster.instance("prefill", 1, 1, routing, BLOCK, PDD_DTYPE="bfloat16")
    prefill.wait_ready()
    decode = cluster.instance("decode", 2, 1, routing, BLOCK, PDD_NUM_BLOCKS=NUM_BLOCKS,
                              PDD_PREFILL_URLS=prefill.url)
    # Not ready: its only prefill peer is incompatible, and /readyz says why.
    status, reason = unready_reason(decode, "dtype")
    assert status == 503
    assert "dtype: local 'bfloat16' != decode 0 rank 0 'float32'" in reason, reason
    # A hand-off from that peer is refused with the same message, and nothing leaks.
    status, pre = http("POST", f"{prefill.url}/v1/prefill",
                       {"request_id": "r-mismatch", "prompt_ids": _prompt(20)})
    assert status == 200, pre
    status, body = http("POST", f"{decode.url}/v1/decode", {
        "request_id": "r-mismatch", "first_token": pre["first_token"], "max_new_tokens": 3,
        "kv_transfer_params": pre["kv_transfer_params"]})
    assert status == 409, body
    assert "dtype: local 'bfloat16' != decode 0 rank" in error_text(body), body
    assert "'float32'" in error_text(body)
    assert _all_free(decode.url) == [NUM_BLOCKS, NUM_BLOCKS]
    status, released = http("POST", f"{prefill.url}/v1/release",
                            {"kv_transfer_params": pre["kv_transfer_params"]})
    assert status == 200 and released == {"released": True}


def test_claims_and_releases_are_answered_while_a_slow_step_runs(cluster: LocalCluster) -> None:
    """A decode's claim (and a router's release) never waits for the prefill's running forward
    step: with every step made 3 s slower, both are answered while another request's step is
    still running (fault injection, PDD_FAULT_STEP_DELAY_S)."""
    routing = cluster.plan_file(_plan((1, 1), (1, 1)))
    prefill = cluster.instance("prefill", 1, 1, routing, BLOCK, PDD_FAULT_STEP_DELAY_S="3")
    prefill.wait_ready()
    status, held = http("POST", f"{prefill.url}/v1/prefill",
                        {"prompt_ids": _prompt(20), "max_tokens": 4}, timeout=60)
    assert status == 200 and held["kv_transfer_params"], held
    status, other = http("POST", f"{prefill.url}/v1/prefill",
                         {"prompt_ids": _prompt(24), "max_tokens": 4}, timeout=60)
    assert status == 200, other
    slow_done = threading.Event()

    def slow() -> None:
        http("POST", f"{prefill.url}/v1/prefill", {"prompt_ids": _prompt(30), "max_tokens": 4},
             timeout=60)
        slow_done.set()

    worker = threading.Thread(target=slow)
    worker.start()
    try:
        time.sleep(1.0)  # the slow request's step is running now (3 s)
        status, body = http("POST", f"{prefill.url}/v1/claim",
                            {"kv_transfer_params": held["kv_transfer_params"], "hold_s": 5})
        claimed_during_step = not slow_done.is_set()
        assert status == 200 and body == {"claimed": True}, body
        status, body = http("POST", f"{prefill.url}/v1/release",
                            {"kv_transfer_params": other["kv_transfer_params"]})
        released_during_step = not slow_done.is_set()
        assert status == 200 and body == {"released": True}, body
        assert claimed_during_step, "the claim waited for the running step"
        assert released_during_step, "the release waited for the running step"
    finally:
        worker.join(timeout=60)
    assert slow_done.is_set()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_prefill_gone_before_the_claim_costs_the_client_nothing(
        cluster: LocalCluster, stream: bool) -> None:
    """Two prefills; the one that ran a request dies before the decode claims its KV (pulls
    are held back 4 s): the router runs the prompt again on the other prefill, and the
    client gets the reference tokens, never a 502. A stream has the first token by then: the
    decode is fed that one, and the stream goes on as if nothing happened."""
    routing = cluster.plan_file(_plan((1, 1), (1, 1)))
    prefills = [cluster.instance("prefill", 1, 1, routing, BLOCK, replica=i) for i in range(2)]
    decode = cluster.instance("decode", 1, 1, routing, BLOCK, PDD_FAULT_PULL_DELAY_S="4",
                              PDD_PREFILL_URLS=",".join(p.url for p in prefills))
    router = cluster.router(prefills, [decode])
    for p in (*prefills, decode, router):
        p.wait_ready()
    result: dict[str, Any] = {}
    request = {"prompt": _prompt(40), "max_tokens": 4, "temperature": 0, "stream": stream}

    def complete() -> None:
        if not stream:
            result["answer"] = http("POST", f"{router.url}/v1/completions", request,
                                    timeout=120)
            return
        req = urllib.request.Request(f"{router.url}/v1/completions", method="POST",
                                     data=json.dumps(request).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                      if line.startswith("data: {")]
        result["answer"] = (resp.status, {
            "choices": [{"token_ids": [t for e in events for t in e["choices"][0]["token_ids"]]}],
            "pdd": events[-1].get("pdd", {}), "errors": [e for e in events if "error" in e]})

    thread = threading.Thread(target=complete)
    thread.start()
    holder = None
    for _ in range(400):  # the prefill that holds the request's KV for the decode
        for p in prefills:
            _, text = http("GET", f"{p.url}/metrics")
            if "pdd_held_requests 1.0" in str(text):
                holder = p
        if holder is not None:
            break
        time.sleep(0.02)
    assert holder is not None, "no prefill ever held the request's blocks"
    holder.kill()
    thread.join(120)
    status, body = result["answer"]
    assert status == 200, body
    assert not body.get("errors"), body
    assert body["choices"][0]["token_ids"] == _reference(40, 4)
    assert body["pdd"]["prefill"] != holder.url
