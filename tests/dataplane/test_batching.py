"""The batched step: many sequences in one forward pass, and prompts in chunks, give each sequence
what it gets alone (greedy tokens identical, logits equal within fp32 rounding), also with TP and
DCP ranks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from runtime_fixtures import LocalCluster, http, plan_json

from pdd_sidecar.engine import rank_engine
from pdd_sidecar.engine.comm import Comm, run_threads
from pdd_sidecar.engine.rank_engine import RankEngine, allocate_request, new_cache
from pdd_sidecar.engine.sampling import SamplingParams, sample
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.engine.warmup_shape import warmup_fresh_blocks
from pdd_sidecar.model import mla
from pdd_sidecar.model.rank_model import load_rank_model

pytestmark = pytest.mark.dataplane

BLOCK = 4


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 11 + 5) % 256 for i in range(n)]


def _alone(engine: RankEngine, prompt: list[int],
           steps: int) -> tuple[list[int], list[torch.Tensor]]:
    table = allocate_request(engine.cache, len(prompt) + steps, engine.dcp)
    logits = engine.prefill(prompt, table)
    out, all_logits = [], [logits]
    for i in range(steps):
        tok = int(torch.argmax(logits))
        out.append(tok)
        logits = engine.decode_step(tok, len(prompt) + i, table)
        all_logits.append(logits)
    engine.cache.free(table)
    return out, all_logits


def _batched(engine: RankEngine, prompts: list[list[int]], steps: int,
             chunk: int) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Prompts prefilled in chunks of ``chunk`` tokens, all in the same steps, then decoded
    together; sequences start decoding as soon as their prompt is done."""
    tables = [allocate_request(engine.cache, len(p) + steps, engine.dcp) for p in prompts]
    done = [0] * len(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    logs: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(len(o) < steps for o in outs):
        chunks, who = [], []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                n = min(chunk, len(p) - done[i])
                chunks.append(SeqChunk(p[done[i]:done[i] + n], done[i], tables[i]))
                done[i] += n
                who.append((i, done[i] == len(p)))
            elif len(outs[i]) < steps:
                tok = outs[i][-1]
                chunks.append(SeqChunk([tok], len(p) + len(outs[i]) - 1, tables[i]))
                who.append((i, True))
        logits = engine.step(chunks)
        assert logits is not None
        for row, (i, sampled) in enumerate(who):
            if sampled and len(outs[i]) < steps:
                logs[i].append(logits[row])
                outs[i].append(int(torch.argmax(logits[row])))
    for t in tables:
        engine.cache.free(t)
    return outs, logs


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 1), (2, 2)])
def test_batch_of_mixed_lengths_equals_each_alone(tp: int, dcp: int) -> None:
    prompts = [_prompt(n, i) for i, n in enumerate([3, 9, 17, 4, 30, 12])]
    steps = 6

    def body(rank: int, comm: Comm) -> tuple[list[list[int]], list[list[int]], float]:
        model = load_rank_model("builtin", rank, tp)
        engine = RankEngine(model, new_cache(model, 128, BLOCK), comm, dcp)
        alone = [_alone(engine, p, steps) for p in prompts]
        batched, logs = _batched(engine, prompts, steps, chunk=8)
        worst = max(
            float((a - b).abs().max())
            for (_, la), lb in zip(alone, logs, strict=True)
            for a, b in zip(la[:steps], lb, strict=True)
        )
        assert engine.cache.num_free == 128
        return [a for a, _ in alone], batched, worst

    alone, batched, worst = run_threads(tp, body)[0]
    assert batched == alone
    assert worst < 1e-4, worst


