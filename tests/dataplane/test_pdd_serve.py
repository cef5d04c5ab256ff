"""`pdd serve` as a user runs it: one command, a ready line, completions, and nothing left behind.

Each test starts the real command (`python -m pdd_cli.main serve ...`) in its own session, reads
its stdout for the ready line, and afterwards walks /proc for every process the stack had: the
command, the instances, their forked rank processes and the router.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
import torch  # noqa: F401  (the tier needs it; never skip)
from runtime_fixtures import http, reference_tokens

pytestmark = pytest.mark.dataplane

BLOCK = 16
READY = re.compile(r"^pdd serve: ready at (http://\S+) \((.*)\)$")


def _proc_stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, pgid, state) of a live process, None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[2]), fields[0]


def _all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        st = _proc_stat(pid)
        if st is not None:
            children.setdefault(st[0], []).append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        for c in children.get(pid, []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _role(pid: int) -> str:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    for item in env:
        if item.startswith(b"PDD_ROLE="):
            return item.split(b"=", 1)[1].decode()
    return "router" if b"PDD_DECODE_URLS=" in b"\0".join(env) else ""


@dataclass
class Serve:
    """One `pdd serve` run with its stdout read on a thread."""

    args: list[str]
    log_dir: Path
    process: subprocess.Popen[str] = field(init=False)
    lines: queue.Queue[str | None] = field(default_factory=queue.Queue)
    stdout: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdd_cli.main", "serve", "--port", "0",
             "--log-dir", str(self.log_dir), "--log-level", "WARNING", *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_ready(self, timeout: float = 240) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no ready line after {timeout}s: {self.stdout}") from None
            if line is None:
                raise AssertionError(f"pdd serve exited ({self.process.wait()}) before ready: "
                                     f"{self.stdout} {self.stderr()}")
            self.stdout.append(line)
            m = READY.match(line)
            if m:
                return m.group(1)

    def rest(self) -> list[str]:
        """The stdout lines after the ready line, once the command has exited."""
        out = []
        while (line := self.lines.get(timeout=10)) is not None:
            out.append(line)
        return out

    def stderr(self) -> str:
        assert self.process.stderr is not None
        if self.process.poll() is None:
            return ""
        return self.process.stderr.read()

    def tree(self) -> dict[int, str]:
        """Every process under the command now, with its role (rank processes inherit it)."""
        return {pid: _role(pid) for pid in _descendants(self.process.pid)}

    def kill_all(self) -> None:
        for pid in [self.process.pid, *self.tree()]:
            st = _proc_stat(pid)
            if st is not None:
                try:
                    os.killpg(st[1], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.process.wait(timeout=30)


def _assert_nothing_left(pids: set[int], pgids: set[int], timeout: float = 15) -> None:
    """No process of the stack remains: neither one we saw nor any member of its groups.

    Zombies count as gone (their reaper is not ours); anything else alive is a leak.
    """
    deadline = time.monotonic() + timeout
    while True:
        alive = {}
        for pid in _all_pids():
            st = _proc_stat(pid)
            if st is None or st[2] == "Z":
                continue
            if pid in pids or st[1] in pgids:
                alive[pid] = st
        if not alive:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes of the stack still running: {alive}")
        time.sleep(0.2)


@pytest.fixture
def serves(tmp_path: Path) -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for s in started:
        if s.process.poll() is None:
            s.kill_all()


def _start(serves: list[Serve], tmp_path: Path, *args: str) -> tuple[Serve, str]:
    s = Serve(list(args), tmp_path / f"logs{len(serves)}")
    serves.append(s)
    return s, s.wait_ready()


def _snapshot(s: Serve) -> tuple[set[int], set[int], dict[int, str]]:
    tree = s.tree()
    pgids = {st[1] for pid in tree if (st := _proc_stat(pid)) is not None}
    return {s.process.pid, *tree}, pgids, tree


def _stop_and_check(s: Serve, sig: signal.Signals, pids: set[int], pgids: set[int]) -> None:
    s.process.send_signal(sig)
    assert s.process.wait(timeout=60) == 0, s.stderr()
    _assert_nothing_left(pids, pgids)


def test_sharded_to_sharded_completion_matches_reference_and_sigterm_stops_all(
    serves: list[Serve], tmp_path: Path
) -> None:
    from pdd_sidecar.engine.generate import generate
    from pdd_sidecar.serve.openai import tokenizer

    s, url = _start(serves, tmp_path, "--prefill-tp", "2", "--prefill-dcp", "2",
                    "--decode-tp", "2", "--decode-dcp", "2", "--block-size", str(BLOCK))
    assert url.startswith("http://127.0.0.1:")
    assert "prefill tp2/dcp2, decode tp2/dcp2" in s.stdout[-1]
    assert any(str(tmp_path / "logs0") in line for line in s.stdout), s.stdout
    pids, pgids, tree = _snapshot(s)
    roles = sorted(tree.values())
    # Two ranks per instance (rank 0 and its forked rank 1) and the router.
    assert roles == ["decode", "decode", "prefill", "prefill", "router"], tree
    # Each child leads its own group; the ranks share their instance's.
    assert len(pgids) == 3 and os.getpgid(s.process.pid) not in pgids

    prompt = [(i * 37 + 11) % 256 for i in range(3 * BLOCK + 5)]  # 4 chunks: both ranks hold some
    status, body = http("POST", f"{url}/v1/completions",
                        {"prompt": prompt, "max_tokens": 7, "temperature": 0})
    assert status == 200, body
    want = generate("builtin", prompt, 7, block_size=BLOCK)
    assert body["choices"][0]["token_ids"] == want
    # Three choices of each of two prompts: the decode forks each prompt's pulled KV (a whole
    # unit shared, the last one copied on both ranks); greedy, every choice is the answer.
    short = prompt[:9]
    status, body = http("POST", f"{url}/v1/completions",
                        {"prompt": [prompt, short], "n": 3, "max_tokens": 7, "temperature": 0})
    assert status == 200, body
    assert [c["token_ids"] for c in body["choices"]] == (
        [want] * 3 + [generate("builtin", short, 7, block_size=BLOCK)] * 3)

    text = "Try it without a cluster."
    status, body = http("POST", f"{url}/v1/completions",
                        {"prompt": text, "max_tokens": 5, "temperature": 0})
    assert status == 200, body
    want = generate("builtin", tokenizer.encode(text), 5, block_size=BLOCK)
    assert body["choices"][0]["token_ids"] == want
    assert body["choices"][0]["text"] == tokenizer.decode(want)

    _stop_and_check(s, signal.SIGTERM, pids, pgids)
    assert s.rest()[-2:] == ["pdd serve: SIGTERM received, stopping", "pdd serve: stopped"]


def test_kv_cache_dtype_fp8_serves_the_tokens_of_one_fp8_instance(
    serves: list[Serve], tmp_path: Path
) -> None:
    """`pdd serve --kv-cache-dtype fp8`: both instances keep FP8 KV (their compat records say
    so) and a completion through the hand-off is what one FP8 instance generates."""
    from pdd_sidecar.engine.generate import generate

    # Through the hand-off (its bytes are checked), not prefilled on the decode.
    s, url = _start(serves, tmp_path, "--prefill-tp", "1", "--decode-tp", "2",
                    "--decode-dcp", "2", "--block-size", str(BLOCK), "--kv-cache-dtype", "fp8",
                    "--local-prefill-tokens", "0")
    prompt = [(i * 37 + 11) % 256 for i in range(3 * BLOCK + 5)]
    status, body = http("POST", f"{url}/v1/completions",
                        {"prompt": prompt, "max_tokens": 7, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == generate("builtin", prompt, 7, block_size=BLOCK,
                                                       kv_cache_dtype="fp8")
    row_bytes = 3 * (32 + 4 + 8 * 2)  # the built-in model's FP8 token, every layer
    assert body["pdd"]["transfer"]["bytes"] == len(prompt) * row_bytes
    _stop_and_check(s, signal.SIGTERM, *_snapshot(s)[:2])


def test_sigint_stops_all(serves: list[Serve], tmp_path: Path) -> None:
    s, url = _start(serves, tmp_path, "--prefill-tp", "2", "--decode-tp", "1")
    pids, pgids, tree = _snapshot(s)
    assert sorted(tree.values()) == ["decode", "prefill", "prefill", "router"], tree
    status, body = http("POST", f"{url}/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3,
                                                          "temperature": 0})
    assert status == 200, body
    _stop_and_check(s, signal.SIGINT, pids, pgids)


@pytest.mark.parametrize("victim", ["decode", "router"])
def test_a_dead_child_stops_the_stack_with_an_error(
    serves: list[Serve], tmp_path: Path, victim: str
) -> None:
    s, _ = _start(serves, tmp_path, "--prefill-tp", "2", "--prefill-dcp", "2")
    pids, pgids, tree = _snapshot(s)
    (leader,) = [pid for pid, role in tree.items()
                 if role == victim and _proc_stat(pid) is not None
                 and _proc_stat(pid)[0] == s.process.pid]  # type: ignore[index]
    assert os.getpgid(leader) == leader
    os.kill(leader, signal.SIGKILL)
    rc = s.process.wait(timeout=60)
    err = s.stderr()
    assert rc == 1, err
    assert f"{victim} killed by SIGKILL" in err, err
    assert str(tmp_path / "logs0" / f"{victim}.log") in err, err
    _assert_nothing_left(pids, pgids)


def test_a_child_refusing_to_start_is_reported(tmp_path: Path) -> None:
    """Settings the command does not set pass through to the instances; one they refuse stops
    the start-up with the instance's own message and nothing left running."""
    env = {**os.environ, "PDD_LEASE_SECONDS": "soon"}
    proc = subprocess.run(
        [sys.executable, "-m", "pdd_cli.main", "serve", "--port", "0", "--log-dir",
         str(tmp_path)], env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1, proc
    assert "exited with code 2" in proc.stderr, proc.stderr
    assert "PDD_LEASE_SECONDS: must be a number, got 'soon'" in proc.stderr, proc.stderr
    assert "ready at" not in proc.stdout
    assert _with_env(b"PDD_LEASE_SECONDS=soon") == []


def _with_env(item: bytes) -> list[int]:
    """Live processes whose environment holds `item` (what this test's stack inherited)."""
    out = []
    for pid in _all_pids():
        st = _proc_stat(pid)
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if st is not None and st[2] != "Z" and item in env:
            out.append(pid)
    return out


def test_sigterm_during_start_up_stops_all(serves: list[Serve], tmp_path: Path) -> None:
    s = Serve(["--prefill-tp", "2", "--decode-tp", "2"], tmp_path / "logs")
    serves.append(s)
    deadline = time.monotonic() + 60
    while len({r for r in s.tree().values() if r}) < 3:  # every child spawned, none ready yet
        assert time.monotonic() < deadline, s.tree()
        assert s.process.poll() is None, s.stderr()
        time.sleep(0.05)
    pids, pgids, _ = _snapshot(s)
    s.process.send_signal(signal.SIGTERM)
    assert s.process.wait(timeout=60) == 0, s.stderr()
    out = s.rest()
    assert not any(READY.match(line) for line in out), out
    assert out[-2:] == ["pdd serve: SIGTERM received, stopping", "pdd serve: stopped"], out
    _assert_nothing_left(pids, pgids)


def _metric(url: str, name: str, labels: str = "") -> float:
    """One sample of an instance's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _samples(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return {line.rsplit(" ", 1)[0] for line in resp.read().decode().splitlines()
                if line and not line.startswith("#")}


def test_ready_means_warm_a_round_trip_ran_before_the_ready_line(
    serves: list[Serve], tmp_path: Path
) -> None:
    """Before any request of ours: each instance warmed up, and one completion went through
    the router, the prefill and the decode (their request counters say so)."""
    s, url = _start(serves, tmp_path, "--block-size", str(BLOCK))
    status, ready = http("GET", f"{url}/readyz")
    assert status == 200 and ready["warm"] is True, ready
    (prefill,) = ready["prefill"]
    (decode,) = ready["decode"]
    assert _metric(url, "pdd_router_warmup_seconds") > 0
    for role, inst in (("prefill", prefill), ("decode", decode)):
        assert _metric(inst, "pdd_warmup_seconds") > 0, role
        ok = _metric(inst, "pdd_requests_total",
                     f'{{endpoint="{role}",outcome="ok",role="{role}"}}')
        assert ok >= 1, f"{role}: no request answered before the ready line"
        status, body = http("GET", f"{inst}/readyz")
        assert status == 200 and body["ready"], body
        load = body["load"]  # what the router's policy weighs (serve/router/routing_policy.py)
        assert set(load) == {"running", "waiting", "free_blocks", "num_blocks"}, load
        assert 0 <= load["free_blocks"] <= load["num_blocks"], load
        assert load["running"] >= 0 and load["waiting"] >= 0, load
        # No --num-blocks: a CPU instance keeps the small fixed pool
        status, info = http("GET", f"{inst}/v1/info")
        pool = info["kv_pool"]
        assert (pool["blocks"], pool["sized_by"], pool["block_size"]) == (
            1024, "cpu default", BLOCK), pool
        assert pool["tokens"] == info["kv_capacity_tokens"] == 1024 * BLOCK
        assert pool["longest_sequence_tokens"] == min(1024 * BLOCK, info["max_model_len"])
    assert _metric(decode, "pdd_kv_transfer_bytes_total", '{rank="0"}') > 0
    # Garbage-collector pauses are timed in every process, each generation.
    for name, where in (("pdd_router_gc_pause_seconds", url), ("pdd_gc_pause_seconds", prefill),
                        ("pdd_gc_pause_seconds", decode)):
        samples = _samples(where)
        for g in range(3):
            assert f'{name}_count{{generation="{g}"}}' in samples, (where, name, g)


def _completion(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    status, body = http("POST", f"{url}/v1/completions",
                        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True}, timeout=300)
    assert status == 200, body
    return body  # type: ignore[no-any-return]


ROW_BYTES = 3 * 40 * 4  # one token's KV in the built-in model: layers x latent x float32


def test_xpyd_routes_each_prefix_and_each_conversation_to_the_instance_holding_it(
    serves: list[Serve], tmp_path: Path
) -> None:
    """`pdd serve --prefill-replicas 2 --decode-replicas 2`: four instances and a router, each
    instance its own log; 8 prefixes x 8 requests in random order, 8 at a time, find their
    prefix on the prefill that computed it (the instances' own hit counters: >= 90 % of what
    one shared cache would hit), both prefills take some; a conversation's next turn goes to
    the decode that served its first and moves only its new tokens' KV. Without the prompt in
    the router's prefill choice or in what it records as routed, the prefixes land on both
    prefills and miss; without what the decodes served, the turns land on either decode."""
    # Every request through a prefill: the prefills' prefix routing is what is checked.
    s, url = _start(serves, tmp_path, "--prefill-replicas", "2", "--decode-replicas", "2",
                    "--router-workers", "1", "--block-size", str(BLOCK),
                    "--local-prefill-tokens", "0")
    assert s.stdout[-1].endswith("(2 x prefill tp1/dcp1, 2 x decode tp1/dcp1)"), s.stdout
    pids, pgids, tree = _snapshot(s)
    assert sorted(tree.values()) == ["decode", "decode", "prefill", "prefill", "router"], tree
    assert len(pgids) == 5
    logs = tmp_path / "logs0"
    assert {p.name for p in logs.iterdir()} >= {"prefill-0.log", "prefill-1.log",
                                                "decode-0.log", "decode-1.log", "router.log"}
    status, ready = http("GET", f"{url}/readyz")
    assert status == 200 and len(ready["prefill"]) == len(ready["decode"]) == 2, ready
    assert all(ready["prefill"].values()) and all(ready["decode"].values()), ready
    prefills, decodes = list(ready["prefill"]), list(ready["decode"])
    assert len(set(prefills + decodes)) == 4

    rng = random.Random(38)
    shared = 4 * BLOCK
    prefixes = [[(i * 41 + p * 67 + 5) % 256 for i in range(shared)] for p in range(8)]
    prompts = [prefixes[p] + [(j * 13 + p * 7 + k * 3 + 1) % 256 for k in range(3 + j)]
               for p in range(8) for j in range(8)]
    order = list(range(len(prompts)))
    rng.shuffle(order)

    def hits_and_queries() -> list[tuple[float, float]]:
        return [(_metric(p, "pdd_prefix_cache_hits_total"),
                 _metric(p, "pdd_prefix_cache_queries_total")) for p in prefills]

    before = hits_and_queries()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        bodies = dict(zip(order, pool.map(lambda i: _completion(url, prompts[i], 3), order),
                          strict=True))
    after = hits_and_queries()
    hits = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    queries = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    assert sum(queries) == sum(len(p) for p in prompts)
    assert all(q > 0 for q in queries), queries  # the prefixes spread over both prefills
    # One shared cache would hit each prefix for its 7 later requests (the rest is unique).
    ratio = sum(hits) / (8 * 7 * shared)
    assert 0.9 <= ratio <= 1.0, (ratio, hits, queries)
    for p in range(8):  # each prefix lives on one prefill
        assert len({bodies[p * 8 + j]["pdd"]["prefill"] for j in range(8)}) == 1, p
    for i in rng.sample(range(len(prompts)), 12):
        assert bodies[i]["choices"][0]["token_ids"] == reference_tokens(prompts[i], 3, BLOCK), i

    # Conversations of their own (a decode keeps one partial last unit per parent, so chats
    # sharing a prefix would replace each other's): the first turn, then the next in another
    # order.
    first = {c: [(c * 89 + k * 31 + 3) % 256 for k in range(40)] for c in range(8)}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        turn1 = dict(zip(first, pool.map(lambda c: _completion(url, first[c], 3), first),
                         strict=True))
    follow = {c: first[c] + turn1[c]["choices"][0]["token_ids"] + [9, 8, 7, 6, 5] for c in first}
    again = list(first)
    rng.shuffle(again)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        turn2 = dict(zip(again, pool.map(lambda c: _completion(url, follow[c], 3), again),
                         strict=True))
    for c in first:
        assert turn2[c]["pdd"]["decode"] == turn1[c]["pdd"]["decode"], c
        # the first turn's last token was never fed; the rest of its KV stayed on the decode
        assert turn2[c]["pdd"]["transfer"]["bytes"] == (1 + 5) * ROW_BYTES, (c, turn2[c]["pdd"])
    assert len({b["pdd"]["decode"] for b in [*bodies.values(), *turn1.values()]}) == 2

    _stop_and_check(s, signal.SIGINT, pids, pgids)
