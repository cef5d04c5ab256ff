"""Decode TPOT under structured output and log probabilities (issue 39's benchmark): `pdd serve`
with the defaults a user gets, ``--streams`` concurrent streams (prompt ``--prompt-tokens``,
``--out-tokens`` out), in four cases:

- ``0%``: no request constrained (the baseline),
- ``25%``: a quarter of them under a JSON schema, the rest as in the baseline,
- ``100%``: every request under the JSON schema,
- ``top_logprobs 5``: every request asks for 5 log probabilities a token (completions'
  ``logprobs: 5``); skipped, with a line saying so, when the server refuses the field.

Each case runs ``--rounds`` bursts of ``--streams`` requests after a warm-up burst (which also
compiles the schema, once); a request's TPOT is (last token - first token) / (tokens - 1), and
a case's TPOT the median over its requests. Printed per case with its ratio to the 0% case;
target (issue 39): <= 1.10 at 100% for either, and none for the unconstrained requests of the
25% case.

The schema is nested and unbounded (a list of records, strings without maxLength), so a
random-weights model keeps producing tokens until max_tokens, as a real answer of that length
would. A checkpoint without tokenizer.json (bench/random_checkpoint.py writes none) gets a
synthetic byte-level vocabulary of the model's size, in an overlay folder that links the
weights: the mask's cost grows with the vocabulary, so it must be the model's.

    python bench/structured_tpot.py --quick                  # CPU, built-in model, a minute
    python bench/structured_tpot.py --device cuda --dtype bfloat16 --model DIR \\
        --json structured_tpot.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sidecar"))
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT / "bench"))

import aiohttp  # noqa: E402
from stream_client import parse_metrics, stream_completion  # noqa: E402

from pdd_sidecar.model.config import load_config  # noqa: E402
from pdd_sidecar.serve.local_stack import (  # noqa: E402
    LocalStack,
    check_config,
    config_from_args,
    parser,
)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "status": {"enum": ["open", "closed", "pending"]},
        "count": {"type": "integer"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "score": {"type": "number"},
                    "ok": {"type": "boolean"},
                },
                "required": ["id", "name", "tags", "score", "ok"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["title", "status", "count", "items"],
    "additionalProperties": False,
}


@dataclass
class Case:
    name: str
    requests: int = 0
    constrained: int = 0
    errors: int = 0
    tokens: int = 0
    logprob_tokens: int = 0  # tokens whose log-probability came back (the logprobs case)
    stopped_early: int = 0  # constrained answers the grammar completed before max_tokens
    off_grammar: int = 0  # constrained answers with a token the schema's grammar rejects
    tpot_ms: float = float("nan")  # median over requests
    tpot_constrained_ms: float = float("nan")
    tpot_plain_ms: float = float("nan")
    wall_s: float = 0.0
    mask_ms: float = float("nan")  # the decode's mean host time filling a step's mask
    mask_steps: int = 0  # decode steps that filled one
    skipped: str = ""
    first_error: str = ""
    per_round_ms: list[float] = field(default_factory=list)


def synthetic_tokenizer(vocab: int, seed: int = 0) -> dict[str, Any]:
    """A byte-level BPE tokenizer.json of ``vocab`` tokens: the 256 bytes, then words of
    letters, digits and JSON punctuation, with and without a leading space, as a real
    vocabulary holds. No merges: it encodes byte by byte, which the bench never needs (it sends
    token ids); llguidance reads the tokens' bytes."""
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    to_char = dict(enumerate(_byte_chars()))
    assert set(to_char.values()) == set(alphabet)
    rng = random.Random(seed)
    tokens = [to_char[b] for b in range(256)]
    seen = set(tokens)
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = ['"', '":', '",', "{", "}", "[", "]", ",", ":", " ", "_", "-", "."]
    while len(tokens) < vocab - 2:
        kind = rng.random()
        if kind < 0.7:
            word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
            if rng.random() < 0.2:
                word = word.capitalize()
        elif kind < 0.85:
            word = str(rng.randint(0, 99999))
        else:
            word = "".join(rng.choice(pieces) for _ in range(rng.randint(2, 4)))
        if rng.random() < 0.5:
            word = " " + word
        text = "".join(to_char[b] for b in word.encode())
        if text not in seen:
            seen.add(text)
            tokens.append(text)
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
    vocab_map = {t: i for i, t in enumerate(tokens)}
    added: list[dict[str, Any]] = [
        {"id": len(tokens) + i, "content": s, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
        for i, s in enumerate(specials)]
    for a in added:
        vocab_map[a["content"]] = a["id"]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab_map, "merges": []},
    }


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def model_with_tokenizer(model: str, work: Path) -> str:
    """``model`` itself when it has a tokenizer (or is the built-in one); else an overlay
    folder linking its files, with a synthetic tokenizer of its vocabulary's size."""
    if model == "builtin" or (Path(model) / "tokenizer.json").is_file():
        return model
    src = Path(model).resolve()
    out = work / "model"
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    tok = synthetic_tokenizer(int(cfg["vocab_size"]))
    (out / "tokenizer.json").write_text(json.dumps(tok))
    eos = tok["added_tokens"][1]
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tok["added_tokens"][0]["content"], "eos_token": eos["content"],
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    print(f"synthetic tokenizer: {len(tok['model']['vocab'])} tokens for vocab "
          f"{cfg['vocab_size']} (overlay {out})", flush=True)
    return str(out)


