"""The router's per-request path: a prompt whose uncached part is short is prefilled on its
decode, a long one through a prefill, a follow-up turn the decode caches on the decode again;
with no prefill ready the decode serves (fallback) or the router refuses, and it shows."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
import torch  # noqa: F401  (the tier needs it; never skip)
from runtime_fixtures import LocalCluster, Proc, http, plan_json, reference_tokens  # noqa: E402

pytestmark = pytest.mark.dataplane

BLOCK = 16
THRESHOLD = 32


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    cluster = LocalCluster(tmp_path_factory.mktemp("paths"))
    try:
        routing = cluster.plan_file(plan_json((1, 1), (1, 1), BLOCK))
        prefill = cluster.instance("prefill", 1, 1, routing, BLOCK)
        decode = cluster.instance("decode", 1, 1, routing, BLOCK, PDD_PREFILL_URLS=prefill.url)
        router = cluster.router([prefill], [decode], PDD_BLOCK_SIZE=BLOCK,
                                PDD_ROUTER_LOCAL_PREFILL_TOKENS=THRESHOLD)
        refusing = cluster.router([prefill], [decode], PDD_BLOCK_SIZE=BLOCK,
                                  PDD_ROUTER_NO_PREFILL="refuse", PDD_ROUTER_READY_WAIT_S=0.5)
        for p in (prefill, decode, router, refusing):
            p.wait_ready()
        yield {"prefill": prefill, "decode": decode, "router": router, "refusing": refusing}
    finally:
        cluster.close()


def _complete(router: Proc, prompt: list[int], max_tokens: int = 4) -> tuple[int, Any]:
    return http("POST", f"{router.url}/v1/completions",
                {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                 "ignore_eos": True})


def _paths(router: Proc) -> dict[str, float]:
    status, text = http("GET", f"{router.url}/metrics")
    assert status == 200
    return {m[1]: float(m[2]) for m in re.finditer(
        r'^pdd_router_request_paths_total\{path="(\w+)"\} (\S+)$', str(text), re.M)}


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 11 + salt) % 241 + 2 for i in range(n)]


def test_short_prompts_prefill_on_the_decode_long_ones_through_a_prefill(
        stack: dict[str, Proc]) -> None:
    before = _paths(stack["router"])
    short, long = _prompt(THRESHOLD, 1), _prompt(THRESHOLD + 1, 2)
    status, body = _complete(stack["router"], short)
    assert status == 200, body
    assert body["pdd"]["path"] == "local_prefill" and body["pdd"]["prefill"] is None
    assert body["choices"][0]["token_ids"] == reference_tokens(short, 4, BLOCK)
    status, body = _complete(stack["router"], long)
    assert status == 200, body
    assert body["pdd"]["path"] == "remote_prefill" and body["pdd"]["prefill"]
    assert body["choices"][0]["token_ids"] == reference_tokens(long, 4, BLOCK)
    after = _paths(stack["router"])
    assert after.get("local_prefill", 0) - before.get("local_prefill", 0) == 1
    assert after.get("remote_prefill", 0) - before.get("remote_prefill", 0) == 1


def test_a_follow_up_turn_the_decode_caches_is_prefilled_there(stack: dict[str, Proc]) -> None:
    """The first turn is long (through a prefill); the second extends it by a few tokens, and
    the decode holds the first turn's KV: its uncached part is short."""
    first = _prompt(100, 3)
    status, body = _complete(stack["router"], first)
    assert status == 200 and body["pdd"]["path"] == "remote_prefill", body
    second = [*first, *body["choices"][0]["token_ids"], 7, 8, 9]
    status, body = _complete(stack["router"], second)
    assert status == 200, body
    assert body["pdd"]["path"] == "local_prefill"
    assert body["choices"][0]["token_ids"] == reference_tokens(second, 4, BLOCK)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96


def test_what_only_a_prefill_serves_goes_through_one(stack: dict[str, Proc]) -> None:
    status, body = http("POST", f"{stack['router'].url}/v1/completions",
                        {"prompt": _prompt(8, 4), "max_tokens": 2, "n": 2, "temperature": 0})
    assert status == 200, body
    assert all(p["path"] == "remote_prefill" for p in [body["pdd"]]), body["pdd"]


def _wait_prefill_gone(router: Proc) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, ready = http("GET", f"{router.url}/readyz")
        if isinstance(ready, dict) and not any(ready.get("prefill", {}).values()):
            return
        time.sleep(0.2)
    raise AssertionError(f"the router still sees a ready prefill: {ready}")


def test_with_no_prefill_ready_the_decode_serves_and_it_shows(stack: dict[str, Proc]) -> None:
    """Last in this module: the prefill is killed."""
    stack["prefill"].kill()
    _wait_prefill_gone(stack["router"])
    before = _paths(stack["router"])
    long = _prompt(80, 5)
    status, body = _complete(stack["router"], long)
    assert status == 200, body
    assert body["pdd"]["path"] == "fallback" and body["pdd"]["prefill"] is None
    assert body["choices"][0]["token_ids"] == reference_tokens(long, 4, BLOCK)
    assert _paths(stack["router"]).get("fallback", 0) - before.get("fallback", 0) == 1
    status, ready = http("GET", f"{stack['router'].url}/readyz")
    assert status == 200, ready  # still serving: the fallback keeps it routable
    # What a decode cannot serve alone is refused, naming why.
    status, body = http("POST", f"{stack['router'].url}/v1/completions",
                        {"prompt": long, "max_tokens": 2, "n": 2})
    assert status == 503 and "prefill" in body["error"]["message"], body
    # A router told to refuse answers 503 and is not ready.
    _wait_prefill_gone(stack["refusing"])
    status, body = _complete(stack["refusing"], _prompt(8, 6))
    assert status == 503 and "prefill" in body["error"]["message"], body
    status, ready = http("GET", f"{stack['refusing'].url}/readyz")
    assert status == 503 and "prefill" in ready["reason"], ready
