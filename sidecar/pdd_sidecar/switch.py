"""An on/off setting of the environment, read one way wherever it is read: the instance's
settings (env.py) and the engine, which reads its own switches from the process environment so
that the benches and tests that import it need nothing else."""

from __future__ import annotations

from collections.abc import Mapping


def switch(env: Mapping[str, str], key: str, default: bool) -> bool:
    """``1`` or ``0`` (unset or empty: ``default``); anything else is an error naming ``key``."""
    raw = (env.get(key, "") or ("1" if default else "0")).strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{key}: must be 0 or 1, got {raw!r}")
    return raw == "1"
