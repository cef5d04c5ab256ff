"""The sampling controls clients send (presence / frequency / repetition penalties, logit_bias,
min_tokens): the batched sampler against reference implementations computed independently
(transformers' logits processors, OpenAI's documented formula in plain Python), the fast path
for batches without them, and end to end through the router and real instances on the CPU.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_fixtures import LocalCluster

from pdd_sidecar.engine import sampling
from pdd_sidecar.engine.sampling import (
    SamplingError,
    SamplingParams,
    TokenHistory,
    adjust_logits,
    needs_history,
    sample,
)

pytestmark = pytest.mark.dataplane

V = 97


def _random(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 4


def _history(seed: int, prompt_len: int, gen_len: int, stops: tuple[int, ...] = ()
             ) -> TokenHistory:
    g = torch.Generator().manual_seed(seed)
    # Few distinct ids, so tokens repeat (counts above 1) and prompt and output overlap.
    prompt = torch.randint(0, V // 3, (prompt_len,), generator=g).tolist()
    generated = torch.randint(0, V // 3, (gen_len,), generator=g).tolist()
    return TokenHistory(prompt, generated, frozenset(stops))


def _openai_penalties(row: list[float], generated: list[int], frequency: float,
                      presence: float) -> list[float]:
    """OpenAI's formula, element by element: mu[j] - c[j] * a_freq - (c[j] > 0) * a_pres."""
    out = list(row)
    for j in range(len(out)):
        c = generated.count(j)
        out[j] = out[j] - c * frequency - (1.0 if c > 0 else 0.0) * presence
    return out


def test_repetition_penalty_is_transformers_processor() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = _random(4, 1)
    penalties = [1.0, 1.3, 0.7, 2.0]
    params = [SamplingParams(repetition_penalty=r) for r in penalties]
    hists = [_history(10 + b, 12, 9) for b in range(4)]
    got = adjust_logits(logits, params, hists)
    for b, (p, h) in enumerate(zip(penalties, hists, strict=True)):
        if p == 1.0:
            assert torch.equal(got[b], logits[b])  # no control: left as it was
            continue
        ids = torch.tensor([[*h.prompt, *h.generated]])
        want = RepetitionPenaltyLogitsProcessor(p)(ids, logits[b:b + 1].clone())[0]
        torch.testing.assert_close(got[b], want, rtol=1e-6, atol=1e-6)
        assert not torch.equal(want, logits[b])  # the check can fail


def test_frequency_and_presence_follow_openais_formula_over_generated_tokens_only() -> None:
    logits = _random(3, 2)
    params = [SamplingParams(frequency_penalty=0.8, presence_penalty=-0.5),
              SamplingParams(),
              SamplingParams(frequency_penalty=-2.0, presence_penalty=2.0)]
    hists: list[TokenHistory | None] = [_history(20, 30, 14), None, _history(21, 5, 40)]
    got = adjust_logits(logits, params, hists)
    for b in (0, 2):
        h = hists[b]
        assert h is not None
        want = _openai_penalties(logits[b].tolist(), list(h.generated),
                                 params[b].frequency_penalty, params[b].presence_penalty)
        torch.testing.assert_close(got[b], torch.tensor(want), rtol=1e-6, atol=1e-5)
    assert torch.equal(got[1], logits[1])


def test_logit_bias_and_min_tokens_then_penalties_in_vllms_order() -> None:
    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

    logits = _random(2, 3)
    bias = ((3, 100.0), (5, -100.0), (40, 2.5))
    p = SamplingParams(logit_bias=bias, min_tokens=6, repetition_penalty=1.4,
                       frequency_penalty=0.3, presence_penalty=0.2)
    h = _history(30, 10, 4, stops=(7, 8))
    late = _history(31, 10, 6, stops=(7, 8))  # min_tokens reached: stop ids allowed again
    got = adjust_logits(logits, [p, p], [h, late])
    for b, hist in enumerate((h, late)):
        x = logits[b:b + 1].clone()
        for t, v in bias:
            x[0, t] += v
        ids = torch.tensor([[*hist.prompt, *hist.generated]])
        x = MinNewTokensLengthLogitsProcessor(len(hist.prompt), 6, [7, 8])(ids, x)
        x = RepetitionPenaltyLogitsProcessor(1.4)(ids, x)
        want = torch.tensor(_openai_penalties(x[0].tolist(), list(hist.generated), 0.3, 0.2))
        torch.testing.assert_close(got[b], want, rtol=1e-6, atol=1e-5)
    assert got[0, 7] == float("-inf") and got[1, 7] > float("-inf")


