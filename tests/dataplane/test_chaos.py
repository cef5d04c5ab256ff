"""Processes killed under load: a prefill rank, a decode rank or the router gets SIGKILL at a
random moment while clients send requests. Every client call ends within its bound with either
the reference tokens or an explicit error (never a 200 with other tokens), the test restarts what
died on the same port, and the instances that lived through the round hold no blocks once its
requests are gone.

Rounds: PDD_CHAOS_ROUNDS (6 by default, which CI runs; 30 by hand). The victims and moments come
from a seeded generator (PDD_CHAOS_SEED).
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
from runtime_fixtures import LocalCluster, Proc, http, plan_json

pytestmark = pytest.mark.dataplane

BLOCK = 16
ROUNDS = int(os.environ.get("PDD_CHAOS_ROUNDS", "6"))
SEED = int(os.environ.get("PDD_CHAOS_SEED", "1130"))
CLIENTS = 3
CALL_TIMEOUT_S = 45.0  # above every server-side bound (transfer 5 s, handshake 5 s): a hang
LEASE_S = 3.0
PREFILL, DECODE = (2, 2), (2, 1)
PROMPTS = [[(i * 31 + k * 17 + 3) % 256 for i in range(n)] for k, n in
           enumerate((5, 16, 17, 33, 40, 61))]
MAX_TOKENS = [6, 9, 4, 12, 7, 10]


def _plan() -> str:
    return plan_json(PREFILL, DECODE, BLOCK)


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc (a rank's processes are rank 0's children)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            continue
    return out


@dataclass
class Tally:
    ok: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    wrong: list[str] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def error(self, what: str) -> None:
        with self.lock:
            self.errors[what] += 1


def _request(router: str, k: int, stream: bool) -> tuple[int, list[int] | None, str]:
    """(status, token ids of a complete answer or None, what went wrong)."""
    body = json.dumps({"prompt": PROMPTS[k], "max_tokens": MAX_TOKENS[k], "temperature": 0,
                       "stream": stream}).encode()
    req = urllib.request.Request(f"{router}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=CALL_TIMEOUT_S) as resp:
            if not stream:
                answer = json.loads(resp.read())
                return resp.status, answer["choices"][0]["token_ids"], ""
            ids: list[int] = []
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return resp.status, ids, ""
                event = json.loads(data)
                if "error" in event:
                    return resp.status, None, "error event in the stream"
                ids += event["choices"][0]["token_ids"]
            return resp.status, None, "stream cut before [DONE]"
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code, None, f"HTTP {exc.code}"


class Load:
    """CLIENTS threads sending requests to the router until stopped; each result is tallied."""

    def __init__(self, router: str, refs: list[list[int]], seed: int) -> None:
        self.router = router
        self.refs = refs
        self.tally = Tally()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(seed * 10 + c,))
                        for c in range(CLIENTS)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(CALL_TIMEOUT_S + 10)
            if t.is_alive():
                self.tally.hung.append(f"client thread {t.name} still running")

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            k = rng.randrange(len(PROMPTS))
            stream = rng.random() < 0.4
            start = time.monotonic()
            try:
                status, ids, why = _request(self.router, k, stream)
            except TimeoutError as exc:  # also socket.timeout: the bound ran out
                self.tally.hung.append(f"prompt {k} stream={stream}: no answer within "
                                       f"{time.monotonic() - start:.0f}s ({exc})")
                continue
            except (OSError, ValueError, KeyError) as exc:  # refused, reset: the router died
                self.tally.error(type(exc).__name__)
                time.sleep(0.05)
                continue
            if status == 200 and ids is not None:
                if ids != self.refs[k]:
                    self.tally.wrong.append(f"prompt {k} stream={stream}: {ids} != "
                                            f"{self.refs[k]}")
                else:
                    with self.tally.lock:
                        self.tally.ok += 1
            else:
                self.tally.error(why or f"HTTP {status}")
                time.sleep(0.05)


def _held(url: str) -> int:
    status, stats = http("GET", f"{url}/v1/stats", timeout=10)
    assert status == 200, stats
    return sum(stats["num_blocks"] - r["free_blocks"] for r in stats["ranks"])


def test_sigkill_under_load_gives_reference_tokens_or_errors_and_leaks_nothing(
        cluster: LocalCluster) -> None:
    from pdd_sidecar.engine.generate import generate

    refs = [generate("builtin", p, m, block_size=BLOCK) for p, m in zip(PROMPTS, MAX_TOKENS,
                                                                          strict=True)]
    routing = cluster.plan_file(_plan())
    common = {"PDD_TRANSFER_TIMEOUT_S": 5, "PDD_DRAIN_S": 1}

    def start(role: str, port: str | None = None) -> Proc:
        extra: dict[str, Any] = dict(common)
        if port is not None:
            extra["PDD_HTTP_PORT"] = port
        if role == "prefill":
            return cluster.instance("prefill", PREFILL[0], PREFILL[1], routing, BLOCK,
                                    PDD_LEASE_SECONDS=LEASE_S, **extra)
        return cluster.instance("decode", DECODE[0], DECODE[1], routing, BLOCK,
                                PDD_PREFILL_URLS=procs["prefill"].url, **extra)

    procs: dict[str, Proc] = {}
    procs["prefill"] = start("prefill")
    procs["decode"] = start("decode")
    procs["router"] = cluster.router([procs["prefill"]], [procs["decode"]],
                                     PDD_ROUTER_REQUEST_TIMEOUT_S=30)
    for p in procs.values():
        p.wait_ready()
    router_url = procs["router"].url

    def stack_ready(timeout: float = 120) -> None:
        for p in procs.values():
            p.wait_ready(timeout)
        deadline = time.monotonic() + timeout
        while True:  # the router sees both again (it probes every 0.3 s)
            status, body = http("GET", f"{router_url}/readyz", timeout=5)
            if status == 200:
                return
            assert time.monotonic() < deadline, body
            time.sleep(0.1)

    rng = random.Random(SEED)
    victims: collections.Counter[str] = collections.Counter()
    totals = Tally()
    leaked: list[str] = []
    for round_ in range(ROUNDS):
        victim = rng.choice(["prefill", "decode", "router"])
        with Load(router_url, refs, SEED * 1000 + round_) as load:
            time.sleep(rng.uniform(0.3, 2.5))
            old = procs[victim]
            if victim == "router":
                pid = old.process.pid
            else:  # any rank: rank 0 is the process the test started, the rest its children
                pid = rng.choice([old.process.pid, *_children(old.process.pid)])
            os.kill(pid, signal.SIGKILL)
            victims[f"{victim} {'rank 0' if pid == old.process.pid else 'rank > 0'}"] += 1
            old.process.join(30)
            assert not old.alive(), f"{old.name} lived on after its rank {pid} was killed"
            old.kill()  # whatever is left of its session
            port = old.url.rsplit(":", 1)[1]
            if victim == "router":
                new = cluster.router([procs["prefill"]], [procs["decode"]],
                                     PDD_HTTP_PORT=port, PDD_ROUTER_REQUEST_TIMEOUT_S=30)
                new.url = old.url
            else:
                new = start(victim, port)
            procs[victim] = new
            stack_ready()
            time.sleep(rng.uniform(0.5, 1.5))  # requests through the restarted stack
        # Load is over: every request ended. What lived through the round gives every block
        # back within the lease; what restarted holds none.
        t = load.tally
        totals.ok += t.ok
        totals.errors.update(t.errors)
        totals.wrong += t.wrong
        totals.hung += t.hung
        for role in ("prefill", "decode"):
            url = procs[role].url
            deadline = time.monotonic() + LEASE_S + 10
            while (held := _held(url)) and time.monotonic() < deadline:
                time.sleep(0.2)
            if held:
                leaked.append(f"round {round_} ({victim} killed): {role} holds {held} blocks")
        assert not t.wrong and not t.hung, (round_, victim, t.wrong[:3], t.hung[:3])
    print(f"\n{ROUNDS} rounds (seed {SEED}); killed: {dict(victims)}; requests with the "
          f"reference tokens: {totals.ok}; explicit errors: {dict(totals.errors)}; wrong "
          f"tokens: {len(totals.wrong)}; hung: {len(totals.hung)}; leaked: {leaked}")
    assert not leaked, leaked
    assert totals.ok > ROUNDS, "hardly any request got through: the test tested nothing"
    status, body = http("POST", f"{router_url}/v1/completions",
                        {"prompt": PROMPTS[3], "max_tokens": MAX_TOKENS[3], "temperature": 0})
    assert status == 200 and body["choices"][0]["token_ids"] == refs[3], body
