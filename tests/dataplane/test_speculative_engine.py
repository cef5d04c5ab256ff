"""Speculation in the engine: a verify step (the fed token and its drafts as rows of one decode
step) gives the greedy tokens of plain decoding on every layout, drafts kept and rejected alike,
and a grammar cuts the drafts it refuses."""

from __future__ import annotations

import pytest

from pdd_sidecar.engine.generate import generate_result
from pdd_sidecar.engine.speculative.config import SpeculativeConfig

pytestmark = pytest.mark.dataplane

PROMPT = list(range(40, 77))  # 37 tokens: 9 full blocks of 4 and one partial
BLOCK = 4
STEPS = 40
LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 4)]


@pytest.fixture(scope="module")
def plain() -> list[int]:
    return generate_result("builtin", PROMPT, STEPS, block_size=BLOCK).token_ids


@pytest.mark.parametrize("tp,dcp", LAYOUTS, ids=[f"tp{t}-dcp{d}" for t, d in LAYOUTS])
def test_greedy_tokens_are_plain_decodings_on_every_layout(plain: list[int], tp: int,
                                                           dcp: int) -> None:
    res = generate_result("builtin", PROMPT, STEPS, tp=tp, dcp=dcp, block_size=BLOCK,
                          speculative=SpeculativeConfig(tokens=3))
    print(f"tp{tp} dcp{dcp}: drafted {res.drafted}, accepted {res.accepted}")
    assert res.token_ids == plain
    # both outcomes happened: kept drafts (whose KV the next steps read) and rejected ones
    # (whose KV the next steps overwrite)
    assert 0 < res.accepted < res.drafted


def test_max_tokens_is_never_passed_and_the_kv_fits_the_request() -> None:
    # num_blocks defaults to exactly what the request needs: a draft past it would not fit
    for n in (1, 2, 5, 13):
        res = generate_result("builtin", [5, 6, 7, 8] * 4, n, block_size=BLOCK,
                              speculative=SpeculativeConfig(tokens=3))
        assert res.token_ids == generate_result("builtin", [5, 6, 7, 8] * 4, n,
                                                block_size=BLOCK).token_ids


def test_a_grammar_cuts_drafts_at_the_first_it_refuses() -> None:
    import llguidance

    from pdd_sidecar.engine.grammar_mask import Constrained, _ByteTokens
    from pdd_sidecar.engine.speculative.rows import grammar_drafts

    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(256)))
    grammar = llguidance.LLMatcher.grammar_from_regex("ab+c")
    g = Constrained(llguidance.LLMatcher(tok, grammar), 9)
    a, b, c, x = (ord(ch) for ch in "abcx")
    kept, states = grammar_drafts(g, [a, b, x, b])
    assert kept == [a, b]
    assert len(states) == 3 and states[0] is g
    assert g.matcher.consume_token(a)  # the sequence's own matcher was not advanced
    # each state is the grammar after the drafts before it: only b may follow "ab"... or c
    assert states[2].matcher.validate_tokens([c]) == 1
    assert states[1].matcher.validate_tokens([c]) == 0
    # a draft that completes the grammar ends the sequence: nothing is drafted from it on
    g2 = Constrained(llguidance.LLMatcher(tok, grammar), 9)
    kept, states = grammar_drafts(g2, [a, b, c, a])
    assert kept == [a, b] and len(states) == 3


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)], ids=["tp1", "tp2-dcp2"])
def test_verify_rows_through_the_padded_graph_path(plain: list[int], tp: int, dcp: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU twin of CUDA graphs: the verify rows staged into a bucket's static buffers,
    several rows of one table, each storing its latent before any attends."""
    from pdd_sidecar.engine import rank_engine

    padded: list[int] = []
    real = rank_engine.RankEngine._decode_padded

    def counted(self, chunks, want_logits):  # type: ignore[no-untyped-def]
        padded.append(len(chunks))
        return real(self, chunks, want_logits)

    monkeypatch.setenv("PDD_CUDA_GRAPHS", "padded")
    monkeypatch.setattr(rank_engine.RankEngine, "_decode_padded", counted)
    res = generate_result("builtin", PROMPT, STEPS, tp=tp, dcp=dcp, block_size=BLOCK,
                          speculative=SpeculativeConfig(tokens=3))
    assert res.token_ids == plain
    assert any(n > 1 for n in padded)  # verify steps of several rows ran padded


@pytest.mark.parametrize("mode", ["eager", "padded"])
@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)], ids=["tp1", "tp2-dcp2"])
def test_verify_rows_beside_a_prompt_equal_each_alone(plain: list[int], tp: int, dcp: int,
                                                      mode: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step that also prefills a prompt on the decode (a local prefill) and verifies a
    sequence's fed token and three drafts: the prompt's row and each verify row give what they
    give in steps of their own."""
    import torch

    from pdd_sidecar.engine.comm import Comm, run_threads
    from pdd_sidecar.engine.rank_engine import RankEngine, allocate_request, new_cache
    from pdd_sidecar.engine.seq_chunk import SeqChunk
    from pdd_sidecar.model.rank_model import load_rank_model

    if mode == "padded":  # the CPU twin of CUDA graphs
        monkeypatch.setenv("PDD_CUDA_GRAPHS", "padded")
    other = list(range(100, 113))
    fed = plain[:4]  # the fed token and drafts that plain decoding would keep

    def body(rank: int, comm: Comm) -> tuple[float, list[int]]:
        model = load_rank_model("builtin", rank, tp)
        runs = []
        for _ in range(2):
            eng = RankEngine(model, new_cache(model, 64, BLOCK), comm, dcp)
            seq = allocate_request(eng.cache, len(PROMPT) + 8, dcp)
            eng.prefill(PROMPT, seq)
            runs.append((eng, seq, allocate_request(eng.cache, len(other) + 4, dcp)))

        def rows(seq: list[int]) -> list[SeqChunk]:
            return [SeqChunk([t], len(PROMPT) + j, seq) for j, t in enumerate(fed)]

        eng, seq, prompt = runs[0]
        mixed = eng.step([SeqChunk(other, 0, prompt), *rows(seq)])
        eng, seq, prompt = runs[1]
        alone = torch.cat([eng.step([SeqChunk(other, 0, prompt)]), eng.step(rows(seq))])
        assert mixed is not None and mixed.shape == alone.shape == (5, mixed.shape[1])
        return float((mixed - alone).abs().max()), mixed[1:].argmax(-1).tolist()

    worst, picks = run_threads(tp, body)[0]
    assert picks == plain[1:5]
    assert worst < 1e-4, worst
