"""`n` > 1 and completions' list of prompts, end to end on the CPU: a router, a prefill and a
decode of the built-in model, through plain HTTP and the official `openai` SDK.

Several choices run one prefill and one KV hand-off, then one decode sequence per choice
sharing the prompt's blocks; each choice has its own index, seed stream and finish reason, and
usage counts the prompt once. A list of prompts runs each as its own request, choices indexed
`i * n + j`. Both layouts (P TP1 -> D TP1, P TP2/DCP2 -> D TP2/DCP2) give the same choices.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from runtime_fixtures import LocalCluster, error_text, http, pd_stack, reference_tokens

pytestmark = pytest.mark.dataplane

BLOCK = 16
N = 4
# Distinct prompts, so no test's decode takes another's KV from its prefix cache.
PROMPTS = {name: [(7 * i + 3 * k) % 250 + 1 for i in range(length)]
           for k, (name, length) in enumerate([("greedy", 14), ("seeded", 11), ("shared", 100),
                                               ("list0", 9), ("list1", 13), ("list2", 6),
                                               ("sdk", 10), ("fresh", 100), ("layout", 70),
                                               ("twin", 14), ("stopend", 12)])}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    cluster = LocalCluster(tmp_path_factory.mktemp("choices"))
    try:
        # Slow decode steps keep a request running while the test looks at the pool.
        procs = pd_stack(cluster, (1, 1), (1, 1), BLOCK,
                         decode_env={"PDD_FAULT_STEP_DELAY_S": "0.05"})
        yield {role: p.url for role, p in procs.items()}
    finally:
        cluster.close()


def _metric(url: str, name: str, labels: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _handoffs(stack: dict[str, str]) -> tuple[float, float, float]:
    """(prefill requests, decode requests, KV bytes pulled) so far."""
    return (_metric(stack["prefill"], "pdd_requests_total",
                    '{endpoint="prefill",outcome="ok",role="prefill"}'),
            _metric(stack["decode"], "pdd_requests_total",
                    '{endpoint="decode",outcome="ok",role="decode"}'),
            _metric(stack["decode"], "pdd_kv_transfer_bytes_total", '{rank="0"}'))


def _complete(router: str, **body: Any) -> dict[str, Any]:
    status, out = http("POST", f"{router}/v1/completions", body)
    assert status == 200, out
    return out  # type: ignore[no-any-return]


def _ids(out: dict[str, Any]) -> list[list[int]]:
    assert [c["index"] for c in out["choices"]] == list(range(len(out["choices"])))
    return [c["token_ids"] for c in out["choices"]]


def test_greedy_choices_are_the_single_answer_from_one_prefill_and_one_handoff(
        stack: dict[str, str]) -> None:
    router, prompt = stack["router"], PROMPTS["greedy"]
    before = _handoffs(stack)
    out = _complete(router, prompt=prompt, max_tokens=8, temperature=0, n=N)
    after = _handoffs(stack)
    assert after[0] - before[0] == 1 and after[1] - before[1] == 1, (before, after)
    # The prompt's KV moved once: as many bytes as one request of a prompt as long.
    twin = _complete(router, prompt=PROMPTS["twin"], max_tokens=8, temperature=0)
    moved = out["pdd"]["transfer"]["bytes"]
    assert moved == twin["pdd"]["transfer"]["bytes"] > 0
    assert after[2] - before[2] == moved
    single = _complete(router, prompt=prompt, max_tokens=8, temperature=0)
    want = single["choices"][0]["token_ids"]
    assert want == reference_tokens(prompt, 8, BLOCK)
    assert _ids(out) == [want] * N
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["usage"]["completion_tokens"] == 8 * N
    assert out["usage"]["total_tokens"] == len(prompt) + 8 * N


def test_seeded_choices_are_reproducible_and_differ_by_index(stack: dict[str, str]) -> None:
    router, prompt = stack["router"], PROMPTS["seeded"]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 1234}
    first = _ids(_complete(router, **body, n=N))
    again = _ids(_complete(router, **body, n=N))
    assert first == again
    assert len({tuple(c) for c in first}) == N, first  # distinct per index
    # Choice 0 keeps the request's seed: it is the n = 1 answer.
    assert _ids(_complete(router, **body))[0] == first[0]
    other = _ids(_complete(router, **{**body, "seed": 99}, n=N))
    assert other != first


def test_a_choice_a_stop_string_ended_stops_generating_while_the_others_run_on(
        stack: dict[str, str]) -> None:
    """Stop strings are the router's to find; it tells the decode, so the ended choice stops
    generating tokens that would be thrown away, and the request ends with its last choice
    rather than with the ended one's max_tokens."""
    router, decode = stack["router"], stack["decode"]
    body = {"prompt": PROMPTS["stopend"], "max_tokens": 48, "temperature": 1.0, "seed": 5,
            "n": 2, "ignore_eos": True}
    a, b = (c["text"] for c in _complete(router, **body)["choices"])
    # Three characters early in choice 0, first seen there, and nowhere in choice 1.
    stop = next((a[i:i + 3] for i in range(1, min(12, len(a) - 3))
                 if a.find(a[i:i + 3]) == i and a[i:i + 3] not in b), None)
    assert stop is not None, (a, b)
    before = _metric(decode, "pdd_tokens_total", '{kind="generated"}')
    out = _complete(router, **body, stop=[stop])
    generated = _metric(decode, "pdd_tokens_total", '{kind="generated"}') - before
    c0, c1 = out["choices"]
    assert (c0["text"], c0["finish_reason"]) == (a[:a.index(stop)], "stop"), c0
    assert (c1["text"], c1["finish_reason"]) == (b, "length"), c1
    assert out["usage"]["completion_tokens"] == len(c0["token_ids"]) + 48
    # Both choices to max_tokens would be 2 x 47 decode tokens; choice 0 ended within its
    # first 15 characters, and the decode stopped it a step or two later.
    assert generated < 2 * 47 - 20, generated
    # The decode's call: bad fields named; an unknown request is no error (it may have ended).
    for bad, field in [({"request_id": "", "choice": 0}, "request_id"),
                       ({"request_id": "x", "choice": 16}, "choice"),
                       ({"request_id": "x", "choice": "1"}, "choice")]:
        status, err = http("POST", f"{decode}/v1/decode/end", bad)
        assert status == 400 and error_text(err).startswith(f"{field}:"), (status, err)
    assert http("POST", f"{decode}/v1/decode/end", {"request_id": "x", "choice": 1})[0] == 202


