"""E2E tier: the whole stack (tests/e2e/harness.py) once per session, a namespace per test.

The stack gets a control plane of its own under .cache/e2e with the real node only (no kwok
nodes: pods land only where a kubelet runs them), so an integration session on the shared
.cluster/ never sees these pods and vice versa. Needs root (the kubelet, containerd, the node's
network) and the images of ``make image``; when the stack cannot start every test fails with the
logs, never skips.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import harness
import pytest

WORK_DIR = Path(os.environ.get("PDD_E2E_DIR") or harness.REPO_ROOT / ".cache" / "e2e")


@pytest.fixture(scope="session")
def stack() -> Iterator[harness.Stack]:
    if os.geteuid() != 0:
        pytest.fail("the e2e tier needs root: it runs a kubelet, containerd and the node's network")
    lines: list[str] = []
    s = harness.Stack(WORK_DIR, say=lines.append)
    try:
        s.start()
    except Exception as e:  # noqa: BLE001 - any start failure fails every test loudly
        s.stop()
        pytest.fail(f"e2e stack did not start: {e}\n" + "\n".join(lines) + "\n" + s.diagnostics())
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def namespace(stack: harness.Stack) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    stack.create_namespace(name)
    yield name
    stack.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(autouse=True)
def _diagnostics_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failed e2e test prints the operator, kubelet and pod log tails: that is where the
    reason is, and the stack is gone by the time anyone reads the report."""
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed and "stack" in request.fixturenames:
        s: harness.Stack = request.getfixturevalue("stack")
        print(s.diagnostics(40))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep
