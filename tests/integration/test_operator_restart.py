"""Crash-safety: the operator killed in the middle of a reconcile converges after a restart with
no duplicate or needlessly replaced objects, and a write that loses a race (the object was
replaced between the operator's read and its write) is retried from a fresh read."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from localcluster import Cluster
from operator_fixtures import (  # noqa: F401  (fixtures)
    Kubectl,
    Operator,
    kube,
    make_namespace,
    pdd,
    pods_of,
    routing_cm_name,
    teardown_namespace,
    wait_for,
    wait_ready,
)

from pdd_api import keys
from pdd_operator.conditions import ObjectError
from pdd_operator.kube import Kube
from pdd_operator.reconciler import PassErrors, Reconciler

pytestmark = pytest.mark.integration
HASH = keys.ANNOTATION_SPEC_HASH

SPEC: dict[str, Any] = {
    "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"},
    "image": "pdd:0.1.0",
    "prefill": {"replicas": 2, "tensorParallelSize": 1, "decodeContextParallelSize": 1},
    "decode": {"replicas": 2, "tensorParallelSize": 1, "decodeContextParallelSize": 1},
}


def doc(name: str, **over: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec.update(over)
    return {"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
            "metadata": {"name": name}, "spec": spec}


@pytest.fixture
def namespace(kube: Kubectl) -> Iterator[str]:
    ns = make_namespace(kube, "oprs")
    yield ns
    teardown_namespace(kube, ns, None)


def owned(k: Kubectl, ns: str, name: str) -> list[str]:
    sel = f"app.kubernetes.io/instance={name},app.kubernetes.io/managed-by=pdd-operator"
    items = k.json("get", "pods,services,configmaps,deployments", "-n", ns, "-l", sel)["items"]
    return sorted(f"{o['kind']}/{o['metadata']['name']}" for o in items)


def test_restart_mid_reconcile_converges_without_duplicates(
        cluster: Cluster, kube: Kubectl, namespace: str, tmp_path: Path) -> None:
    ns, name = namespace, "crash"
    op = Operator(cluster, ns, tmp_path, webhook=False)
    # Dies (os._exit) after 4 successful writes: some objects exist (how many depends on
    # which of the concurrent writes the API server finished), no status was written.
    op.start(extra_env={"PDD_FAULT_EXIT_AFTER_WRITES": "4"})
    try:
        kube.apply(doc(name), "-n", ns)
        wait_for("the operator to die mid-reconcile", lambda: not op.alive(), timeout=60)
        assert op.proc is not None and op.proc.returncode == 17, op.log()
        partial = owned(kube, ns, name)
        assert partial, "the operator wrote something before dying"
        assert "status" not in pdd(kube, ns, name), "it died before finishing the pass"
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods_of(kube, ns, name)}

        op.start()
        obj = wait_ready(kube, ns, name, op)
        assert owned(kube, ns, name) == sorted([
            f"ConfigMap/{routing_cm_name(pdd(kube, ns, name)['spec'], name)}",
            "Deployment/crash", "Pod/crash-decode-0",
            "Pod/crash-decode-1", "Pod/crash-prefill-0", "Pod/crash-prefill-1",
            "Service/crash", "Service/crash-decode", "Service/crash-prefill"])
        after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods_of(kube, ns, name)}
        for pod, uid in before.items():
            assert after[pod] == uid, f"{pod} was replaced after the restart"
        assert obj["status"]["prefill"]["readyReplicas"] == 2

        # A second crash at an arbitrary point of a roll, then a restart: still converges.
        op.stop(kill=True)
        op.start(extra_env={"PDD_FAULT_EXIT_AFTER_WRITES": "2"})
        kube("patch", "pddeployment", name, "-n", ns, "--type=merge",
             "-p", '{"spec":{"image":"pdd:0.1.1"}}')
        wait_for("the operator to die mid-roll", lambda: not op.alive(), timeout=60)
        op.start()
        wait_ready(kube, ns, name, op, timeout=120)
        images = {p["spec"]["containers"][0]["image"] for p in pods_of(kube, ns, name)}
        assert images == {"pdd:0.1.1"}
        assert len(pods_of(kube, ns, name)) == 4
    finally:
        teardown_namespace(kube, ns, op)


class RacingKube(Kube):
    """Deletes and recreates a pod (new uid) right before the operator's own delete of it: the
    object changed between the operator's read and its write."""

    def __init__(self, inner: Kube, victim: str) -> None:
        super().__init__(inner.host, inner._ssl, inner._auth)
        self.victim = victim
        self.raced = False

    async def delete(self, kind: str, namespace: str | None, name: str, *,
                     uid: str | None = None, grace_seconds: int | None = None) -> Any:
        if kind == "Pod" and name == self.victim and not self.raced:
            self.raced = True
            current = await self.get("Pod", namespace, name)
            assert current is not None
            await super().delete("Pod", namespace, name, grace_seconds=0)
            await wait_gone(self, namespace or "", name)
            clone = {k: current[k] for k in ("apiVersion", "kind", "spec")}
            clone["metadata"] = {k: current["metadata"][k] for k in (
                "name", "namespace", "labels", "annotations", "ownerReferences")}
            clone["spec"].pop("nodeName", None)
            await self.create(clone)
        return await super().delete(kind, namespace, name, uid=uid, grace_seconds=grace_seconds)