def _used(decode: str) -> int:
    status, ready = http("GET", f"{decode}/readyz")
    assert status == 200, ready
    return int(ready["load"]["num_blocks"] - ready["load"]["free_blocks"])


def _streamed_used(stack: dict[str, str], prompt: list[int], n: int, max_tokens: int
                   ) -> tuple[int, list[list[int]]]:
    """Decode blocks in use while a streamed request of ``n`` choices is mid-decode, and each
    choice's tokens."""
    client = openai.OpenAI(base_url=f"{stack['router']}/v1", api_key="none")
    tokens: list[list[int]] = [[] for _ in range(n)]
    used = -1
    stream = client.completions.create(model="builtin", prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, n=n, stream=True,
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        for c in chunk.choices:
            tokens[c.index] += (c.model_extra or {}).get("token_ids", [])
        if used < 0 and all(len(t) >= 3 for t in tokens):  # every choice decoding
            used = _used(stack["decode"])
    return used, tokens


def test_choices_share_the_prompts_decode_blocks(stack: dict[str, str]) -> None:
    """n = 8 holds the prompt's blocks once: well below eight times one request's."""
    idle = _used(stack["decode"])
    single, _ = _streamed_used(stack, PROMPTS["fresh"], 1, 12)
    eight, tokens = _streamed_used(stack, PROMPTS["shared"], 8, 12)
    assert single - idle > 0 and eight > 0
    need = -(-(len(PROMPTS["shared"]) + 12) // BLOCK)  # one request's table
    shared = len(PROMPTS["shared"]) // BLOCK
    assert eight - idle <= need + 7 * (need - shared), (idle, single, eight)
    assert eight - idle < 0.5 * 8 * (single - idle), (idle, single, eight)
    assert all(t == tokens[0] for t in tokens) and len(tokens[0]) == 12


def test_a_list_of_prompts_equals_separate_requests(stack: dict[str, str]) -> None:
    router = stack["router"]
    prompts = [PROMPTS["list0"], PROMPTS["list1"], PROMPTS["list2"]]
    body = {"max_tokens": 6, "temperature": 0.8, "seed": 5}
    alone = [_complete(router, prompt=p, n=2, **body) for p in prompts]
    together = _complete(router, prompt=prompts, n=2, **body)
    assert _ids(together) == [ids for out in alone for ids in _ids(out)]
    assert together["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert together["usage"]["completion_tokens"] == sum(
        o["usage"]["completion_tokens"] for o in alone)
    # Text prompts too (the byte codec), and one bad element named.
    texts = _complete(router, prompt=["ab", "cd"], max_tokens=3, temperature=0)
    assert [c["index"] for c in texts["choices"]] == [0, 1]
    status, err = http("POST", f"{router}/v1/completions",
                       {"prompt": [[1, 2], [3, 999]], "max_tokens": 2})
    assert status == 400 and err["error"]["param"] == "prompt[1]", err
    assert "prompt[1]" in error_text(err)
    status, err = http("POST", f"{router}/v1/completions", {"prompt": [1], "n": 17})
    assert status == 400 and err["error"]["param"] == "n", err


def test_a_streamed_list_interleaves_its_choices_and_ends_once(stack: dict[str, str]) -> None:
    router = stack["router"]
    prompts = [PROMPTS["list0"], PROMPTS["list2"]]
    req = urllib.request.Request(
        f"{router}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({"prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 0,
                         "stream": True, "stream_options": {"include_usage": True}}).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = [line[6:] for line in resp.read().decode().splitlines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    tokens: dict[int, list[int]] = {}
    finishes: dict[int, str] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        tokens.setdefault(choice["index"], []).extend(choice["token_ids"])
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    want = [reference_tokens(p, 5, BLOCK) for p in prompts]
    assert tokens == {0: want[0], 1: want[0], 2: want[1], 3: want[1]}
    assert finishes == dict.fromkeys(range(4), "length")
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == sum(map(len, prompts)) and usage["completion_tokens"] == 20


def test_the_openai_sdk_reads_n_choices_streamed_and_not(stack: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=f"{stack['router']}/v1", api_key="none")
    prompt = PROMPTS["sdk"]
    done = client.completions.create(model="builtin", prompt=prompt, max_tokens=6, n=3,
                                     temperature=0.7, seed=3)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert done.usage is not None and done.usage.completion_tokens == 18
    streamed = client.completions.create(model="builtin", prompt=prompt, max_tokens=6, n=3,
                                         temperature=0.7, seed=3, stream=True)
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in done.choices]

    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model="builtin", messages=messages,  # type: ignore[arg-type]
                                          max_tokens=5, n=3, temperature=0.9, seed=8)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.usage is not None and chat.usage.completion_tokens == 15
    streamed_chat = client.chat.completions.create(
        model="builtin", messages=messages, max_tokens=5, n=3,  # type: ignore[arg-type]
        temperature=0.9, seed=8, stream=True)
    contents = ["", "", ""]
    roles = set()
    for chunk in streamed_chat:
        for c in chunk.choices:
            contents[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
    assert roles == {0, 1, 2}
    assert contents == [c.message.content for c in chat.choices]


def test_layouts_give_the_same_choices(stack: dict[str, str], tmp_path: Path) -> None:
    """P TP2/DCP2 -> D TP2/DCP2 against the module's P TP1 -> D TP1."""
    body = {"prompt": PROMPTS["layout"], "max_tokens": 6, "temperature": 0.9, "seed": 21,
            "n": N}
    want = _complete(stack["router"], **body)
    cluster = LocalCluster(tmp_path)
    try:
        router = pd_stack(cluster, (2, 2), (2, 2), BLOCK)["router"].url
        got = _complete(router, **body)
        assert _ids(got) == _ids(want)
        greedy = _complete(router, prompt=PROMPTS["layout"], max_tokens=6, temperature=0, n=3)
        assert _ids(greedy) == [reference_tokens(PROMPTS["layout"], 6, BLOCK)] * 3
    finally:
        cluster.close()


def test_each_choice_follows_the_grammar_with_its_own_matcher(stack: dict[str, str]) -> None:
    """Structured output with n: each choice's first token advances its own matcher on the
    prefill, and each forked decode sequence gets its own, advanced by its first token."""
    router = stack["router"]
    words = ["yes", "no", "maybe", "never"]
    out = _complete(router, prompt=PROMPTS["seeded"][:5], max_tokens=8, temperature=1.0,
                    seed=4, n=6, guided_choice=words)
    assert [c["index"] for c in out["choices"]] == list(range(6))
    for c in out["choices"]:
        assert c["text"] in words and c["finish_reason"] == "stop", c
    assert len({c["text"] for c in out["choices"]}) > 1  # the choices drew apart
    # One byte each: every choice's grammar completes with its first token, on the prefill.
    single = _complete(router, prompt=PROMPTS["seeded"][:6], max_tokens=8, temperature=1.0,
                       seed=4, n=5, guided_choice=["a", "b", "c"])
    for c in single["choices"]:
        assert c["text"] in "abc" and len(c["text"]) == 1 and c["finish_reason"] == "stop", c
    # Some choices end on the prefill ("a"), the others go on on the decode.
    mixed = [c["text"] for seed in (1, 2, 3) for c in _complete(
        router, prompt=PROMPTS["seeded"][:7], max_tokens=8, temperature=1.0, seed=seed, n=8,
        guided_choice=["a", "bcd", "bce"])["choices"]]
    assert set(mixed) <= {"a", "bcd", "bce"} and "a" in mixed and len(set(mixed)) > 1, mixed


def test_a_list_with_echo_and_logprobs_equals_separate_requests(stack: dict[str, str]) -> None:
    """lm-eval's batched log-likelihood form: several text prompts, echo, logprobs, no new
    tokens; each choice is what that prompt alone answers."""
    router = stack["router"]
    texts = ["hello there", "the quick brown fox", "xyz"]
    body = {"echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    together = _complete(router, prompt=texts, **body)
    alone = [_complete(router, prompt=t, **body)["choices"][0] for t in texts]
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    for got, want, text in zip(together["choices"], alone, texts, strict=True):
        assert got["text"] == want["text"] == text
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(
            want["logprobs"]["token_logprobs"], abs=1e-5)
    # With n, each prompt's choices (index i * n + j) each carry what that prompt alone does.
    body = {**body, "max_tokens": 2, "n": 2}
    paired = _complete(router, prompt=texts, **body)["choices"]
    alone = [_complete(router, prompt=t, **{**body, "n": 1})["choices"][0] for t in texts]
    assert [c["index"] for c in paired] == list(range(2 * len(texts)))
    for i, got in enumerate(paired):
        want = alone[i // 2]
        assert got["text"] == want["text"] and got["text"].startswith(texts[i // 2])
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(
            want["logprobs"]["token_logprobs"], abs=1e-5)
