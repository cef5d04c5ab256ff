"""Where a request's prompt is prefilled: on a prefill replica, on the decode itself, or on the
decode because no prefill is ready.

A hand-off costs a fixed price whatever the prompt: the prefill's own queue and step, the
grant, the decode's claim and READ, a second HTTP hop (on one H200, 64 prompts of 32 tokens
took 73.8 ms to the first token against ~48 ms of engine work). A prompt whose uncached part is
short costs the decode's running batch less than that when the decode runs it itself, in its
own step (engine/scheduler.py, Local prefill); a long one would hold the batch for its whole
prefill, and goes through a prefill. llm-d decides the same way (its prefix-based P/D decider
adds a prefill only when the uncached part reaches ``nonCachedTokens``).

The uncached part is the prompt less what the chosen decode already caches, as the router's
cache-aware policy estimates it (routing_policy.py: the blocks of the prompts and answers it
routed there); the prompt's last token always runs. ``local_prefill_tokens`` 0 sends every
request through a prefill while one is ready.

With no prefill ready, a request is served on a decode (``fallback``, counted apart so that it
shows) or refused with a 503 (``no_prefill`` = ``refuse``). Requests only a prefill serves
(several choices, prompt log-probabilities, the prompt alone) always go through one.
"""

from __future__ import annotations

REMOTE = "remote_prefill"
LOCAL = "local_prefill"
FALLBACK = "fallback"
PATHS = (REMOTE, LOCAL, FALLBACK)
# The knobs' defaults and values are pdd_api.models' (DEFAULT_LOCAL_PREFILL_TOKENS,
# NO_PREFILL_MODES), shared with the CRD and `pdd serve`.


def uncached_tokens(prompt_tokens: int, cached_tokens: int) -> int:
    """Prompt tokens a prefill must compute: the last one always runs (its logits give the
    first token), whatever is cached."""
    return prompt_tokens - min(max(cached_tokens, 0), max(prompt_tokens - 1, 0))


def prefill_path(prompt_tokens: int, cached_tokens: int, local_prefill_tokens: int,
                 prefill_ready: bool, no_prefill: str, decode_can: bool = True) -> str | None:
    """The path of one request (``REMOTE``, ``LOCAL``, ``FALLBACK``), or None: refuse it (no
    prefill ready, and ``no_prefill`` refuses or the request needs a prefill).

    ``cached_tokens``: what the decode it would go to already caches of the prompt;
    ``decode_can``: the request is one a decode can prefill (one choice, no prompt
    log-probabilities, at least one token to generate)."""
    if not prefill_ready:
        return FALLBACK if decode_can and no_prefill == "fallback" else None
    if (decode_can and local_prefill_tokens > 0
            and uncached_tokens(prompt_tokens, cached_tokens) <= local_prefill_tokens):
        return LOCAL
    return REMOTE
