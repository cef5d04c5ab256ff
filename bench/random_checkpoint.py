"""A random-weights DeepSeek-V2 checkpoint for GPU serving runs (no download, no tokenizer).

Weights are drawn on the device (seconds for V2-Lite width) and written as one bf16 safetensors
file with its config.json. Environment: MODEL_SIZE (v2lite | small), LAYERS (V2-Lite has 27;
a few keep the write and the load short), CKPT (the folder), DEVICE (cuda | cpu).

    MODEL_SIZE=v2lite LAYERS=4 CKPT=/dev/shm/pdd-random-v2lite-4 DEVICE=cuda \\
        python bench/random_checkpoint.py
"""

# Random bf16 weights, drawn on the GPU when there is one, scaled 1/sqrt(fan_in) so activations
# stay O(1); written as one safetensors file plus config.json (token ids only, no tokenizer).
import json
import math
import os
import sys
import time

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import small_config, v2_lite_config  # noqa: E402

from pdd_sidecar.model.weights import hf_shapes  # noqa: E402

t = time.perf_counter()
base = v2_lite_config() if os.environ["MODEL_SIZE"] == "v2lite" else small_config()
cfg = base.replace(num_hidden_layers=int(os.environ["LAYERS"]))
dev = torch.device("cuda" if os.environ["DEVICE"] == "cuda" and torch.cuda.is_available()
                   else "cpu")
g = torch.Generator(device=dev).manual_seed(0)
state = {}
for name, shape in hf_shapes(cfg).items():
    if len(shape) == 1:
        w = 1.0 + 0.1 * torch.randn(shape, device=dev, generator=g)
    elif name == "model.embed_tokens.weight":
        w = torch.randn(shape, device=dev, generator=g)
    else:
        w = torch.randn(shape, device=dev, generator=g) / math.sqrt(shape[1])
    state[name] = w.to(torch.bfloat16).cpu().contiguous()
d = os.environ["CKPT"]
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(cfg.to_hf_dict(), f, indent=2)
save_file(state, os.path.join(d, "model.safetensors"))
n = sum(v.numel() for v in state.values())
print(f"checkpoint {d}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab "
      f"{cfg.vocab_size}, {cfg.n_routed_experts} experts, {n / 1e9:.2f} B params, "
      f"{2 * n / 2**30:.1f} GiB bf16, written in {time.perf_counter() - t:.1f}s")
