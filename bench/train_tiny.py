"""Trains a small DeepSeek V2 or V3 model on real text on the CPU and saves it as a checkpoint
the engine loads, so that accuracy benches can measure a model whose next-token distributions
are peaked the way a trained model's are, rather than the near-flat ones of random weights.

The model is transformers' own ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` built from
``ModelConfig.to_hf_dict()`` (the engine's config, so the architecture trained is the one served),
trained in float32 with AdamW on the bytes of the Python standard library's source files (ids
0..255; ``Lib/*.py`` of the running interpreter, present wherever Python is): mostly 512-byte
windows, which are cheap, then a few steps of whole 4,096-byte windows, the length the bench
evaluates (without them the model is lost past its training length). Every 25th file in
name order is held out: never trained on, it gives the evaluation text. The routers are trained
the way DeepSeek trained theirs: V2 with its expert-level balance loss, V3 with the
auxiliary-loss-free score-correction bias (moved after each step against each expert's load), so
V3's checkpoint carries a bias that changes which experts win.

The checkpoint is written in the per-expert layout ``hf_shapes`` names (transformers v5 keeps the
experts fused in memory), as bf16 safetensors plus config.json, under a folder keyed by a hash of
the config, the training settings and the corpus: a second run with the same settings reuses it.

    python bench/train_tiny.py --model v3 --steps 20     # a short run, printing the loss
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))

from pdd_sidecar.model.config import V2, V3, ModelConfig  # noqa: E402
from pdd_sidecar.model.weights import hf_shapes, write_checkpoint  # noqa: E402

CACHE = Path(__file__).resolve().parents[1] / ".cache" / "kv_accuracy"
HELD_OUT_EVERY = 25  # every 25th stdlib file (name order) is never trained on
V2_BALANCE_ALPHA = 0.003  # DeepSeek-V2's expert-level balance factor
V3_BIAS_RATE = 0.001  # DeepSeek-V3's bias update speed
FORMAT = 1  # bump when training changes in a way the cache key's fields do not show


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 300
    batch: int = 4
    seq_len: int = 512
    # then this many steps of one window of long_len bytes: a model trained on 512-byte windows
    # alone loses about a nat per byte past byte 512, so it is taught the evaluation's length
    long_steps: int = 30
    long_len: int = 4096
    lr: float = 5e-3
    warmup: int = 20
    weight_decay: float = 0.1
    seed: int = 0


@dataclass(frozen=True)
class TrainResult:
    first_loss: float  # nats/byte, the first step's batch
    last_loss: float  # nats/byte, the mean over the last tenth of the seq_len steps
    long_loss: float  # nats/byte, the mean over the last half of the long_len steps (nan: none)
    seconds: float
    tokens: int  # bytes trained on, repeats counted


def corpus_files() -> tuple[list[Path], list[Path]]:
    """``(train, held_out)``: the running interpreter's ``Lib/*.py`` in name order, every
    ``HELD_OUT_EVERY``-th held out."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda p: p.name)
    if len(files) < 2 * HELD_OUT_EVERY:
        raise RuntimeError(f"{len(files)} files in the standard library, expected hundreds")
    held = set(files[::HELD_OUT_EVERY])
    return [f for f in files if f not in held], [f for f in files if f in held]


