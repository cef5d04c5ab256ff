"""What a checkpoint says about ending a completion: its end-of-sequence token ids.

transformers takes ``eos_token_id`` from generation_config.json when present, else from
config.json; either may be one id or a list. The built-in model has none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _ids(value: Any) -> frozenset[int] | None:
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"eos_token_id: expected an integer or a list of integers, got {value!r}")
    return frozenset(values)


def eos_token_ids(model: str | Path) -> frozenset[int]:
    if str(model) == "builtin":
        return frozenset()
    root = Path(model)
    for name in ("generation_config.json", "config.json"):
        path = root / name
        if path.is_file():
            found = _ids(json.loads(path.read_text()).get("eos_token_id"))
            if found is not None:
                return found
    return frozenset()
