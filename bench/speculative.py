"""Speculative decoding's mechanism on one GPU: what a verify step costs and what it can buy.

The checkpoint is random (V2-Lite width, bench/engine.py), so its acceptance says nothing about a
trained model; the mechanism is measured instead, through the serving engine
(``RankEngine.step``, CUDA graphs per row count, greedy draws read on the host each step, the
drafts kept with ``verify.accepted_tokens`` and planned by the driver's ``Speculator``), at
batch x k, every figure beside plain decoding of the same batch in the same run:

- **ceiling**: drafts replayed from the plain run's greedy tokens (always right unless the
  verify step's numerics pick another token): TPOT and the speed-up over plain;
- **floor**: drafts always wrong: TPOT of verifying every step (the cost of a useless verify),
  and with the instance's default self-disable (``SpeculativeConfig``: no drafts above
  ``max_batch`` running sequences, a sequence paused once its acceptance EMA is low);
- **model**: TPOT(a) = verify-step time / expected tokens per step, (1 - a^(k+1)) / (1 - a)
  at acceptance a per draft, from the measured step times, for a = 0 .. 100 % with the
  published 81 % (DeepSeek-R1 MTP-1 in vLLM) marked; and the break-even batch per k, the
  smallest measured batch at which 81 % no longer beats plain decoding
  (``DEFAULT_MAX_BATCH`` in engine/speculative/config.py comes from it);
- **the MTP module's cost** (unless ``--no-mtp``): a random module of the model's width (one
  MoE layer, DeepSeek-V3's), its latents the cache's last layer, run as a decode drafts with it
  (engine/speculative/mtp.py: the fed token and k kept drafts as rows, then the chained drafts,
  replayed from its graphs): the ceiling and the model again with that time added to each
  step, and how much of that time the device was busy (the rest is the host's).

    python bench/speculative.py --device cuda --json /tmp/spec.json
    python bench/speculative.py --device cpu --small      # smoke run, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import (  # noqa: E402
    random_weights,
    small_config,
    sync,
    time_fn,
    v2_lite_config,
    v3_width_config,
)

from pdd_sidecar.engine.comm import SingleComm  # noqa: E402
from pdd_sidecar.engine.rank_engine import RankEngine  # noqa: E402
from pdd_sidecar.engine.seq_chunk import SeqChunk  # noqa: E402
from pdd_sidecar.engine.speculative.config import SpeculativeConfig  # noqa: E402
from pdd_sidecar.engine.speculative.mtp import MTPDrafter  # noqa: E402
from pdd_sidecar.engine.speculative.ngram import NgramIndex  # noqa: E402
from pdd_sidecar.engine.speculative.speculator import Speculator, draft_room  # noqa: E402
from pdd_sidecar.engine.speculative.verify import accepted_tokens  # noqa: E402
from pdd_sidecar.kv.cache import PagedKVCache, num_table_blocks  # noqa: E402
from pdd_sidecar.model.mtp import MTPWeights  # noqa: E402
from pdd_sidecar.model.rank_model import RankModel  # noqa: E402
from pdd_sidecar.model.rope import Rotary  # noqa: E402
from pdd_sidecar.model.weights import RankWeights  # noqa: E402

PUBLISHED_ACCEPTANCE = 0.81  # DeepSeek-R1 MTP-1 in vLLM: 81-83 %
FULL_DEPTH = {"v2lite": 27, "v3": 61}  # the checkpoints' layers


def with_module_speedups(model: str, layers: int, small: bool) -> bool:
    """Whether speedups with the MTP module's time mean anything: the module is one layer's
    work, so beside a model cut to fewer layers than its checkpoint it weighs more than it
    does served (at V3's widths in 1 layer it doubles the step). The smoke model keeps them."""
    return small or layers >= FULL_DEPTH[model]


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verify step of ``k`` drafts emits at acceptance ``a`` per draft: the kept
    drafts (each kept only if those before it were) and the step's own."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class Batch:
    """``b`` sequences with their prompts' KV cached: each one's table and first token."""

    tables: list[list[int]]
    first: list[int]
    context: int


def build_engine(cfg: Any, dtype: torch.dtype, dev: torch.device, blocks: int,
                 block_size: int, mtp: bool = False) -> RankEngine:
    """``mtp``: the cache holds one more layer, the MTP module's (``build_mtp``)."""
    w = random_weights(cfg, dtype, dev)
    rm = RankModel(cfg, w, Rotary(cfg.rope, cfg.qk_rope_head_dim, dev), 0, 1, dtype, dev)
    cache = PagedKVCache(blocks, cfg.num_hidden_layers + int(mtp), block_size, cfg.latent_dim,
                         dtype, dev)
    mode = "graph" if dev.type == "cuda" else "eager"
    return RankEngine(rm, cache, SingleComm(), decode_mode=mode, prefill_buckets=(),
                      extra_layers=int(mtp))


def build_mtp(engine: RankEngine, seed: int = 1) -> MTPDrafter:
    """A random MTP module beside ``engine``'s model: one MoE layer of its width (V3's module),
    its own embedding, norms, ``eh_proj`` and head; its rows graphed like the engine's."""
    cfg, dev, dtype = engine.cfg, engine.cache.device, engine.model.dtype
    one = dataclasses.replace(cfg, num_hidden_layers=1, first_k_dense_replace=0,
                              moe_layer_freq=1)
    rw = random_weights(one, dtype, dev, seed)
    h = cfg.hidden_size
    g = torch.Generator(device=dev).manual_seed(seed)
    eh = torch.randn(h, 2 * h, device=dev, dtype=dtype, generator=g).mul_((2 * h) ** -0.5)
    ones = torch.ones(h, device=dev, dtype=dtype)
    w = MTPWeights(enorm=ones, hnorm=ones.clone(), eh_proj=eh, layer=rw.layers[0],
                   embed=rw.embed, norm=rw.norm, head=rw.lm_head, layer_config=one)
    model = RankModel(one, RankWeights(rw.embed, [w.layer], rw.norm, rw.lm_head),
                      engine.model.rotary, 0, 1, dtype, dev)
    return MTPDrafter(w, model, engine.cache, SingleComm(), 1, cfg.num_hidden_layers,
                      like=engine)


def mtp_draft_ms(drafter: MTPDrafter, batch: Batch, k: int, reps: int) -> tuple[float, float]:
    """A decode step's module call when every draft was kept: k + 1 rows a sequence (the fed
    token and the k drafts), then k - 1 chained drafts: (median ms, the device's busy ms of
    it; the rest is the host's)."""
    dev = drafter.w.embed.device
    h = torch.zeros(k + 1, drafter.w.embed.shape[1], dtype=drafter.w.embed.dtype, device=dev)
    seqs = [(SeqChunk([1] * (k + 1), batch.context + 1, table), h) for table in batch.tables]
    ks = [k] * len(seqs)

    def call() -> None:
        drafter.draft(seqs, ks)

    return time_fn(call, dev, reps) * 1e3, device_busy_ms(call, dev, reps)


def device_busy_ms(fn: Any, device: torch.device, reps: int) -> float:
    """The mean of the device's kernel and copy time per call of ``fn`` (the profiler's
    CUDA self time, graph replays' kernels included where CUPTI reports them): beside a wall
    time it says how much of a call is the host's. NaN off CUDA or where nothing is reported."""
    if device.type != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(device)
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / reps / 1e3 if total_us > 0 else float("nan")


def prefill(engine: RankEngine, b: int, context: int, tokens_after: int, seed: int) -> Batch:
    """Random prompts of ``context`` tokens, prefilled a few per step; tables sized for
    ``tokens_after`` more positions."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.cfg.vocab_size
    bs = engine.cache.block_size
    tables = [engine.cache.allocate(num_table_blocks(context + tokens_after, bs, 1))
              for _ in range(b)]
    first: list[int] = []
    per_step = max(1, 8192 // context)
    for a in range(0, b, per_step):
        chunks = [SeqChunk(torch.randint(0, vocab, (context,), generator=g).tolist(), 0,
                           tables[i]) for i in range(a, min(b, a + per_step))]
        logits = engine.step(chunks)
        assert logits is not None
        first += torch.argmax(logits, -1).tolist()
    return Batch(tables, first, context)


@dataclass
class RunResult:
    seconds: float
    steps: int
    tokens: list[list[int]]
    drafted: int
    accepted: int
    agreed: int  # drafts equal to the draws (``accepted`` but for ``force``)
    verify_steps: int = 0  # steps in which some sequence verified drafts

    @property
    def tpot_ms(self) -> float:
        """Time per output token of a sequence: the run's time over the tokens each emitted."""
        per_seq = sum(len(t) - 1 for t in self.tokens) / len(self.tokens)
        return self.seconds / per_seq * 1e3

    @property
    def step_ms(self) -> float:
        return self.seconds / self.steps * 1e3


def decode_run(engine: RankEngine, batch: Batch, n_tokens: int,
               spec: Speculator | None, force: bool = False) -> RunResult:
    """Each sequence decodes until it has ``n_tokens`` tokens after its first, as the driver
    does: drafts planned (``spec``), one step of every row, greedy draws read on the host,
    drafts kept while they equal the draws; with ``force``, every draft is kept (the ceiling:
    in bf16 a random checkpoint's top logits are near-ties that a step of another row count
    may order otherwise, and one flip would leave the replayed drafts behind for good)."""
    b = len(batch.first)
    outs = [[t] for t in batch.first]
    target = n_tokens + 1
    steps = drafted = accepted = agreed = verify_steps = 0
    sync(engine.cache.device)
    t0 = time.perf_counter()
    while True:
        live = [i for i in range(b) if len(outs[i]) < target]
        if not live:
            break
        drafts: list[list[int]] = [[] for _ in live]
        if spec is not None:
            drafts = spec.plan([(str(i), (outs[i],), draft_room(target, len(outs[i])))
                                for i in live])
        chunks = [SeqChunk([t], batch.context + len(outs[i]) - 1 + j, batch.tables[i])
                  for i, d in zip(live, drafts, strict=True)
                  for j, t in enumerate([outs[i][-1], *d])]
        verify_steps += any(drafts)
        logits = engine.step(chunks)
        assert logits is not None
        draws = torch.argmax(logits, -1).tolist()  # the host waits for the step, as serving
        r = 0
        for i, d in zip(live, drafts, strict=True):
            rows = draws[r:r + len(d) + 1]
            natural = accepted_tokens(d, rows)
            kept = [*d, rows[-1]] if force else natural
            r += len(d) + 1
            if spec is not None:
                spec.record(str(i), len(d), len(kept) - 1)
            drafted += len(d)
            accepted += len(kept) - 1
            agreed += len(natural) - 1
            outs[i] += kept[:target - len(outs[i])]
        steps += 1
    sync(engine.cache.device)
    return RunResult(time.perf_counter() - t0, steps, outs, drafted, accepted, agreed,
                     verify_steps)


def replaying(ref: list[list[int]], wrong: bool, vocab: int) -> Any:
    """A drafter that continues each sequence with the reference run's next tokens (or, with
    ``wrong``, tokens that differ from them)."""
    def drafter(sid: str, index: NgramIndex, k: int) -> list[int]:
        i = int(sid)
        n = len(index.tokens)
        nxt = ref[i][n:n + k]
        return [(t + 1) % vocab for t in nxt] if wrong else nxt
    return drafter


def timed(engine: RankEngine, batch: Batch, n_tokens: int,
          make_spec: Any, force: bool = False) -> RunResult:
    """A run after an untimed one of the same kind (kernels, CUDA graphs of its row counts)."""
    decode_run(engine, batch, n_tokens, make_spec(), force)
    return decode_run(engine, batch, n_tokens, make_spec(), force)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(args.device)
    if args.small:
        cfg = small_config()
    elif args.model == "v3":
        cfg = v3_width_config(args.layers or 2)
    else:
        cfg = v2_lite_config()
        if args.layers:
            cfg = cfg.replace(num_hidden_layers=args.layers)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kmax = max(args.ks)
    after = args.tokens + kmax + 2
    per_seq = num_table_blocks(args.context + after, args.block_size, 1)
    # a longer self-disabled floor run holds its own batch beside the main one
    longer = max(0, (args.floor_tokens or 0) - args.tokens)
    per_seq += num_table_blocks(args.context + after + longer, args.block_size, 1) if longer else 0
    engine = build_engine(cfg, dtype, dev, per_seq * max(args.batches) + 1, args.block_size,
                          mtp=args.mtp)
    drafter = build_mtp(engine) if args.mtp else None
    full = with_module_speedups(args.model, cfg.num_hidden_layers, args.small)
    vocab = cfg.vocab_size
    rows: list[dict[str, Any]] = []
    for b in args.batches:
        batch = prefill(engine, b, args.context, after, seed=b)
        plain = timed(engine, batch, args.tokens, lambda: None)
        ref = plain.tokens
        row: dict[str, Any] = {"batch": b, "plain_tpot_ms": plain.tpot_ms,
                               "plain_step_ms": plain.step_ms, "k": {}}
        print(f"batch {b}: plain TPOT {plain.tpot_ms:.2f} ms")
        # the floor's self-disabled run may be longer (--floor-tokens): its probes back off
        # (engine/speculative/backoff.py), so their share falls with the run's length; its
        # batch and plain reference are made once for every k
        floor_tokens = args.floor_tokens or args.tokens
        batch_long, ref_long = batch, plain
        if floor_tokens > args.tokens:
            batch_long = prefill(engine, b, args.context, floor_tokens + kmax + 2, seed=b)
            ref_long = timed(engine, batch_long, floor_tokens, lambda: None)
        for k in args.ks:
            raw = SpeculativeConfig(tokens=k, max_batch=10**6, min_acceptance=0.0)
            right, wrong = replaying(ref, False, vocab), replaying(ref, True, vocab)
            ceil = timed(engine, batch, args.tokens,
                         lambda raw=raw, d=right: Speculator(raw, d), force=True)
            floor = timed(engine, batch, args.tokens,
                          lambda raw=raw, d=wrong: Speculator(raw, d))
            wrong_long = replaying(ref_long.tokens, True, vocab)
            auto = timed(engine, batch_long, floor_tokens, lambda k=k, d=wrong_long:
                         Speculator(SpeculativeConfig(tokens=k), d))
            auto_plain = ref_long
            # plain decoding's tokens whatever the drafts (exact in fp32; in bf16 a row count
            # other than plain's may order a near-tie otherwise)
            same = floor.tokens == ref and auto.tokens == auto_plain.tokens
            verify_ms = floor.step_ms  # every step verifies k drafts of every sequence
            model = {f"{a:.2f}": plain.tpot_ms / (verify_ms / expected_tokens(a, k))
                     for a in [x / 10 for x in range(11)] + [PUBLISHED_ACCEPTANCE]}
            r = {
                "ceiling_tpot_ms": ceil.tpot_ms,
                "ceiling_speedup": plain.tpot_ms / ceil.tpot_ms,
                "ceiling_acceptance": ceil.accepted / max(1, ceil.drafted),
                # how often the verify rows' own draws equal the replayed drafts
                "ceiling_draw_agreement": ceil.agreed / max(1, ceil.drafted),
                "floor_tpot_ms": floor.tpot_ms,
                "floor_slowdown": floor.tpot_ms / plain.tpot_ms,
                "floor_self_disabled_tpot_ms": auto.tpot_ms,
                "floor_self_disabled_slowdown": auto.tpot_ms / auto_plain.tpot_ms,
                "floor_self_disabled_tokens": floor_tokens,
                # its steps that verified (the probes), and the slowdown they alone explain
                "floor_self_disabled_verify_steps": auto.verify_steps,
                "floor_self_disabled_probe_share": 1 + auto.verify_steps * (
                    floor.step_ms / plain.step_ms - 1) / max(1, auto.steps),
                "verify_step_ms": verify_ms,
                "modelled_speedup": model,
                "same_tokens": same,
            }
            if drafter is not None:
                mtp_ms, mtp_busy = mtp_draft_ms(drafter, batch, k, args.mtp_reps)
                r["mtp_draft_ms"] = mtp_ms
                r["mtp_draft_device_ms"] = mtp_busy
                r["mtp_layers_of_step"] = mtp_ms / (plain.step_ms / cfg.num_hidden_layers)
                if full:
                    r["mtp_ceiling_speedup"] = plain.tpot_ms / (ceil.tpot_ms + mtp_ms / (k + 1))
                    r["mtp_modelled_speedup"] = {
                        a: plain.tpot_ms / ((verify_ms + mtp_ms) / expected_tokens(float(a), k))
                        for a in model}
            row["k"][str(k)] = r
            print(f"  k={k}: ceiling TPOT {ceil.tpot_ms:.2f} ms ({r['ceiling_speedup']:.2f}x, "
                  f"draws equal to the replayed drafts {r['ceiling_draw_agreement']:.1%}); "
                  f"floor {floor.tpot_ms:.2f} ms "
                  f"({r['floor_slowdown']:.2f}x of plain), self-disabled "
                  f"{auto.tpot_ms:.2f} ms ({r['floor_self_disabled_slowdown']:.3f}x over "
                  f"{floor_tokens} tokens, {auto.verify_steps} verify steps of {auto.steps}: "
                  f"{r['floor_self_disabled_probe_share']:.3f}x from them); "
                  f"verify step {verify_ms:.2f} ms vs plain {plain.step_ms:.2f} ms; modelled "
                  f"at 81 %: {model[f'{PUBLISHED_ACCEPTANCE:.2f}']:.2f}x; same tokens: {same}")
            if "mtp_ceiling_speedup" in r:
                print(f"  k={k}: with the MTP module's {r['mtp_draft_ms']:.2f} ms a step "
                      f"(the device busy {r['mtp_draft_device_ms']:.2f} ms of it): "
                      f"ceiling {r['mtp_ceiling_speedup']:.2f}x, modelled at 81 %: "
                      f"{r['mtp_modelled_speedup'][f'{PUBLISHED_ACCEPTANCE:.2f}']:.2f}x")
            elif "mtp_draft_ms" in r:
                print(f"  k={k}: the MTP module's {r['mtp_draft_ms']:.2f} ms a step is "
                      f"{r['mtp_layers_of_step']:.2f} layers' time of this step; speedups with "
                      f"it need the checkpoint's {FULL_DEPTH[args.model]} layers (--layers)")
        rows.append(row)
        engine.cache.free([x for t in batch.tables for x in t])
        if batch_long is not batch:
            engine.cache.free([x for t in batch_long.tables for x in t])
    breakeven: dict[str, int | None] = {}
    for k in args.ks:
        slower = [r["batch"] for r in rows
                  if r["k"][str(k)]["modelled_speedup"][f"{PUBLISHED_ACCEPTANCE:.2f}"] < 1.0]
        breakeven[str(k)] = min(slower) if slower else None
        print(f"break-even batch (k={k}, 81 % modelled): "
              f"{breakeven[str(k)] or f'above {max(args.batches)}'}")
    print("modelled speed-up over plain, TPOT(a) = verify step / expected tokens:")
    for r in rows:
        for k in args.ks:
            m = r["k"][str(k)]["modelled_speedup"]
            print(f"  batch {r['batch']:>3} k={k}: " + " ".join(
                f"{float(a):.0%}:{v:.2f}" for a, v in m.items()))
    return {"config": "small" if args.small else args.model,
            "layers": cfg.num_hidden_layers, "device": str(dev),
            "card": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "context": args.context, "tokens": args.tokens, "rows": rows,
            "breakeven_batch": breakeven}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="a tiny model (CPU smoke run)")
    p.add_argument("--model", choices=["v2lite", "v3"], default="v2lite",
                   help="v2lite: V2-Lite's widths, 27 layers; v3: DeepSeek-V3's widths in "
                   "--layers MoE layers (default 2: about 50 GB, 77 GB with the MTP module)")
    p.add_argument("--layers", type=int, default=None, help="layers of the model (see --model)")
    p.add_argument("--batches", type=_ints, default=[1, 16, 64])
    p.add_argument("--ks", type=_ints, default=[1, 2, 3])
    p.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--tokens", type=int, default=32, help="tokens each sequence decodes")
    p.add_argument("--floor-tokens", type=int, default=None,
                   help="tokens of the self-disabled floor's run (default: --tokens); its "
                   "probes back off, so a longer run shows their cost falling")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--no-mtp", dest="mtp", action="store_false",
                   help="leave out the MTP module's cost (a random module of the model's width)")
    p.add_argument("--mtp-reps", type=int, default=20, help="timed calls of the module a figure")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    res = bench(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
