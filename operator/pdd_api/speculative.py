"""spec.decode.speculative as the decode's environment: one renderer for the operator's pods
and `pdd serve`'s local processes, read back by the sidecar (pdd_sidecar/env.py)."""

from __future__ import annotations

from pdd_api import keys
from pdd_api.models import NgramSpec, SpeculativeSpec


def speculative_env(spec: SpeculativeSpec | None, role: str = "decode") -> dict[str, str]:
    """Nothing without a drafter (so pods of a spec without one keep their hash); the n-gram
    lengths only for ngram, written out with their defaults. A prefill gets the method alone,
    for mtp only: it runs the module over the prompt and sends the decode its draft state (and
    its cache holds the module's latents, as the decode's must for the hand-off)."""
    if spec is None:
        return {}
    if role != "decode":
        return {keys.ENV_SPECULATIVE_METHOD: spec.method} if spec.method == "mtp" else {}
    env = {keys.ENV_SPECULATIVE_METHOD: spec.method,
           keys.ENV_SPECULATIVE_TOKENS: str(spec.tokens)}
    if spec.method == "ngram":
        ngram = spec.ngram or NgramSpec()
        env[keys.ENV_SPECULATIVE_NGRAM_MAX] = str(ngram.maxN)
        env[keys.ENV_SPECULATIVE_NGRAM_MIN] = str(ngram.minN)
    return env
