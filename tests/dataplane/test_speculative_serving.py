"""A decode that speculates (n-gram drafts, PDD_SPECULATIVE_*) serves what one that does not
serves: the same tokens greedy and seeded-sampled, the same log-probabilities, stops,
max_tokens, structured output, choices and usage; on every P/D layout, DCP included. Its metrics
count the drafts and the accepted ones."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from runtime_fixtures import (
    LocalAsk,
    LocalCluster,
    local_prefills,
    pd_stack,
    plan_json,
    reference_tokens,
)

pytestmark = pytest.mark.dataplane

BLOCK = 4
SPEC = {"PDD_SPECULATIVE_METHOD": "ngram", "PDD_SPECULATIVE_TOKENS": "3"}
PROMPT = list(b"the cat sat on the mat and the cat sat on the")


def _complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            out: dict[str, Any] = json.loads(resp.read())
            return out
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"HTTP {exc.code}: {exc.read()[:300]!r}") from None


def _counter(metrics: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(
        rf"^{name}_total(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


def _metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        return str(resp.read().decode())


@pytest.mark.parametrize("p,d", [((1, 1), (1, 1)), ((2, 1), (2, 2))],
                         ids=["p1-d1", "p2-d2dcp2"])
def test_greedy_tokens_are_plain_decodings_on_each_layout(tmp_path: Path, p: tuple[int, int],
                                                          d: tuple[int, int]) -> None:
    cluster = LocalCluster(tmp_path)
    try:
        stack = pd_stack(cluster, p, d, BLOCK, decode_env=SPEC)
        n = 40
        out = _complete(stack["router"].url, {"prompt": PROMPT, "max_tokens": n,
                                              "temperature": 0})
        assert out["choices"][0]["token_ids"] == reference_tokens(PROMPT, n, BLOCK)
        assert out["usage"]["completion_tokens"] == n
        m = _metrics(stack["decode"].url)
        drafted = _counter(m, "pdd_spec_decode_num_draft_tokens")
        accepted = _counter(m, "pdd_spec_decode_num_accepted_tokens")
        print(f"{p} -> {d}: drafted {drafted:.0f}, accepted {accepted:.0f}")
        assert 0 < accepted < drafted  # kept drafts and rejected ones both happened
        assert _counter(m, "pdd_spec_decode_num_accepted_tokens_per_pos") == accepted
        # A follow-up turn reads the first one's KV from the decode's prefix cache: the KV its
        # verify steps wrote (kept drafts', never a rejected one's) is plain decoding's.
        follow = [*PROMPT, *out["choices"][0]["token_ids"][:30], *b" and the"]
        hits = _counter(m, "pdd_prefix_cache_hits")
        again = _complete(stack["router"].url, {"prompt": follow, "max_tokens": 12,
                                                "temperature": 0})
        assert again["choices"][0]["token_ids"] == reference_tokens(follow, 12, BLOCK)
        assert _counter(_metrics(stack["decode"].url), "pdd_prefix_cache_hits") > hits
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One prefill, a plain decode and a speculating one (self-disable off: every case
    drafts), a router in front of each."""
    cluster = LocalCluster(tmp_path_factory.mktemp("spec"))
    try:
        routing = cluster.plan_file(plan_json((1, 1), (1, 1), BLOCK))
        prefill = cluster.instance("prefill", 1, 1, routing, BLOCK)
        plain = cluster.instance("decode", 1, 1, routing, BLOCK, PDD_PREFILL_URLS=prefill.url)
        # without its prefix cache: the prompt its drafts look up comes with the request
        spec = cluster.instance("decode", 1, 1, routing, BLOCK, replica=1,
                                PDD_PREFILL_URLS=prefill.url, PDD_PREFIX_CACHE="0",
                                PDD_SPECULATIVE_MIN_ACCEPTANCE="0", **SPEC)
        routers = [cluster.router([prefill], [plain]), cluster.router([prefill], [spec])]
        for proc in (prefill, plain, spec, *routers):
            proc.wait_ready()
        yield [r.url for r in routers], spec.url
    finally:
        cluster.close()