def tpot(times: list[float]) -> float | None:
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


@dataclass
class Times:
    """A case's per-request TPOTs, kept over its rounds."""

    plain: list[float] = field(default_factory=list)
    constrained: list[float] = field(default_factory=list)


async def mask_counts(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """The decode's ``pdd_structured_mask_seconds`` (sum, count)."""
    async with session.get(f"{url}/metrics") as resp:
        got = parse_metrics(await resp.text())
    return (got.get("pdd_structured_mask_seconds_sum", 0.0),
            got.get("pdd_structured_mask_seconds_count", 0.0))


async def run_round(session: aiohttp.ClientSession, url: str, case: Case, times: Times,
                    args: argparse.Namespace, prompts: list[list[int]], share: float,
                    extra_all: dict[str, Any], salt: int, decode_url: str = "",
                    on_grammar: Callable[[list[int]], bool] | None = None) -> None:
    """One burst of ``args.streams`` requests, ``share`` of them under the schema; each
    constrained answer is checked with ``on_grammar`` (its tokens, the schema's language)."""
    n = args.streams
    every = max(1, round(1 / share)) if share > 0 else 0
    constrained = {i for i in range(n) if every and i % every == 0}
    case.constrained = len(constrained)
    jobs = []
    for i in range(n):
        extra = dict(extra_all)
        if i in constrained:
            extra["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "record", "schema": SCHEMA, "strict": True}}
        jobs.append(stream_completion(session, url, prompts[(salt * n + i) % len(prompts)],
                                      args.out_tokens, extra=extra, exact=False))
    before = await mask_counts(session, decode_url) if decode_url else (0.0, 0.0)
    t0 = time.perf_counter()
    got = await asyncio.gather(*jobs)
    case.wall_s += time.perf_counter() - t0
    if decode_url:
        after = await mask_counts(session, decode_url)
        steps = int(after[1] - before[1])
        if steps:
            total = (0.0 if case.mask_steps == 0 else case.mask_ms * case.mask_steps / 1e3)
            case.mask_steps += steps
            case.mask_ms = (total + after[0] - before[0]) / case.mask_steps * 1e3
    round_t = []
    for i, g in enumerate(got):
        case.requests += 1
        if isinstance(g, str):
            case.errors += 1
            case.first_error = case.first_error or g
            continue
        arrived = g.times
        case.tokens += len(arrived)
        case.logprob_tokens += g.logprob_tokens
        if i in constrained and g.finish_reason == "stop":
            case.stopped_early += 1
        if i in constrained and on_grammar is not None and not on_grammar(g.tokens):
            case.off_grammar += 1
        t = tpot(arrived)
        if t is None:
            continue
        (times.constrained if i in constrained else times.plain).append(t)
        round_t.append(t)
    if round_t:
        case.per_round_ms.append(statistics.median(round_t) * 1e3)


def settle(case: Case, times: Times) -> Case:
    both = times.plain + times.constrained
    if both:
        case.tpot_ms = statistics.median(both) * 1e3
    if times.constrained:
        case.tpot_constrained_ms = statistics.median(times.constrained) * 1e3
    if times.plain:
        case.tpot_plain_ms = statistics.median(times.plain) * 1e3
    return case


async def refused(session: aiohttp.ClientSession, url: str, prompt: list[int],
                  extra: dict[str, Any]) -> str:
    """Why the server refuses ``extra`` (empty when it takes it)."""
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status == 200:
            await resp.read()
            return ""
        text = await resp.text()
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:300]


def show(c: Case, base: Case | None) -> None:
    if c.skipped:
        print(f"  {c.name}: SKIPPED: {c.skipped}", flush=True)
        return
    ratio = f" = {c.tpot_ms / base.tpot_ms:.3f}x the 0% case" if base and base is not c else ""
    split = ""
    if 0 < c.constrained < c.requests // max(1, len(c.per_round_ms)):
        split = (f" (constrained {c.tpot_constrained_ms:.2f} ms, others "
                 f"{c.tpot_plain_ms:.2f} ms)")
    err = f"; {c.errors} failed: {c.first_error[:160]}" if c.errors else ""
    if c.constrained:
        err += f"; {c.off_grammar} constrained answers off the schema's grammar"
    early = f"; {c.stopped_early} grammar-complete before max_tokens" if c.stopped_early else ""
    if c.mask_steps:
        early += (f"; decode mask fill {c.mask_ms:.3f} ms a step (host, {c.mask_steps} "
                  "steps)")
    print(f"  {c.name}: TPOT p50 {c.tpot_ms:.2f} ms{ratio}{split}; rounds "
          f"{', '.join(f'{x:.2f}' for x in c.per_round_ms)} ms; {c.tokens} tokens in "
          f"{c.wall_s:.1f}s{early}{err}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes for the CPU")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default="builtin")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--streams", type=int, default=None, help="concurrent streams (64; quick 8)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="(256; quick 32)")
    p.add_argument("--out-tokens", type=int, default=None, help="(128; quick 16)")
    p.add_argument("--rounds", type=int, default=None, help="bursts per case (4; quick 2)")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--log-dir", default=None, metavar="DIR")
    args = p.parse_args(argv)
    q = args.quick
    args.streams = args.streams or (8 if q else 64)
    args.prompt_tokens = args.prompt_tokens or (32 if q else 256)
    args.out_tokens = args.out_tokens or (16 if q else 128)
    args.rounds = args.rounds or (2 if q else 4)
    print(f"structured_tpot: {args.device}, model {args.model}, {args.streams} streams of "
          f"({args.prompt_tokens} in, {args.out_tokens} out) x {args.rounds} rounds; cpus "
          f"{os.cpu_count()}, load average {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="structured-tpot-") as tmp:
        model = model_with_tokenizer(args.model, Path(tmp))
        span, base = 256, 0
        if model != "builtin":
            vocab = load_config(model).vocab_size
            span, base = min(20000, vocab // 2), min(100, vocab // 4)
        rng = random.Random(5)
        prompts = [[rng.randrange(span) + base for _ in range(args.prompt_tokens)]
                   for _ in range(args.streams * (args.rounds + 1))]
        argv_stack = ["--device", args.device, "--model", model, "--port", "0", "--log-level",
                      "WARNING"]
        if args.dtype:
            argv_stack += ["--dtype", args.dtype]
        cfg = config_from_args(parser().parse_args(argv_stack))
        found = check_config(cfg)
        if found:
            raise SystemExit("structured_tpot: " + "; ".join(found))
        cases = asyncio.run(_serve(cfg, args, prompts, grammar_check(model)))
    base_case = cases[0]
    print("results:")
    for c in cases:
        show(c, base_case)
    summary = {}
    for c in cases[1:]:
        if c.skipped:
            summary[c.name] = f"skipped: {c.skipped}"
        else:
            summary[c.name] = (f"TPOT {c.tpot_ms:.2f} ms = {c.tpot_ms / base_case.tpot_ms:.3f}x "
                               f"the 0% case ({base_case.tpot_ms:.2f} ms); target <= 1.10 at "
                               "100%")
    for k, v in summary.items():
        print(f"{k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": vars(args), "schema": SCHEMA, "cases": [asdict(c) for c in cases],
            "summary": summary}, indent=2, default=str) + "\n")
    return 1 if any(c.errors or c.off_grammar for c in cases) else 0


