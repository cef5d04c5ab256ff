"""KV footprint of well-known MLA models, so `pdd plan --tokens N` can show bytes per rank.

Only the layers that hold KV count: V3/R1 checkpoints carry one multi-token-prediction layer past
their 61, which the sidecar does not load, so it holds no cache.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim

    def bytes_per_token(self, dtype: str) -> int:
        return self.num_layers * self.latent_dim * DTYPE_BYTES[dtype]


KNOWN_MODELS: dict[str, KVShape] = {
    "deepseek-ai/DeepSeek-V2-Lite": KVShape(27, 576),
    "deepseek-ai/DeepSeek-V2-Lite-Chat": KVShape(27, 576),
    "deepseek-ai/DeepSeek-V2": KVShape(60, 576),
    "deepseek-ai/DeepSeek-V2-Chat": KVShape(60, 576),
    "deepseek-ai/DeepSeek-V2.5": KVShape(60, 576),
    "deepseek-ai/DeepSeek-V3": KVShape(61, 576),
    "deepseek-ai/DeepSeek-V3-Base": KVShape(61, 576),
    "deepseek-ai/DeepSeek-V3-0324": KVShape(61, 576),
    "deepseek-ai/DeepSeek-R1": KVShape(61, 576),
    "deepseek-ai/DeepSeek-R1-Zero": KVShape(61, 576),
    "deepseek-ai/DeepSeek-R1-0528": KVShape(61, 576),
}
