"""The decode path of CUDA graphs, run eagerly on the CPU (``decode_mode="padded"``): a batch
padded to its bucket through the static buffers gives the tokens of the unpadded batch and its
logits (bit for bit where no row is padded, to rounding otherwise), and the padded rows touch no
sequence's KV and allocate nothing, also with TP and DCP ranks. On the GPU,
tests/gpu/test_cuda_graphs.py checks graph replay against this path."""

from __future__ import annotations

import pytest
import torch

from pdd_sidecar.engine import cuda_graphs
from pdd_sidecar.engine.comm import Comm, run_threads
from pdd_sidecar.engine.rank_engine import RankEngine, new_cache
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.model.rank_model import load_rank_model

pytestmark = pytest.mark.dataplane

BLOCK = 4
NUM_BLOCKS = 160
BUCKETS = (1, 2, 4, 8)
SENTINEL = 7.25  # what every cache slot holds before any sequence writes it


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 29 + salt * 13 + 3) % 256 for i in range(n)]


def _tables(dcp: int) -> list[list[int]]:
    """Non-contiguous tables; sequence 0 owns block 0, where an unmasked padded row (position
    0, block id 0, offset 0) would write."""
    order = [0] + [b for b in range(NUM_BLOCKS - 1, 0, -1) if b % 3]
    per = 8 // dcp + 1
    return [order[i * per:(i + 1) * per] for i in range(9)]


def _run(rank: int, comm: Comm, tp: int, dcp: int, dtype: str, mode: str,
         schedule: list[list[int]]) -> tuple[list[list[torch.Tensor]], torch.Tensor, int, int]:
    """Prefill nine prompts, then decode steps over the sequences ``schedule`` names (the batch
    changes from step to step); returns the per-step logits, the cache, free blocks, and
    how many steps ran padded."""
    model = load_rank_model("builtin", rank, tp, dtype, "cpu")
    cache = new_cache(model, NUM_BLOCKS, BLOCK)
    cache.kv.fill_(SENTINEL)
    eng = RankEngine(model, cache, comm, dcp, decode_mode=mode, graph_buckets=BUCKETS)
    tables = _tables(dcp)
    free0 = cache.num_free
    prompts = [_prompt(3 + 2 * i, i) for i in range(9)]
    nxt: list[int] = []
    pos: list[int] = []
    for i, p in enumerate(prompts):
        logits = eng.step([SeqChunk(p, 0, tables[i])])
        nxt.append(int(torch.argmax(logits[0])) if logits is not None else 0)
        pos.append(len(p))
    steps: list[list[torch.Tensor]] = []
    for seqs in schedule:
        chunks = [SeqChunk([nxt[s]], pos[s], tables[s]) for s in seqs]
        logits = eng.step(chunks)  # every rank samples the same greedy tokens
        assert logits is not None and logits.shape[0] == len(seqs)
        steps.append([row.clone() for row in logits])
        for s, t in zip(seqs, torch.argmax(logits, dim=-1).tolist(), strict=True):
            nxt[s] = t
            pos[s] += 1
    assert cache.num_free == free0  # nothing allocated
    return steps, cache.kv.clone(), cache.num_free, eng.padded_steps


# Batches of 1..9 sequences: 3 pads to 4, 5 to 8, 9 is above the largest bucket (eager).
SCHEDULE = [[0], [0, 1, 2], [4, 2, 0], [1, 3, 5, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7, 8], [8, 6],
            [2, 3, 4, 5, 6], [7], [0, 1, 2, 3, 4, 5, 6, 7]]


def _both(tp: int, dcp: int, dtype: str, schedule: list[list[int]]) -> tuple[tuple, tuple]:
    def go(mode: str) -> tuple:
        res = run_threads(tp, lambda r, c: _run(r, c, tp, dcp, dtype, mode, schedule))
        return res[0][0], [r[1] for r in res], res[0][3]

    return go("eager"), go("padded")


# CPU BLAS rounds a row differently at some row counts (3 rows vs 4), so a padded batch matches
# the unpadded one to fp32 rounding, and bit for bit where no row is padded.
TOL = {"float32": 1e-5, "bfloat16": 0.05}


@pytest.mark.parametrize("tp,dcp,dtype", [(1, 1, "float32"), (1, 1, "bfloat16"),
                                          (2, 1, "float32"), (2, 2, "float32")])
