"""Choosing the next token on rank 0: greedy, or temperature / top-k / top-p with a seed, after
the controls clients send (logit_bias, min_tokens, repetition / frequency / presence penalties).

Token ``i`` of a completion is drawn from a generator seeded by ``(seed, i)`` alone, so the
prefill (which draws token 0) and the decode (tokens 1..) sample one reproducible stream without
handing generator state across instances, and a request samples the same tokens whatever else
shares its batch.

The controls follow vLLM (and, for the penalties, OpenAI's documented formula), in vLLM's order:
``logit_bias`` is added by token id; while fewer than ``min_tokens`` tokens were generated the
request's stop ids (EOS unless ignored, and its ``stop_token_ids``) are at -inf; then a token in
the prompt or the generated text has its logit divided by ``repetition_penalty`` when positive,
multiplied when not (transformers' RepetitionPenaltyLogitsProcessor), and a token generated
``c`` times loses ``c * frequency_penalty + (c > 0) * presence_penalty``. Temperature, top-k and
top-p apply after. A batch in which no row asks for a control does no extra work at all.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from pdd_sidecar.engine.device_queue import tensor_to_device, to_device
from pdd_sidecar.grammar import STRUCTURED, GrammarError, Spec, parse_spec

_MASK63 = (1 << 63) - 1
_TINY = torch.finfo(torch.float32).tiny
_GOLDEN = 0x9E3779B97F4A7C15


# repetition_penalty is > 0 (vLLM, transformers); beyond these a float32 logit divided or
# multiplied by it may overflow, and inf - inf is a NaN draw.
REPETITION_RANGE = (1e-6, 1e6)


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names the field."""