def byte_ids(files: list[Path]) -> torch.Tensor:
    """The files' bytes end to end, as int64 token ids 0..255."""
    data = b"".join(f.read_bytes() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def held_out_sequences(n: int, length: int) -> list[list[int]]:
    """``n`` consecutive ``length``-byte windows of the held-out files' text."""
    ids = byte_ids(corpus_files()[1])
    if n * length > ids.numel():
        raise ValueError(f"{n} x {length} bytes asked of {ids.numel()} held-out bytes")
    return [ids[i * length:(i + 1) * length].tolist() for i in range(n)]


def hf_model(cfg: ModelConfig, seed: int) -> Any:
    """transformers' model for ``cfg``, initialised as transformers does from ``seed``."""
    import transformers

    if cfg.model_type == V2:
        conf: Any = transformers.DeepseekV2Config(**cfg.to_hf_dict())
        cls: Any = transformers.DeepseekV2ForCausalLM
    elif cfg.model_type == V3:
        conf = transformers.DeepseekV3Config(**cfg.to_hf_dict())
        cls = transformers.DeepseekV3ForCausalLM
    else:
        raise ValueError(f"model_type {cfg.model_type!r}")
    conf._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return cls(conf).float()


def engine_state(model: Any, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's weights under the names and shapes ``hf_shapes(cfg)`` gives (experts split
    out of transformers' fused ``gate_up_proj`` / ``down_proj``), plus V3's score-correction
    biases; anything left over or missing is an error, as the engine would not load it."""
    src = {k: v.detach() for k, v in model.state_dict().items()}
    want = dict(hf_shapes(cfg))
    out: dict[str, torch.Tensor] = {}
    inter = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(i):
            continue
        assert cfg.n_routed_experts
        p = f"model.layers.{i}.mlp."
        gate_up = src.pop(p + "experts.gate_up_proj")  # [E, 2 * inter, hidden]: gate, then up
        down = src.pop(p + "experts.down_proj")  # [E, hidden, inter]
        for e in range(cfg.n_routed_experts):
            out[p + f"experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
            out[p + f"experts.{e}.up_proj.weight"] = gate_up[e, inter:]
            out[p + f"experts.{e}.down_proj.weight"] = down[e]
        if cfg.scoring_func == "sigmoid":
            bias = p + "gate.e_score_correction_bias"
            out[bias] = src.pop(bias)
            want[bias] = (cfg.n_routed_experts,)
    out.update(src)
    if set(out) != set(want):
        raise ValueError(f"state names: extra {sorted(set(out) - set(want))}, "
                         f"missing {sorted(set(want) - set(out))}")
    bad = [n for n in want if tuple(out[n].shape) != want[n]]
    if bad:
        raise ValueError(f"shapes differ from hf_shapes: {bad}")
    return {n: out[n].contiguous() for n in want}


def save(model: Any, cfg: ModelConfig, path: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """config.json and one safetensors file in ``dtype``, as the engine loads them."""
    state = {k: v.to(dtype) for k, v in engine_state(model, cfg).items()}
    return write_checkpoint(path, cfg, state)


def _router_hooks(model: Any, cfg: ModelConfig,
                  seen: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
    """Forward hooks that keep each MoE router's ``(router logits, chosen experts)``."""
    def keep(_mod: Any, _inp: Any, out: tuple[torch.Tensor, ...]) -> None:
        seen.append((out[0], out[2]))

    return [layer.mlp.gate.register_forward_hook(keep)
            for i, layer in enumerate(model.model.layers) if cfg.is_moe_layer(i)]


def _balance_loss(cfg: ModelConfig, seen: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """DeepSeek-V2's expert-level balance loss, summed over MoE layers: E/(K T) times the sum
    over experts of (tokens routed there) x (mean routing probability)."""
    assert cfg.n_routed_experts
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    total = torch.zeros(())
    for logits, chosen in seen:
        probs = logits.softmax(-1)
        f = torch.bincount(chosen.flatten(), minlength=e).float() * e / (k * logits.shape[0])
        total = total + (f * probs.mean(0)).sum()
    return V2_BALANCE_ALPHA * total


def _move_biases(model: Any, cfg: ModelConfig,
                 seen: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: each MoE layer's score-correction bias moves
    by ``V3_BIAS_RATE`` down for experts loaded above the mean and up for those below."""
    assert cfg.n_routed_experts
    gates = [layer.mlp.gate for i, layer in enumerate(model.model.layers) if cfg.is_moe_layer(i)]
    for gate, (_, chosen) in zip(gates, seen, strict=True):
        load = torch.bincount(chosen.flatten(), minlength=cfg.n_routed_experts).float()
        gate.e_score_correction_bias.add_(V3_BIAS_RATE * torch.sign(load.mean() - load))


def train(cfg: ModelConfig, s: TrainSettings, log: Callable[[str], None] = print,
          log_every: int = 50) -> tuple[Any, TrainResult]:
    """AdamW in float32 on random windows of the training files, ``batch`` x ``seq_len`` bytes
    a step, then 1 x ``long_len`` for the last ``long_steps``; learning rate warmed up linearly
    then cosine-decayed to a tenth over all steps; returns the model and its losses."""
    model = hf_model(cfg, s.seed)
    model.train()
    ids = byte_ids(corpus_files()[0])
    decay = [p for p in model.parameters() if p.ndim >= 2]
    keep = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": keep, "weight_decay": 0.0}],
                            lr=s.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(s.seed)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = _router_hooks(model, cfg, seen)
    losses: list[float] = []
    t0 = time.perf_counter()
    try:
        total = s.steps + s.long_steps
        for step in range(total):
            frac = max(0.0, (step - s.warmup) / max(1, total - s.warmup))
            lr = s.lr * min(1.0, (step + 1) / s.warmup) * (0.1 + 0.45 * (1 + math.cos(
                math.pi * frac)))
            for group in opt.param_groups:
                group["lr"] = lr
            batch, length = (s.batch, s.seq_len) if step < s.steps else (1, s.long_len)
            starts = torch.randint(0, ids.numel() - length - 1, (batch,), generator=g)
            x = torch.stack([ids[i:i + length + 1] for i in starts.tolist()])
            seen.clear()
            logits = model(input_ids=x[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            objective = loss + _balance_loss(cfg, seen) if cfg.scoring_func == "softmax" else loss
            opt.zero_grad(set_to_none=True)
            objective.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if cfg.scoring_func == "sigmoid":
                with torch.no_grad():
                    _move_biases(model, cfg, seen)
            losses.append(loss.item())
            if step == 0 or (step + 1) % log_every == 0 or step + 1 in (s.steps, total):
                log(f"step {step + 1}/{total} ({batch} x {length} bytes): loss {losses[-1]:.3f} "
                    f"nats/byte, lr {lr:.2e}, {time.perf_counter() - t0:.0f} s")
    finally:
        for h in hooks:
            h.remove()
    model.eval()
    short, long = losses[:s.steps], losses[s.steps:]
    tail, long_tail = short[-max(1, len(short) // 10):], long[len(long) // 2:]
    return model, TrainResult(
        first_loss=losses[0], last_loss=sum(tail) / len(tail),
        long_loss=sum(long_tail) / len(long_tail) if long_tail else float("nan"),
        seconds=time.perf_counter() - t0,
        tokens=s.steps * s.batch * s.seq_len + s.long_steps * s.long_len)


def cache_key(cfg: ModelConfig, s: TrainSettings) -> str:
    """A hash of everything the trained weights depend on: config, settings, corpus, versions."""
    import transformers

    train_files, held = corpus_files()
    corpus = [(f.name, f.stat().st_size) for f in train_files + held]
    blob = json.dumps({"config": cfg.to_hf_dict(), "settings": asdict(s), "corpus": corpus,
                       "format": FORMAT, "torch": torch.__version__,
                       "transformers": transformers.__version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def trained_checkpoint(cfg: ModelConfig, s: TrainSettings, cache: Path = CACHE,
                       log: Callable[[str], None] = print) -> tuple[Path, dict[str, Any]]:
    """The checkpoint folder for ``cfg`` trained with ``s`` and its training record: from the
    cache when there, else trained now (in ``torch.get_num_threads()`` threads) and stored."""
    path = cache / f"{cfg.model_type}-{cache_key(cfg, s)}"
    record = path / "train.json"
    if record.is_file():
        log(f"trained checkpoint from the cache: {path}")
        return path, json.loads(record.read_text())
    log(f"training {cfg.model_type} ({s.steps} steps of {s.batch} x {s.seq_len} bytes, "
        f"{s.long_steps} of {s.long_len}) for {path}")
    model, result = train(cfg, s, log)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save(model, cfg, tmp)
    info = {"settings": asdict(s), **asdict(result), "threads": torch.get_num_threads(),
            "held_out_files": [f.name for f in corpus_files()[1]]}
    (tmp / "train.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path, info


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kv_dtype_accuracy import test_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="v2", choices=["v2", "v3"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=TrainSettings.steps)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    path, info = trained_checkpoint(test_config(a.model, a.layers, 4096),
                                    TrainSettings(steps=a.steps))
    print(f"{path}: loss {info['first_loss']:.3f} -> {info['last_loss']:.3f} nats/byte, "
          f"{info['long_loss']:.3f} on {TrainSettings.long_len}-byte windows, "
          f"in {info['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
