"""A response's choices and usage, shaped the OpenAI way from what each choice generated.

One place assembles a choice (``choice_body``) for the final answer, and the streamed chunks
take their index from ``choice_index``: with several prompts (completions' list form) and
``n`` choices each, choice ``j`` of prompt ``i`` is index ``i * n + j``, and the response lists
them in that order. Usage counts each prompt once and sums every choice's completion tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def choice_index(prompt: int, choice: int, n: int) -> int:
    return prompt * n + choice


def choice_body(kind: str, index: int, text: str, token_ids: list[int],
                finish: str | None, tool_calls: list[dict[str, Any]] | None = None
                ) -> dict[str, Any]:
    """One choice of a final (not streamed) answer; a chat answer that made ``tool_calls``
    carries them, its content null when it said nothing else."""
    choice: dict[str, Any] = {"index": index}
    if kind == "completion":
        choice.update(text=text)
    elif tool_calls:
        choice.update(message={"role": "assistant", "content": text or None,
                               "tool_calls": tool_calls})
    else:
        choice.update(message={"role": "assistant", "content": text})
    choice.update(token_ids=token_ids, logprobs=None, finish_reason=finish)
    return choice


def usage(prompt_tokens: Sequence[int], completion_tokens: Sequence[int],
          cached_tokens: int) -> dict[str, Any]:
    """``prompt_tokens``: each prompt's length (once, whatever its ``n``);
    ``completion_tokens``: each choice's."""
    p, c = sum(prompt_tokens), sum(completion_tokens)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
