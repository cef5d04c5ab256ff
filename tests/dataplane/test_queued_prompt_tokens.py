"""`pdd_queued_prompt_tokens` under load (issue 40: the prefill's scaling signal). The gauge is
set between engine steps, so with whole prompts prefilled in one step it reads 0 at every
scrape (tests/dataplane/test_runtime.py checks that idle value); here prompts of 320 tokens in
16-token steps from concurrent clients leave prompt work waiting between steps, and the prefill's
/metrics must say so, read through the operator's own parser, then fall back to 0 once the
load is gone."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest

from pdd_operator.autoscale_metrics import parse_instance
from pdd_sidecar.serve.local_stack import LocalStack, StackConfig

pytestmark = pytest.mark.dataplane

CLIENTS = 4
PROMPT_TOKENS = 320
STEP_TOKENS = 16


def _metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        return str(r.read().decode())


def _gauge(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def test_queued_prompt_tokens_is_nonzero_under_load_and_zero_after(tmp_path: Path) -> None:
    cfg = StackConfig(port=0, log_level="WARNING", max_step_tokens=STEP_TOKENS,
                      chunk_tokens=STEP_TOKENS, long_chunk_tokens=STEP_TOKENS)
    failures: list[str] = []
    done = [0]
    stop = threading.Event()

    def client(c: int, router: str) -> None:
        k = 0
        while not stop.is_set():
            k += 1
            body = {"prompt": [(c * 131 + k * 17 + j) % 250 + 1 for j in range(PROMPT_TOKENS)],
                    "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            req = urllib.request.Request(f"{router}/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    assert len(json.loads(resp.read())["choices"][0]["token_ids"]) == 4
                done[0] += 1
            except Exception as exc:  # noqa: BLE001 - reported below
                failures.append(f"{type(exc).__name__}: {exc}")

    with LocalStack(cfg, tmp_path / "logs") as stack:
        stack.start(timeout_s=180)
        threads = [threading.Thread(target=client, args=(c, stack.url), daemon=True)
                   for c in range(CLIENTS)]
        for t in threads:
            t.start()
        seen: list[float] = []
        deadline = time.monotonic() + 60
        try:
            while len([q for q in seen if q > 0]) < 3 and time.monotonic() < deadline:
                text = _metrics(stack.prefill_url)
                gauges = parse_instance(text)
                q = gauges.queued_prompt_tokens
                assert q is not None and q == _gauge(text, "pdd_queued_prompt_tokens")
                # Only admitted prompts' remainders: at most every client's whole prompt.
                assert 0 <= q <= CLIENTS * PROMPT_TOKENS, q
                if q > 0:
                    assert gauges.running + gauges.waiting >= 1, text
                seen.append(q)
                time.sleep(0.05)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)
        assert [q for q in seen if q > 0], f"queued prompt tokens stayed 0 in {len(seen)} " \
                                           f"scrapes of {done[0]} requests"
        idle = _metrics(stack.prefill_url)
        assert parse_instance(idle).queued_prompt_tokens == 0
    assert not failures, failures[:3]
    print(f"{len(seen)} scrapes, queued prompt tokens up to {max(seen):.0f}, {done[0]} requests")
