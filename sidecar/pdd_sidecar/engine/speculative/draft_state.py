"""The hand-off's draft state (kv/handoff.py ``DraftState``) to and from a tensor: the prefill
writes the final normed hidden state of the prompt's last position, the decode reads it back
for its first MTP draft. kv/handoff.py stays torch-free; this is the one place that knows both.
"""

from __future__ import annotations

import torch

from pdd_sidecar.kv.handoff import DraftState

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def encode_draft_state(hidden: torch.Tensor, position: int) -> DraftState:
    """``hidden`` ``[H]`` (float32 or bfloat16) at prompt position ``position``."""
    name = next((n for n, d in _DTYPES.items() if d == hidden.dtype), None)
    if name is None or hidden.dim() != 1:
        raise ValueError(f"draft state: need a [hidden] float32 or bfloat16 tensor, got "
                         f"{list(hidden.shape)} {hidden.dtype}")
    raw = hidden.detach().to("cpu").contiguous().view(torch.uint8)
    return DraftState(position, name, raw.numpy().tobytes())


def decode_draft_state(state: DraftState, hidden_size: int,
                       device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The hidden state ``[hidden_size]`` in ``dtype`` on ``device``; a ValueError naming the
    field when its length is not the model's hidden size (another model's prefill)."""
    src = _DTYPES[state.dtype]
    t = torch.frombuffer(bytearray(state.data), dtype=torch.uint8).view(src)
    if t.numel() != hidden_size:
        raise ValueError(f"kv_transfer_params.draft_state.hidden: {t.numel()} values, this "
                         f"model's hidden size is {hidden_size}")
    return t.to(device=device, dtype=dtype)


__all__ = ["decode_draft_state", "encode_draft_state"]
