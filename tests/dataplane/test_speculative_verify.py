"""A verify step that keeps drafts while they equal the sampler's own draws is lossless: the
same tokens as plain decoding for every seed, whatever the drafts, and so the same distribution
(checked too, by a chi-square test over many seeds, against the exact two-token law)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from pdd_sidecar.engine.sampling import SamplingParams, sample_on_device
from pdd_sidecar.engine.speculative.verify import accepted_tokens

pytestmark = pytest.mark.dataplane

VOCAB = 6
_TABLE = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5


def target_logits(context: list[int]) -> torch.Tensor:
    """A toy target model: the next token's logits depend on the last token."""
    return _TABLE[context[-1]]


def draw(context: list[int], p: SamplingParams, index: int) -> int:
    return int(sample_on_device(target_logits(context).unsqueeze(0), [p], [index])[0])


def plain(prompt: list[int], p: SamplingParams, n: int) -> list[int]:
    ctx = list(prompt)
    for i in range(n):
        ctx.append(draw(ctx, p, i))
    return ctx[len(prompt):]


def speculative(prompt: list[int], p: SamplingParams, n: int, drafts_of) -> list[int]:
    ctx, out = list(prompt), []
    while len(out) < n:
        drafts = drafts_of(ctx)
        draws = [draw(ctx + drafts[:j], p, len(out) + j) for j in range(len(drafts) + 1)]
        out += accepted_tokens(drafts, draws)
        ctx = list(prompt) + out
    return out[:n]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_the_tokens_are_those_of_plain_decoding_whatever_the_drafts(temperature: float) -> None:
    rng = random.Random(7)
    for seed in range(150):
        p = SamplingParams(temperature=temperature, seed=seed)
        k = 1 + seed % 3
        want = plain([0], p, 8)

        def wrong(ctx: list[int], k: int = k) -> list[int]:
            return [rng.randrange(VOCAB) for _ in range(k)]

        def oracle(ctx: list[int], k: int = k, want: list[int] = want) -> list[int]:
            return want[len(ctx) - 1:len(ctx) - 1 + k] or [0]

        assert speculative([0], p, 8, wrong) == want
        assert speculative([0], p, 8, oracle) == want


def test_two_token_law_matches_the_target_under_random_drafts() -> None:
    rng = random.Random(11)
    probs = _TABLE.softmax(-1)
    pairs = itertools.product(range(VOCAB), repeat=2)
    exact = {(a, b): float(probs[0, a] * probs[a, b]) for a, b in pairs}
    counts = dict.fromkeys(exact, 0)
    n = 6000
    for seed in range(n):
        p = SamplingParams(temperature=1.0, seed=seed + 10_000)
        toks = speculative([0], p, 2, lambda ctx: [rng.randrange(VOCAB), rng.randrange(VOCAB)])
        counts[(toks[0], toks[1])] += 1
    chi2 = sum((counts[c] - n * q) ** 2 / (n * q) for c, q in exact.items())
    # 35 degrees of freedom: the 0.999 quantile is 66.6
    assert chi2 < 66.6, chi2


def test_each_row_is_sampled_with_the_history_its_drafts_make() -> None:
    """Penalties and min_tokens look at the generated tokens: row j of a verify step must see
    the drafts before it as generated, or right drafts get wrong draws."""
    from pdd_sidecar.engine.sampling import TokenHistory
    from pdd_sidecar.engine.speculative.rows import row_histories

    def draw_h(ctx: list[int], p: SamplingParams, index: int, h: TokenHistory) -> int:
        return int(sample_on_device(target_logits(ctx).unsqueeze(0), [p], [index], [h])[0])

    stops = frozenset({2})
    for seed in range(40):
        p = SamplingParams(temperature=0.0 if seed % 2 else 0.8, seed=seed,
                           frequency_penalty=1.5, presence_penalty=0.5,
                           repetition_penalty=1.3, min_tokens=4)
        prompt = [0, 1]
        ctx, want = list(prompt), []
        for i in range(10):
            want.append(draw_h(ctx, p, i, TokenHistory(prompt, list(want), stops)))
            ctx.append(want[-1])
        out: list[int] = []
        while len(out) < 10:
            drafts = want[len(out):len(out) + 3]  # always right
            rows = row_histories(TokenHistory(prompt, list(out), stops), drafts)
            draws = [draw_h(prompt + out + drafts[:j], p, len(out) + j, rows[j])
                     for j in range(len(drafts) + 1)]
            out += accepted_tokens(drafts, draws)
        assert out[:10] == want, seed
    assert row_histories(None, [1, 2]) == [None, None, None]
