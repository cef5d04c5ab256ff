"""FP8 latent KV against bf16 KV, teacher-forced: how often the next-token choice agrees and how
far the chosen token's log-probability moves.

For each checkpoint the same token sequence runs twice through the serving engine
(``RankEngine.step``, the prompt in chunks so that every chunk after the first reads the earlier
tokens back from the paged cache, as a long prompt or a decode does), once with the KV cache in
the model's dtype (``auto``) and once in FP8 (kv/fp8_layout.py's 656-byte token). From each
position's logits:

- top-1 agreement: the share of positions where FP8's argmax equals bf16's;
- mean |delta log-prob|: the mean over positions of |log p_fp8(t) - log p_bf16(t)| for t, the
  token bf16 chooses there;
- the same two restricted to positions where bf16's top-1 leads its runner-up by at least
  ``--margin`` nats: random weights give near-flat next-token distributions, where a flip of
  the argmax between two tokens a hair apart says little about the cache; positions with a
  clear winner say how often FP8 changes a decision that matters.

The checkpoints have DeepSeek's real MLA widths (latent 512 + RoPE 64, so every token has four
128-value scale groups): V2 (softmax routing, no q LoRA) and V3 (sigmoid routing with the
score-correction bias, group-limited top-k, q LoRA). Their weights are either

- ``--weights random`` (the default): scaled 1/sqrt(fan_in), as bench/random_checkpoint.py
  does, and the sequence uniform random token ids. Random weights are not a trained model:
  these figures bound what FP8 rounding does to this engine's arithmetic, not a benchmark
  score; or
- ``--weights trained``: the same architectures trained on the CPU on the bytes of the Python
  standard library's source (bench/train_tiny.py, cached under .cache/kv_accuracy/), and the
  sequence held-out source text the training never saw. Their next-token distributions are
  peaked the way a trained model's are, so a flip of the argmax means something; the rows also
  give the held-out loss (nats/byte) under each KV dtype.

The same sequence goes through both runs.

    python bench/kv_dtype_accuracy.py --tokens 4096 --json /tmp/kv_dtype.json
    python bench/kv_dtype_accuracy.py --weights trained --tokens 4096 --seqs 3
    python bench/kv_dtype_accuracy.py --tokens 256 --layers 2     # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_tiny import TrainSettings, held_out_sequences, trained_checkpoint  # noqa: E402

from pdd_sidecar.engine.comm import SingleComm  # noqa: E402
from pdd_sidecar.engine.rank_engine import RankEngine, allocate_request, new_cache  # noqa: E402
from pdd_sidecar.engine.seq_chunk import SeqChunk  # noqa: E402
from pdd_sidecar.model.config import V2, V3, ModelConfig, RopeConfig  # noqa: E402
from pdd_sidecar.model.rank_model import load_rank_model  # noqa: E402
from pdd_sidecar.model.weights import hf_shapes, write_checkpoint  # noqa: E402

DEFAULT_MARGIN = 0.5  # nats between bf16's top-1 and runner-up


def test_config(kind: str, layers: int, max_positions: int) -> ModelConfig:
    """Small everywhere but attention's latent: DeepSeek's 512 + 64, the widths FP8 rounds."""
    common: dict[str, Any] = dict(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64,
        v_head_dim=64, moe_intermediate_size=128, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=max_positions,
        rope=RopeConfig(rope_type="default", theta=10000.0),
    )
    if kind == "v2":
        return ModelConfig(q_lora_rank=None, model_type=V2, **common)
    if kind == "v3":
        return ModelConfig(q_lora_rank=192, model_type=V3, scoring_func="sigmoid",
                           topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                           routed_scaling_factor=2.5, **common)
    raise ValueError(f"--models: {kind!r} is not v2 or v3")


def random_checkpoint(cfg: ModelConfig, path: Path, seed: int = 0) -> Path:
    """Random bf16 weights and config.json, as bench/random_checkpoint.py writes them."""
    g = torch.Generator().manual_seed(seed)
    shapes = dict(hf_shapes(cfg))
    if cfg.scoring_func == "sigmoid":
        for i in range(cfg.num_hidden_layers):
            if cfg.is_moe_layer(i):
                assert cfg.n_routed_experts
                shapes[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = (
                    cfg.n_routed_experts, 1)
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("e_score_correction_bias"):
            w = 0.1 * torch.randn(shape[0], generator=g)
        elif len(shape) == 1:
            w = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name == "model.embed_tokens.weight":
            w = torch.randn(shape, generator=g)
        else:
            w = torch.randn(shape, generator=g) / math.sqrt(shape[1])
        state[name] = w.to(torch.bfloat16)
    return write_checkpoint(path, cfg, state)


def teacher_forced(model_dir: str, tokens: list[int], kv_cache_dtype: str, dtype: str = "bfloat16",
                   chunk: int = 512, block_size: int = 64, device: str = "cpu",
                   seed: int = 0) -> torch.Tensor:
    """fp32 log-probabilities ``[T, V]`` of the next token at every position of ``tokens``,
    the prompt run in chunks of ``chunk`` through one engine whose cache keeps
    ``kv_cache_dtype``."""
    model = load_rank_model(model_dir, 0, 1, dtype, device, seed)
    cache = new_cache(model, -(-len(tokens) // block_size) + 1, block_size, device,
                      kv_cache_dtype)
    engine = RankEngine(model, cache, SingleComm(), decode_mode="eager")
    table = allocate_request(cache, len(tokens), 1)
    out = []
    for start in range(0, len(tokens), chunk):
        engine.step([SeqChunk(tokens[start:start + chunk], start, table)], keep=[0])
        out.append(torch.log_softmax(engine.logits(engine.kept[0]), dim=-1).cpu())
    return torch.cat(out)


@dataclass(frozen=True)
class Agreement:
    positions: int
    top1: float  # share of positions where the argmax agrees
    mean_abs_dlogp: float  # of bf16's chosen token
    max_abs_dlogp: float
    margin: float  # nats: bf16's top-1 over its runner-up, for the restricted figures
    clear_positions: int
    clear_top1: float
    clear_mean_abs_dlogp: float
    flip_max_margin: float  # the widest bf16 top-1 lead where FP8 chose another token
    median_margin: float


def compare(ref: torch.Tensor, got: torch.Tensor, margin: float = DEFAULT_MARGIN) -> Agreement:
    """``ref`` (bf16 KV) against ``got`` (FP8 KV), both ``[T, V]`` log-probabilities."""
    top2 = ref.topk(2, dim=-1)
    chosen = top2.indices[:, 0]
    same = got.argmax(dim=-1) == chosen
    dlogp = (got.gather(1, chosen[:, None]) - ref.gather(1, chosen[:, None])).abs()[:, 0]
    lead = top2.values[:, 0] - top2.values[:, 1]
    clear = lead >= margin
    n_clear = int(clear.sum())
    return Agreement(
        positions=ref.shape[0], top1=float(same.float().mean()),
        mean_abs_dlogp=float(dlogp.mean()), max_abs_dlogp=float(dlogp.max()), margin=margin,
        clear_positions=n_clear,
        clear_top1=float(same[clear].float().mean()) if n_clear else float("nan"),
        clear_mean_abs_dlogp=float(dlogp[clear].mean()) if n_clear else float("nan"),
        flip_max_margin=float(lead[~same].max()) if bool((~same).any()) else 0.0,
        median_margin=float(lead.median()))


def next_token_loss(logp: torch.Tensor, tokens: list[int]) -> float:
    """Mean negative log-probability (nats per token) of each next token of ``tokens``."""
    nxt = torch.tensor(tokens[1:])[:, None]
    return -float(logp[:-1].gather(1, nxt).mean())


def run_one(model_dir: str, tokens: list[int], dtype: str, chunk: int, device: str,
            margin: float) -> tuple[Agreement, Agreement | None, dict[str, float]]:
    """FP8 KV against ``dtype`` KV, and the yardstick: ``dtype`` against float32 throughout
    (the same checkpoint, KV in the model's dtype), what bf16 arithmetic alone moves; with
    the next-token loss of the sequence under each (meaningful where the text is real)."""
    ref = teacher_forced(model_dir, tokens, "auto", dtype, chunk, device=device)
    got = teacher_forced(model_dir, tokens, "fp8", dtype, chunk, device=device)
    loss = {"kv_dtype": next_token_loss(ref, tokens), "fp8": next_token_loss(got, tokens)}
    floor = None
    if dtype != "float32":
        wide = teacher_forced(model_dir, tokens, "auto", "float32", chunk, device=device)
        floor = compare(wide, ref, margin)
        loss["float32"] = next_token_loss(wide, tokens)
    return compare(ref, got, margin), floor, loss


def describe(r: Agreement) -> str:
    return (f"{r.positions} positions, top-1 agreement {100 * r.top1:.2f} %, mean |dlogp| "
            f"{r.mean_abs_dlogp:.4f} (max {r.max_abs_dlogp:.3f}); where the top-1 leads by >= "
            f"{r.margin:g} nats ({r.clear_positions} positions): {100 * r.clear_top1:.2f} %, "
            f"mean |dlogp| {r.clear_mean_abs_dlogp:.4f}; median top-1 lead "
            f"{r.median_margin:.3f} nats, widest lead overturned {r.flip_max_margin:.3f}")


def checkpoint(kind: str, a: argparse.Namespace, tmp: Path) -> tuple[ModelConfig, str]:
    """``kind``'s config and checkpoint folder: random weights written to ``tmp``, or trained
    weights from bench/train_tiny.py's cache (trained first when not there)."""
    cfg = test_config(kind, a.layers, max(4096, a.tokens))
    if a.weights == "random":
        return cfg, str(random_checkpoint(cfg, tmp / kind))
    path, info = trained_checkpoint(cfg, TrainSettings(steps=a.train_steps), log=print)
    st = info["settings"]
    print(f"{kind}: trained {st['steps']} + {st['long_steps']} steps in {info['seconds']:.0f} s, "
          f"training loss {info['first_loss']:.3f} -> {info['last_loss']:.3f} nats/byte "
          f"({st['seq_len']}-byte windows), {info['long_loss']:.3f} ({st['long_len']}-byte)",
          flush=True)
    return cfg, str(path)


def sequences(cfg: ModelConfig, a: argparse.Namespace) -> list[list[int]]:
    """Uniform random token ids for random weights; held-out text's bytes for trained ones."""
    if a.weights == "trained":
        return held_out_sequences(a.seqs, a.tokens)
    return [torch.randint(0, cfg.vocab_size, (a.tokens,),
                          generator=torch.Generator().manual_seed(1000 + s)).tolist()
            for s in range(a.seqs)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="v2,v3", help="comma list of v2, v3")
    p.add_argument("--weights", default="random", choices=["random", "trained"],
                   help="random weights and token ids, or trained weights and held-out text")
    p.add_argument("--train-steps", type=int, default=TrainSettings.steps,
                   help="with --weights trained: AdamW steps on 512-byte windows, before the "
                   "4,096-byte ones (part of the cache key)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--tokens", type=int, default=4096, help="sequence length")
    p.add_argument("--seqs", type=int, default=1, help="sequences per model")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--chunk", type=int, default=512, help="prompt tokens per step")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN)
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in a.models.split(","):
            cfg, ckpt = checkpoint(kind, a, Path(tmp))
            for s, tokens in enumerate(sequences(cfg, a)):
                t = time.perf_counter()
                r, floor, loss = run_one(ckpt, tokens, a.dtype, a.chunk, a.device, a.margin)
                rows.append({"model": kind, "seq": s, "fp8_vs_kv_dtype": asdict(r),
                             "dtype_vs_float32": None if floor is None else asdict(floor),
                             "loss_nats_per_token": loss,
                             "seconds": time.perf_counter() - t})
                print(f"{kind} seq {s}: FP8 KV against {a.dtype} KV: {describe(r)}", flush=True)
                if floor is not None:
                    print(f"{kind} seq {s}: yardstick, {a.dtype} against float32 (KV in each "
                          f"model dtype): {describe(floor)}", flush=True)
                print(f"{kind} seq {s}: next-token loss, nats/token (a byte when trained): "
                      + ", ".join(f"{k} {v:.4f}" for k, v in loss.items()), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