async def wait_gone(k: Kube, ns: str, name: str) -> None:
    for _ in range(200):
        if await k.get("Pod", ns, name) is None:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{ns}/{name} never went away")


def test_conflict_between_read_and_write_is_retried(cluster: Cluster, kube: Kubectl,
                                                    namespace: str) -> None:
    ns, name = namespace, "race"
    one = {"replicas": 1, "tensorParallelSize": 1, "decodeContextParallelSize": 1}
    kube.apply(doc(name, prefill=one, decode=one), "-n", ns)

    async def scenario() -> tuple[ObjectError | None, str]:
        base = Kube.from_environment(kubeconfig=str(cluster.kubeconfig))
        rec = Reconciler(base)
        try:
            rec.observe_pdd(pdd(kube, ns, name))
            await rec.run(ns, name)
            # Change the image: both pods are to be replaced; the racer recreates one of
            # them under the operator's feet with a new uid.
            kube("patch", "pddeployment", name, "-n", ns, "--type=merge",
                 "-p", '{"spec":{"image":"pdd:0.2.0"}}')
            await rec.resync(ns, name)
            racer = RacingKube(base, f"{name}-prefill-0")
            rec.kube = racer
            rec.observe_pdd(pdd(kube, ns, name))
            error: ObjectError | None = None
            try:
                await rec.run(ns, name)
            except PassErrors as exc:  # the pass went on, wrote status, then failed
                error = exc.errors[0]
            assert racer.raced
            # Level-based retries from fresh reads until the pods carry the new spec.
            rec.kube = base
            for _ in range(60):
                await rec.resync(ns, name)
                await rec.run(ns, name)
                live = [p for p in rec.store.of_instance("Pod", ns, name)
                        if p["metadata"].get("deletionTimestamp") is None]
                images = {p["spec"]["containers"][0]["image"] for p in live}
                if images == {"pdd:0.2.0"} and len(live) == 2:
                    break
                await asyncio.sleep(0.5)
            return error, ",".join(sorted(images))
        finally:
            await base.close()

    error, images = asyncio.run(scenario())
    assert error is not None and error.status == 409, error
    assert error.ref == f"Pod {ns}/{name}-prefill-0", error
    assert "precondition" in error.message.lower() or "uid" in error.message.lower(), error
    assert images == "pdd:0.2.0"
    names = sorted(p["metadata"]["name"] for p in pods_of(kube, ns, name))
    assert names == [f"{name}-decode-0", f"{name}-prefill-0"]