def test_chunked_prefill_attends_over_the_cached_chunks() -> None:
    model = load_rank_model("builtin", 0, 1)
    engine = RankEngine(model, new_cache(model, 64, BLOCK), _single(), 1)
    prompt = _prompt(23, 3)
    table = allocate_request(engine.cache, len(prompt), 1)
    whole = engine.prefill(prompt, table, all_logits=True)
    for chunk in (4, 8, 12):
        logits = []
        for start in range(0, len(prompt), chunk):
            piece = prompt[start:start + chunk]
            out = engine.step([SeqChunk(piece, start, table)])
            assert out is not None
            logits.append(out[0])
        assert torch.allclose(logits[-1], whole[-1], atol=1e-4)


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced"])
def test_chunked_prefill_equals_one_pass(tp: int, dcp: int, sliced: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt in chunks (off the block grid, on it, several blocks) gives the one-pass logits
    at every chunk's end and the same cache, also under DCP, where each rank holds only its
    blocks and attends with every head; ``sliced`` expands the cached latent a few tokens at a
    time, so the context's slices merge by LSE too."""
    if sliced:
        monkeypatch.setattr(mla, "EXPANDED_SLICE_BYTES", 3 * 8 * 32 * 4)  # 3-6 tokens a slice
    prompt = _prompt(37, 5)

    def body(rank: int, comm: Comm) -> float:
        model = load_rank_model("builtin", rank, tp)
        one = RankEngine(model, new_cache(model, 64, BLOCK), comm, dcp)
        table = allocate_request(one.cache, len(prompt), dcp)
        whole = one.prefill(prompt, table, all_logits=True)
        worst = 0.0
        for chunk in (5, 8, 16):
            eng = RankEngine(model, new_cache(model, 64, BLOCK), comm, dcp)
            assert allocate_request(eng.cache, len(prompt), dcp) == table
            for start in range(0, len(prompt), chunk):
                piece = prompt[start:start + chunk]
                out = eng.step([SeqChunk(piece, start, table)])
                assert out is not None
                end = start + len(piece)
                worst = max(worst, float((out[0] - whole[end - 1]).abs().max()))
                assert torch.equal(out[0].argmax(), whole[end - 1].argmax())
            assert torch.equal(eng.cache.kv == 0, one.cache.kv == 0)
            worst = max(worst, float((eng.cache.kv - one.cache.kv).abs().max()))
        return worst

    worst = max(run_threads(tp, body))
    assert worst < 1e-4, worst


def _differ_by(got: list[torch.Tensor], want: list[torch.Tensor], eng: RankEngine,
               alone: RankEngine) -> float:
    """The largest difference of the batched engine's logits and cache from those of each
    sequence alone, once the greedy tokens are the same and the cache was written in the same
    slots."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.argmax(), b.argmax())
        worst = max(worst, float((a - b).abs().max()))
    assert torch.equal(eng.cache.kv == 0, alone.cache.kv == 0)
    return max(worst, float((eng.cache.kv - alone.cache.kv).abs().max()))


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_fresh_prompts_in_one_attention_call_equal_each_alone(
        tp: int, dcp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched fresh path (forced here on the CPU, where it runs the torch reference of the
    varlen kernel): fresh prompts of 1 to 13 tokens attending in one call per layer, between a
    continuing chunk's rows and as a step of fresh prompts only, give each prompt's logits and
    cache as prefilled alone, also under DCP."""
    calls: list[int] = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return mla.varlen_prefill_attention(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(rank_engine, "batch_fresh_prompts", lambda n, dev, dt: n >= 2)
    monkeypatch.setattr(rank_engine, "varlen_prefill_attention", counted)
    lead = _prompt(14, 9)
    mixed = [_prompt(n, i) for i, n in enumerate([1, 5, 13])]
    only = [_prompt(n, i + 3) for i, n in enumerate([7, 2])]

    def body(rank: int, comm: Comm) -> float:
        model = load_rank_model("builtin", rank, tp)
        engines = [RankEngine(model, new_cache(model, 64, BLOCK), comm, dcp) for _ in range(2)]
        tables = [[allocate_request(e.cache, len(p), dcp) for p in [lead, *mixed, *only]]
                  for e in engines]
        assert tables[0] == tables[1]
        alone, eng = engines
        t = tables[0]
        # one prompt a step: the per-prompt path (the forced rule asks for two or more)
        whole = alone.prefill(lead, t[0], all_logits=True)
        want = [alone.prefill(p, tb) for p, tb in zip([*mixed, *only], t[1:], strict=True)]
        got = []
        eng.step([SeqChunk(lead[:6], 0, t[0])])
        out = eng.step([SeqChunk(mixed[0], 0, t[1]), SeqChunk(lead[6:], 6, t[0]),
                        SeqChunk(mixed[1], 0, t[2]), SeqChunk(mixed[2], 0, t[3])])
        assert out is not None
        worst = float((out[1] - whole[-1]).abs().max())
        got += [out[0], out[2], out[3]]
        out = eng.step([SeqChunk(p, 0, tb) for p, tb in zip(only, t[4:], strict=True)])
        assert out is not None
        got += list(out)
        return max(worst, _differ_by(got, want, eng, alone))

    worst = max(run_threads(tp, body))
    assert calls, "the batched fresh path never ran"
    assert worst < 1e-4, worst


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_continuing_chunks_in_one_attention_call_equal_each_alone(
        tp: int, dcp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched continuing path (forced on the CPU, where it runs the kernel's torch
    reference): chunks that continue three cached sequences of different lengths (blocks full
    and partly filled, a DCP rank holding nothing of one) attend in one call per layer, beside
    a fresh prompt and a decode token, and give each sequence's logits and cache as prefilled in
    one pass, also under DCP."""
    calls: list[int] = []

    def counted(*args: object, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return mla.chunk_prefill_attention(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(rank_engine, "batch_continuing_chunks", lambda n, dev, dt: n >= 2)
    monkeypatch.setattr(rank_engine, "chunk_prefill_attention", counted)
    # (prompt, tokens cached before the batched step)
    seqs = [(_prompt(23, 1), 9), (_prompt(6, 2), 3), (_prompt(17, 3), 8)]
    fresh, decoded = _prompt(5, 4), _prompt(7, 5)

    def body(rank: int, comm: Comm) -> float:
        model = load_rank_model("builtin", rank, tp)
        engines = [RankEngine(model, new_cache(model, 64, BLOCK), comm, dcp) for _ in range(2)]
        lens = [len(p) for p, _ in seqs] + [len(fresh), len(decoded) + 1]
        tables = [[allocate_request(e.cache, n, dcp) for n in lens] for e in engines]
        assert tables[0] == tables[1]
        alone, eng = engines
        t = tables[0]
        want = [alone.prefill(p, tb, all_logits=True)[-1]
                for (p, _), tb in zip(seqs, t[:3], strict=True)]
        want.append(alone.prefill(fresh, t[3]))
        alone.prefill(decoded, t[4])
        want.append(alone.decode_step(3, len(decoded), t[4]))
        for (p, k), tb in zip(seqs, t[:3], strict=True):
            eng.step([SeqChunk(p[:k], 0, tb)])
        eng.prefill(decoded, t[4])
        step = [SeqChunk(p[k:], k, tb) for (p, k), tb in zip(seqs, t[:3], strict=True)]
        step.insert(1, SeqChunk(fresh, 0, t[3]))
        step.append(SeqChunk([3], len(decoded), t[4]))
        out = eng.step(step)
        assert out is not None
        return _differ_by([out[0], out[2], out[3], out[1], out[4]], want, eng, alone)

    worst = max(run_threads(tp, body))
    layers = load_rank_model("builtin", 0, 1).config.num_hidden_layers
    assert len(calls) == tp * layers  # the batched step only: one call per layer and rank
    assert worst < 1e-4, worst


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_continuing_chunks_that_share_cached_blocks_equal_the_per_chunk_path(
        tp: int, dcp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefix-cache hits of one system prompt: three chunks whose tables start with the same
    two cached units (one chunk starting a unit later, after its own cached tokens). The
    batched path attends the shared units once for all of them (cascade) and the rest per
    sequence; logits and cache equal the per-chunk path's on the same cache."""
    found: list[int] = []
    real = rank_engine.shared_prefix_entries

    def shared(*args: object) -> int:
        n = real(*args)  # type: ignore[arg-type]
        found.append(n)
        return n

    monkeypatch.setattr(rank_engine, "shared_prefix_entries", shared)
    unit = BLOCK * dcp
    system = _prompt(2 * unit, 9)
    tails = [_prompt(n, 20 + i) for i, n in enumerate([5, 2 * unit + 3, 2])]

    def body(rank: int, comm: Comm) -> float:
        model = load_rank_model("builtin", rank, tp)
        outs, kvs = [], []
        for batched in (False, True):
            monkeypatch.setattr(rank_engine, "batch_continuing_chunks",
                                lambda n, dev, dt, b=batched: b and n >= 2)
            eng = RankEngine(model, new_cache(model, 64, BLOCK), comm, dcp)
            pre = eng.cache.allocate(2)
            tables = [pre + eng.cache.allocate(-(-len(t) // unit)) for t in tails]
            eng.step([SeqChunk(system, 0, tables[0])])
            eng.step([SeqChunk(tails[1][:unit], 2 * unit, tables[1])])
            out = eng.step([SeqChunk(tails[0], 2 * unit, tables[0]),
                            SeqChunk(tails[1][unit:], 3 * unit, tables[1]),
                            SeqChunk(tails[2], 2 * unit, tables[2])])
            assert out is not None
            outs.append(out)
            kvs.append(eng.cache.kv.clone())
        assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))
        return max(float((outs[0] - outs[1]).abs().max()), float((kvs[0] - kvs[1]).abs().max()))

    worst = max(run_threads(tp, body))
    assert 2 in found, found  # the batched step found both units shared
    assert worst < 1e-4, worst


def _single() -> Comm:
    from pdd_sidecar.engine.comm import SingleComm

    return SingleComm()


def test_seeded_sampling_is_reproducible_and_temperature_zero_is_greedy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    logits[1] = logits[0]
    greedy = sample(logits, [SamplingParams()] * 4, [0, 1, 2, 3])
    assert greedy == torch.argmax(logits, -1).tolist()
    hot = [SamplingParams(temperature=1.5, top_p=0.9, top_k=20, seed=s) for s in (1, 1, 2, 3)]
    a = [sample(logits, hot, [i] * 4) for i in range(20)]
    b = [sample(logits, hot, [i] * 4) for i in range(20)]
    assert a == b
    assert [r[0] for r in a] == [r[1] for r in a]  # same seed, index and logits: same token
    assert len({tuple(r[2] for r in a)} | {tuple(r[3] for r in a)}) == 2  # seeds differ
    top1 = [SamplingParams(temperature=1.0, top_k=1, seed=9)] * 4
    assert sample(logits, top1, [5] * 4) == greedy
    narrow = [SamplingParams(temperature=1.0, top_p=1e-6, seed=9)] * 4
    assert sample(logits, narrow, [5] * 4) == greedy
    # top_k keeps only the k best: a thousand draws never leave them.
    k3 = SamplingParams(temperature=5.0, top_k=3, seed=4)
    best = set(torch.topk(logits[0], 3).indices.tolist())
    drawn = {sample(logits[:1], [k3], [i])[0] for i in range(300)}
    assert drawn <= best and len(drawn) == 3


def test_a_draw_is_the_one_torch_multinomial_makes_and_rows_are_picked_as_indexed() -> None:
    """Sampling draws without multinomial's host-side check (a sync on CUDA) but draws the same
    token from the same generator; rows are picked without a list index (another sync)."""
    from pdd_sidecar.engine.sampling import _draw, _generator, pick_rows

    torch.manual_seed(1)
    for i in range(200):
        probs = torch.randn(300).mul(3).softmax(-1)
        probs[torch.randint(0, 300, (100,))] = 0
        expected = torch.multinomial(probs, 1, generator=_generator(7, i, probs.device))
        assert int(_draw(probs, _generator(7, i, probs.device))) == int(expected)
    logits = torch.randn(5, 20)
    assert pick_rows(logits, [0, 1, 2, 3, 4]) is logits
    assert torch.equal(pick_rows(logits, [4, 0, 2]), logits[[4, 0, 2]])


@pytest.mark.parametrize("raw,field", [
    ({"temperature": -1}, "sampling.temperature"),
    ({"temperature": "hot"}, "sampling.temperature"),
    ({"top_p": 0}, "sampling.top_p"),
    ({"top_p": 1.5}, "sampling.top_p"),
    ({"top_k": -2}, "sampling.top_k"),
    ({"top_k": 2.5}, "sampling.top_k"),
    ({"seed": True}, "sampling.seed"),
    ([], "sampling"),
])
def test_bad_sampling_parameters_name_the_field(raw: object, field: str) -> None:
    from pdd_sidecar.engine.sampling import SamplingError

    with pytest.raises(SamplingError, match=field.replace(".", r"\.")):
        SamplingParams.parse(raw)


def test_warm_up_runs_a_chunk_its_continuation_and_shorter_fresh_prompts() -> None:
    """The fresh prompt lengths of a real first request (their matmul and attention shapes)
    are met in the warm-up, not on a user's request."""
    model = load_rank_model("builtin", 0, 1)
    bs = 16  # the warm-up's mixed steps assume real block sizes
    engine = RankEngine(model, new_cache(model, 128, bs), _single(), 1)
    seen: list[list[tuple[int, int]]] = []
    step = engine.step

    def spy(chunks: Sequence[SeqChunk], want_logits: bool = True) -> torch.Tensor | None:
        seen.append([(c.start, len(c.tokens)) for c in chunks])
        return step(chunks, want_logits)

    engine.step = spy  # type: ignore[method-assign]
    chunk, prompt = 300, 300 + bs // 2 + 1
    blocks = engine.cache.allocate(-(-prompt // bs) + 2 * warmup_fresh_blocks(bs, 1))
    engine.warm_up(blocks, prompt, chunk, [1, 2], want_logits=True)
    fresh = [s[0][1] for s in seen if len(s) == 1 and s[0][0] == 0]
    assert fresh == [chunk, 64, 128, 256]
    assert rank_engine.warmup_lengths(64) == [] and rank_engine.warmup_lengths(65) == [64]
    assert [(300, 9)] in seen  # the chunk's continuation over the cached latent
    assert [[(1, 1)] * n for n in (1, 2)] == [s for s in seen if s[0] == (1, 1)]


def test_a_prefill_at_block_size_4_warms_up_and_serves(tmp_path: Path) -> None:
    """``pdd serve --block-size 4`` with the default chunk: the warm-up's longer fresh prompt
    (2 blocks + 5 tokens = 13 tokens) needs 4 table blocks, which a fixed 3 fell short of, and
    the instance never became ready."""
    cluster = LocalCluster(tmp_path)
    try:
        routing = cluster.plan_file(plan_json((1, 1), (1, 1), 4))
        prefill = cluster.instance("prefill", 1, 1, routing, 4)
        prefill.wait_ready()
        status, body = http("POST", f"{prefill.url}/v1/prefill",
                            {"prompt_ids": list(range(1, 20)), "max_tokens": 1}, timeout=60)
        assert status == 200 and isinstance(body["first_token"], int), body
    finally:
        cluster.close()
