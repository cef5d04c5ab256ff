"""Instances whose ranks span the pods of a LeaderWorkerSet group, emulated on 127.0.0.1.

Each pod is its own process tree with LWS's env (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE,
LWS_WORKER_INDEX) and its own HTTP and side-channel ports; the ranks meet at the leader. Through
the router, completions must equal the single-process reference and every decode rank must
receive exactly the plan's minimum bytes, read from the pod that holds each prefill rank. A rank
that dies on a worker pod, or the leader, must take the whole group down, leaving no process
behind.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
import torch  # noqa: F401  (the tier needs it; never skip)
from runtime_fixtures import LocalCluster, Proc, error_text, http

from pdd_api.plan import SidePlan
from pdd_api.routing import bytes_per_decode_rank, plan_routing
from pdd_sidecar.kv.grants import sign

pytestmark = pytest.mark.dataplane

BLOCK = 16
MAX_TOKENS = 12
PROMPT_LENGTHS = (5, 37, 70)  # < 1 block, a partial 3rd block, 5 blocks


def _prompt(n: int) -> list[int]:
    return [(i * 37 + 11) % 256 for i in range(n)]


@pytest.fixture(scope="module")
def references() -> dict[int, list[int]]:
    from pdd_sidecar.engine.generate import generate

    return {n: generate("builtin", _prompt(n), MAX_TOKENS, block_size=BLOCK)
            for n in PROMPT_LENGTHS}


Side = tuple[int, int, int | None]  # tp, dcp, ranks per pod (None: one pod)
CASES: list[tuple[Side, Side]] = [
    ((4, 4, 2), (2, 2, None)),  # prefill on two pods, sharded -> sharded
    ((2, 1, None), (4, 4, 2)),  # decode on two pods, replicated -> sharded
    ((2, 2, 1), (2, 1, 1)),  # both sides span pods, one rank each; sharded -> replicated
]
IDS = ["P44x2-D22", "P21-D44x2", "P22x1-D21x1"]


def _start(cluster: LocalCluster, role: str, side: Side, routing: str,
           **extra: Any) -> list[Proc]:
    tp, dcp, per_pod = side
    # Every prompt's whole KV moves (no prefix reuse), so bytes meet the plan's minimum exactly.
    extra.setdefault("PDD_PREFIX_CACHE", "0")
    if per_pod is None:
        return [cluster.instance(role, tp, dcp, routing, BLOCK, **extra)]
    return cluster.group(role, tp, dcp, routing, BLOCK, per_pod, **extra)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_ranks_across_pods_serve_the_reference_with_minimum_bytes(
        case: tuple[Side, Side], cluster: LocalCluster, references: dict[int, list[int]]) -> None:
    from pdd_sidecar.model.config import builtin_config

    p_side, d_side = case
    plan = plan_routing(SidePlan(tensor_parallel_size=p_side[0],
                                 decode_context_parallel_size=p_side[1]),
                        SidePlan(tensor_parallel_size=d_side[0],
                                 decode_context_parallel_size=d_side[1]), BLOCK)
    routing = cluster.plan_file(plan.to_json())
    prefill = _start(cluster, "prefill", p_side, routing)
    decode = _start(cluster, "decode", d_side, routing, PDD_PREFILL_URLS=prefill[0].url)
    router = cluster.router([prefill[0]], [decode[0]])
    for p in [*prefill, *decode, router]:
        p.wait_ready()

    status, info = http("GET", f"{prefill[0].url}/v1/info")
    assert status == 200
    ports = [port for _, port in info["rank_endpoints"]]
    assert len(ports) == p_side[0] and len(set(ports)) == p_side[0]
    if p_side[2] is not None:  # each rank is where its own pod published it
        for k, pod in enumerate(prefill):
            ranks = range(k * p_side[2], (k + 1) * p_side[2])
            base = int(pod.env["PDD_SIDE_CHANNEL_PORT"])
            assert [ports[r] for r in ranks] == [base + r for r in ranks]

    model = builtin_config()
    bytes_per_token = model.num_hidden_layers * model.latent_dim * 4  # float32
    problems = []
    moved = minimum = 0
    for n in PROMPT_LENGTHS:
        status, body = http("POST", f"{router.url}/v1/completions",
                            {"prompt": _prompt(n), "max_tokens": MAX_TOKENS, "temperature": 0})
        assert status == 200, body
        got = body["choices"][0]["token_ids"]
        if got != references[n]:
            problems.append(f"prompt {n}: tokens {got} != reference {references[n]}")
        per_rank = [r["bytes"] for r in body["pdd"]["transfer"]["ranks"]]
        need = bytes_per_decode_rank(plan, n, bytes_per_token)
        moved, minimum = moved + sum(per_rank), minimum + sum(need)
        if per_rank != need:
            problems.append(f"prompt {n}: bytes per decode rank {per_rank} != minimum {need}")
    print(f"\n{case}: bytes moved {moved} / minimum {minimum}")
    assert not problems, "\n".join(problems)
    # Every prefill rank, on every pod, got its notifications: nothing was freed by the lease.
    status, stats = http("GET", f"{prefill[0].url}/v1/stats")
    assert status == 200 and stats["leases"]["expired_total"] == 0
    # Worker pods answer probes only.
    for pod in [*prefill[1:], *decode[1:]]:
        assert http("GET", f"{pod.url}/healthz")[0] == 200
        assert http("POST", f"{pod.url}/v1/prefill", {})[0] in (404, 501)


def test_a_grant_naming_other_rank_endpoints_is_refused(cluster: LocalCluster) -> None:
    """Signed or not, a decode reads a multi-pod prefill only where it discovered its ranks."""
    plan = plan_routing(SidePlan(tensor_parallel_size=2, decode_context_parallel_size=2),
                        SidePlan(tensor_parallel_size=2, decode_context_parallel_size=2), BLOCK)
    routing = cluster.plan_file(plan.to_json())
    prefill = cluster.group("prefill", 2, 2, routing, BLOCK, 1)
    decode = cluster.instance("decode", 2, 2, routing, BLOCK, PDD_PREFILL_URLS=prefill[0].url)
    for p in [*prefill, decode]:
        p.wait_ready()
    status, pre = http("POST", f"{prefill[0].url}/v1/prefill",
                       {"prompt_ids": _prompt(40), "max_tokens": 4})
    assert status == 200, pre
    grant = pre["kv_transfer_params"]
    assert [e[1] for e in grant["rank_endpoints"]] == [
        int(p.env["PDD_SIDE_CHANNEL_PORT"]) + r for r, p in enumerate(prefill)]
    elsewhere = [[h, port + 1000] for h, port in grant["rank_endpoints"]]
    unsigned = {**grant, "rank_endpoints": elsewhere}
    stripped = {k: v for k, v in grant.items() if k != "rank_endpoints"}
    resigned = sign({k: v for k, v in unsigned.items() if k != "signature"}, cluster.key)
    for params, want in ((unsigned, "signature"), (stripped, "signature"),
                         (resigned, "found at")):
        status, body = http("POST", f"{decode.url}/v1/decode",
                            {"first_token": pre["first_token"], "max_new_tokens": 2,
                             "kv_transfer_params": params})
        assert status == 403 and want in error_text(body), body
    status, body = http("POST", f"{decode.url}/v1/decode",
                        {"first_token": pre["first_token"], "max_new_tokens": 2,
                         "kv_transfer_params": grant})
    assert status == 200, body


def _session(sid: int) -> list[int]:
    """Processes still in session ``sid`` (each emulated pod is its own session)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(entry))
    return out


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