def _number(raw: Mapping[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingError(f"sampling.{key}: must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise SamplingError(f"sampling.{key}: out of range, got an integer of "
                            f"{int(value).bit_length()} bits") from None


def _integer(raw: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = raw.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(f"sampling.{key}: must be an integer, got {value!r}")
    return value


def _finite(raw: Mapping[str, Any], key: str, default: float, lo: float, hi: float,
            what: str) -> float:
    value = _number(raw, key, default)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise SamplingError(f"sampling.{key}: must be in {what}, got {value}")
    return value


def _logit_bias(raw: Any, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` (JSON keys are strings), biases in [-100, 100]; of two
    keys naming one id ("5", "05") the last counts, as in the router's reading."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise SamplingError(f"sampling.logit_bias: must be an object of token id -> bias, "
                            f"got {type(raw).__name__}")
    out: dict[int, float] = {}
    for key, value in raw.items():
        digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 20
        tid = int(key) if digits else -1
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            where = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise SamplingError(f"sampling.logit_bias: keys must be token ids in {where}, "
                                f"got {str(key)[:40]!r}")
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not -100 <= value <= 100):
            raise SamplingError(f"sampling.logit_bias: biases must be numbers in [-100, 100], "
                                f"got {str(value)[:40]} for token {tid}")
        out[tid] = float(value)
    return tuple(sorted((t, v) for t, v in out.items() if v))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted
    min_tokens: int = 0
    structured: Spec | None = None  # structured output (engine/grammar_mask.py)
    # Computed once: whether the row's logits change before the choice, and whether the
    # penalties need its token counts.
    adjusts: bool = field(init=False, repr=False, compare=False)
    penalizes: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        penalizes = bool(self.presence_penalty or self.frequency_penalty
                         or self.repetition_penalty != 1.0)
        object.__setattr__(self, "penalizes", penalizes)
        object.__setattr__(self, "adjusts",
                           penalizes or bool(self.logit_bias) or self.min_tokens > 0)

    @property
    def greedy(self) -> bool:
        """Also below float32's smallest normal: such a temperature is 0 or a denormal on the
        logits' device, and the distribution it asks for is the greedy one anyway."""
        return self.temperature < _TINY or self.top_k == 1

    @classmethod
    def parse(cls, raw: Any, vocab_size: int | None = None) -> SamplingParams:
        """From the instance API's ``sampling`` object; absent means greedy. Without a seed one is
        drawn here, once per request, so the request's own stream is still consistent.
        ``vocab_size`` bounds logit_bias's token ids."""
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise SamplingError(f"sampling: must be an object, got {type(raw).__name__}")
        temperature = _number(raw, "temperature", 0.0)
        if not 0.0 <= temperature <= 100.0:
            raise SamplingError(f"sampling.temperature: must be in [0, 100], got {temperature}")
        top_p = _number(raw, "top_p", 1.0)
        if not 0.0 < top_p <= 1.0:
            raise SamplingError(f"sampling.top_p: must be in (0, 1], got {top_p}")
        top_k = _integer(raw, "top_k", 0)
        assert top_k is not None
        if top_k < -1:
            raise SamplingError(f"sampling.top_k: must be -1, 0 (off) or >= 1, got {top_k}")
        seed = _integer(raw, "seed", None)
        if seed is None:
            seed = random.getrandbits(63)
        presence = _finite(raw, "presence_penalty", 0.0, -2.0, 2.0, "[-2, 2]")
        frequency = _finite(raw, "frequency_penalty", 0.0, -2.0, 2.0, "[-2, 2]")
        repetition = _finite(raw, "repetition_penalty", 1.0, *REPETITION_RANGE,
                             "[1e-6, 1e6] (> 0; the bounds keep float32 logits finite)")
        min_tokens = _integer(raw, "min_tokens", 0)
        assert min_tokens is not None
        if min_tokens < 0:
            raise SamplingError(f"sampling.min_tokens: must be >= 0, got {min_tokens}")
        try:
            structured = parse_spec(raw.get(STRUCTURED), f"sampling.{STRUCTURED}")
        except GrammarError as exc:
            raise SamplingError(str(exc)) from None
        return cls(temperature, top_p, max(top_k, 0), seed & _MASK63, presence, frequency,
                   repetition, _logit_bias(raw.get("logit_bias"), vocab_size), min_tokens,
                   structured)


class TokenHistory(NamedTuple):
    """What a row's controls look at: the prompt (repetition_penalty), the tokens generated so
    far (the penalties; min_tokens counts them), the ids min_tokens holds back. ``cache``, the
    sequence's own dict, keeps the prompt's ids on the device from one step to the next (a
    long prompt is not copied up again every step)."""

    prompt: Sequence[int]
    generated: Sequence[int]
    stop_ids: Collection[int]
    cache: dict[str, Any] | None = None


_PROMPT_IDS = "sampling_prompt_ids"


def _prompt_on(h: TokenHistory, dev: torch.device) -> torch.Tensor:
    t = h.cache.get(_PROMPT_IDS) if h.cache is not None else None
    if t is None or t.device != dev:
        t = to_device(sorted(set(h.prompt)), torch.long, dev)
        if h.cache is not None:
            h.cache[_PROMPT_IDS] = t
    return t


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                  histories: Sequence[TokenHistory | None]) -> torch.Tensor:
    """``logits [B, V]`` in float32 with each row's controls applied (module docstring); the
    input is left as it was. Only the rows that ask for a control are touched, all of them at
    once; everything goes to the device asynchronously (no host sync)."""
    x = logits.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
    vocab = x.shape[-1]
    dev = x.device
    flat = x.view(-1)
    bias_at: list[int] = []
    bias: list[float] = []
    banned: list[int] = []
    for b, p in enumerate(params):
        if not p.adjusts:
            continue
        for t, v in p.logit_bias:
            bias_at.append(b * vocab + t)
            bias.append(v)
        h = histories[b]
        assert h is not None, "a row that adjusts needs its history"
        if len(h.generated) < p.min_tokens:
            banned.extend(b * vocab + t for t in h.stop_ids if 0 <= t < vocab)
    if bias_at:
        flat.index_add_(0, to_device(bias_at, torch.long, dev),
                        tensor_to_device(torch.tensor(bias, dtype=torch.float32), dev))
    if banned:
        flat.index_fill_(0, to_device(banned, torch.long, dev), float("-inf"))
    rows = [b for b, p in enumerate(params) if p.penalizes]
    if not rows:
        return x
    counted: list[int] = []
    for r, b in enumerate(rows):
        h = histories[b]
        assert h is not None
        counted.extend(r * vocab + t for t in h.generated)
    idx = to_device(rows, torch.long, dev)
    sub = x.index_select(0, idx)
    counts = torch.zeros_like(sub)
    if counted:
        counts.view(-1).index_add_(0, to_device(counted, torch.long, dev),
                                   torch.ones(len(counted), dtype=torch.float32, device=dev))
    scalars = tensor_to_device(torch.tensor(
        [[params[b].repetition_penalty, params[b].frequency_penalty, params[b].presence_penalty]
         for b in rows], dtype=torch.float32), dev)
    rep, freq, pres = scalars[:, 0:1], scalars[:, 1:2], scalars[:, 2:3]
    generated = counts > 0
    in_prompt = torch.zeros_like(generated)
    for r, b in enumerate(rows):
        h = histories[b]
        if params[b].repetition_penalty != 1.0 and h is not None and h.prompt:
            in_prompt[r].index_fill_(0, _prompt_on(h, dev), True)
    factor = torch.where(generated | in_prompt, rep, 1.0)
    sub = torch.where(sub > 0, sub / factor, sub * factor)
    sub = sub - freq * counts - pres * generated
    return x.index_copy_(0, idx, sub)


class Allowed(NamedTuple):
    """Structured output's mask for some rows of a batch: ``bitmask[r]`` (int32 words, on the
    host or the device) says which tokens row ``rows[r]`` may take (engine/grammar_mask.py)."""

    rows: Sequence[int]
    bitmask: torch.Tensor


_BIT: dict[torch.device, torch.Tensor] = {}  # device -> arange(32), int32, made once


def apply_allowed(logits: torch.Tensor, allowed: Allowed) -> torch.Tensor:
    """``logits [B, V]`` with the tokens ``allowed`` rules out at -inf in its rows, the others
    untouched; a new tensor (the input may be a CUDA graph's output). The bitmask goes up in
    one asynchronous copy and is unpacked on the device: no host sync. Tokens past the
    bitmask's width are ruled out too; bits past ``V`` (a tokenizer larger than the model's
    vocabulary, the built-in model's EOS) are dropped."""
    dev = logits.device
    vocab = logits.shape[-1]
    bits = _BIT.get(dev)
    if bits is None:
        bits = _BIT[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    words = tensor_to_device(allowed.bitmask, dev)
    ok = ((words.unsqueeze(-1) >> bits) & 1).view(words.shape[0], -1).bool()
    if ok.shape[1] < vocab:
        ok = torch.nn.functional.pad(ok, (0, vocab - ok.shape[1]), value=False)
    ok = ok[:, :vocab]
    x = logits.clone(memory_format=torch.contiguous_format)
    idx = to_device(list(allowed.rows), torch.long, dev)
    return x.index_copy_(0, idx, x.index_select(0, idx).masked_fill(~ok, float("-inf")))


MAX_CHOICES = 16  # the bound on a request's ``n`` (docs/openai-api.md)
_CHOICE_MIX = 0xD1B54A32D192ED03  # an odd 64-bit constant (splitmix's), not _GOLDEN


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` of a request seeded ``seed`` (both roles derive it, so the
    prefill's first token and the decode's later ones are one stream per choice): choice 0
    keeps the request's own seed, so its answer is the one ``n: 1`` gives; choice ``i`` uses
    ``(seed + i * 0xD1B54A32D192ED03) mod 2**63``, distinct per index and reproducible."""
    seed &= _MASK63
    return seed if choice == 0 else (seed + choice * _CHOICE_MIX) & _MASK63


def _generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed ^ ((index + 1) * _GOLDEN)) & _MASK63)
    return g


def _filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``logits [V]`` scaled by temperature with everything outside top-k / top-p at -inf."""
    # From the row's maximum down: a temperature as small as 5e-324 then gives 0 and -inf, never
    # inf - inf = nan (which torch.multinomial refuses, stopping the engine loop, and which any
    # draw would turn into a wrong token).
    x = logits.float()
    x = (x - x.max()) / p.temperature
    if 0 < p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= p.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return x


def pick_rows(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``logits[rows]`` without a host sync (a list index is copied to the device with one):
    the rows go up asynchronously on the current stream; all rows in order need no copy."""
    if list(rows) == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, to_device(list(rows), torch.long, logits.device))


def _draw(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One token from ``probs``: the draw ``torch.multinomial(probs, 1, generator=g)`` makes
    (its one-sample path: the argmax of the probabilities over exponential noise), without its
    check of the probabilities on the host, a sync; ``_filtered`` gives finite ones."""
    noise = torch.empty_like(probs).exponential_(1, generator=g)
    return torch.argmax(probs / noise)


def sample_on_device(logits: torch.Tensor, params: Sequence[SamplingParams],
                     indices: Sequence[int],
                     histories: Sequence[TokenHistory | None] | None = None,
                     allowed: Allowed | None = None) -> torch.Tensor:
    """One token per row of ``logits [B, V]``, left on the logits' device (int64 ``[B]``) with
    no host sync: the caller reads them when it chooses to wait. ``indices[b]`` is the
    completion index of the token being drawn for row ``b``. ``histories`` (per row; None for a
    row that asks for no control) is given when some row ``adjusts`` (``needs_history``), and
    only then is anything adjusted. ``allowed``: structured output's mask for the rows under a
    grammar, applied after the controls (a ruled-out token stays at -inf whatever they add)."""
    if histories is not None:
        logits = adjust_logits(logits, params, histories)
    if allowed is not None:
        logits = apply_allowed(logits, allowed)
    out = torch.argmax(logits, dim=-1)
    for b, p in enumerate(params):
        if p.greedy:
            continue
        probs = _filtered(logits[b], p).softmax(-1)
        out[b] = _draw(probs, _generator(p.seed, indices[b], probs.device))
    return out


def needs_history(params: Sequence[SamplingParams]) -> bool:
    """Some row asks for a control: the batch's histories must be built and passed."""
    return any(p.adjusts for p in params)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int],
           histories: Sequence[TokenHistory | None] | None = None,
           allowed: Allowed | None = None) -> list[int]:
    """``sample_on_device``, read on the host now."""
    return [int(t) for t in
            sample_on_device(logits, params, indices, histories, allowed).tolist()]


# --- log probabilities -------------------------------------------------------------------------
# OpenAI's bound on top_logprobs (and vLLM's default max_logprobs).
MAX_LOGPROBS = 20


class LogprobRows(NamedTuple):
    """The log-probabilities of the batch rows that asked for them, still on the device:
    ``rows`` (batch rows), ``tops`` (each row's top count), and ``[R, 2 + 2K]`` float32
    ``values``: per row the chosen token's log-probability, its rank (1 = the likeliest), then
    the K = max(tops) likeliest log-probabilities, then their token ids (exact in float32 below
    2**24, far above any vocabulary)."""

    rows: list[int]
    tops: list[int]
    values: torch.Tensor


# One entry per token, on the host: (logprob, rank, [(token id, logprob), ...] likeliest first).
Logprob = tuple[float, int, list[tuple[int, float]]]


def raw_logprobs(logits: torch.Tensor, tops: Sequence[int | None]) -> torch.Tensor | None:
    """``log_softmax`` of the raw logits (before any control, temperature, top-k or top-p, as
    vLLM's default ``raw_logprobs`` mode) of the rows whose top count is not None, taken
    before sampling so that nothing the sampler does to the logits can reach them; None (and no
    work at all) when no row asks."""
    rows = [b for b, k in enumerate(tops) if k is not None]
    if not rows:
        return None
    return pick_rows(logits, rows).float().log_softmax(-1)


def chosen_logprobs(lsm: torch.Tensor, tops: Sequence[int | None],
                    tokens: torch.Tensor) -> LogprobRows:
    """``raw_logprobs``'s rows with each row's chosen token (``tokens [B]``, on the device)
    looked up, ranked, and its top-k beside it; no host sync."""
    rows = [b for b, k in enumerate(tops) if k is not None]
    ks = [int(tops[b] or 0) for b in rows]
    chosen = pick_rows(tokens.view(-1, 1), rows).view(-1)
    return LogprobRows(rows, ks, logprob_table(lsm, chosen, max(ks)))


def sample_with_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams],
                         indices: Sequence[int], tops: Sequence[int | None],
                         histories: Sequence[TokenHistory | None] | None = None,
                         allowed: Allowed | None = None,
                         ) -> tuple[torch.Tensor, LogprobRows | None]:
    """``sample_on_device`` and, for the rows whose ``tops[b]`` is not None, the chosen
    token's raw log-probability with the row's top ``tops[b]`` (``LogprobRows``); rows that
    ask for none cost nothing more, and a batch in which none asks is exactly
    ``sample_on_device``."""
    lsm = raw_logprobs(logits, tops)
    tokens = sample_on_device(logits, params, indices, histories, allowed)
    return tokens, None if lsm is None else chosen_logprobs(lsm, tops, tokens)


def logprob_table(lsm: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """``[R, 2 + 2k]``: each row's log-probability of ``targets[r]``, its rank, the row's k
    likeliest log-probabilities and their ids (``LogprobRows.values``)."""
    lp = lsm.gather(1, targets.view(-1, 1).to(torch.long))
    rank = (lsm > lp).sum(-1, keepdim=True).float() + 1
    parts = [lp, rank]
    if k > 0:
        top = torch.topk(lsm, min(k, lsm.shape[-1]), dim=-1)
        parts += [top.values, top.indices.float()]
    return torch.cat(parts, dim=1)


def logprob_entries(values: list[list[float]], tops: Sequence[int]) -> list[Logprob]:
    """``LogprobRows.values`` read on the host (``.tolist()``), one entry per row."""
    out: list[Logprob] = []
    for row, k in zip(values, tops, strict=True):
        width = (len(row) - 2) // 2
        top = [(int(row[2 + width + j]), row[2 + j]) for j in range(k)]
        out.append((row[0], int(row[1]), top))
    return out