def _both(twins: Any, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    (plain, spec), _ = twins
    return _complete(plain, body), _complete(spec, body)


def _same_logprobs(a: dict[str, Any], b: dict[str, Any]) -> None:
    la, lb = a["logprobs"], b["logprobs"]
    assert la["tokens"] == lb["tokens"]
    assert la["token_logprobs"] == pytest.approx(lb["token_logprobs"], abs=1e-4)
    for ta, tb in zip(la["top_logprobs"], lb["top_logprobs"], strict=True):
        assert set(ta) == set(tb)
        assert [ta[k] for k in ta] == pytest.approx([tb[k] for k in ta], abs=1e-4)


CASES = {
    "greedy": {"temperature": 0},
    "sampled": {"temperature": 0.4, "top_p": 0.95, "seed": 7},
    "cool": {"temperature": 0.15, "seed": 4},
    "hot": {"temperature": 1.5, "top_k": 20, "seed": 11},
    "penalties": {"temperature": 0.3, "seed": 3, "frequency_penalty": 0.1,
                  "repetition_penalty": 1.05, "min_tokens": 5},
    "frequency": {"temperature": 0, "frequency_penalty": 0.3},
    "presence": {"temperature": 0, "presence_penalty": 0.6},
    "repetition": {"temperature": 0, "repetition_penalty": 1.15},
    "logprobs": {"temperature": 0.3, "seed": 5, "logprobs": 3},
    "stop_ids": {"temperature": 0, "stop_token_ids": [ord("m")]},
    "stop_string": {"temperature": 0, "stop": ["mat a"]},
    "short": {"temperature": 0, "max_tokens": 3},
    "choices": {"temperature": 0.3, "seed": 9, "n": 3},
    "regex": {"temperature": 0.6, "seed": 2,
              "structured_outputs": {"regex": "(the cat sat on the mat ){2,5}and"}},
}


# cases whose speculating decode must have drafted (the others may or may not)
DRAFTING = {"greedy", "sampled", "logprobs", "choices", "regex"}
ACCEPTING = {"greedy", "cool", "logprobs", "choices", "regex"}  # and must have kept some


@pytest.mark.parametrize("case", list(CASES))
def test_served_output_is_plain_decodings(twins: Any, case: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 32, **CASES[case]}
    before = _counter(_metrics(twins[1]), "pdd_spec_decode_num_drafts")
    acc_before = _counter(_metrics(twins[1]), "pdd_spec_decode_num_accepted_tokens")
    a, b = _both(twins, body)
    m = _metrics(twins[1])
    print(f"{case}: drafts {_counter(m, 'pdd_spec_decode_num_drafts') - before:.0f}, accepted "
          f"{_counter(m, 'pdd_spec_decode_num_accepted_tokens') - acc_before:.0f}")
    if case in DRAFTING:
        assert _counter(m, "pdd_spec_decode_num_drafts") > before
    if case in ACCEPTING:
        assert _counter(m, "pdd_spec_decode_num_accepted_tokens") > acc_before
    assert len(a["choices"]) == len(b["choices"]) == body.get("n", 1)
    for ca, cb in zip(a["choices"], b["choices"], strict=True):
        assert cb["token_ids"] == ca["token_ids"]
        assert cb["text"] == ca["text"]
        assert cb["finish_reason"] == ca["finish_reason"]
        if "logprobs" in body:
            _same_logprobs(ca, cb)
    # (the second request's prompt is a prefix-cache hit on the shared prefill: cached_tokens)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [b["usage"][k] for k in counts] == [a["usage"][k] for k in counts]


def test_the_speculating_decode_drafted_and_kept_some(twins: Any) -> None:
    _both(twins, {"prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    m = _metrics(twins[1])
    drafts = _counter(m, "pdd_spec_decode_num_drafts")
    accepted = _counter(m, "pdd_spec_decode_num_accepted_tokens")
    assert drafts > 0 and 0 < accepted < _counter(m, "pdd_spec_decode_num_draft_tokens")


def test_prompts_prefilled_on_the_speculating_decode_mid_stream_are_plain_decodings(
        twins: Any) -> None:
    """Short prompts the decode prefills itself (local prefill) arrive while long streams
    speculate: the steps that prefill a prompt and verify drafts at once give every request
    plain decoding's tokens, and no step skips its drafts for a prompt."""
    spec = twins[1]
    before = _counter(_metrics(spec), "pdd_spec_decode_num_drafts")
    asks: list[LocalAsk] = [(f"long-{i}", [*PROMPT, *PROMPT], 72, 0.0) for i in range(2)]
    asks += [(f"short-{i}", [*PROMPT[: 6 + 2 * i], 97 + i], 8, 0.04 * (i + 1)) for i in range(8)]
    got = local_prefills(spec, asks)
    for (rid, prompt, n, _), tokens in zip(asks, got, strict=True):
        assert tokens == reference_tokens(prompt, n, BLOCK), rid
    m = _metrics(spec)
    assert _counter(m, "pdd_spec_decode_num_drafts") > before
    assert 'reason="prefill"' not in m