def test_padded_equals_unpadded(tp: int, dcp: int, dtype: str) -> None:
    (ref_logits, ref_kv, ref_padded), (got_logits, got_kv, got_padded) = _both(
        tp, dcp, dtype, SCHEDULE)
    assert ref_padded == 0
    assert got_padded == len(SCHEDULE) - 1  # every step but the one above the largest bucket
    tol = TOL[dtype]
    for step, (a, b) in enumerate(zip(ref_logits, got_logits, strict=True)):
        assert [int(x.argmax()) for x in a] == [int(x.argmax()) for x in b], step
        for row, (x, y) in enumerate(zip(a, b, strict=True)):
            assert float((x - y).abs().max()) <= tol, (step, row)
    for r, (a, b) in enumerate(zip(ref_kv, got_kv, strict=True)):
        # the same slots written (padded rows wrote none), holding the same latents
        assert torch.equal(a == SENTINEL, b == SENTINEL), f"rank {r}: other slots written"
        assert (a == SENTINEL).any()
        assert float((a.float() - b.float()).abs().max()) <= tol, f"rank {r}"


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_full_buckets_are_bit_identical(tp: int, dcp: int) -> None:
    """Batches that fill their bucket exactly (no padded row) run the same products on the
    same rows as the eager step: every logit and latent is equal bit for bit."""
    schedule = [[0], [0, 1], [3, 2, 1, 0], [0, 1, 2, 3, 4, 5, 6, 7], [8], [5, 8]]
    (ref_logits, ref_kv, _), (got_logits, got_kv, padded) = _both(tp, dcp, "float32", schedule)
    assert padded == len(schedule)
    for a, b in zip(ref_logits, got_logits, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ref_kv, got_kv, strict=True))


def test_unmasked_padding_would_be_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above sees a leak: padded rows that did write (mask all ones) land on
    sequence 0's first slot and change its later logits and the cache."""
    real_stage = cuda_graphs.stage

    def leaky(buf, chunks, block_size, dcp, rank):  # type: ignore[no-untyped-def]
        real_stage(buf, chunks, block_size, dcp, rank)
        buf.write_mask.fill_(1)

    monkeypatch.setattr("pdd_sidecar.engine.rank_engine.stage", leaky)
    (ref_logits, ref_kv, _), (got_logits, got_kv, _) = _both(1, 1, "float32", SCHEDULE)
    assert float((ref_kv[0] - got_kv[0]).abs().max()) > 100 * TOL["float32"]
    worst = max(float((x - y).abs().max()) for a, b in zip(ref_logits, got_logits, strict=True)
                for x, y in zip(a, b, strict=True))
    assert worst > 100 * TOL["float32"]


def test_decode_mode_and_setting_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_rank_model("builtin", 0, 1, "float32", "cpu")
    cache = new_cache(model, 8, BLOCK)
    from pdd_sidecar.engine.comm import SingleComm

    with pytest.raises(ValueError, match="decode_mode"):
        RankEngine(model, cache, SingleComm(), decode_mode="fast")
    with pytest.raises(ValueError, match="needs a CUDA cache"):
        RankEngine(model, cache, SingleComm(), decode_mode="graph")
    with pytest.raises(ValueError, match="graph buckets"):
        RankEngine(model, cache, SingleComm(), decode_mode="padded", graph_buckets=[0, 4])
    from pdd_sidecar import env

    assert cuda_graphs.PDD_CUDA_GRAPHS == env.PDD_CUDA_GRAPHS
    monkeypatch.setenv("PDD_CUDA_GRAPHS", "yes")
    with pytest.raises(ValueError, match="PDD_CUDA_GRAPHS: must be 0 or 1, got 'yes'"):
        RankEngine(model, cache, SingleComm())
    monkeypatch.setenv("PDD_CUDA_GRAPHS", "0")
    assert cuda_graphs.default_decode_mode(torch.device("cuda")) == "eager"
    monkeypatch.delenv("PDD_CUDA_GRAPHS")
    assert cuda_graphs.default_decode_mode(torch.device("cuda")) == "graph"
    assert cuda_graphs.default_decode_mode(torch.device("cpu")) == "eager"
    assert RankEngine(model, cache, SingleComm()).decode_mode == "eager"


