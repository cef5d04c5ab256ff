"""FP8 latent KV through running instances and real NIXL READs on the CPU: a P/D pair whose KV
is FP8 on both sides gives the tokens of one FP8 instance for every layout the hand-off takes,
moving 52-byte tokens per layer of the built-in model (32 e4m3 values, one fp32 scale, 8 bf16
RoPE values) instead of 160 in float32; a chat whose decode reuses its own FP8 KV gives the
tokens of a fresh FP8 prefill of the whole conversation; a decode whose KV dtype differs from
its prefill's is refused at the handshake and at the hand-off, naming both values."""

from __future__ import annotations

import re
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
from runtime_fixtures import LocalCluster, Proc, error_text, http, plan_json, unready_reason

from pdd_sidecar.engine.generate import generate

pytestmark = pytest.mark.dataplane

BLOCK = 16
LAYERS = 3
FP8_ROW_BYTES = LAYERS * (32 + 4 + 8 * 2)  # kv/fp8_layout.py's token of the built-in model
FP8 = {"PDD_KV_CACHE_DTYPE": "fp8"}
_REFS: dict[tuple[tuple[int, ...], int], list[int]] = {}


def _tokens(n: int, salt: int) -> list[int]:
    return [(i * 53 + salt * 29 + 7) % 256 for i in range(n)]


def _fp8_reference(prompt: list[int], max_tokens: int) -> list[int]:
    """One FP8 instance, one process: a fresh prefill of ``prompt``, then greedy decode."""
    key = (tuple(prompt), max_tokens)
    if key not in _REFS:
        _REFS[key] = generate("builtin", prompt, max_tokens, block_size=BLOCK,
                              kv_cache_dtype="fp8")
    return _REFS[key]


def _stack(cluster: LocalCluster, p: tuple[int, int], d: tuple[int, int],
           prefill_env: dict[str, Any], decode_env: dict[str, Any],
           ready: bool = True) -> dict[str, Proc]:
    routing = cluster.plan_file(plan_json(p, d, BLOCK))
    prefill = cluster.instance("prefill", p[0], p[1], routing, BLOCK, **prefill_env)
    decode = cluster.instance("decode", d[0], d[1], routing, BLOCK,
                              PDD_PREFILL_URLS=prefill.url, **decode_env)
    procs = {"prefill": prefill, "decode": decode}
    if ready:
        procs["router"] = cluster.router([prefill], [decode])
        for proc in procs.values():
            proc.wait_ready()
    return procs