@pytest.mark.parametrize("victim", ["worker-rank", "leader"])
def test_a_rank_or_the_leader_killed_takes_the_whole_group_down(
        victim: str, cluster: LocalCluster) -> None:
    plan = plan_routing(SidePlan(tensor_parallel_size=4, decode_context_parallel_size=4),
                        SidePlan(tensor_parallel_size=4, decode_context_parallel_size=4), BLOCK)
    pods = cluster.group("prefill", 4, 4, cluster.plan_file(plan.to_json()), BLOCK, 1)
    for p in pods:
        p.wait_ready()
    for p in pods[1:]:
        status, body = http("GET", f"{p.url}/healthz")
        assert status == 200 and body["ranks"] == [pods.index(p)], body
    sessions = {p.name: p.process.pid for p in pods}
    assert all(_session(sid) for sid in sessions.values())
    if victim == "leader":
        pods[0].kill()  # rank 0 and its pod
    else:
        ranks = _children(pods[2].process.pid)
        assert len(ranks) == 1, ranks  # pod 2's one rank process
        os.kill(ranks[0], signal.SIGKILL)

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(p.alive() for p in pods):
        time.sleep(0.2)
    alive = [p.name for p in pods if p.alive()]
    assert not alive, f"still running 60 s after a rank was killed: {alive}"
    assert all(p.process.exitcode not in (0, None) for p in pods), [
        (p.name, p.process.exitcode) for p in pods]  # non-zero: the group's restart policy acts
    with pytest.raises(OSError):
        http("GET", f"{pods[0].url}/readyz", timeout=2)
    deadline = time.monotonic() + 10
    left = {name: _session(sid) for name, sid in sessions.items()}
    while time.monotonic() < deadline and any(left.values()):
        time.sleep(0.2)
        left = {name: _session(sid) for name, sid in sessions.items()}
    assert not any(left.values()), f"processes left behind: {left}"
