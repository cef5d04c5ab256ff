"""The batched sampler's log-probabilities (engine/sampling.py): the raw distribution's, for the
rows that ask only, the tokens drawn unchanged, and a batch in which no row asks doing exactly
what it did before."""

from __future__ import annotations

import pytest
import torch

from pdd_sidecar.engine import sampling
from pdd_sidecar.engine.sampling import (
    SamplingParams,
    logprob_entries,
    raw_logprobs,
    sample_on_device,
    sample_with_logprobs,
)

pytestmark = pytest.mark.dataplane

V = 61


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_rows_that_ask_get_the_raw_log_softmax_and_the_tokens_do_not_change() -> None:
    logits = _logits(4, 0)
    params = [SamplingParams(), SamplingParams(temperature=0.7, seed=3, top_k=5),
              SamplingParams(temperature=1.3, seed=8, logit_bias=((7, 30.0),)),
              SamplingParams(temperature=0.5, seed=1, top_p=0.5)]
    indices = [0, 4, 2, 9]
    tops = [3, None, 0, 20]
    histories = [None, None, sampling.TokenHistory([1], [], ()), None]
    tokens, lp = sample_with_logprobs(logits.clone(), params, indices, tops, histories)
    assert torch.equal(tokens, sample_on_device(logits.clone(), params, indices, histories))
    assert lp is not None and lp.rows == [0, 2, 3] and lp.tops == [3, 0, 20]
    entries = logprob_entries(lp.values.tolist(), lp.tops)
    ref = logits.log_softmax(-1)  # before logit_bias, temperature, top-k, top-p
    for (lp_, rank, top), b in zip(entries, lp.rows, strict=True):
        tok = int(tokens[b])
        assert lp_ == pytest.approx(float(ref[b, tok]), abs=1e-6)
        assert rank == int((ref[b] > ref[b, tok]).sum()) + 1
        want = torch.topk(ref[b], tops[b] or 0)
        assert [t for t, _ in top] == want.indices.tolist()
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-6)
    # the biased row drew the biased token, yet its log-probability is the raw one
    assert int(tokens[2]) == 7 and entries[1][1] > 1


def test_no_row_asking_is_no_work() -> None:
    logits = _logits(3, 1)
    params = [SamplingParams(temperature=0.9, seed=s) for s in range(3)]
    assert raw_logprobs(logits, [None, None, None]) is None
    tokens, lp = sample_with_logprobs(logits, params, [0, 1, 2], [None, None, None])
    assert lp is None
    assert torch.equal(tokens, sample_on_device(logits, params, [0, 1, 2]))