def test_greedy_and_seeded_draws_obey_the_controls() -> None:
    logits = _random(3, 4)
    forced = int(torch.argmin(logits[0]))
    greedy = SamplingParams(logit_bias=((forced, 100.0),))
    assert sample(logits[:1], [greedy], [0], [_history(1, 3, 0)]) == [forced]
    stops = frozenset(torch.topk(logits[1], 5).indices.tolist())  # the likeliest five
    hot = [SamplingParams(temperature=1.0, seed=s, min_tokens=2) for s in range(200)]
    drawn = [sample(logits[1:2], [p], [1], [TokenHistory([1], [9], stops)])[0] for p in hot]
    assert not stops & set(drawn)
    free = [sample(logits[1:2], [SamplingParams(temperature=1.0, seed=s)], [1])[0]
            for s in range(200)]
    assert stops & set(free)  # without min_tokens those are the usual draws


def test_a_batch_without_controls_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5, seed=3),
             SamplingParams(presence_penalty=0.0, logit_bias=(), min_tokens=0)]
    assert not needs_history(plain)
    assert needs_history([*plain, SamplingParams(min_tokens=1)])
    for p in (SamplingParams(presence_penalty=0.1), SamplingParams(frequency_penalty=-0.1),
              SamplingParams(repetition_penalty=1.01), SamplingParams(logit_bias=((1, 1.0),)),
              SamplingParams(min_tokens=1)):
        assert p.adjusts
    logits = _random(3, 5)
    want = sample(logits, plain, [0, 1, 2])

    def boom(*args: Any) -> Any:
        raise AssertionError("adjusted a batch without controls")

    monkeypatch.setattr(sampling, "adjust_logits", boom)
    assert sample(logits, plain, [0, 1, 2]) == want


def test_a_decode_row_counts_its_first_token_and_keeps_its_prompt() -> None:
    from pdd_sidecar.engine.driver import _history as history
    from pdd_sidecar.engine.scheduler import PENALTY_PROMPT, Sequence

    dec = Sequence("d", [], 8, 20, SamplingParams(), frozenset({2}), source=object(),
                   first_token=11)
    dec.output = [4, 4]
    dec.extra[PENALTY_PROMPT] = [1, 2, 3]
    assert history(dec)[:3] == ([1, 2, 3], [11, 4, 4], frozenset({2}))
    pre = Sequence("p", [5, 6], 8, 10, SamplingParams())
    assert history(pre)[:3] == ([5, 6], [], frozenset())


def test_the_prompt_goes_to_the_device_once_per_sequence() -> None:
    logits = _random(1, 6)
    p = [SamplingParams(repetition_penalty=1.5)]
    cache: dict[str, Any] = {}
    h = TokenHistory([3, 4, 4, 9], [9], frozenset(), cache)
    first = adjust_logits(logits, p, [h])
    kept = cache["sampling_prompt_ids"]
    assert kept.tolist() == [3, 4, 9]
    later = h._replace(generated=[9, 7])
    again = adjust_logits(logits, p, [later])
    assert cache["sampling_prompt_ids"] is kept
    assert torch.equal(again, adjust_logits(logits, p, [later._replace(cache=None)]))
    assert torch.equal(first[0, 3], again[0, 3]) and not torch.equal(first[0, 7], again[0, 7])


