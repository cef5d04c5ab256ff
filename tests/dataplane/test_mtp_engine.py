"""MTP drafts in the engine (engine/speculative/mtp.py) on a V3 checkpoint with the module:
greedy output identical with and without speculation on every layout, the drafts are the
module's (its torch reference's argmax), and a checkpoint without one is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from test_mtp import mtp_checkpoint  # noqa: F401  (the fixture: a V3 checkpoint with the module)

from pdd_sidecar.engine.comm import SingleComm
from pdd_sidecar.engine.generate import generate_result, main
from pdd_sidecar.engine.rank_engine import RankEngine, allocate_request, new_cache
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.engine.speculative.config import SpeculativeConfig
from pdd_sidecar.engine.speculative.mtp import MTPDrafter
from pdd_sidecar.model.config import ConfigError
from pdd_sidecar.model.mtp import load_mtp_rank_model, mtp_reference_logits
from pdd_sidecar.model.rank_model import load_rank_model

pytestmark = pytest.mark.dataplane

PROMPT = list(range(40, 77))  # 37 tokens: 9 full blocks of 4 and one partial
BLOCK = 4
STEPS = 24
LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2)]


@pytest.fixture(scope="module")
def plain(mtp_checkpoint) -> list[int]:  # noqa: F811
    return generate_result(mtp_checkpoint[0], PROMPT, STEPS, block_size=BLOCK).token_ids


@pytest.mark.parametrize("tp,dcp,k", LAYOUTS, ids=[f"tp{t}-dcp{d}-k{k}" for t, d, k in LAYOUTS])
def test_greedy_tokens_are_plain_decodings(mtp_checkpoint, plain, tp, dcp, k):  # noqa: F811
    res = generate_result(mtp_checkpoint[0], PROMPT, STEPS, tp=tp, dcp=dcp, block_size=BLOCK,
                          speculative=SpeculativeConfig(method="mtp", tokens=k))
    print(f"tp{tp} dcp{dcp} k{k}: drafted {res.drafted}, accepted {res.accepted}")
    assert res.token_ids == plain
    assert res.drafted >= (STEPS - 1) // (k + 1)  # it drafted at every step that had room


def test_drafts_are_the_modules_argmax(mtp_checkpoint, plain):  # noqa: F811
    """Draft 1 fed at position p is the reference module's argmax at p - 1 over the whole
    sequence (the main model's hidden states of the plain run, the tokens that followed); a
    draft spoiled into another token is then never kept, and the output stays the same."""
    path = mtp_checkpoint[0]
    res = generate_result(path, PROMPT, STEPS, block_size=BLOCK,
                          speculative=SpeculativeConfig(method="mtp", tokens=1))
    seq = [*PROMPT, *plain]
    model = load_rank_model(path)
    cache = new_cache(model, 64, BLOCK)
    engine = RankEngine(model, cache, SingleComm(), decode_mode="eager")
    table = allocate_request(cache, len(seq), 1)
    engine.step([SeqChunk(seq, 0, table)], keep=[0])
    hidden = engine.kept[0]
    w, _ = load_mtp_rank_model(path, model)
    n = len(seq) - 1
    ref = mtp_reference_logits(w, model.config, model.rotary, hidden[:n],
                               torch.tensor(seq[1:]), torch.arange(n)).argmax(-1)
    checked = 0
    for pos, drafts in res.drafts:
        if drafts:
            assert drafts[0] == int(ref[pos - 1]), f"draft fed at {pos}"
            checked += 1
    assert checked >= STEPS // 2
    assert res.accepted > 0  # the fixture's module guesses some right: the accept path ran
    spoiled = generate_result(path, PROMPT, STEPS, block_size=BLOCK, spoil_drafts=True,
                              speculative=SpeculativeConfig(method="mtp", tokens=1))
    assert spoiled.token_ids == plain
    assert spoiled.drafted > 0 and spoiled.accepted == 0


def test_the_drafter_runs_the_modules_kv_like_the_reference(mtp_checkpoint):  # noqa: F811
    """Position by position (one decode row each, reading the module's paged KV) the drafter's
    picks equal the reference's over the whole sequence at once."""
    path = mtp_checkpoint[0]
    model = load_rank_model(path)
    cache = new_cache(model, 32, BLOCK, extra_layers=1)
    drafter = MTPDrafter.load(path, model, cache, SingleComm())
    g = torch.Generator().manual_seed(5)
    n = 19
    hidden = torch.randn(n, model.config.hidden_size, generator=g)
    after = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
    table = allocate_request(cache, n + 1, 1)
    ref = mtp_reference_logits(drafter.w, model.config, model.rotary, hidden,
                               torch.tensor(after), torch.arange(n)).argmax(-1)
    got = drafter.draft([(SeqChunk(after[:7], 0, table), hidden[:7])], [1])[0]
    picks = [got[0]]
    for p in range(7, n):
        picks.append(drafter.draft([(SeqChunk([after[p]], p, table), hidden[p:p + 1])], [1])[0][0])
    assert picks == ref[6:].tolist()
    # the main layers' latents are untouched: the module's are the cache's last layer
    assert cache.kv[:, :-1].abs().sum() == 0 and cache.kv[:, -1].abs().sum() > 0
    with pytest.raises(ValueError, match="build the cache with extra_layers=1"):
        MTPDrafter.load(path, model, new_cache(model, 32, BLOCK), SingleComm())


def test_a_checkpoint_without_the_module_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"speculative\.method.*'mtp'.*'builtin'"):
        generate_result("builtin", [1, 2, 3], 4,
                        speculative=SpeculativeConfig(method="mtp", tokens=1))


def test_pdd_generate_speculates_with_mtp(mtp_checkpoint, plain, capsys):  # noqa: F811
    argv = ["generate", "--model", str(mtp_checkpoint[0]), "--prompt-ids",
            ",".join(map(str, PROMPT)), "--max-tokens", str(STEPS), "--block-size", str(BLOCK),
            "-o", "json"]
    assert main([*argv, "--speculative", "mtp"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == plain and out["drafted"] > out["accepted"] >= 0
    assert main(["generate", "--prompt-ids", "1,2", "--max-tokens", "3", "--speculative",
                 "mtp"]) == 1
    assert "speculative.method: 'mtp' needs a checkpoint with an MTP module" in \
        capsys.readouterr().err


def test_a_batch_drafts_as_each_sequence_alone(mtp_checkpoint):  # noqa: F811
    """Sequences of one call (different tables, positions, draft counts, chained drafts) get
    the drafts each gets in a call of its own: the decode driver drafts for a whole step."""
    path = mtp_checkpoint[0]
    model = load_rank_model(path)
    g = torch.Generator().manual_seed(9)
    h = model.config.hidden_size
    lens, ks = [11, 6, 9], [2, 3, 0]
    hidden = [torch.randn(n, h, generator=g) for n in lens]
    after = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lens]

    def run(which: list[int]) -> list[list[int]]:
        cache = new_cache(model, 32, BLOCK, extra_layers=1)
        drafter = MTPDrafter.load(path, model, cache, SingleComm())
        tables = [allocate_request(cache, 16, 1) for _ in lens]
        split = 4  # a first call over the first positions, then the rest: the KV is read back
        drafter.draft([(SeqChunk(after[i][:split], 0, tables[i]), hidden[i][:split])
                       for i in which], [1] * len(which))
        return drafter.draft([(SeqChunk(after[i][split:], split, tables[i]),
                               hidden[i][split:]) for i in which], [ks[i] for i in which])

    together = run([0, 1, 2])
    assert together == [run([0])[0], run([1])[0], run([2])[0]]
    assert [len(d) for d in together] == ks


@pytest.mark.parametrize("send_state", [True, False], ids=["with-state", "without-state"])
def test_pd_hands_the_draft_state_over(mtp_checkpoint, plain, send_state):  # noqa: F811
    """Prefill tp1 -> decode tp2/dcp2: the module's latents move with the prompt's blocks and,
    with the draft state, the decode's drafts are the one-instance run's from the first step;
    without it, the first step drafts nothing and is counted, and the rest are the same."""
    from pdd_sidecar.engine.speculative.mtp_handoff import mtp_handoff_generate

    cfg = SpeculativeConfig(method="mtp", tokens=1)
    one = generate_result(mtp_checkpoint[0], PROMPT, STEPS, block_size=BLOCK, speculative=cfg)
    res = mtp_handoff_generate(str(mtp_checkpoint[0]), PROMPT, STEPS, (1, 1), (2, 2), cfg,
                               send_state=send_state, block_size=BLOCK)
    assert res.token_ids == plain
    by_pos = dict(one.drafts)
    if send_state:
        assert res.drafts == one.drafts and res.missing_draft_state == 0
    else:
        assert res.drafts[0] == (len(PROMPT), []) and res.missing_draft_state == 1
        later = [(p, d) for p, d in res.drafts[1:] if d]
        assert later and all(by_pos.get(p, d) == d for p, d in later)
        assert sum(p in by_pos for p, _ in later) >= len(later) - 1


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_padded_rows_draft_as_the_eager_module(mtp_checkpoint, tp, dcp):  # noqa: F811
    """The module's decode-side rows (a few positions per sequence, chained drafts) padded to
    a batch bucket, the CPU twin of its CUDA graphs, draft what the eager module drafts and
    store the same latents; a prompt's positions still run as a chunk, eagerly."""
    from pdd_sidecar.engine.comm import run_threads

    path = mtp_checkpoint[0]
    lens, ks = [11, 6, 9], [2, 3, 1]

    def run(rank, comm, mode):
        model = load_rank_model(path, rank, tp)
        h = model.config.hidden_size
        g = torch.Generator().manual_seed(9)
        hidden = [torch.randn(n, h, generator=g) for n in lens]
        after = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
                 for n in lens]
        cache = new_cache(model, 48, BLOCK, extra_layers=1)
        main = RankEngine(model, cache, comm, dcp, decode_mode=mode, extra_layers=1,
                          graph_buckets=(1, 2, 4, 8))
        drafter = MTPDrafter.load(path, model, cache, comm, dcp, like=main)
        tables = [allocate_request(cache, 16, dcp) for _ in lens]
        drafter.draft([(SeqChunk(after[i][:5], 0, tables[i]), hidden[i][:5])
                       for i in range(3)], [0, 0, 0])
        out = []
        pos = 5
        while pos < min(lens):  # one or two positions a sequence a call, as a decode's steps
            n = 1 + pos % 2
            out.append(drafter.draft([(SeqChunk(after[i][pos:pos + n], pos, tables[i]),
                                       hidden[i][pos:pos + n]) for i in range(3)], ks))
            pos += n
        return out, cache.kv[:, -1].clone(), drafter.engine.padded_steps

    eager = run_threads(tp, lambda r, c: run(r, c, "eager"))
    padded = run_threads(tp, lambda r, c: run(r, c, "padded"))
    assert eager[0][0] == padded[0][0]
    assert [len(d) for d in padded[0][0][0]] == ks
    assert eager[0][2] == 0 and padded[0][2] > 0
    for (_, a, _), (_, b, _) in zip(eager, padded, strict=True):
        assert float((a - b).abs().max()) <= 1e-5
