"""bench/structured_tpot.py --quick end to end: every case runs with no failed request and the
share of constrained requests it names; the logprobs case runs and its answers carry their
log-probabilities (pdd serves them: a skip would hide a refusal); a
checkpoint without a tokenizer gets a synthetic one of its vocabulary's size that llguidance
and the router's tokenizers both read."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench_fixtures import load_bench

pytestmark = pytest.mark.dataplane


def test_quick_run_of_every_case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = load_bench("structured_tpot.py", monkeypatch)
    out = tmp_path / "structured_tpot.json"
    assert mod.main(["--quick", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    cases = {c["name"]: c for c in res["cases"]}
    streams, rounds = res["config"]["streams"], res["config"]["rounds"]
    shares = {"0% under a JSON schema": 0, "25% under a JSON schema": streams // 4,
              "100% under a JSON schema": streams}
    for name, constrained in shares.items():
        c = cases[name]
        assert c["errors"] == 0 and c["requests"] == streams * rounds, c
        assert c["constrained"] == constrained
        assert c["off_grammar"] == 0  # every constrained answer checked against the grammar
        assert len(c["per_round_ms"]) == rounds and math.isfinite(c["tpot_ms"])
        assert 0 < c["tokens"] <= streams * rounds * res["config"]["out_tokens"]
    assert cases["0% under a JSON schema"]["mask_steps"] == 0  # nothing filled without a grammar
    for name in ("25% under a JSON schema", "100% under a JSON schema"):
        assert cases[name]["mask_steps"] > 0 and cases[name]["mask_ms"] > 0
    assert math.isfinite(cases["25% under a JSON schema"]["tpot_constrained_ms"])
    assert math.isfinite(cases["25% under a JSON schema"]["tpot_plain_ms"])
    for name in shares:
        assert cases[name]["logprob_tokens"] == 0  # none asked
    # pdd serves logprobs: the case must run, and every token it timed carried its entry.
    lp = cases["top_logprobs 5 on all"]
    assert not lp["skipped"], lp["skipped"]
    assert lp["errors"] == 0 and lp["requests"] == streams * rounds, lp
    assert math.isfinite(lp["tpot_ms"]) and lp["tokens"] > 0
    assert lp["logprob_tokens"] == lp["tokens"], lp
    assert set(res["summary"]) == set(cases) - {"0% under a JSON schema"}


def test_the_grammar_check_rejects_an_answer_off_the_schema(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mod = load_bench("structured_tpot.py", monkeypatch)
    on_grammar = mod.grammar_check("builtin")  # byte tokens: a token is its byte
    assert on_grammar(list(b'{"title":"a","status":"open","count":1,"items":[]}'))
    assert on_grammar(list(b'{"title":"ab'))  # a prefix of the language: cut by max_tokens
    assert not on_grammar(list(b'{"name":'))
    assert not on_grammar(list(b'{"title":"a","status":"shut"'))


def test_a_checkpoint_without_a_tokenizer_gets_one_of_its_vocabulary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import llguidance
    from tokenizers import Tokenizer

    mod = load_bench("structured_tpot.py", monkeypatch)
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"vocab_size": 3000}))
    (src / "model.safetensors").write_bytes(b"weights")
    work = tmp_path / "work"
    work.mkdir()
    model = Path(mod.model_with_tokenizer(str(src), work))
    assert model != src and (model / "model.safetensors").read_bytes() == b"weights"
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert tok.get_vocab_size() == 3000
    text = '{"name": "Ada", "n": [1, 2]}'
    assert tok.decode(tok.encode(text).ids) == text  # byte by byte, every byte a token
    ll = llguidance.LLTokenizer((model / "tokenizer.json").read_text(), n_vocab=3000)
    assert ll.vocab_size == 3000
    assert ll.decode_bytes(tok.encode(text).ids) == text.encode()
    assert mod.model_with_tokenizer(str(model), work) == str(model)  # has one now
    assert mod.model_with_tokenizer("builtin", work) == "builtin"
