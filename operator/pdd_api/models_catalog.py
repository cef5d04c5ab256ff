"""KV footprint of well-known MLA models, so `pdd plan --tokens N` can show bytes per rank.

Only the layers that hold KV count: V3/R1 checkpoints carry one multi-token-prediction layer past
their 61 (``mtp_layers``, the config's num_nextn_predict_layers), which holds KV only when
speculative decoding uses it (method mtp); V2 and V2-Lite have none, so the spec validators
refuse mtp for them.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim
    mtp_layers: int = 0  # num_nextn_predict_layers: multi-token-prediction modules carried

    def bytes_per_token(self, dtype: str) -> int:
        return self.num_layers * self.latent_dim * DTYPE_BYTES[dtype]


KNOWN_MODELS: dict[str, KVShape] = {
    "deepseek-ai/DeepSeek-V2-Lite": KVShape(27, 576),
    "deepseek-ai/DeepSeek-V2-Lite-Chat": KVShape(27, 576),
    "deepseek-ai/DeepSeek-V2": KVShape(60, 576),
    "deepseek-ai/DeepSeek-V2-Chat": KVShape(60, 576),
    "deepseek-ai/DeepSeek-V2.5": KVShape(60, 576),
    "deepseek-ai/DeepSeek-V3": KVShape(61, 576, mtp_layers=1),
    "deepseek-ai/DeepSeek-V3-Base": KVShape(61, 576, mtp_layers=1),
    "deepseek-ai/DeepSeek-V3-0324": KVShape(61, 576, mtp_layers=1),
    "deepseek-ai/DeepSeek-R1": KVShape(61, 576, mtp_layers=1),
    "deepseek-ai/DeepSeek-R1-Zero": KVShape(61, 576, mtp_layers=1),
    "deepseek-ai/DeepSeek-R1-0528": KVShape(61, 576, mtp_layers=1),
}


def without_mtp() -> tuple[str, ...]:
    """Checkpoint names known to carry no multi-token-prediction module, without their owner
    (a copy under another owner, or a directory `pdd serve` names by its last part, keeps it)."""
    return tuple(sorted({n.rsplit("/", 1)[-1] for n, s in KNOWN_MODELS.items()
                         if s.mtp_layers == 0}))
