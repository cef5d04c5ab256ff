"""A response's choices and usage the OpenAI way: choice j of prompt i at index i * n + j,
the prompt counted once whatever n, completion tokens summed over every choice; and the
request reading behind them (n bounded, list prompts each their own request)."""

from __future__ import annotations

from typing import Any

import pytest

from pdd_sidecar.serve.openai.choices import choice_body, choice_index, usage
from pdd_sidecar.serve.openai.openai_request import ApiError, parse_request, parse_requests
from pdd_sidecar.serve.openai.text import load_model_text

BUILTIN = load_model_text("builtin")


def test_indices_run_prompt_by_prompt_then_choice_by_choice() -> None:
    n = 3
    got = [choice_index(i, j, n) for i in range(4) for j in range(n)]
    assert got == list(range(12))
    assert choice_index(2, 1, 5) == 11


def test_a_choice_in_each_endpoints_shape() -> None:
    done = choice_body("completion", 4, "hi", [1, 2], "stop")
    assert done == {"index": 4, "text": "hi", "token_ids": [1, 2], "logprobs": None,
                    "finish_reason": "stop"}
    chat = choice_body("chat", 1, "yo", [3], "length")
    assert chat == {"index": 1, "message": {"role": "assistant", "content": "yo"},
                    "token_ids": [3], "logprobs": None, "finish_reason": "length"}


def test_usage_counts_each_prompt_once_and_sums_the_choices() -> None:
    # Two prompts of 5 and 7 tokens, n = 3: six choices.
    u = usage([5, 7], [4, 4, 1, 2, 0, 3], cached_tokens=8)
    assert u == {"prompt_tokens": 12, "completion_tokens": 14, "total_tokens": 26,
                 "prompt_tokens_details": {"cached_tokens": 8}}


def _reqs(body: dict[str, Any]) -> Any:
    return parse_requests("completion", body, BUILTIN, "m")


def test_a_list_of_prompts_is_a_request_each_with_the_same_fields() -> None:
    reqs = _reqs({"prompt": ["ab", [5, 6, 7], "c"], "n": 2, "seed": 9, "max_tokens": 3,
                  "temperature": 0.5})
    assert [r.prompt_ids for r in reqs] == [[97, 98], [5, 6, 7], [99]]
    assert {r.n for r in reqs} == {2} and {r.sampling["seed"] for r in reqs} == {9}
    assert {r.max_tokens for r in reqs} == {3}
    # Without a seed one is drawn, once: every prompt samples as a separate request would.
    drawn = _reqs({"prompt": [[1], [2]], "temperature": 1})
    assert drawn[0].sampling["seed"] == drawn[1].sampling["seed"]
    # A batch of one is one prompt, as before.
    assert [r.prompt_ids for r in _reqs({"prompt": [[4, 5]]})] == [[4, 5]]
    assert parse_request("completion", {"prompt": [[4, 5]]}, BUILTIN, "m").prompt_ids == [4, 5]


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": [[1], [2, 256]]}, "prompt[1]"),
    ({"prompt": [[1], []]}, "prompt[1]"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": [[1], [2.5]]}, "prompt[1]"),
    ({"prompt": [[1]] * 65}, "prompt"),
    ({"prompt": [1], "n": 17}, "n"),
    ({"prompt": [1], "n": 0}, "n"),
    ({"prompt": [1], "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": [[1], [1] * 9000]}, "prompt"),  # "prompt[1]: the prompt is 9000 tokens"
    ({"prompt": [[1] * 8000, [1]], "max_tokens": 300}, "max_tokens"),
])
def test_bad_lists_and_choices_are_400s_naming_the_element(body: dict[str, Any],
                                                           param: str) -> None:
    with pytest.raises(ApiError) as err:
        _reqs(body)
    assert err.value.status == 400 and err.value.param == param, err.value.message
    if "[" in param:
        assert err.value.message.startswith(param)


def test_n_and_best_of_equal_to_it_pass() -> None:
    (req,) = _reqs({"prompt": [1], "n": 16, "best_of": 16})
    assert req.n == 16
    with pytest.raises(ApiError):  # one prompt expected where the caller takes one
        parse_request("completion", {"prompt": [[1], [2]]}, BUILTIN, "m")
