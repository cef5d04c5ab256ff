"""Loading a bench/ script as a module, as its test drives it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def load_bench(script: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench/``script`` as a module, registered under its own name while the test runs (its
    dataclasses look themselves up there)."""
    name = f"bench_{Path(script).stem}"
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / script)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    return mod
