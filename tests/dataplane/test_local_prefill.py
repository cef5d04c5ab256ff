"""Decode-local prefill: a decode instance runs a prompt itself and answers the same tokens as
the prefill → hand-off → decode path, over P TP1 → D TP1 and a DCP layout (each decode rank
keeping its share as a prefill rank would), chunked, and through its own prefix cache."""

from __future__ import annotations

import concurrent.futures
import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
import torch  # noqa: F401  (the tier needs it; never skip)
from runtime_fixtures import LocalCluster, Proc, http, pd_stack, reference_tokens  # noqa: E402

pytestmark = pytest.mark.dataplane

BLOCK = 16
CHUNK = 32  # prompts longer than this run in several chunks on the decode


def local_decode(decode: Proc, prompt: list[int], max_new: int, rid: str,
                 **extra: Any) -> tuple[list[int], dict[str, Any]]:
    """The tokens (first one included) and the final line of a local-prefill decode stream."""
    body = {"request_id": rid, "local_prefill": True, "prompt_ids": prompt,
            "max_new_tokens": max_new, "sampling": {"temperature": 0.0}, "ignore_eos": True,
            "stream": True, **extra}
    req = urllib.request.Request(f"{decode.url}/v1/decode", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    tokens: list[int] = []
    final: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = json.loads(raw)
            if "token" in line:
                tokens.append(line["token"])
            else:
                final = line
    return tokens, final


# A decode that speculates (n-gram drafts verified in its steps, always on): a step that
# prefills a prompt drafts nothing, and the tokens stay the same.
SPECULATING = {"PDD_SPECULATIVE_METHOD": "ngram", "PDD_SPECULATIVE_TOKENS": "3",
               "PDD_SPECULATIVE_MIN_ACCEPTANCE": "0"}


@pytest.fixture(scope="module", params=[((1, 1), (1, 1), {}), ((2, 1), (2, 2), {}),
                                        ((1, 1), (1, 1), SPECULATING)],
                ids=["tp1-to-tp1", "tp2-to-tp2dcp2", "tp1-speculating"])
def stack(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    cluster = LocalCluster(tmp_path_factory.mktemp("local_prefill"))
    p, d, extra = request.param
    try:
        yield pd_stack(cluster, p, d, BLOCK, decode_env={"PDD_CHUNK_TOKENS": CHUNK, **extra})
    finally:
        cluster.close()


def _remote(stack: dict[str, Proc], prompt: list[int], max_tokens: int) -> list[int]:
    status, body = http("POST", f"{stack['router'].url}/v1/completions",
                        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True})
    assert status == 200, body
    return list(body["choices"][0]["token_ids"])


@pytest.mark.parametrize("length", [5, 40, 83])  # one chunk; several; several and a tail
def test_local_prefill_answers_the_tokens_of_the_hand_off(stack: dict[str, Proc],
                                                          length: int) -> None:
    prompt = [(i * 13 + length) % 251 + 1 for i in range(length)]
    remote = _remote(stack, prompt, 6)
    local, final = local_decode(stack["decode"], prompt, 5, f"local-{length}")
    assert local == remote == reference_tokens(prompt, 6, BLOCK)
    assert final["done"] and final["token_ids"] == local
    assert final["transfer"]["bytes"] == 0  # nothing was pulled
    # Its timing is a prefill's (the router lays it out as local_queue, local_compute).
    assert {"queue", "compute"} <= set(final["timing"]) and "claim" not in final["timing"]


def test_local_prefill_uses_and_fills_the_decode_prefix_cache(stack: dict[str, Proc]) -> None:
    """A second turn extending the first's conversation finds the first's units cached on
    this decode (computed by its own prefill), and answers the same tokens as from scratch."""
    first = [(i * 7) % 241 + 3 for i in range(50)]
    tokens, final = local_decode(stack["decode"], first, 3, "turn-1")
    assert tokens == reference_tokens(first, 4, BLOCK)
    second = [*first, *tokens, 9, 8, 7]
    again, final = local_decode(stack["decode"], second, 3, "turn-2")
    assert again == reference_tokens(second, 4, BLOCK)
    unit = BLOCK * int(stack["decode"].env["PDD_DCP_SIZE"])
    assert final["cached_tokens"] >= (len(first) // unit) * unit > 0


def test_a_prompt_prefilled_beside_running_sequences(stack: dict[str, Proc]) -> None:
    """Local prompts arrive while hand-off sequences decode (repetitive ones, which a
    speculating decode drafts for): every one gets the reference's tokens."""
    loop = [3, 4, 5, 6] * 10
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        remote = [pool.submit(_remote, stack, loop, 40) for _ in range(2)]
        local = [pool.submit(local_decode, stack["decode"],
                             [(i * 29 + j) % 199 + 1 for i in range(70)], 7, f"beside-{j}")
                 for j in range(2)]
        for f in remote:
            assert f.result() == reference_tokens(loop, 40, BLOCK)
        for j, f in enumerate(local):
            prompt = [(i * 29 + j) % 199 + 1 for i in range(70)]
            assert f.result()[0] == reference_tokens(prompt, 8, BLOCK)
    if "PDD_SPECULATIVE_METHOD" in stack["decode"].env:  # it did speculate meanwhile
        _, text = http("GET", f"{stack['decode'].url}/metrics")
        drafts = re.search(r"^pdd_spec_decode_num_drafts_total (\S+)$", str(text), re.M)
        assert drafts is not None and float(drafts.group(1)) > 0, drafts


def test_a_local_prefill_request_is_checked(stack: dict[str, Proc]) -> None:
    url = f"{stack['decode'].url}/v1/decode"
    status, body = http("POST", url, {"local_prefill": True, "max_new_tokens": 2})
    assert status == 400 and "prompt_ids" in body["error"]["message"], body
    status, body = http("POST", url, {"local_prefill": True, "prompt_ids": [1, 2],
                                      "first_token": 3})
    assert status == 400 and "first_token" in body["error"]["message"], body
    status, body = http("POST", url, {"local_prefill": "yes", "prompt_ids": [1, 2]})
    assert status == 400 and "local_prefill" in body["error"]["message"], body
