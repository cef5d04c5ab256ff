"""Scale-down on the local control plane (issue 40 item 4; docs/operator.md, "Scaling down"):
the replica that goes is chosen (one that serves nothing first, else the least loaded, else the
highest index), marked on the pod, named in a Draining event and deleted; the indices may keep
a hole, which a scale-up fills, and a marked pod not yet deleted is taken back by a scale-up.
kwok's pods run no instance, so no load is reported here: the dataplane tier
(tests/dataplane/test_scale_down_drain.py) shows the instances finishing their work."""

from __future__ import annotations

import json
from typing import Any

import pytest
from operator_fixtures import (  # noqa: F401  (fixtures)
    Kubectl,
    Operator,
    env_of,
    events_of,
    kube,
    op_namespace,
    operator,
    pods_of,
    wait_for,
    wait_ready,
)
from test_operator_behaviour import delete_and_wait, make, patch_spec, uids

from pdd_api import keys

pytestmark = pytest.mark.integration


def names(pods: list[dict[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")]


def router_decode_urls(kube: Kubectl, ns: str, name: str) -> str:
    router = kube.json("get", "deployment", name, "-n", ns)
    return str(env_of(router["spec"]["template"])[keys.ENV_DECODE_URLS])


def wait_pods(kube: Kubectl, op: Operator, ns: str, name: str, role: str,
              want: list[int]) -> None:
    expected = [f"{name}-{role}-{i}" for i in want]
    try:
        wait_for(f"{role} pods {want}",
                 lambda: names(pods_of(kube, ns, name, role)) == expected, timeout=60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {names(pods_of(kube, ns, name, role))}\n"
                             f"operator log:\n{op.log()[-4000:]}") from None


def draining_events(kube: Kubectl, ns: str, name: str, reason: str = "Draining") -> list[str]:
    return [e["message"] for e in events_of(kube, ns, name) if e["reason"] == reason]


def test_scale_down_takes_the_replica_that_serves_nothing_and_leaves_a_hole(
        kube: Kubectl, operator: Operator, op_namespace: str) -> None:
    ns, name = op_namespace, "drain"
    kube.apply(make(name, decode={"replicas": 3, "tensorParallelSize": 1,
                                  "drainSeconds": 30}), "-n", ns)
    wait_ready(kube, ns, name, operator)
    before = uids(pods_of(kube, ns, name, "decode"))
    urls = router_decode_urls(kube, ns, name)
    kube("patch", "pod", f"{name}-decode-0", "-n", ns, "--subresource=status", "--type=merge",
         "-p", json.dumps({"status": {"conditions": [
             {"type": "Ready", "status": "False"},
             {"type": "ContainersReady", "status": "False"},
             {"type": "PodScheduled", "status": "True"}]}}))

    patch_spec(kube, ns, name, {"decode": {"replicas": 2}})
    wait_pods(kube, operator, ns, name, "decode", [1, 2])
    obj = wait_ready(kube, ns, name, operator)
    assert obj["status"]["decode"]["readyReplicas"] == 2
    kept = uids(pods_of(kube, ns, name, "decode"))
    assert all(kept[n] == before[n] for n in kept), "the serving replicas were kept"
    msgs = wait_for("a Draining event", lambda: draining_events(kube, ns, name), timeout=30)
    assert any(f"{name}-decode-0" in m and "not Ready" in m and "30s" in m for m in msgs), msgs
    assert router_decode_urls(kube, ns, name) == urls, "a hole does not roll the router"

    # The scale subresource (an HPA's door): the lowest free index comes back.
    kube("scale", f"pdd/{name}", "-n", ns, "--replicas=3")
    wait_pods(kube, operator, ns, name, "decode", [0, 1, 2])
    wait_ready(kube, ns, name, operator)
    now = uids(pods_of(kube, ns, name, "decode"))
    assert now[f"{name}-decode-0"] != before[f"{name}-decode-0"]
    assert now[f"{name}-decode-2"] == before[f"{name}-decode-2"]

    # A mark on a pod the replicas still need is taken back (a scale-up that came before
    # the deletion, or an operator restarted between the two).
    kube("annotate", "pod", f"{name}-decode-1", "-n", ns,
         f"{keys.ANNOTATION_DRAINING_SINCE}=2026-01-01T00:00:00Z")

    def unmarked() -> bool:
        pod = kube.json("get", "pod", f"{name}-decode-1", "-n", ns)
        return keys.ANNOTATION_DRAINING_SINCE not in (pod["metadata"].get("annotations") or {})

    wait_for("the mark taken back", unmarked, timeout=30)
    assert uids(pods_of(kube, ns, name, "decode")) == now
    assert wait_for("a DrainCancelled event",
                    lambda: draining_events(kube, ns, name, "DrainCancelled"), timeout=30)

    # No load reported and every replica serving: the highest index goes, as before.
    patch_spec(kube, ns, name, {"decode": {"replicas": 2}})
    wait_pods(kube, operator, ns, name, "decode", [0, 1])
    msgs = draining_events(kube, ns, name)
    assert any(f"{name}-decode-2" in m and "highest index" in m for m in msgs), msgs
    delete_and_wait(kube, ns, name)


def test_prefill_scale_down_drains_too(kube: Kubectl, operator: Operator,
                                       op_namespace: str) -> None:
    ns, name = op_namespace, "pdrain"
    kube.apply(make(name, prefill={"replicas": 2}), "-n", ns)
    wait_ready(kube, ns, name, operator)
    patch_spec(kube, ns, name, {"prefill": {"replicas": 1}})
    wait_pods(kube, operator, ns, name, "prefill", [0])
    msgs = wait_for("a Draining event", lambda: draining_events(kube, ns, name), timeout=30)
    assert any(f"{name}-prefill-1" in m and "prefill" in m and "120s" in m for m in msgs), msgs
    wait_ready(kube, ns, name, operator)
    delete_and_wait(kube, ns, name)