def grammar_check(model: str) -> Callable[[list[int]], bool]:
    """Whether an answer's tokens are all accepted by the schema's grammar, on the tokenizer
    the instances use: what the mask did on the device, checked on the host apart from it."""
    from pdd_sidecar.engine.grammar_mask import build_tokenizer
    from pdd_sidecar.grammar import GrammarCache, parse_spec

    vocab = load_config(model).vocab_size
    spec = parse_spec({"kind": "json_schema", "value": SCHEMA})
    assert spec is not None
    compiled = GrammarCache(build_tokenizer(model, vocab, frozenset())).get(spec)

    def on_grammar(tokens: list[int]) -> bool:
        m = compiled.matcher()
        return all(m.consume_token(t) for t in tokens)
    return on_grammar


async def _serve(cfg: Any, args: argparse.Namespace, prompts: list[list[int]],
                 on_grammar: Callable[[list[int]], bool]) -> list[Case]:
    log_dir = Path(args.log_dir) if args.log_dir else None
    stack = LocalStack(cfg, log_dir)
    cases: list[Case] = []
    try:
        t0 = time.perf_counter()
        await asyncio.to_thread(stack.start)
        print(f"pdd serve ready in {time.perf_counter() - t0:.0f}s", flush=True)
        timeout = aiohttp.ClientTimeout(total=3600)
        conn = aiohttp.TCPConnector(limit=512)
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
            url = stack.url
            # Compiles the schema (once, cached) and warms the path the cases take.
            warm = Case("warm-up")
            await run_round(session, url, warm, Times(), args, prompts, 0.5, {}, 0)
            if warm.errors:
                print(f"warm-up failed: {warm.first_error}", flush=True)
            plan: list[tuple[Case, float, dict[str, Any]]] = [
                (Case(f"{name} under a JSON schema"), share, {})
                for name, share in (("0%", 0.0), ("25%", 0.25), ("100%", 1.0))]
            logprobs = {"logprobs": 5}
            why = await refused(session, url, prompts[0], logprobs)
            lp = Case("top_logprobs 5 on all")
            if why:
                lp.skipped = f"the server refuses logprobs: {why}"
            else:
                plan.append((lp, 0.0, logprobs))
            times = {id(c): Times() for c, _, _ in plan}
            # Round by round, each case in turn: a drift of the machine falls on all of them.
            for r in range(args.rounds):
                for c, share, extra in plan:
                    await run_round(session, url, c, times[id(c)], args, prompts, share, extra,
                                    r + 1, stack.decode_url, on_grammar)
                print(f"round {r + 1}: " + "; ".join(
                    f"{c.name} {c.per_round_ms[-1]:.2f} ms" for c, _, _ in plan
                    if c.per_round_ms), flush=True)
            cases = [settle(c, times[id(c)]) for c, _, _ in plan]
            if lp.skipped:
                cases.append(lp)
        stack.raise_if_dead()
    finally:
        stack.stop()
        stack.cleanup()
    return cases


if __name__ == "__main__":
    raise SystemExit(main())
