"""Local processes for runtime tests: prefill/decode instances and routers on 127.0.0.1.

Instances are the real entry point (`pdd_sidecar.serve.instance.server.serve`, what
`python -m pdd_sidecar serve` runs) with their environment passed in. They are forked from a
forkserver that imported torch once, because importing torch costs seconds of CPU per process
on a small machine. Each instance runs in its own session, so a test can kill it with all its
rank processes at once, and gets SIGTERM when the forkserver ends (it does when pytest ends,
killed outright included), so a killed test run leaves no instance behind.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import random
import signal
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd_sidecar.processes import die_with_parent

_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(
            ["torch", "aiohttp", "nixl._api", "pdd_sidecar.serve.instance.server",
             "pdd_sidecar.engine.rank_engine", "pdd_sidecar.serve.router.router"]
        )
    return _CTX


def _ports_free(base: int, n: int) -> bool:
    for port in range(base, base + n):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


_taken: set[int] = set()


def free_ports(n: int) -> int:
    """First of n consecutive free ports (not handed out before in this test run).

    Drawn below Linux's ephemeral range (32768+), where gloo, UCX and other tests' `bind(0)`
    sockets would otherwise take a port between our check and the instance's bind.
    """
    while True:
        base = random.randint(10000, 32000 - n)
        if any(p in _taken for p in range(base, base + n)):
            continue
        if _ports_free(base, n):
            _taken.update(range(base, base + n))
            return base


def detach() -> None:
    """An instance's own session (killed with its ranks as one group), ended with its
    forkserver. A forked child holds the forkserver's keep-alive pipe (so that it could fork
    from it too), which would keep the forkserver, and so the instance, alive past a killed
    test run: it lets go of it, as it never forks from there."""
    os.setsid()
    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    die_with_parent()


def _serve_entry(env: dict[str, str]) -> None:
    detach()
    os.environ.update(env)
    from pdd_sidecar.serve.instance.server import serve

    os._exit(serve(env))


def _router_entry(env: dict[str, str]) -> None:
    detach()
    os.environ.update(env)
    from pdd_sidecar.serve.router.router import main

    os._exit(main(env))


def http(method: str, url: str, body: Any = None, timeout: float = 60) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


@dataclass
class Proc:
    name: str
    url: str
    process: Any
    env: dict[str, str] = field(default_factory=dict)

    def alive(self) -> bool:
        return bool(self.process.is_alive())

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.join(timeout=10)

    def wait_ready(self, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.process.exitcode}")
            try:
                status, body = http("GET", f"{self.url}/readyz", timeout=5)
                if status == 200:
                    return body  # type: ignore[no-any-return]
                last = body
            except OSError as exc:
                last = exc
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout}s: {last}")


class LocalCluster:
    """Starts and always stops the processes of one test."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[Proc] = []
        self.key_file = workdir / "grant.key"
        self.key_file.write_bytes(os.urandom(32).hex().encode())
        self.key = self.key_file.read_bytes()

    def plan_file(self, plan_json: str, name: str = "routing.json") -> str:
        path = self.workdir / name
        path.write_text(plan_json)
        return str(path)

    def instance(self, role: str, tp: int, dcp: int, routing_file: str, block_size: int,
                 replica: int = 0, **extra: Any) -> Proc:
        http_port = free_ports(1)
        env = {
            "PDD_ROLE": role,
            "PDD_REPLICA": str(replica),
            "PDD_TP_SIZE": str(tp),
            "PDD_DCP_SIZE": str(dcp),
            "PDD_BLOCK_SIZE": str(block_size),
            "PDD_ROUTING_FILE": routing_file,
            "PDD_SIDE_CHANNEL_PORT": str(free_ports(tp)),
            "POD_IP": "127.0.0.1",
            "PDD_BIND_HOST": "127.0.0.1",
            "PDD_HTTP_PORT": str(http_port),
            "PDD_DIST_PORT": str(free_ports(1)),
            "PDD_NUM_BLOCKS": "256",
            "PDD_LOG_LEVEL": "WARNING",
            "PDD_HANDSHAKE_TIMEOUT_S": "5",
            "PDD_TRANSFER_TIMEOUT_S": "20",
            "PDD_GRANT_KEY_FILE": str(self.key_file),
        }
        env.update({k: str(v) for k, v in extra.items()})
        process = _context().Process(target=_serve_entry, args=(env,), daemon=False)
        process.start()
        proc = Proc(f"{role}-{replica} tp{tp}/dcp{dcp}",
                    f"http://127.0.0.1:{env['PDD_HTTP_PORT']}", process, env)
        self.procs.append(proc)
        return proc

    def group(self, role: str, tp: int, dcp: int, routing_file: str, block_size: int,
              ranks_per_pod: int, replica: int = 0, **extra: Any) -> list[Proc]:
        """One instance whose ranks span ``tp // ranks_per_pod`` emulated pods of a
        LeaderWorkerSet group: one process per pod with LWS's env, its own HTTP port and its own
        side-channel base (plus the global rank, as in a pod), the leader first. Only the leader
        serves the instance API."""
        pods = tp // ranks_per_pod
        common = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": str(pods),
                  "PDD_RANKS_PER_POD": str(ranks_per_pod), "PDD_DIST_PORT": str(free_ports(1))}
        procs = []
        for k in range(pods):
            env = {**common, "LWS_WORKER_INDEX": str(k), **extra}
            proc = self.instance(role, tp, dcp, routing_file, block_size, replica, **env)
            proc.name += f" pod {k}"
            procs.append(proc)
        return procs

    def router(self, prefill: list[Proc], decode: list[Proc], **extra: Any) -> Proc:
        port = free_ports(1)
        env = {
            "PDD_HTTP_PORT": str(port),
            "PDD_BIND_HOST": "127.0.0.1",
            "PDD_PREFILL_URLS": ",".join(p.url for p in prefill),
            "PDD_DECODE_URLS": ",".join(p.url for p in decode),
            "PDD_ROUTER_HEALTH_INTERVAL_S": "0.3",
            "PDD_LOG_LEVEL": "WARNING",
            # Every request through a prefill and the hand-off these tests are about; those of
            # the per-request decision set it (test_request_paths.py).
            "PDD_ROUTER_LOCAL_PREFILL_TOKENS": "0",
        }
        env.update({k: str(v) for k, v in extra.items()})
        process = _context().Process(target=_router_entry, args=(env,), daemon=False)
        process.start()
        proc = Proc("router", f"http://127.0.0.1:{env['PDD_HTTP_PORT']}", process, env)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        self.procs.clear()


