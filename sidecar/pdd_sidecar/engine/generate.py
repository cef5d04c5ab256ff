"""Greedy generation on one instance (``pdd generate``), ranks simulated in-process (threads) or
run as local processes over torch.distributed; also the single-process reference for tests."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty
from typing import Any, Protocol

import torch

from pdd_sidecar.engine.comm import Comm, TorchDistComm, run_threads
from pdd_sidecar.engine.rank_engine import RankEngine, allocate_request, new_cache
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.engine.speculative.config import SpeculativeConfig
from pdd_sidecar.engine.speculative.mtp import MTPDrafter
from pdd_sidecar.engine.speculative.ngram import NgramIndex
from pdd_sidecar.engine.speculative.speculator import draft_room
from pdd_sidecar.engine.speculative.verify import accepted_tokens
from pdd_sidecar.kv.cache import KVCacheFullError, num_table_blocks
from pdd_sidecar.kv.fp8_layout import KV_CACHE_DTYPES, check_kv_cache_dtype
from pdd_sidecar.model.config import BUILTIN_SEED, load_config
from pdd_sidecar.model.rank_model import load_rank_model, parse_dtype


@dataclass
class GenerationResult:
    token_ids: list[int]
    prompt_logits: torch.Tensor | None = None  # [T, V] fp32 when requested
    step_logits: list[torch.Tensor] = field(default_factory=list)  # per decode step, [V] fp32
    drafted: int = 0  # speculation: tokens drafted, and those kept
    accepted: int = 0
    drafts: list[tuple[int, list[int]]] = field(default_factory=list)  # (position fed, drafts)
    missing_draft_state: int = 0  # P/D: decodes whose prefill sent no MTP draft state


@dataclass(frozen=True)
class _Spec:
    model: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    tp: int
    dcp: int
    dtype: str
    block_size: int
    num_blocks: int | None
    device: str
    seed: int
    keep_logits: bool
    forced_ids: tuple[int, ...] | None  # teacher forcing: feed these instead of greedy picks
    speculative: SpeculativeConfig | None = None
    kv_cache_dtype: str = "auto"
    spoil_drafts: bool = False  # tests: every draft replaced by a token it is not

    def run(self, rank: int, comm: Comm) -> GenerationResult | None:
        return _rank_main(rank, comm, self)


def rank_device(device: str, rank: int) -> str:
    """Rank r on GPU r; simulated ranks share what GPUs there are."""
    return f"cuda:{rank % torch.cuda.device_count()}" if device == "cuda" else "cpu"


def _rank_main(rank: int, comm: Comm, spec: _Spec) -> GenerationResult | None:
    model = load_rank_model(spec.model, rank, spec.tp, spec.dtype, rank_device(spec.device, rank),
                            spec.seed)
    # KV is written for every token but the last generated one.
    kv_tokens = len(spec.prompt_ids) + spec.max_tokens - 1
    num_blocks = spec.num_blocks or max(1, num_table_blocks(kv_tokens, spec.block_size, spec.dcp))
    mtp = int(spec.speculative is not None and spec.speculative.method == "mtp")
    cache = new_cache(model, num_blocks, spec.block_size, kv_cache_dtype=spec.kv_cache_dtype,
                      extra_layers=mtp)  # the MTP module's KV after the main layers'
    engine = RankEngine(model, cache, comm, spec.dcp, extra_layers=mtp)
    table = allocate_request(cache, kv_tokens, spec.dcp)
    out = GenerationResult(token_ids=[])
    if spec.speculative is not None and spec.speculative.method == "mtp":
        drafter = MTPDrafter.load(spec.model, model, cache, comm, spec.dcp, spec.seed,
                                  like=engine)
        logits = engine.step([SeqChunk(spec.prompt_ids, 0, table)], keep=[0])
        assert logits is not None
        first = int(torch.argmax(logits[0]))
        out.token_ids.append(first)
        # the module's positions still to run: from 0, the tokens after them, h there
        pending = (0, [*spec.prompt_ids[1:], first], engine.kept[0])
        speculate_mtp(engine, drafter, spec.speculative, spec.max_tokens, table,
                      len(spec.prompt_ids), pending, out, spec.spoil_drafts)
        cache.free(table)
        return out if rank == 0 else None
    logits = engine.prefill(spec.prompt_ids, table, all_logits=spec.keep_logits)
    if spec.keep_logits:
        out.prompt_logits = logits.cpu()
        logits = logits[-1]
    pos = len(spec.prompt_ids)
    if spec.speculative is not None:
        _speculate(engine, spec, table, logits, out)
        cache.free(table)
        return out if rank == 0 else None
    for step in range(spec.max_tokens):
        tok = int(torch.argmax(logits))
        out.token_ids.append(tok)
        if step == spec.max_tokens - 1:
            break
        feed = spec.forced_ids[step] if spec.forced_ids is not None else tok
        logits = engine.decode_step(feed, pos, table)
        if spec.keep_logits:
            out.step_logits.append(logits.cpu())
        pos += 1
    cache.free(table)
    return out if rank == 0 else None


def _speculate(engine: RankEngine, spec: _Spec, table: list[int], logits: torch.Tensor,
               out: GenerationResult) -> None:
    """Greedy generation with prompt-lookup drafts: each step feeds the last token and its
    drafts as rows of one decode step (engine/speculative/rows.py), keeps the drafts that equal
    the greedy picks, and emits those and the pick after them. Every rank drafts alike (the
    picks come from the full logits, which every rank has under TP)."""
    assert spec.speculative is not None
    index = NgramIndex(spec.speculative.ngram)
    index.extend(spec.prompt_ids)
    first = int(torch.argmax(logits))
    out.token_ids.append(first)
    index.extend([first])
    pos = len(spec.prompt_ids)
    k = spec.speculative.tokens
    while len(out.token_ids) < spec.max_tokens:
        drafts = index.propose(min(k, draft_room(spec.max_tokens, len(out.token_ids))))
        feed = [out.token_ids[-1], *drafts]
        rows = engine.step([SeqChunk([t], pos + j, table) for j, t in enumerate(feed)],
                           want_logits=True)
        assert rows is not None
        kept = accepted_tokens(drafts, [int(t) for t in torch.argmax(rows, -1).tolist()])
        out.drafted += len(drafts)
        out.accepted += len(kept) - 1
        if spec.keep_logits:
            out.step_logits.extend(r.cpu() for r in rows[:len(kept)])
        out.token_ids.extend(kept)
        index.extend(kept)
        pos += len(kept)
    del out.token_ids[spec.max_tokens:]


def speculate_mtp(engine: RankEngine, drafter: MTPDrafter, cfg: SpeculativeConfig,
                  max_tokens: int, table: list[int], pos: int,
                  pending: tuple[int, list[int], torch.Tensor] | None,
                  out: GenerationResult, spoil: bool = False) -> None:
    """Greedy generation with MTP drafts, ``out.token_ids`` holding the first token, fed next
    at ``pos``: after each verify step the module runs over the positions whose next token
    became known (the fed token's and the accepted drafts'), from the main model's hidden
    states there, and drafts what follows; the verify step is the n-gram one's (rows of one
    decode step, the keep rule). ``pending``: the module's positions still to run before the
    first draft (from ``start``: the tokens after them, the hidden states there); None (a
    decode whose prefill sent no draft state) drafts nothing in the first step."""
    k = cfg.tokens
    while len(out.token_ids) < max_tokens:
        drafts: list[int] = []
        if pending is not None:
            start, after, hidden = pending
            room = min(k, draft_room(max_tokens, len(out.token_ids)))
            drafts = drafter.draft([(SeqChunk(after, start, table), hidden)], [room])[0]
        if spoil:
            drafts = [(d + 1) % engine.cfg.vocab_size for d in drafts]
        out.drafts.append((pos, drafts))
        feed = [out.token_ids[-1], *drafts]
        rows = engine.step([SeqChunk([t], pos + j, table) for j, t in enumerate(feed)],
                           want_logits=True, keep=range(len(feed)))
        assert rows is not None
        kept = accepted_tokens(drafts, [int(t) for t in torch.argmax(rows, -1).tolist()])
        out.drafted += len(drafts)
        out.accepted += len(kept) - 1
        out.token_ids.extend(kept)
        pending = (pos, kept, torch.cat([engine.kept[j] for j in range(len(kept))]))
        pos += len(kept)
    del out.token_ids[max_tokens:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankRun(Protocol):
    """What one launch runs on every rank; rank 0's return value is the launch's result."""

    @property
    def tp(self) -> int: ...

    @property
    def device(self) -> str: ...

    def run(self, rank: int, comm: Comm) -> Any: ...


def _proc_entry(rank: int, spec: RankRun, port: int, queue: object) -> None:
    import torch.distributed as dist

    backend = "nccl" if spec.device == "cuda" else "gloo"
    if spec.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=spec.tp
    )
    try:
        res = spec.run(rank, TorchDistComm())
        if rank == 0:
            # Plain pickle copies tensors by value; the queue's own pickler would share them by
            # file descriptor, which dies with this process before the parent reads them.
            queue.put(("ok", pickle.dumps(res)))  # type: ignore[attr-defined]
    except Exception as e:  # forwarded to the parent, which reports it once
        queue.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))  # type: ignore[attr-defined]
        sys.exit(1)
    finally:
        dist.destroy_process_group()


def run_procs(spec: RankRun, timeout_s: float = 900.0) -> Any:
    """Every rank as a local process over torch.distributed (NCCL on CUDA, else gloo), like a
    serving instance's ranks; rank 0's result."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_proc_entry, args=(r, spec, port, queue), daemon=True)
        for r in range(spec.tp)
    ]
    for p in procs:
        p.start()
    status: str = "error"
    payload: Any = "interrupted"
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                status, payload = queue.get(timeout=1.0)
                break
            except Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    status, payload = (
                        "error",
                        f"rank {dead[0]} exited with {procs[dead[0]].exitcode}",
                    )
                    break
                if time.monotonic() > deadline:
                    status, payload = "error", f"ranks gave no result within {timeout_s:.0f} s"
                    break
    finally:
        for p in procs:
            p.join(timeout=30 if status == "ok" else 1)
            if p.is_alive():
                p.kill()
    if status != "ok":
        if "KVCacheFullError" in payload:
            raise KVCacheFullError(payload)
        raise RuntimeError(payload)
    return pickle.loads(payload)


