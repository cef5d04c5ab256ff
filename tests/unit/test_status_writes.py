"""How often a pass writes status: a new PDDeployment's first pass already describes the pods
it created (from their create answers), so the pass their watch events trigger writes nothing;
a status write is the API server's time and, through kopf's watch, one more event to handle
for every PDDeployment (bench/operator_scale.py at 200 of them)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from pdd_operator.kube import PriorityGate
from pdd_operator.reconciler import Reconciler

SPEC: dict[str, Any] = {
    "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"}, "image": "pdd:0.1.0",
    "prefill": {"replicas": 1, "tensorParallelSize": 2, "decodeContextParallelSize": 2},
    "decode": {"replicas": 2, "tensorParallelSize": 2, "decodeContextParallelSize": 1},
    "router": {"enabled": False},
}


class FakeKube:
    """Answers writes as the API server would (uid, resourceVersion); no object exists until
    written. Counts status patches."""

    def __init__(self) -> None:
        self.gate = PriorityGate(8)
        self.statuses: list[dict[str, Any]] = []
        self._rv = itertools.count(100)

    def _answer(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = {**obj["metadata"], "uid": obj["metadata"].get("uid") or f"uid-{next(self._rv)}",
                "resourceVersion": str(next(self._rv))}
        out = {**obj, "metadata": meta}
        if obj["kind"] == "Pod":
            out["status"] = {"phase": "Pending"}
        return out

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self._answer(obj)

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self._answer(obj)

    async def get(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def list_objects(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        return []

    async def post_event(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def patch_status(self, kind: str, ns: str, name: str,
                           status: dict[str, Any]) -> dict[str, Any]:
        self.statuses.append(status)
        return {"apiVersion": "serving.pdd.dev/v1alpha1", "kind": kind,
                "metadata": {"name": name, "namespace": ns, "uid": "owner-uid", "generation": 1,
                             "resourceVersion": str(next(self._rv))},
                "spec": SPEC, "status": status}


def test_a_new_pddeployment_writes_status_once_for_its_pods_creation() -> None:
    kube = FakeKube()

    async def passes() -> None:
        rec = Reconciler(kube)  # type: ignore[arg-type]
        rec.observe_pdd({"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
                         "metadata": {"name": "demo", "namespace": "ns", "uid": "owner-uid",
                                      "generation": 1, "resourceVersion": "1"},
                         "spec": SPEC})
        first = await rec.run("ns", "demo")
        assert first is not None and sorted(c for c in first.created if c.startswith("Pod")) == [
            "Pod demo-decode-0", "Pod demo-decode-1", "Pod demo-prefill-0"]
        # The pods' watch events (or the PDDeployment's own, for the status write) bring the
        # next pass: the store holds what the first one created.
        second = await rec.run("ns", "demo")
        assert second is not None and second.created == []
        await asyncio.gather(*rec._background)

    asyncio.run(passes())
    assert len(kube.statuses) == 1, [s["conditions"][-1]["message"] for s in kube.statuses]
    status = kube.statuses[0]
    assert status["prefill"]["replicas"] == 1 and status["decode"]["replicas"] == 2
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and "demo-prefill-0 is Pending" in ready["message"]


def test_the_echo_of_our_own_status_write_starts_no_pass() -> None:
    """kopf shows the operator its own status write as a PDDeployment event: the pass that
    wrote it knew everything, so only a version the operator does not hold starts one."""
    import copy

    from pdd_operator import handlers

    kube = FakeKube()
    kicks: list[tuple[str, str]] = []

    async def scenario() -> None:
        rec = Reconciler(kube)  # type: ignore[arg-type]
        handlers.STATE.reconciler = rec
        rec.observe_pdd({"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
                         "metadata": {"name": "demo", "namespace": "ns", "uid": "owner-uid",
                                      "generation": 1, "resourceVersion": "1"},
                         "spec": SPEC})
        await rec.run("ns", "demo")
        await asyncio.gather(*rec._background)
        rec.kick = lambda ns, name, delay=None: kicks.append((ns, name))  # type: ignore[method-assign]
        echo = copy.deepcopy(rec.pdds[("ns", "demo")])
        await handlers.pddeployment_event(event={"type": "MODIFIED", "object": echo})
        assert kicks == []
        edited = copy.deepcopy(echo)
        edited["metadata"]["resourceVersion"] = "999"  # someone else's write
        await handlers.pddeployment_event(event={"type": "MODIFIED", "object": edited})
        assert kicks == [("ns", "demo")]
        other = copy.deepcopy(edited)
        other["metadata"]["uid"] = "new-incarnation"  # same name and version: another object
        await handlers.pddeployment_event(event={"type": "MODIFIED", "object": other})
        assert kicks == [("ns", "demo")] * 2

    try:
        asyncio.run(scenario())
    finally:
        handlers.STATE.reconciler = None