def test_table_wider_than_the_bound_runs_eagerly() -> None:
    from pdd_sidecar.engine.comm import SingleComm

    model = load_rank_model("builtin", 0, 1, "float32", "cpu")
    cache = new_cache(model, 16, BLOCK)
    eng = RankEngine(model, cache, SingleComm(), decode_mode="padded", max_table_blocks=2)
    eng.step([SeqChunk(_prompt(5, 1), 0, [3, 4, 5])])
    eng.step([SeqChunk([1], 5, [3, 4, 5])])  # three blocks > the bound of two
    assert eng.padded_steps == 0
    eng.step([SeqChunk([1], 5, [3, 4])])
    assert eng.padded_steps == 1


# Prefill graphs' twin: steps of fresh prompts padded to their token bucket. Each group is one
# step; 40 tokens is above the largest bucket (eager).
PREFILL_BUCKETS = (8, 16, 32)
GROUPS = [[1], [3, 5], [9], [2, 2, 2, 2], [16], [10, 21], [32], [40], [20, 20]]


def _prefill_run(rank: int, comm: Comm, tp: int, dcp: int, buckets: tuple[int, ...],
                 ) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """Each group of ``GROUPS`` prefilled as one step, then one decode step of its sequences
    (it reads the latents the prefill stored); every logits row of both steps, the cache, and
    how many prefill steps ran padded."""
    model = load_rank_model("builtin", rank, tp, "float32", "cpu")
    cache = new_cache(model, NUM_BLOCKS, BLOCK)
    cache.kv.fill_(SENTINEL)
    mode = "padded" if buckets else "eager"
    eng = RankEngine(model, cache, comm, dcp, decode_mode=mode, prefill_buckets=buckets)
    order = [0] + [b for b in range(NUM_BLOCKS - 1, 0, -1) if b % 3]
    out: list[torch.Tensor] = []
    salt = 0
    for lengths in GROUPS:
        chunks = []
        for n in lengths:
            need = -(-(n + 1) // BLOCK)
            chunks.append(SeqChunk(_prompt(n, salt), 0, order[:need]))
            order = order[need:]
            salt += 1
        first = eng.step(chunks)
        assert first is not None and first.shape == (len(chunks), model.config.vocab_size)
        nxt = eng.step([SeqChunk([int(row.argmax())], len(c.tokens), c.block_ids)
                        for row, c in zip(first, chunks, strict=True)])
        assert nxt is not None
        out += [row.clone() for row in first] + [row.clone() for row in nxt]
    return out, cache.kv.clone(), eng.padded_prefills


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 1), (2, 2)])
def test_a_padded_prefill_equals_the_eager_one(tp: int, dcp: int) -> None:
    def go(buckets: tuple[int, ...]) -> tuple:
        res = run_threads(tp, lambda r, c: _prefill_run(r, c, tp, dcp, buckets))
        return res[0][0], [r[1] for r in res], res[0][2]

    (ref, ref_kv, ref_padded), (got, got_kv, got_padded) = go(()), go(PREFILL_BUCKETS)
    assert ref_padded == 0
    assert got_padded == sum(sum(g) <= PREFILL_BUCKETS[-1] for g in GROUPS)
    _same_rows_and_slots(ref, got, ref_kv, got_kv)


def _same_rows_and_slots(ref: list[torch.Tensor], got: list[torch.Tensor],
                         ref_kv: list[torch.Tensor], got_kv: list[torch.Tensor]) -> None:
    """The same greedy picks and logits to fp32 rounding, and on every rank the same slots
    written (no other) with the same latents."""
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert int(a.argmax()) == int(b.argmax()), i
        assert float((a - b).abs().max()) <= TOL["float32"], i
    for r, (a, b) in enumerate(zip(ref_kv, got_kv, strict=True)):
        assert torch.equal(a == SENTINEL, b == SENTINEL), f"rank {r}: other slots written"
        assert float((a - b).abs().max()) <= TOL["float32"], f"rank {r}"


