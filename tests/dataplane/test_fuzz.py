"""Hostile input against a running stack: thousands of random and malformed bodies at the router
and at the instances' own endpoints get 4xx answers in the error format, never a 5xx; every
process stays up, every KV block comes back, and a normal request still gets its tokens.

The cases come from a seeded generator (PDD_FUZZ_SEED, PDD_FUZZ_CASES), so a failure names the
case index that reproduces it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import http.client as httpc
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
from runtime_fixtures import LocalCluster, Proc, http, plan_json

from pdd_sidecar.kv.grants import GRANT_FIELDS, sign

pytestmark = pytest.mark.dataplane

BLOCK = 16
SEED = int(os.environ.get("PDD_FUZZ_SEED", "20261130"))
CASES = int(os.environ.get("PDD_FUZZ_CASES", "2000"))
VOCAB = 256
CLIENT_TIMEOUT_S = 60.0


class Raw:
    """JSON text put into a body as is: literals json.dumps cannot write (NaN is fine, but not
    a 5,000-digit integer, nesting deeper than its recursion, or bytes that are not UTF-8)."""

    def __init__(self, text: bytes) -> None:
        self.text = text


def _deep(depth: int, open_: bytes = b"[", close: bytes = b"]") -> Raw:
    return Raw(open_ * depth + b"1" + close * depth)


def _deep_obj(depth: int) -> Raw:
    return Raw(b'{"a":' * depth + b"1" + b"}" * depth)


def _hostile_values(rng: random.Random) -> list[Any]:
    """Built once per run: some are megabytes."""
    return [
        None, True, False, 0, -1, 1, 2, 255, 256, 2**31, 2**31 - 1, 2**63, 2**63 - 1, -2**63 - 1,
        2**64, 10**400, -10**400, 1e308, -1e308, 5e-324, -0.0, 0.5, 1.0, 2.0000001, 1e-9,
        float("nan"), float("inf"), float("-inf"),
        Raw(b"NaN"), Raw(b"Infinity"), Raw(b"-Infinity"), Raw(b"1e999"), Raw(b"-1e999"),
        Raw(b"9" * 5000), Raw(b"-" + b"9" * 4301), Raw(b"1" + b"0" * 400 + b".5"),
        Raw(b"1E400"), Raw(b"0x10"), Raw(b"01"), Raw(b"+1"), Raw(b".5"), Raw(b"true1"),
        "", " ", "0", "1", "true", "null", "NaN", "\x00", "\ud800", "\udfff", "a\udc80b",
        "\ud83d\ude00", "\U0001f600" * 50, "\u202e\u0301\ufeff", "\uffff", "\\u0000",
        "<|endoftext|>", "x" * 1000, "x" * 100_000, "\u00e9" * 1_000_000,
        [], {}, [None], [True, False], [1.5], ["1"], [-1], [VOCAB], [2**63], list(range(300)),
        *([rng.randrange(VOCAB) for _ in range(n)] for n in (2000, 9000, 200_000)),
        [[1, 2]], [[[[]]]], {"$ne": 1}, {"": None}, {"a" * 1000: 1},
        *(_deep(n) for n in (50, 900, 1100, 5000, 200_000)), _deep_obj(200), _deep_obj(2000),
        Raw(b"\xed\xa0\x80"), Raw(b'"\xff\xfe"'), Raw(b'"\xed\xa0\x80"'), Raw(b'"\\ud800"'),
        Raw(b'"\\uDFFF\\uD800"'), Raw(b'"\\u"'), Raw(b"[1,]"), Raw(b'{"a" 1}'),
    ]


def _embed(body: Any, ascii_only: bool = True) -> bytes:
    """``body`` as JSON bytes, each Raw placed where it sits. Not ASCII-only: UTF-8 as is, lone
    surrogates included (which makes the body invalid UTF-8)."""
    raws: dict[str, bytes] = {}

    def walk(v: Any) -> Any:
        if isinstance(v, Raw):
            marker = f"__raw{len(raws)}__"
            raws[marker] = v.text
            return marker
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    text = json.dumps(walk(body), ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    for marker, raw in raws.items():
        text = text.replace(f'"{marker}"'.encode(), raw)
    return text


@dataclass
class Target:
    name: str
    url: str
    base: Callable[[random.Random], dict[str, Any]]
    grant_field: bool = False


@dataclass
class Outcome:
    index: int
    target: str
    label: str
    status: int  # 0: no HTTP answer
    body: str
    error_in_200: bool = False


def _mutate(rng: random.Random, body: dict[str, Any], target: Target, key: bytes,
            values: list[Any]) -> tuple[Any, str]:
    """One to three hostile changes to a well-formed body; returns it and what was done."""
    done = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        op = rng.random()
        fields = list(body) if isinstance(body, dict) else []
        if not isinstance(body, dict) or op < 0.06:
            body = rng.choice(values)
            done.append(f"body={_label(body)}")
            break
        if op < 0.45 and fields:
            f = rng.choice(fields)
            body[f] = rng.choice(values)
            done.append(f"{f}={_label(body[f])}")
        elif op < 0.55 and fields:
            f = rng.choice(fields)
            del body[f]
            done.append(f"-{f}")
        elif op < 0.65:
            f = rng.choice(["sampling", "stream_options", "messages", "prompt", "stop"])
            inner = body.get(f) if isinstance(body.get(f), dict) else {}
            inner = dict(inner)
            inner[rng.choice(["temperature", "top_p", "top_k", "seed", "include_usage",
                              "role", "content", "x", "logit_bias", "min_tokens",
                              "repetition_penalty", "presence_penalty"])] = rng.choice(values)
            body[f] = inner
            done.append(f"{f}.*={_label(inner)}")
        elif op < 0.75:
            f = rng.choice(["temperature", "top_p", "top_k", "seed", "n", "best_of", "stop",
                            "stop_token_ids", "ignore_eos", "stream", "logprobs", "echo",
                            "model", "max_completion_tokens", "hold_s", "request_id",
                            "first_token", "max_new_tokens", "kv_transfer_params", "tools",
                            "suffix", "add_generation_prompt", "logit_bias", "min_tokens",
                            "frequency_penalty", "repetition_penalty", "\ud800"])
            body[f] = rng.choice(values)
            done.append(f"{f}={_label(body[f])}")
        elif target.grant_field and isinstance(body.get("kv_transfer_params"), dict):
            grant = dict(body["kv_transfer_params"])
            f = rng.choice(sorted(grant) or ["request_id"])
            grant[f] = rng.choice(values)
            resign = (rng.random() < 0.5 and f != "signature" and not _has_raw(grant)
                      and all(k in grant for k in GRANT_FIELDS))
            if resign:
                grant = sign({k: v for k, v in grant.items() if k != "signature"}, key)
            body["kv_transfer_params"] = grant
            done.append(f"grant.{f}={_label(grant[f])}{' (re-signed)' if resign else ''}")
        else:
            f = rng.choice(fields) if fields else "x"
            small = len(_embed(body.get(f))) < 1000  # a thousand 3 MB strings is no test
            body[f] = [body.get(f)] * rng.choice([2, 1000] if small else [2])
            done.append(f"{f}=[...]")
    return body, "; ".join(done)


def _has_raw(v: Any) -> bool:
    if isinstance(v, Raw):
        return True
    if isinstance(v, dict):
        return any(_has_raw(x) for x in v.values())
    if isinstance(v, list):
        return any(_has_raw(x) for x in v)
    return False


def _label(v: Any) -> str:
    text = repr(v.text[:40]) if isinstance(v, Raw) else repr(v)
    return text if len(text) < 60 else text[:57] + "..."


def _bytes_case(rng: random.Random, good: bytes) -> tuple[bytes, str]:
    """Malformed at the byte level: cut short, not UTF-8, not JSON at all, or too big."""
    op = rng.random()
    if op < 0.35:
        cut = rng.randrange(0, max(1, len(good)))
        return good[:cut], f"truncated at {cut}"
    if op < 0.5:
        at = rng.randrange(0, len(good) + 1)
        junk = rng.choice([b"\xff", b"\xed\xa0\x80", b"\x00", b"\xc3", b"}", b'"', b"\\"])
        return good[:at] + junk + good[at:], f"{junk!r} inserted at {at}"
    if op < 0.6:
        return rng.choice([b"", b" ", b"null", b"[]", b'"x"', b"1", b"\xef\xbb\xbf{}",
                           b"{}", b'{"a":1,"a":2}', b"NaN", b"{" * 100_000]), "raw text"
    if op < 0.7:
        size = rng.choice([9 << 20, 17 << 20])
        return b'{"prompt": "' + b"a" * size + b'"}', f"{size >> 20} MiB body"
    return rng.randbytes(rng.choice([1, 10, 1000, 100_000])), "random bytes"


def _send(url: str, data: bytes, timeout: float) -> tuple[int, str]:
    """POST raw bytes; 0 when no HTTP answer came (the server may close on a huge body), 1
    when none came within ``timeout`` (a hang)."""
    host, _, rest = url.removeprefix("http://").partition("/")
    name, port = host.split(":")
    conn = httpc.HTTPConnection(name, int(port), timeout=timeout)
    try:
        conn.request("POST", "/" + rest, body=data,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    except TimeoutError:
        return 1, f"no answer within {timeout:.0f}s"
    except (ConnectionError, httpc.RemoteDisconnected) as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def _error_shaped(text: str) -> bool:
    try:
        body = json.loads(text)
    except ValueError:
        return False
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str)


def _plan(p: tuple[int, int], d: tuple[int, int]) -> str:
    return plan_json(p, d, BLOCK)


def _stack(cluster: LocalCluster) -> dict[str, Proc]:
    routing = cluster.plan_file(_plan((2, 2), (2, 1)))
    prefill = cluster.instance("prefill", 2, 2, routing, BLOCK, PDD_LEASE_SECONDS=5)
    decode = cluster.instance("decode", 2, 1, routing, BLOCK, PDD_PREFILL_URLS=prefill.url,
                              PDD_NUM_BLOCKS=64)
    router = cluster.router([prefill], [decode])
    for proc in (prefill, decode, router):
        proc.wait_ready()
    return {"prefill": prefill, "decode": decode, "router": router}


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]


def _stats_all_free(url: str) -> tuple[bool, Any]:
    status, stats = http("GET", f"{url}/v1/stats", timeout=10)
    assert status == 200, stats
    return all(r["free_blocks"] == stats["num_blocks"] for r in stats["ranks"]), stats


def test_hostile_bodies_get_4xx_and_leave_the_stack_whole(cluster: LocalCluster) -> None:
    from pdd_sidecar.engine.generate import generate

    t0 = time.monotonic()
    stack = _stack(cluster)
    print(f"\nstack ready in {time.monotonic() - t0:.0f}s")
    router, prefill, decode = (stack[k].url for k in ("router", "prefill", "decode"))
    rng = random.Random(SEED)
    grants: list[dict[str, Any]] = []

    def fresh_grant() -> dict[str, Any]:
        status, body = http("POST", f"{prefill}/v1/prefill", {
            "prompt_ids": _prompt(rng), "max_tokens": 6, "ignore_eos": True,
            "sampling": {"temperature": 0}}, timeout=CLIENT_TIMEOUT_S)
        assert status == 200, body
        return body["kv_transfer_params"]  # type: ignore[no-any-return]

    grants = [fresh_grant() for _ in range(12)]

    def sampling(r: random.Random) -> dict[str, Any]:
        return {"temperature": r.choice([0, 0.7]), "top_p": 1.0, "top_k": 0,
                "seed": r.randrange(2**32)}

    targets = [
        Target("router /v1/completions", f"{router}/v1/completions", lambda r: {
            "prompt": r.choice([_prompt(r), "hello \u00e9\u4e2d"]), "max_tokens": r.randint(1, 4),
            "temperature": 0, "stream": r.random() < 0.3}),
        Target("router /v1/chat/completions", f"{router}/v1/chat/completions", lambda r: {
            "messages": [{"role": "user", "content": "hi there"}], "max_tokens": r.randint(1, 4),
            "temperature": 0, "stream": r.random() < 0.3}),
        Target("prefill /v1/prefill", f"{prefill}/v1/prefill", lambda r: {
            "request_id": f"fz{r.randrange(10**9)}", "prompt_ids": _prompt(r),
            "max_tokens": r.randint(1, 4), "sampling": sampling(r), "stop_token_ids": [],
            "ignore_eos": False}),
        Target("prefill /v1/release", f"{prefill}/v1/release", lambda r: {
            "kv_transfer_params": copy.deepcopy(r.choice(grants))}, grant_field=True),
        Target("prefill /v1/claim", f"{prefill}/v1/claim", lambda r: {
            "kv_transfer_params": copy.deepcopy(r.choice(grants)), "hold_s": 1},
            grant_field=True),
        Target("decode /v1/decode", f"{decode}/v1/decode", lambda r: {
            "request_id": f"fz{r.randrange(10**9)}", "first_token": r.randrange(VOCAB),
            "max_new_tokens": r.randint(0, 3), "kv_transfer_params": copy.deepcopy(
                r.choice(grants)), "sampling": sampling(r), "stop_token_ids": [],
            "ignore_eos": False, "stream": r.random() < 0.3}, grant_field=True),
    ]

    values = _hostile_values(rng)

    completions, chat = targets[0], targets[1]
    # The reported ones first: bools as ints, ids past the vocabulary, lone surrogates, prompts
    # the model takes but the decode's cache (1,024 tokens a rank at dcp 1) can never hold.
    known = [(completions, {"prompt": [1, 2], "max_tokens": True}),
             (completions, {"prompt": [VOCAB], "max_tokens": 2}),
             (completions, {"prompt": "\ud800", "max_tokens": 2}),
             (chat, {"messages": [{"role": "user", "content": "a\udfffb"}]}),
             (completions, {"prompt": [7] * 1100, "max_tokens": 2, "temperature": 0}),
             (completions, {"prompt": [7] * 1000, "max_tokens": 100, "temperature": 0}),
             (completions, {"prompt": [7] * 8192, "max_tokens": 1}),
             (completions, {"prompt": [1], "max_tokens": 10**30}),
             # One request id twice while the first holds its blocks (stopped the engine loop).
             (targets[2], {"request_id": "twice", "prompt_ids": [1, 2, 3], "max_tokens": 4}),
             (targets[2], {"request_id": "twice", "prompt_ids": [1, 2, 3], "max_tokens": 4}),
             # A request id UTF-8 cannot carry in a notification (killed the pull threads).
             (targets[5], {"request_id": "\udfff", "first_token": 1, "max_new_tokens": 2,
                           "kv_transfer_params": grants[0]})]

    def build(i: int) -> tuple[Target, bytes, str]:
        """Case i, from its own generator: the same whatever order the threads take, and only
        a few bodies (some are megabytes) in memory at once."""
        if i < len(known):
            target, body = known[i]
            return target, _embed(body), "known: " + _label(body)
        r = random.Random(SEED * 1_000_003 + i)
        target = r.choice(targets)
        good = target.base(r)
        if r.random() < 0.2:
            data, label = _bytes_case(r, _embed(good))
            return target, data, label
        mutated, label = _mutate(r, good, target, cluster.key, values)
        if (target.name.endswith("claim") and isinstance(mutated, dict)
                and isinstance(mutated.get("hold_s"), int | float)
                and not isinstance(mutated["hold_s"], bool)):
            # A valid hold pins real blocks for that long; keep the end of the test near.
            mutated["hold_s"] = min(mutated["hold_s"], 2)
        return target, _embed(mutated, ascii_only=r.random() < 0.8), label

    def run(i: int) -> Outcome:
        target, data, label = build(i)
        status, text = _send(target.url, data, CLIENT_TIMEOUT_S)
        if 400 <= status < 500 and not _error_shaped(text):
            status = -status  # answered, but not in the error format
        return Outcome(i, target.name, label, status, text[:300],
                       status == 200 and '"error"' in text)

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(run, range(CASES)))
    elapsed = time.monotonic() - started

    table = collections.Counter((o.target, o.status) for o in outcomes)
    summary = "\n".join(f"  {t:32} {s}: {n}" for (t, s), n in sorted(table.items()))
    print(f"\n{len(outcomes)} hostile bodies in {elapsed:.0f}s (seed {SEED}):\n{summary}")
    for o in outcomes[:len(known)]:
        print(f"  {o.label[:70]:72} -> {o.status} {o.body[:90]}")
    server_errors = [o for o in outcomes if o.status >= 500]
    assert not server_errors, "\n".join(
        f"case {o.index} {o.target} [{o.label}] -> {o.status} {o.body}"
        for o in server_errors[:15])
    hung = [o for o in outcomes if o.status == 1]
    assert not hung, "\n".join(f"case {o.index} {o.target} [{o.label}]: {o.body}"
                               for o in hung[:15])
    # A 413 may reach a client still sending its body as a reset instead of the answer; any
    # other case must be answered.
    unanswered = [o for o in outcomes if o.status == 0 and "MiB body" not in o.label]
    assert not unanswered, "\n".join(f"case {o.index} {o.target} [{o.label}]: {o.body}"
                                     for o in unanswered[:15])
    shapeless = [o for o in outcomes if o.status < 0]
    assert not shapeless, "\n".join(f"case {o.index} {o.target} [{o.label}] -> {-o.status} "
                                     f"not an error object: {o.body}" for o in shapeless[:15])
    in_stream = [o for o in outcomes if o.error_in_200]
    print(f"200 answers carrying an error: {len(in_stream)}")

    t0 = time.monotonic()
    for name, proc in stack.items():
        assert proc.alive(), f"{name} died under hostile input"
    for url in (prefill, decode):
        deadline = time.monotonic() + 20
        while True:
            free, stats = _stats_all_free(url)
            if free:
                break
            assert time.monotonic() < deadline, f"{url}: blocks still held: {stats}"
            time.sleep(0.2)
    prompt = [(i * 37 + 11) % VOCAB for i in range(29)]
    status, body = http("POST", f"{router}/v1/completions",
                        {"prompt": prompt, "max_tokens": 8, "temperature": 0},
                        timeout=CLIENT_TIMEOUT_S)
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == generate("builtin", prompt, 8, block_size=BLOCK)
    print(f"checks after the run took {time.monotonic() - t0:.0f}s")


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-40, 1e-37])
def test_a_vanishing_temperature_samples_the_greedy_token(temperature: float) -> None:
    """Logits divided by a denormal temperature overflow to inf, and inf - inf is nan, which
    torch.multinomial refuses (that one request would stop the instance's engine loop) and any
    draw turns into a wrong token."""
    import torch

    from pdd_sidecar.engine.sampling import SamplingParams, sample

    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(SEED)) * 30
    params = [SamplingParams(temperature, top_p, top_k, seed=7)
              for top_p, top_k in ((1.0, 0), (0.9, 0), (1.0, 40))]
    assert sample(logits, params, [0, 1, 2]) == logits.argmax(-1).tolist()


def test_a_decode_named_unlike_its_grant_still_frees_the_prefill_blocks_at_once(
        cluster: LocalCluster) -> None:
    """The prefill holds blocks under the grant's request id; a caller that names the decode
    request otherwise must not leave them held until the lease (60 s) runs out."""
    routing = cluster.plan_file(_plan((2, 2), (2, 1)))
    prefill = cluster.instance("prefill", 2, 2, routing, BLOCK)
    decode = cluster.instance("decode", 2, 1, routing, BLOCK, PDD_PREFILL_URLS=prefill.url)
    for proc in (prefill, decode):
        proc.wait_ready()
    prompt = [(i * 37 + 11) % VOCAB for i in range(40)]
    status, pre = http("POST", f"{prefill.url}/v1/prefill", {
        "request_id": "asked-as-p", "prompt_ids": prompt, "max_tokens": 5, "ignore_eos": True,
        "sampling": {"temperature": 0}})
    assert status == 200 and pre["kv_transfer_params"], pre
    assert not _stats_all_free(prefill.url)[0]
    status, out = http("POST", f"{decode.url}/v1/decode", {
        "request_id": "asked-as-d", "first_token": pre["first_token"], "max_new_tokens": 4,
        "kv_transfer_params": pre["kv_transfer_params"], "ignore_eos": True,
        "sampling": {"temperature": 0}})
    assert status == 200, out
    deadline = time.monotonic() + 5
    while not (free := _stats_all_free(prefill.url))[0]:
        assert time.monotonic() < deadline, f"prefill still holds the read blocks: {free[1]}"
        time.sleep(0.1)
