"""Status conditions computed from observations: what `kubectl describe pdd` tells a user."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdd_api.validation import parse_spec
from pdd_operator.builders import Owner, build
from pdd_operator.conditions import (
    CONDITION_TYPES,
    RouterState,
    compute_status,
    router_state,
)
from pdd_operator.rollout import plan_role

ROOT = Path(__file__).resolve().parents[2]
OWNER = Owner("demo", "ns1", "uid-1")
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


@pytest.fixture
def doc() -> dict[str, Any]:
    path = ROOT / "manifests/examples/p-tp4-dcp4-to-d-tp4-dcp4.yaml"
    d = copy.deepcopy(next(x for x in yaml.safe_load_all(path.read_text()) if x))
    d["spec"]["decode"].update({"tensorParallelSize": 2, "decodeContextParallelSize": 2,
                                "replicas": 2})
    d["spec"]["decode"].pop("resources", None)
    return d


def pod_obs(pod: dict[str, Any], state: str) -> dict[str, Any]:
    out = copy.deepcopy(pod)
    out["metadata"]["uid"] = "u-" + out["metadata"]["name"]
    if state == "ready":
        out["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    elif state == "unschedulable":
        out["status"] = {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]}
    elif state == "starting":
        out["status"] = {"phase": "Pending"}
    elif state == "old":
        out["metadata"]["annotations"]["serving.pdd.dev/spec-hash"] = "old"
        out["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    return out


def status_for(doc: dict[str, Any], states: dict[str, list[str]], *, published: bool = True,
               router: RouterState | None = None, previous: dict[str, Any] | None = None,
               now: str = T0, generation: int = 1) -> dict[str, Any]:
    spec = parse_spec(doc["spec"])
    desired = build(OWNER, spec)
    roles = {}
    for role in ("prefill", "decode"):
        obs = [pod_obs(desired.pods[role][i], s) for i, s in enumerate(states[role]) if s]
        roles[role] = plan_role(desired.pods[role], obs, "uid-1", spec.rollout.maxUnavailable)
    return compute_status(
        generation=generation, problems=[], plan=desired.plan, routing_published=published,
        roles=roles, wanted={"prefill": spec.prefill.replicas, "decode": spec.decode.replicas},
        max_unavailable=spec.rollout.maxUnavailable,
        router=router or RouterState(enabled=True, replicas=1, ready=1),
        previous=previous, now=now,
    )


def conds(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_all_ready(doc: dict[str, Any]) -> None:
    st = status_for(doc, {"prefill": ["ready"], "decode": ["ready", "ready"]})
    c = conds(st)
    assert [x["type"] for x in st["conditions"]] == list(CONDITION_TYPES)
    assert all(x["status"] == "True" for x in st["conditions"])
    assert c["RoutingReady"]["message"] == "sharded-to-sharded: D0 <- P0,P2; D1 <- P1,P3"
    assert c["Ready"]["message"] == ("prefill 1/1 ready; decode 2/2 ready; router 1/1 ready; "
                                     "D0 <- P0,P2; D1 <- P1,P3")
    assert st["decode"] == {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}
    assert st["routingCase"] == "sharded-to-sharded"
    assert all(x["observedGeneration"] == 1 for x in st["conditions"])


def test_unschedulable_names_pod_and_scheduler_message(doc: dict[str, Any]) -> None:
    c = conds(status_for(doc, {"prefill": ["unschedulable"], "decode": ["ready", "ready"]}))
    assert c["PrefillAvailable"]["status"] == "False"
    assert c["PrefillAvailable"]["reason"] == "Unschedulable"
    assert c["PrefillAvailable"]["message"] == (
        "0/1 prefill pods ready; demo-prefill-0 is Pending (Unschedulable): 0/4 nodes are "
        "available: 4 Insufficient nvidia.com/gpu.")
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "PrefillUnavailable"
    assert "demo-prefill-0 is Pending" in c["Ready"]["message"]
    assert c["DecodeAvailable"]["status"] == "True"


def test_rolling_keeps_role_available(doc: dict[str, Any]) -> None:
    c = conds(status_for(doc, {"prefill": ["ready"], "decode": ["old", "ready"]}))
    assert c["DecodeAvailable"]["status"] == "True"
    assert c["DecodeAvailable"]["reason"] == "MinimumReplicasAvailable"
    assert "1 outdated, being replaced" in c["DecodeAvailable"]["message"]
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "Rolling"


def test_starting_and_router_and_plan_pending(doc: dict[str, Any]) -> None:
    c = conds(status_for(doc, {"prefill": [""], "decode": ["starting", "ready"]},
                         published=False))
    assert c["PrefillAvailable"]["reason"] == "PodsStarting"
    assert c["RoutingReady"]["status"] == "False"
    c = conds(status_for(doc, {"prefill": ["ready"], "decode": ["ready", "ready"]},
                         router=RouterState(enabled=True, replicas=2, ready=1)))
    assert c["Ready"]["reason"] == "RouterUnavailable"
    assert c["Ready"]["message"] == "router 1/2 ready"
    c = conds(status_for(doc, {"prefill": ["ready"], "decode": ["ready", "ready"]},
                         router=RouterState(enabled=False)))
    assert c["Ready"]["status"] == "True"


def test_last_transition_time_kept_while_status_unchanged(doc: dict[str, Any]) -> None:
    states = {"prefill": ["ready"], "decode": ["ready", "ready"]}
    first = status_for(doc, states, now=T0)
    again = status_for(doc, states, previous=first, now=T1)
    assert all(c["lastTransitionTime"] == T0 for c in again["conditions"])
    flipped = status_for(doc, {"prefill": ["unschedulable"], "decode": ["ready", "ready"]},
                         previous=first, now=T1)
    assert conds(flipped)["PrefillAvailable"]["lastTransitionTime"] == T1
    assert conds(flipped)["Validated"]["lastTransitionTime"] == T0


def test_invalid_spec_keeps_other_conditions(doc: dict[str, Any]) -> None:
    good = status_for(doc, {"prefill": ["ready"], "decode": ["ready", "ready"]})
    bad = compute_status(
        generation=2, problems=["spec.decode.decodeContextParallelSize: must be 1 or equal to "
                                "tensorParallelSize (2), got 3"],
        plan=None, routing_published=False, roles={}, wanted={}, max_unavailable=1,
        router=RouterState(enabled=False), previous=good, now=T1)
    c = conds(bad)
    assert bad["observedGeneration"] == 2
    assert c["Validated"] == {
        "type": "Validated", "status": "False", "reason": "InvalidSpec",
        "message": "spec.decode.decodeContextParallelSize: must be 1 or equal to "
                   "tensorParallelSize (2), got 3",
        "lastTransitionTime": T1, "observedGeneration": 2}
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "InvalidSpec"
    assert c["PrefillAvailable"] == conds(good)["PrefillAvailable"]
    assert bad["routingSummary"] == good["routingSummary"]


def test_router_state_from_deployment_status() -> None:
    want = {"spec": {"replicas": 2}}
    dep = {"metadata": {"generation": 3}, "status": {
        "observedGeneration": 3, "replicas": 2, "updatedReplicas": 2, "availableReplicas": 2}}
    assert router_state(True, want, dep) == RouterState(True, 2, 2, True)
    dep["status"]["observedGeneration"] = 2
    assert router_state(True, want, dep).updated is False
    assert router_state(True, want, None) == RouterState(True, 2, 0, False)
    assert router_state(False, None, dep).enabled is False


def test_peering_pause_follows_kopf_rules() -> None:
    import datetime

    from pdd_operator.peering import paused

    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    fresh = (now - datetime.timedelta(seconds=5)).isoformat()
    stale = (now - datetime.timedelta(seconds=120)).isoformat()
    me = {"priority": 10, "lifetime": 60, "lastseen": fresh}
    assert not paused({"me": me}, 10, now)
    assert not paused(None, 10, now)
    assert paused({"me": me, "b": {"priority": 20, "lifetime": 60, "lastseen": fresh}}, 10, now)
    assert not paused({"me": me, "b": {"priority": 20, "lifetime": 60, "lastseen": stale}}, 10,
                      now), "a dead leader does not pause the others"
    assert paused({"me": me, "c": {"priority": 10, "lifetime": 60, "lastseen": fresh}}, 10, now)
    assert not paused({"me": me, "d": {"priority": 5, "lifetime": 60, "lastseen": fresh}}, 10,
                      now)


def test_object_errors_and_conflicts_make_ready_false_and_stalled(doc: dict[str, Any]) -> None:
    from pdd_operator.conditions import ObjectError, with_errors

    base = status_for(doc, {"prefill": ["ready"], "decode": ["ready", "ready"]})
    assert conds(base)["Ready"]["status"] == "True" and "Stalled" not in conds(base)
    quota = ObjectError("Pod ns1/demo-decode-1", 403,
                        'pods "demo-decode-1" is forbidden: exceeded quota: gpus')
    st = conds(with_errors(base, errors=[quota], conflicts=[], generation=1, previous=base,
                           now=T1))
    assert st["Ready"]["status"] == "False" and st["Ready"]["reason"] == "ReconcileError"
    assert "exceeded quota: gpus" in st["Ready"]["message"]
    assert "Pod ns1/demo-decode-1" in st["Ready"]["message"]
    assert st["Stalled"]["status"] == "True" and st["Stalled"]["reason"] == "ReconcileError"
    transient = ObjectError("Pod ns1/demo-decode-1", 503, "etcdserver: leader changed")
    st = conds(with_errors(base, errors=[transient], conflicts=[], generation=1, previous=base,
                           now=T1))
    assert st["Ready"]["reason"] == "ReconcileError" and "Stalled" not in st
    st = conds(with_errors(base, errors=[transient], conflicts=["Service ns1/demo"],
                           generation=1, previous=base, now=T1))
    assert st["Ready"]["reason"] == "NameConflict" and st["Stalled"]["reason"] == "NameConflict"
    assert st["Ready"]["message"].startswith("Service ns1/demo exists and is not controlled")
    assert with_errors(base, errors=[], conflicts=[], generation=1, previous=base,
                       now=T1) is base
    # a role short of a pod the API refused names the refusal, not "being created"
    starting = status_for(doc, {"prefill": ["ready"], "decode": ["ready", ""]})
    assert conds(starting)["DecodeAvailable"]["status"] == "True", "1 of 2 is the floor"
    one = copy.deepcopy(doc)
    one["spec"]["decode"]["replicas"] = 1
    missing = status_for(one, {"prefill": ["ready"], "decode": [""]})
    assert conds(missing)["DecodeAvailable"]["reason"] == "PodsStarting"
    refs = {"prefill": {"Pod ns1/demo-prefill-0"}, "decode": {"Pod ns1/demo-decode-0"}}
    refused = ObjectError("Pod ns1/demo-decode-0", 403, "exceeded quota: gpus")
    st = conds(with_errors(missing, errors=[refused], conflicts=[], generation=1,
                           previous=missing, now=T1, role_refs=refs))
    assert st["DecodeAvailable"]["reason"] == "ReconcileError"
    assert st["DecodeAvailable"]["message"] == "Pod ns1/demo-decode-0: exceeded quota: gpus"
    assert st["PrefillAvailable"]["status"] == "True"


def test_invalid_spec_is_stalled(doc: dict[str, Any]) -> None:
    st = compute_status(generation=2, problems=["spec.x: bad"], plan=None,
                        routing_published=False, roles={}, wanted={}, max_unavailable=1,
                        router=RouterState(enabled=False), previous=None, now=T0)
    assert conds(st)["Stalled"]["status"] == "True"
    assert conds(st)["Stalled"]["reason"] == "InvalidSpec"