@pytest.mark.parametrize(("raw", "field"), [
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty"),
    ({"logit_bias": {"97": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"1": -100.5}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"),
])
def test_the_instance_api_checks_the_controls(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(SamplingError, match=f"sampling.{field}"):
        SamplingParams.parse(raw, V)


def test_the_vllm_protocol_passes_the_controls_to_the_instance_parser() -> None:
    from pdd_sidecar.serve.instance.common import RequestError
    from pdd_sidecar.serve.instance.vllm_api import _options

    opts = _options({"prompt": [1], "presence_penalty": 0.5, "logit_bias": {"3": 5},
                     "min_tokens": 2, "repetition_penalty": None, "seed": 1})
    p = SamplingParams.parse(opts["sampling"], V)
    assert (p.presence_penalty, p.logit_bias, p.min_tokens, p.repetition_penalty) == (
        0.5, ((3, 5.0),), 2, 1.0)
    with pytest.raises(RequestError, match="min_p"):
        _options({"prompt": [1], "min_p": 0.2})


# ---------------------------------------------------------------- end to end
def _complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            out: dict[str, Any] = json.loads(resp.read())
            return out
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"HTTP {exc.code}: {exc.read()[:300]!r}") from None


def _teacher_forced_check(prompt: list[int], served: list[int], block: int,
                          frequency: float, presence: float, repetition: float) -> None:
    """Each served token is the argmax of the model's logits at its position (teacher forced
    along the served tokens, in one process) after the penalties computed here by hand."""
    from pdd_sidecar.engine.generate import generate_result

    ref = generate_result("builtin", prompt, len(served), block_size=block, keep_logits=True,
                          forced_ids=served)
    assert ref.prompt_logits is not None
    steps = [ref.prompt_logits[-1], *ref.step_logits]
    for i, tok in enumerate(served):
        row = steps[i].tolist()
        seen = set(prompt) | set(served[:i])
        row = [(x / repetition if x > 0 else x * repetition) if j in seen else x
               for j, x in enumerate(row)]
        row = _openai_penalties(row, served[:i], frequency, presence)
        best = sorted(row, reverse=True)
        if best[0] - best[1] < 1e-4:
            continue  # a near tie: either is right
        assert row.index(best[0]) == tok, f"token {i}"


def test_controls_end_to_end_through_the_router(tmp_path: Path) -> None:
    from pdd_api.plan import SidePlan
    from pdd_api.routing import plan_routing

    block = 16
    cluster = LocalCluster(tmp_path)
    try:
        side = SidePlan(tensor_parallel_size=1, decode_context_parallel_size=1)
        routing = cluster.plan_file(plan_routing(side, side, block).to_json())
        prefill = cluster.instance("prefill", 1, 1, routing, block)
        # Without its prefix cache the decode keeps the prompt for repetition_penalty itself.
        decode = cluster.instance("decode", 1, 1, routing, block, PDD_PREFILL_URLS=prefill.url,
                                  PDD_PREFIX_CACHE="0")
        router = cluster.router([prefill], [decode])
        for p in (prefill, decode, router):
            p.wait_ready()
        url = router.url
        prompt = list(b"the cat sat on the mat and the cat sat")
        n = 16
        base = {"prompt": prompt, "max_tokens": n, "temperature": 0}
        plain = _complete(url, base)["choices"][0]["token_ids"]
        assert len(plain) == n and len(set(plain)) < n  # greedy repeats itself here

        # A strong frequency penalty changes the repetitive continuation, token for token as
        # the formula says.
        pen = _complete(url, {**base, "frequency_penalty": 2.0, "presence_penalty": 0.5}
                        )["choices"][0]["token_ids"]
        assert pen != plain and len(set(pen)) > len(set(plain))
        _teacher_forced_check(prompt, pen, block, 2.0, 0.5, 1.0)
        rep = _complete(url, {**base, "repetition_penalty": 1.8})["choices"][0]["token_ids"]
        assert rep != plain
        _teacher_forced_check(prompt, rep, block, 0.0, 0.0, 1.8)

        # logit_bias +100 forces a token the model never chose, on the prefill and the decode.
        forced = next(t for t in range(32, 127) if t not in plain)
        out = _complete(url, {**base, "logit_bias": {str(forced): 100}})
        assert out["choices"][0]["token_ids"] == [forced] * n

        # min_tokens keeps a stop id away until that many tokens are out.
        stop = {**base, "stop_token_ids": [plain[0]]}
        first = _complete(url, stop)["choices"][0]
        assert first["token_ids"] == [plain[0]] and first["finish_reason"] == "stop"
        held = _complete(url, {**stop, "min_tokens": 6})["choices"][0]
        assert len(held["token_ids"]) >= 6 and plain[0] not in held["token_ids"][:6]
        assert held["finish_reason"] in ("stop", "length")
        # At the boundary, on the decode (which counts the prefill's token): with min_tokens
        # k the stop id the model picks at index k ends the completion there; with k + 1 it
        # is still held back.
        k = next(i for i in range(1, n) if plain[i] not in plain[:i])
        at = {**base, "stop_token_ids": [plain[k]]}
        ends = _complete(url, {**at, "min_tokens": k})["choices"][0]
        assert ends["token_ids"] == plain[:k + 1] and ends["finish_reason"] == "stop"
        later = _complete(url, {**at, "min_tokens": k + 1})["choices"][0]["token_ids"]
        assert later[:k] == plain[:k] and later[k] != plain[k]
    finally:
        cluster.close()
