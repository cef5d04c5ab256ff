"""The compatibility record two instances compare before any KV byte moves.

A decode rank that reads KV written by a different model, dtype, block size or layout would
produce plausible-looking garbage, so both sides refuse the hand-off on any difference and say
which field differs and both values. ``kv_cache_dtype`` is the KV cache's own dtype (``auto``:
the model's ``dtype``; ``fp8``: kv/fp8_layout.py's 656-byte token): an FP8 token read as bf16
rows (or the reverse) would be bytes of the wrong shape, so a peer that differs is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

CACHE_LAYOUT_VERSION = "block-major-v1"


class CompatError(RuntimeError):
    """Two instances disagree on something the KV hand-off depends on."""


def cache_layout(num_layers: int, block_size: int, latent_dim: int) -> str:
    """Names the per-rank tensor shape [num_blocks, layers, block_size, latent]."""
    return (
        f"{CACHE_LAYOUT_VERSION}[blocks,layers={num_layers},block={block_size},"
        f"latent={latent_dim}]"
    )


def plan_digest(plan_json: str) -> str:
    """Both sides must follow the same plan; key order and whitespace must not matter."""
    canonical = json.dumps(json.loads(plan_json), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CompatRecord:
    model: str
    dtype: str
    block_size: int
    cache_layout: str
    plan_version: int
    plan_digest: str
    kv_cache_dtype: str = "auto"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompatRecord:
        try:
            return cls(**{k: data[k] for k in cls.__dataclass_fields__})
        except KeyError as exc:
            raise CompatError(f"compatibility record lacks field {exc.args[0]!r}") from None


# What to change when a field differs, where one setting decides it.
_FIXES = {
    "kv_cache_dtype": "prefill and decode must keep KV in one dtype: set the same "
                      "kvCacheDtype on both roles (PDD_KV_CACHE_DTYPE, pdd serve "
                      "--kv-cache-dtype)",
    # the most likely cause where the checkpoints agree: one side holds the MTP module's layer
    "cache_layout": "an instance with PDD_SPECULATIVE_METHOD=mtp holds one more layer (the MTP "
                    "module's): a prefill and its mtp decode must both set it, as the operator "
                    "and pdd serve do",
}


def check_compatible(local: CompatRecord, remote: CompatRecord, peer: str) -> None:
    """Raise naming every differing field with the local and the remote value."""
    differ = [name for name in CompatRecord.__dataclass_fields__
              if getattr(local, name) != getattr(remote, name)]
    problems = [
        f"{name}: local {getattr(local, name)!r} != {peer} {getattr(remote, name)!r}"
        for name in differ
    ]
    fixes = [_FIXES[name] for name in differ if name in _FIXES]
    if problems:
        raise CompatError(f"incompatible with {peer}: " + "; ".join(problems)
                          + "".join(f" ({fix})" for fix in fixes))
