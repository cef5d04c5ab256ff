from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))


@pytest.fixture
def valid_doc() -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load((ROOT / "manifests/examples/p-tp4-dcp4-to-d-tp4-dcp4.yaml")
                                        .read_text()))
