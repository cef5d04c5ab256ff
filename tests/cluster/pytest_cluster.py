"""Session fixture ``cluster``: the local control plane for integration and e2e tests.

Use it from any test folder by importing it into that folder's ``conftest.py``::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
    from pytest_cluster import cluster  # noqa: E402,F401

A test then takes ``cluster`` (a :class:`localcluster.Cluster`): ``os.fspath(cluster)`` and
``cluster.kubeconfig`` are the kubeconfig, ``cluster.kubectl(...)`` runs kubectl against it,
and ``KUBECONFIG`` is set for the whole session so clients that read it (kubernetes, kopf,
subprocesses) find the cluster without arguments.

A cluster that is already running (``make cluster-up``) is reused and left running; one a
test session started is stopped when the last session using it ends (sessions in the same
working tree share it), unless ``PDD_KEEP_CLUSTER=1``. When the
cluster cannot start, every test that needs it fails with the components' log tails: these
tests are never skipped, because a skipped tier looks like a green one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
from localcluster import (
    COMPONENTS,
    DEFAULT_BIN_DIR,
    DEFAULT_STATE_DIR,
    Cluster,
    ClusterError,
    _env_path,
    _tail,
    release,
    up,
)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl is not on PATH; the integration tier needs it", pytrace=False)
    state_dir = _env_path("PDD_CLUSTER_DIR", DEFAULT_STATE_DIR)
    bin_dir = _env_path("PDD_CLUSTER_BIN", DEFAULT_BIN_DIR)
    messages: list[str] = []
    error: ClusterError | None = None
    try:
        handle, _started = up(state_dir, bin_dir, log=messages.append, user=os.getpid())
    except ClusterError as e:
        error = e
    if error is not None:  # outside `except`, so the report is not a chained traceback
        tails = "\n".join(
            f"----- {state_dir / (n + '.log')} -----\n{_tail(state_dir / (n + '.log'), 20)}"
            for n in COMPONENTS
            if (state_dir / f"{n}.log").exists()
        )
        pytest.fail(
            f"local control plane did not start: {error}\n\nall component logs:\n{tails}",
            pytrace=False,
        )
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(handle.kubeconfig)
    try:
        yield handle
    finally:
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous
        if os.environ.get("PDD_KEEP_CLUSTER") != "1":
            release(state_dir, os.getpid(), log=lambda _msg: None)
