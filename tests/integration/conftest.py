"""Integration tier: tests against the local control plane built by ``make cluster-build``.

The ``cluster`` fixture lives in tests/cluster/pytest_cluster.py so the e2e tier can import the
same one; the ``integration`` marker is registered in pyproject.toml.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

from pytest_cluster import cluster  # noqa: E402,F401
