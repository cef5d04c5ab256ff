"""The router's per-request decision: through a prefill, on the decode, or the fallback."""

from __future__ import annotations

from typing import Any

import pytest

from pdd_sidecar.serve.router.prefill_path import (
    FALLBACK,
    LOCAL,
    REMOTE,
    prefill_path,
    uncached_tokens,
)


@pytest.mark.parametrize("prompt, cached, want", [
    (32, 0, 32), (32, 16, 16), (32, 32, 1), (32, 64, 1), (1, 0, 1), (1, 1, 1), (10, -3, 10),
])
def test_the_last_prompt_token_always_runs(prompt: int, cached: int, want: int) -> None:
    assert uncached_tokens(prompt, cached) == want


@pytest.mark.parametrize("prompt, cached, threshold, want", [
    (32, 0, 256, LOCAL),  # a short prompt runs where it decodes
    (256, 0, 256, LOCAL),  # at the threshold: still local
    (257, 0, 256, REMOTE),  # one past it: through a prefill
    (4096, 3968, 256, LOCAL),  # long, but the decode caches all but 128 tokens of it
    (4096, 3712, 256, REMOTE),  # 384 uncached
    (32, 0, 0, REMOTE),  # 0 turns the decision off
    (32, 32, 0, REMOTE),
])
def test_local_when_the_uncached_part_is_at_most_the_threshold(
        prompt: int, cached: int, threshold: int, want: str) -> None:
    assert prefill_path(prompt, cached, threshold, True, "fallback") == want


def test_what_only_a_prefill_serves_goes_through_one() -> None:
    assert prefill_path(8, 0, 256, True, "fallback", decode_can=False) == REMOTE
    assert prefill_path(8, 0, 256, False, "fallback", decode_can=False) is None


@pytest.mark.parametrize("prompt", [8, 100_000])
def test_no_prefill_ready_falls_back_or_refuses_as_configured(prompt: int) -> None:
    assert prefill_path(prompt, 0, 256, False, "fallback") == FALLBACK
    assert prefill_path(prompt, 0, 0, False, "fallback") == FALLBACK
    assert prefill_path(prompt, 0, 256, False, "refuse") is None


def _router(**env: str) -> Any:
    from types import SimpleNamespace

    from pdd_sidecar.env import RouterSettings
    from pdd_sidecar.serve.router.upstreams import Router

    settings = RouterSettings.from_env({"PDD_PREFILL_URLS": "http://p:1",
                                        "PDD_DECODE_URLS": "http://d:1,http://d:2",
                                        "PDD_BLOCK_SIZE": "16", **env})
    router = Router(settings, SimpleNamespace(vocab_size=256, max_model_len=4096))
    router.prefill.mark("http://p:1", True)
    for url in ("http://d:1", "http://d:2"):
        router.decode.mark(url, True)
        router.decode.local_prefill.add(url)  # its /readyz says so
    return router


def _req(prompt: list[int], **fields: Any) -> Any:
    from pdd_sidecar.serve.openai.openai_request import GenRequest

    req = GenRequest("completion", prompt, 4, {}, [], [], True, False, False)
    for k, v in fields.items():
        setattr(req, k, v)
    return req


def test_the_router_counts_what_the_decode_caches() -> None:
    """A long first turn goes through the prefill; the decode that served it holds its KV, so
    the next turn, a few tokens longer, is prefilled there."""
    from pdd_sidecar.serve.router.upstreams import Trip

    router = _router(PDD_ROUTER_LOCAL_PREFILL_TOKENS="32")
    first = list(range(1, 201))
    assert router.choose_path(_req(first), Trip()) == REMOTE
    router.decode.served("http://d:2", [*first, 7, 8, 9])
    assert router.choose_path(_req([*first, 7, 8, 9, 10, 11]), Trip()) == LOCAL
    assert router.choose_path(_req(list(range(300, 340))), Trip()) == REMOTE


def test_the_router_falls_back_only_when_no_prefill_is_ready() -> None:
    from pdd_sidecar.serve.router.upstreams import Trip

    router = _router()
    long = list(range(1, 1001))
    assert router.choose_path(_req(long), Trip()) == REMOTE
    assert router.choose_path(_req(long[:8]), Trip(warmup=True)) == REMOTE  # warms the hand-off
    assert router.choose_path(_req(long[:8], n=2), Trip()) == REMOTE
    router.prefill.mark("http://p:1", False)
    assert router.choose_path(_req(long), Trip()) == FALLBACK
    assert router.choose_path(_req(long), Trip(warmup=True)) == FALLBACK
    assert router.choose_path(_req(long, n=2), Trip()) is None
    assert router.routable and not router.pools_ready
    # A decode that does not say it prefills itself (an older one) gets no such request.
    router.decode.local_prefill.clear()
    assert router.choose_path(_req(long), Trip()) is None and not router.routable
    refusing = _router(PDD_ROUTER_NO_PREFILL="refuse")
    refusing.prefill.mark("http://p:1", False)
    assert refusing.choose_path(_req(long[:8]), Trip()) is None
    assert not refusing.routable


def test_losing_every_prefill_posts_one_warning() -> None:
    import asyncio

    from pdd_operator.conditions import DISAGGREGATED, NO_PREFILL_READY
    from pdd_operator.reconciler import Reconciler

    posted: list[tuple[str, str]] = []

    class Kube:
        async def post_event(self, body: Any, kind: str, reason: str, message: str) -> None:
            posted.append((kind, reason))

    def status(ok: bool) -> dict[str, Any]:
        return {"conditions": [{"type": DISAGGREGATED, "status": "True" if ok else "False",
                                "reason": "PrefillReady" if ok else NO_PREFILL_READY,
                                "message": "m"}]}

    async def passes() -> None:
        rec = Reconciler(Kube())  # type: ignore[arg-type]
        body = {"metadata": {"uid": "u1", "namespace": "ns", "name": "ds"}}
        # Starting (no prefill yet), ready, lost, back.
        for old, new in ((None, status(False)), (status(False), status(True)),
                         (status(True), status(False)), (status(False), status(True))):
            rec._transition_events(body, old or {}, new)
            await asyncio.sleep(0)
        await asyncio.gather(*rec._background)

    asyncio.run(passes())
    assert posted == [("Warning", NO_PREFILL_READY)]