def error_text(body: Any) -> str:
    """The message of an error answer, OpenAI-shaped (``{"error": {"message": ...}}``)."""
    err = body.get("error") if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err)


def unready_reason(proc: Proc, needle: str, tries: int = 600) -> tuple[int, str]:
    """Poll ``proc``'s /readyz until its reason names ``needle`` (or ``tries`` run out): the
    last status and reason, so a test can assert the refusal a peer mismatch leaves there.
    The process must stay alive meanwhile: a mismatch is reported, never a crash."""
    reason, status = "", 0
    for _ in range(tries):
        try:
            status, body = http("GET", f"{proc.url}/readyz")
        except OSError:  # not listening yet
            body = {}
        reason = body.get("reason", "") if isinstance(body, dict) else ""
        if needle in reason:
            break
        assert proc.alive()
        time.sleep(0.1)
    return status, reason


def plan_json(p: tuple[int, int], d: tuple[int, int], block_size: int) -> str:
    """The routing plan (contract JSON) of prefill ``(tp, dcp)`` to decode ``(tp, dcp)``."""
    from pdd_api.plan import SidePlan
    from pdd_api.routing import plan_routing

    return plan_routing(
        SidePlan(tensor_parallel_size=p[0], decode_context_parallel_size=p[1]),
        SidePlan(tensor_parallel_size=d[0], decode_context_parallel_size=d[1]),
        block_size,
    ).to_json()


LocalAsk = tuple[str, list[int], int, float]  # request id, prompt ids, tokens, delay (s)


def local_prefills(url: str, asks: list[LocalAsk], timeout: float = 180) -> list[list[int]]:
    """Each ask sent to the decode at ``url`` as a local prefill (``/v1/decode`` with
    ``local_prefill``) from a thread of its own after its delay; each answer's token ids (the
    first token and ``tokens - 1`` more), in the asks' order."""
    from concurrent.futures import ThreadPoolExecutor

    def send(ask: LocalAsk) -> list[int]:
        rid, prompt, n, delay = ask
        time.sleep(delay)
        status, body = http("POST", f"{url}/v1/decode", {
            "request_id": rid, "local_prefill": True, "prompt_ids": prompt,
            "max_new_tokens": n - 1}, timeout=timeout)
        assert status == 200, (rid, body)
        return list(body["token_ids"])

    with ThreadPoolExecutor(len(asks)) as pool:
        return list(pool.map(send, asks))


_REFERENCES: dict[tuple[tuple[int, ...], int, int], list[int]] = {}


def reference_tokens(prompt: list[int], max_tokens: int, block_size: int) -> list[int]:
    """The built-in model's greedy tokens for ``prompt`` in one process (computed once)."""
    from pdd_sidecar.engine.generate import generate

    key = (tuple(prompt), max_tokens, block_size)
    if key not in _REFERENCES:
        _REFERENCES[key] = generate("builtin", prompt, max_tokens, block_size=block_size)
    return _REFERENCES[key]


def pd_stack(cluster: LocalCluster, p: tuple[int, int], d: tuple[int, int], block_size: int,
             prefill_env: dict[str, Any] | None = None,
             decode_env: dict[str, Any] | None = None) -> dict[str, Proc]:
    """A prefill, a decode reading from it and a router, each ready."""
    routing = cluster.plan_file(plan_json(p, d, block_size))
    prefill = cluster.instance("prefill", p[0], p[1], routing, block_size, **(prefill_env or {}))
    decode = cluster.instance("decode", d[0], d[1], routing, block_size,
                              PDD_PREFILL_URLS=prefill.url, **(decode_env or {}))
    router = cluster.router([prefill], [decode])
    for proc in (prefill, decode, router):
        proc.wait_ready()
    return {"prefill": prefill, "decode": decode, "router": router}