def generate_result(
    model: str | Path,
    prompt_ids: Sequence[int],
    max_tokens: int,
    tp: int = 1,
    dcp: int = 1,
    dtype: str | torch.dtype = "float32",
    block_size: int = 16,
    num_blocks: int | None = None,
    device: str = "cpu",
    launcher: str = "inproc",
    seed: int = BUILTIN_SEED,
    keep_logits: bool = False,
    forced_ids: Sequence[int] | None = None,
    speculative: SpeculativeConfig | None = None,
    kv_cache_dtype: str = "auto",
    spoil_drafts: bool = False,
) -> GenerationResult:
    """Greedy generation with per-step logits kept on request; ``num_blocks`` (per rank)
    defaults to exactly what the request needs. ``speculative``: prompt-lookup or MTP drafts
    verified per step (the same tokens; ``drafted`` and ``accepted`` say how many, ``drafts``
    what was drafted where; ``spoil_drafts`` replaces every MTP draft by another token).
    ``kv_cache_dtype`` ``fp8`` keeps the KV in kv/fp8_layout.py's FP8 tokens."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    if speculative is not None and forced_ids is not None:
        raise ValueError("speculative: teacher forcing (forced_ids) feeds no drafts")
    if dcp not in (1, tp):
        raise ValueError(f"dcp must be 1 or tp ({tp}), got {dcp}")
    dt = parse_dtype(dtype)
    heads = load_config(model).num_attention_heads
    if tp < 1 or heads % tp:
        raise ValueError(f"tp ({tp}) must divide num_attention_heads ({heads})")
    spec = _Spec(
        model=str(model),
        prompt_ids=tuple(int(t) for t in prompt_ids),
        max_tokens=max_tokens,
        tp=tp,
        dcp=dcp,
        dtype="bfloat16" if dt == torch.bfloat16 else "float32",
        block_size=block_size,
        num_blocks=num_blocks,
        device=device,
        seed=seed,
        keep_logits=keep_logits,
        forced_ids=None if forced_ids is None else tuple(forced_ids),
        speculative=speculative,
        kv_cache_dtype=check_kv_cache_dtype(kv_cache_dtype),
        spoil_drafts=spoil_drafts,
    )
    if launcher == "procs" and tp > 1:
        result: GenerationResult = run_procs(spec)
        return result
    if launcher not in ("inproc", "procs"):
        raise ValueError(f"launcher must be inproc or procs, got {launcher!r}")
    res = run_threads(tp, lambda rank, comm: _rank_main(rank, comm, spec))[0]
    assert res is not None
    return res


def generate(
    model: str | Path,
    prompt_ids: Sequence[int],
    max_tokens: int,
    tp: int = 1,
    dcp: int = 1,
    dtype: str | torch.dtype = "float32",
    block_size: int = 16,
    **kwargs: object,
) -> list[int]:
    """Greedy token ids of one request on one instance (the single-process reference)."""
    return generate_result(
        model,
        prompt_ids,
        max_tokens,
        tp,
        dcp,
        dtype,
        block_size,
        **kwargs,  # type: ignore[arg-type]
    ).token_ids


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdd generate", description=__doc__)
    p.add_argument("--model", default="builtin", help="Hugging Face DeepSeek-V2 dir or 'builtin'")
    p.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="auto: the model's dtype; fp8: e4m3 latents with a scale per 128")
    p.add_argument("-o", "--output", choices=["json", "text"], default="text")
    p.add_argument("--launcher", choices=["inproc", "procs"], default="inproc")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks per rank")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--seed", type=int, default=BUILTIN_SEED, help="seed of the built-in model")
    p.add_argument("--speculative", choices=["off", "ngram", "mtp"], default="off",
                   help="drafts verified per step (the same tokens): prompt lookup, or the "
                        "checkpoint's MTP module (V3-family checkpoints that carry one)")
    p.add_argument("--speculative-tokens", type=int, default=None,
                   help="drafts per step (default: 3 for ngram, 1 for mtp)")
    return p


def main(argv: list[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["generate"]:
        args_in = args_in[1:]
    parser = _parser()
    a = parser.parse_args(args_in)
    try:
        prompt = [int(t) for t in a.prompt_ids.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--prompt-ids: expected comma-separated integers, got {a.prompt_ids!r}")
    if not prompt:
        parser.error("--prompt-ids: empty prompt")
    if a.tp < 1 or a.dcp not in (1, a.tp):
        parser.error(f"--dcp: must be 1 or equal to --tp ({a.tp}), got {a.dcp}")
    if a.max_tokens < 1:
        parser.error("--max-tokens: must be >= 1")
    if a.model != "builtin" and not os.path.isdir(a.model):
        parser.error(f"--model: {a.model!r} is neither 'builtin' nor a directory")
    try:
        speculative = SpeculativeConfig.from_settings(a.speculative, a.speculative_tokens)
    except ValueError as e:
        parser.error(f"--speculative-tokens: {e}")
    try:
        res = generate_result(
            a.model,
            prompt,
            a.max_tokens,
            a.tp,
            a.dcp,
            a.dtype,
            a.block_size,
            num_blocks=a.num_blocks,
            device=a.device,
            launcher=a.launcher,
            seed=a.seed,
            kv_cache_dtype=a.kv_cache_dtype,
            speculative=speculative,
        )
    except (RuntimeError, ValueError) as e:  # KVCacheFullError, bad layout, a failed rank,
        print(f"pdd generate: {e}", file=sys.stderr)  # a checkpoint without an MTP module
        return 1
    ids = res.token_ids
    if a.output == "json":
        extra = ({} if speculative is None else
                 {"drafted": res.drafted, "accepted": res.accepted})
        print(json.dumps({"token_ids": ids, **extra}))
    else:
        print(" ".join(str(t) for t in ids))
        if speculative is not None:
            print(f"speculative {speculative.method} k={speculative.tokens}: drafted "
                  f"{res.drafted}, accepted {res.accepted}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