def test_a_padded_prefill_that_wrote_its_padding_would_be_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above sees padded rows that store their latents (all masked in): they land
    on slot 0 of block 0, prompt 0's first token's."""
    real = cuda_graphs.stage_prefill

    def leaky(buf, chunk, block_size, dcp, rank):  # type: ignore[no-untyped-def]
        real(buf, chunk, block_size, dcp, rank)
        buf.write_mask.fill_(1)

    monkeypatch.setattr("pdd_sidecar.engine.rank_engine.stage_prefill", leaky)
    ref, ref_kv, _ = _prefill_run(0, _single(), 1, 1, ())
    got, got_kv, _ = _prefill_run(0, _single(), 1, 1, PREFILL_BUCKETS)
    assert float((ref_kv - got_kv).abs().max()) > 100 * TOL["float32"]
    worst = max(float((a - b).abs().max()) for a, b in zip(ref, got, strict=True))
    assert worst > 100 * TOL["float32"]


def _single() -> Comm:
    from pdd_sidecar.engine.comm import SingleComm

    return SingleComm()


def test_prefill_buckets_need_a_padded_mode() -> None:
    model = load_rank_model("builtin", 0, 1, "float32", "cpu")
    cache = new_cache(model, 8, BLOCK)
    with pytest.raises(ValueError, match="prefill_buckets need decode_mode"):
        RankEngine(model, cache, _single(), decode_mode="eager", prefill_buckets=(8,))
    with pytest.raises(ValueError, match="graph buckets"):
        RankEngine(model, cache, _single(), decode_mode="padded", prefill_buckets=(0, 8))
    assert RankEngine(model, cache, _single(), decode_mode="padded").prefill_buckets == ()
    assert cuda_graphs.PREFILL_BUCKETS == tuple(sorted(set(cuda_graphs.PREFILL_BUCKETS)))


# A decode's local prefill beside its running batch: fresh prompts first, then one-token rows.
# (prompt lengths, running sequences' rows) per step; the last step's prompt continues one
# prompted before (eager), the one before it holds more tokens than the largest bucket (eager).
MIXED = [([5], 2), ([3, 6], 3), ([9], 1), ([20, 20], 2), ([7], 4)]


def _mixed_run(rank: int, comm: Comm, tp: int, dcp: int, buckets: tuple[int, ...]
               ) -> tuple[list[torch.Tensor], torch.Tensor, tuple[int, int, int]]:
    """Four sequences prefilled, then steps that prefill new prompts beside one decode row of
    some of them; every logits row, the cache, and (split, padded prefill, padded decode)
    step counts."""
    model = load_rank_model("builtin", rank, tp, "float32", "cpu")
    cache = new_cache(model, NUM_BLOCKS, BLOCK)
    cache.kv.fill_(SENTINEL)
    mode = "padded" if buckets else "eager"
    eng = RankEngine(model, cache, comm, dcp, decode_mode=mode, graph_buckets=BUCKETS,
                     prefill_buckets=buckets)
    order = [0] + [b for b in range(NUM_BLOCKS - 1, 0, -1) if b % 3]
    per = 64 // BLOCK
    tables = [order[i * per:(i + 1) * per] for i in range(4)]
    order = order[4 * per:]
    nxt, pos = [], []
    for i in range(4):
        p = _prompt(4 + i, 10 + i)
        logits = eng.step([SeqChunk(p, 0, tables[i])])
        assert logits is not None
        nxt.append(int(logits[0].argmax()))
        pos.append(len(p))
    out: list[torch.Tensor] = []
    salt, last = 20, None
    for lengths, rows in MIXED:
        fresh = []
        for n in lengths:
            need = -(-(2 * n + 1) // BLOCK)
            fresh.append(SeqChunk(_prompt(n, salt), 0, order[:need]))
            order = order[need:]
            salt += 1
        if lengths == MIXED[-1][0] and last is not None:
            fresh = [SeqChunk(_prompt(7, salt), len(last.tokens), last.block_ids)]
        decode = [SeqChunk([nxt[s]], pos[s], tables[s]) for s in range(rows)]
        logits = eng.step(fresh + decode)
        assert logits is not None and logits.shape[0] == len(fresh) + len(decode)
        out += [row.clone() for row in logits]
        for s in range(rows):
            nxt[s] = int(logits[len(fresh) + s].argmax())
            pos[s] += 1
        last = fresh[0]
    return out, cache.kv.clone(), (eng.split_steps, eng.padded_prefills, eng.padded_steps)


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 1), (2, 2)])
def test_fresh_prompts_beside_decode_rows_split_into_padded_steps(tp: int, dcp: int) -> None:
    """Such a step runs as a padded prefill and a padded decode step (on CUDA: two graph
    replays) and gives the eager mixed step's logits and latents; a step whose prompts a
    bucket does not hold, or whose prompt continues, runs eagerly."""
    def go(buckets: tuple[int, ...]) -> tuple:
        res = run_threads(tp, lambda r, c: _mixed_run(r, c, tp, dcp, buckets))
        return res[0][0], [r[1] for r in res], res[0][2]

    (ref, ref_kv, ref_counts), (got, got_kv, got_counts) = go(()), go(PREFILL_BUCKETS)
    assert ref_counts == (0, 0, 0)
    assert got_counts == (3, 4 + 3, 3)  # the four prompts above, then three split steps
    _same_rows_and_slots(ref, got, ref_kv, got_kv)


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_a_decode_step_that_keeps_hidden_states_runs_padded(tp: int, dcp: int) -> None:
    """An MTP decode keeps its rows' final hidden states (``keep``): its decode steps run
    padded too (on CUDA: a graph of their own), with the eager step's logits and kept rows."""
    def run(rank: int, comm: Comm, mode: str) -> tuple[list[torch.Tensor], int]:
        model = load_rank_model("builtin", rank, tp, "float32", "cpu")
        cache = new_cache(model, NUM_BLOCKS, BLOCK)
        eng = RankEngine(model, cache, comm, dcp, decode_mode=mode, graph_buckets=BUCKETS)
        tables = _tables(dcp)
        out: list[torch.Tensor] = []
        nxt = []
        for i in range(3):
            logits = eng.step([SeqChunk(_prompt(5 + i, i), 0, tables[i])])
            assert logits is not None
            nxt.append(int(logits[0].argmax()))
        for pos in range(8, 11):  # three rows, the last two of one sequence (a verify step's)
            chunks = [SeqChunk([nxt[0]], pos - 3, tables[0]), SeqChunk([nxt[1]], pos - 2,
                                                                      tables[1]),
                      SeqChunk([nxt[2]], pos, tables[2]), SeqChunk([5], pos + 1, tables[2])]
            logits = eng.step(chunks, keep=[0, 3])
            assert logits is not None
            out += [eng.kept[0], eng.kept[3], logits]
            nxt = [int(r.argmax()) for r in logits[:3]]
            assert set(eng.kept) == {0, 3} and eng.kept[3].shape == (1, model.config.hidden_size)
        return out, eng.padded_steps

    def go(mode: str) -> list[tuple[list[torch.Tensor], int]]:
        return run_threads(tp, lambda r, c: run(r, c, mode))

    eager, padded = go("eager"), go("padded")
    for (ref, ref_n), (got, got_n) in zip(eager, padded, strict=True):
        assert ref_n == 0 and got_n == 3
        for a, b in zip(ref, got, strict=True):
            assert float((a - b).abs().max()) <= TOL["float32"]


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 2)])
def test_a_prefill_step_that_keeps_hidden_states_runs_padded(tp: int, dcp: int) -> None:
    """Prompt log-probabilities and an MTP prefill keep every row's hidden state: a step of
    fresh prompts that a bucket holds still runs padded, with the eager step's logits and
    kept rows."""
    def run(rank: int, comm: Comm, buckets: tuple[int, ...]) -> tuple[list[torch.Tensor], int]:
        model = load_rank_model("builtin", rank, tp, "float32", "cpu")
        cache = new_cache(model, NUM_BLOCKS, BLOCK)
        mode = "padded" if buckets else "eager"
        eng = RankEngine(model, cache, comm, dcp, decode_mode=mode, prefill_buckets=buckets)
        tables = _tables(dcp)
        out: list[torch.Tensor] = []
        for group in ([0], [1, 2, 3], [4, 5]):
            chunks = [SeqChunk(_prompt(4 + 2 * i, i), 0, tables[i]) for i in group]
            logits = eng.step(chunks, keep=[0, len(group) - 1])
            assert logits is not None and set(eng.kept) == {0, len(group) - 1}
            assert eng.kept[0].shape == (len(chunks[0].tokens), model.config.hidden_size)
            out += [logits, eng.kept[0], eng.kept[len(group) - 1]]
        return out, eng.padded_prefills

    def go(buckets: tuple[int, ...]) -> list[tuple[list[torch.Tensor], int]]:
        return run_threads(tp, lambda r, c: run(r, c, buckets))

    for (ref, ref_n), (got, got_n) in zip(go(()), go(PREFILL_BUCKETS), strict=True):
        assert ref_n == 0 and got_n == 3
        for a, b in zip(ref, got, strict=True):
            assert float((a - b).abs().max()) <= TOL["float32"]
