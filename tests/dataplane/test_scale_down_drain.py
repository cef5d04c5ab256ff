"""A replica taken out under load loses nothing (issue 40 item 4): `pdd serve` with two prefills
and two decodes under a steady stream of requests; SIGTERM (what the operator's deletion with
the role's drainSeconds as grace period sends) to one decode while it runs streams, then to one
prefill. Every request succeeds; the drained instance finishes what it had (it exits 0, once
idle, well before its drain bound), and no request sent after it started draining is served by
it (the router retries its 503 elsewhere and drops it from its pool)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest

from pdd_sidecar.serve.local_stack import LocalStack, StackConfig

pytestmark = pytest.mark.dataplane

CLIENTS = 6
MAX_TOKENS = 48
DRAIN_S = 60.0  # the bound; an idle instance leaves long before


def _load_of(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=2) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read() or b"{}")
    except OSError:
        return {}
    load = body.get("load") if isinstance(body, dict) else None
    return load if isinstance(load, dict) else {}


class Traffic:
    """Clients sending completions back to back; each result: (sent at, done at, prefill,
    decode, error or None)."""

    def __init__(self, router: str) -> None:
        self.router = router
        self.results: list[tuple[float, float, str | None, str | None, str | None]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(c,), daemon=True)
                         for c in range(CLIENTS)]

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def _client(self, c: int) -> None:
        k = 0
        while not self._stop.is_set():
            k += 1
            body = {"prompt": [(c * 131 + k * 17 + j) % 250 + 1 for j in range(20)],
                    "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            req = urllib.request.Request(f"{self.router}/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            sent = time.monotonic()
            prefill = decode = error = None
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    out = json.loads(resp.read())
                tokens = out["choices"][0]["token_ids"]
                if len(tokens) != MAX_TOKENS:
                    error = f"{len(tokens)} tokens"
                prefill, decode = out["pdd"]["prefill"], out["pdd"]["decode"]
            except urllib.error.HTTPError as exc:
                error = f"HTTP {exc.code}: {exc.read()[:300]!r}"
            except (OSError, KeyError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.results.append((sent, time.monotonic(), prefill, decode, error))

    def served_by(self, url: str, after: float) -> list[float]:
        with self._lock:
            return [s for s, _, p, d, _ in self.results if s > after and url in (p, d)]

    def count(self) -> int:
        with self._lock:
            return len(self.results)


def _drain(stack: LocalStack, traffic: Traffic, role: str) -> tuple[float, str]:
    """SIGTERM the role's second instance just after it took a request; returns when it has
    exited.

    Busy alone is not enough: a sequence seen on its last token may reach its client before
    the signal does on a loaded machine. One that joined since the previous poll has a whole
    stream ahead of it."""
    victim = stack.role_children(role)[1]
    deadline = time.monotonic() + 60
    seen: int | None = None
    while time.monotonic() < deadline:
        load = _load_of(victim.url)
        busy = load.get("running", 0) + load.get("waiting", 0)
        if seen is not None and busy > seen:
            break
        seen = busy if load else None
        time.sleep(0.02)
    else:
        pytest.fail(f"{victim.name} never ran a request under load")
    start = time.monotonic()
    os.kill(victim.pid, signal.SIGTERM)
    assert victim.process is not None
    code = victim.process.wait(timeout=DRAIN_S + 10)
    took = time.monotonic() - start
    assert code == 0, victim.describe_exit()
    assert took < DRAIN_S - 5, f"{victim.name} drained for {took:.1f}s: it was never idle"
    before = traffic.count()
    wait = time.monotonic() + 30
    while traffic.count() < before + 2 * CLIENTS and time.monotonic() < wait:
        time.sleep(0.1)  # the others keep serving
    return start, victim.url


def test_a_drained_decode_and_prefill_finish_their_work_and_take_no_new(
        tmp_path: Path) -> None:
    # Every request through a prefill, so that draining one is seen by the traffic.
    cfg = StackConfig(port=0, prefill_replicas=2, decode_replicas=2, num_blocks=512,
                      log_level="WARNING", drain_s=DRAIN_S, local_prefill_tokens=0)
    with LocalStack(cfg, tmp_path / "logs") as stack:
        stack.start()
        with Traffic(stack.url) as traffic:
            time.sleep(1.0)
            d_start, d_url = _drain(stack, traffic, "decode")
            p_start, p_url = _drain(stack, traffic, "prefill")
        results = list(traffic.results)
    errors = [r for r in results if r[4] is not None]
    assert not errors, f"{len(errors)} of {len(results)} requests failed: {errors[:3]}"
    # Work the victims had when they were told: finished there, successfully.
    assert any(d == d_url and s < d_start < e for s, e, _, d, _ in results), \
        "no stream of the drained decode was running when it was told"
    assert any(p == p_url and s < p_start for s, _, p, _, _ in results)
    # Nothing sent after the drain began went to the drained instance (0.5 s: a request
    # already on its way when the signal came).
    for url, start in ((d_url, d_start), (p_url, p_start)):
        late = [s - start for s, _, p, d, _ in results if s > start + 0.5 and url in (p, d)]
        assert not late, f"{url} served requests sent {late[:5]} s after its drain began"
    after = [r for r in results if r[0] > p_start]
    assert len(after) >= CLIENTS, "the remaining replicas kept serving"
    print(f"{len(results)} requests, none failed; decode drained, then prefill drained")