def _complete(router: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    status, body = http("POST", f"{router}/v1/completions",
                        {"prompt": prompt, "temperature": 0, "max_tokens": max_tokens,
                         "ignore_eos": True}, timeout=300)
    assert status == 200, body
    return dict(body)


@pytest.mark.parametrize("p,d", [((1, 1), (1, 1)), ((2, 2), (2, 2)), ((1, 1), (2, 2))])
def test_fp8_pd_gives_the_tokens_of_one_fp8_instance(
        cluster: LocalCluster, p: tuple[int, int], d: tuple[int, int]) -> None:
    stack = _stack(cluster, p, d, FP8, FP8)
    _, info = http("GET", f"{stack['decode'].url}/v1/info")
    assert info["compat"]["kv_cache_dtype"] == "fp8"
    for prompt in (_tokens(5, 1), _tokens(70, 2)):
        body = _complete(stack["router"].url, prompt, 10)
        assert body["choices"][0]["token_ids"] == _fp8_reference(prompt, 10)
        # every chunk read once, as FP8 bytes
        assert body["pdd"]["transfer"]["bytes"] == len(prompt) * FP8_ROW_BYTES


TURNS, FIRST, NEW, MAX_TOKENS = 3, 40, 9, 10


@pytest.mark.parametrize("p,d", [((1, 1), (1, 1)), ((1, 1), (2, 2))])
def test_an_fp8_chat_reusing_its_decode_kv_gives_the_tokens_of_a_fresh_prefill(
        cluster: LocalCluster, p: tuple[int, int], d: tuple[int, int]) -> None:
    """Each turn's prompt is the one before, its completion and new tokens; the decode keeps
    the FP8 KV it wrote and reads only the new tokens (and the last answer's last token), yet
    every turn's tokens are those of one FP8 instance prefilling the whole conversation."""
    stack = _stack(cluster, p, d, FP8, FP8)
    prompt = _tokens(FIRST, 5)
    for k in range(TURNS):
        body = _complete(stack["router"].url, prompt, MAX_TOKENS)
        completion = body["choices"][0]["token_ids"]
        assert completion == _fp8_reference(prompt, MAX_TOKENS), k
        moved = body["pdd"]["transfer"]["bytes"]
        assert moved == (FIRST if k == 0 else 1 + NEW) * FP8_ROW_BYTES, (k, moved)
        prompt = prompt + completion + _tokens(NEW, 15 + k)


def test_a_decode_whose_kv_dtype_differs_is_refused_naming_both(cluster: LocalCluster) -> None:
    stack = _stack(cluster, (1, 1), (1, 1), FP8, {}, ready=False)
    prefill, decode = stack["prefill"], stack["decode"]
    prefill.wait_ready()
    status, reason = unready_reason(decode, "kv_cache_dtype")
    assert status == 503
    # the prefill refuses the decode's handshake: its side of the message
    assert "kv_cache_dtype: local 'fp8' != decode 0 rank 0 'auto'" in reason, reason
    assert "--kv-cache-dtype" in reason, reason
    # the hand-off itself is refused with the same message, before any byte moves
    prompt = _tokens(20, 3)
    status, pre = http("POST", f"{prefill.url}/v1/prefill",
                       {"request_id": "r-fp8", "prompt_ids": prompt})
    assert status == 200, pre
    status, body = http("POST", f"{decode.url}/v1/decode", {
        "request_id": "r-fp8", "first_token": pre["first_token"], "max_new_tokens": 3,
        "kv_transfer_params": pre["kv_transfer_params"]})
    assert status == 409, body
    text = error_text(body)
    assert "kv_cache_dtype: local" in text and "'fp8'" in text and "'auto'" in text, body
    status, released = http("POST", f"{prefill.url}/v1/release",
                            {"kv_transfer_params": pre["kv_transfer_params"]})
    assert status == 200 and released == {"released": True}


def test_fp8_prefixes_evicted_to_host_memory_load_back_with_the_same_tokens(
        cluster: LocalCluster) -> None:
    """A 16-block FP8 prefill with a host tier of 160 FP8 blocks: 12 prompts turn the device
    cache over, and asked again the oldest come back from host memory as FP8 bytes (the load
    counter counts 156-byte tokens) with the tokens of one FP8 instance."""
    block_bytes = BLOCK * FP8_ROW_BYTES
    env = {**FP8, "PDD_NUM_BLOCKS": 16, "PDD_HOST_KV_CACHE_GIB": 160 * block_bytes / (1 << 30)}
    stack = _stack(cluster, (1, 1), (1, 1), env, FP8)
    router, prefill = stack["router"].url, stack["prefill"].url
    prompts = [_tokens(2 * BLOCK + 7 + 9 * (i % 3), 100 + i) for i in range(12)]
    for q in prompts:
        assert _complete(router, q, 3)["choices"][0]["token_ids"] == _fp8_reference(q, 3)
    _, text = http("GET", f"{prefill}/metrics")
    loaded = _metric_sum(text, "pdd_host_kv_load_bytes_total")
    for q in prompts[:4]:  # the first ones left the device long ago
        body = _complete(router, q, 3)
        assert body["choices"][0]["token_ids"] == _fp8_reference(q, 3)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == (
            (len(q) - 1) // BLOCK * BLOCK)
    _, text = http("GET", f"{prefill}/metrics")
    moved = _metric_sum(text, "pdd_host_kv_load_bytes_total") - loaded
    assert moved > 0 and moved % block_bytes == 0, moved
    assert _metric_sum(text, "pdd_host_kv_blocks_total") == 160


def _metric_sum(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
