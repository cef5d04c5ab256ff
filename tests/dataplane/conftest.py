"""Fixtures the dataplane tier's files share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from runtime_fixtures import LocalCluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """Instances started by one test, every process stopped after it, failed or not."""
    c = LocalCluster(tmp_path)
    yield c
    c.close()
