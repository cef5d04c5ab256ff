"""One rank's share of a DeepSeek-V2 model: config, its TP slice of the weights and the rotary
table, loaded from a Hugging Face checkpoint directory or built from the seeded built-in config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pdd_sidecar.model.config import BUILTIN_SEED, ModelConfig, load_config
from pdd_sidecar.model.rope import Rotary
from pdd_sidecar.model.weights import RankWeights, load_rank_weights, open_source

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"unsupported dtype {dtype} (float32 or bfloat16)")
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r} (float32 or bfloat16)") from None


@dataclass
class RankModel:
    config: ModelConfig
    weights: RankWeights
    rotary: Rotary
    rank: int
    tp: int
    dtype: torch.dtype
    device: torch.device

    @property
    def heads_per_rank(self) -> int:
        return self.config.num_attention_heads // self.tp


def load_rank_model(
    model: str | Path = "builtin",
    rank: int = 0,
    tp: int = 1,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = BUILTIN_SEED,
) -> RankModel:
    """``model`` is ``"builtin"`` or a Hugging Face DeepSeek-V2 directory; ``seed`` only matters
    for the built-in model."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} out of range for tp {tp}")
    cfg = load_config(model)
    dt = parse_dtype(dtype)
    dev = torch.device(device)
    weights = load_rank_weights(cfg, open_source(model, cfg, seed), rank, tp, dt, dev)
    return RankModel(cfg, weights, Rotary(cfg.rope, cfg.qk_rope_head_dim, dev), rank, tp, dt, dev)
