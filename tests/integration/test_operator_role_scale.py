"""PDDRoleScale against a real API server and operator: the scale subresource an HPA or KEDA
uses (`kubectl scale` goes through the same /scale endpoint) drives prefill, its status follows
the role's pods, and a second object, an out-of-range value or an autoscaled role are each
refused with a message that says so. One owner per role's replicas: a write by anyone else
(`kubectl scale pdd`, an HPA) moves no pod and is reported, not fought over on every pass."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from operator_fixtures import (  # noqa: F401  (fixtures)
    Kubectl,
    Operator,
    conditions,
    events_of,
    kube,
    op_namespace,
    operator,
    pdd,
    pods_of,
    wait_for,
    wait_ready,
)

pytestmark = pytest.mark.integration
NAME = "rs"


def deployment(**autoscaling: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"}, "image": "pdd:0.1.0",
        "prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    if autoscaling:
        spec["autoscaling"] = autoscaling
    return {"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
            "metadata": {"name": NAME}, "spec": spec}


def role_scale(name: str, role: str, replicas: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"deployment": NAME, "role": role}
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDRoleScale",
            "metadata": {"name": name}, "spec": spec}


def get(k: Kubectl, ns: str, name: str) -> dict[str, Any]:
    return k.json("get", "pddrolescale", name, "-n", ns)  # type: ignore[no-any-return]


def not_applied(k: Kubectl, ns: str, name: str) -> str:
    """The status message of a PDDRoleScale the operator did not apply, once written."""
    status = wait_for(f"{name}'s status", lambda: (
        lambda st: st if st.get("message") else None)(get(k, ns, name).get("status") or {}))
    assert status["applied"] is False, status
    return str(status["message"])


def scale_of(k: Kubectl, ns: str, name: str) -> dict[str, Any]:
    raw = k("get", "--raw", f"/apis/serving.pdd.dev/v1alpha1/namespaces/{ns}/pddrolescales/"
            f"{name}/scale").stdout
    return json.loads(raw)  # type: ignore[no-any-return]


def test_a_role_scale_drives_prefill_through_its_scale_subresource(
        kube: Kubectl, operator: Operator, op_namespace: str) -> None:
    ns = op_namespace
    kube.apply(deployment(), "-n", ns)
    wait_ready(kube, ns, NAME, operator)
    # Left out of the manifest (as a GitOps repo leaves what an HPA owns): filled in.
    kube.apply(role_scale("rs-prefill", "prefill"), "-n", ns)
    obj = wait_for("spec.replicas filled in", lambda: (
        lambda o: o if (o.get("spec") or {}).get("replicas") == 1
        and (o.get("status") or {}).get("applied") else None)(get(kube, ns, "rs-prefill")))
    assert "filled in" in obj["status"]["message"] or "drives" in obj["status"]["message"]

    kube("scale", "pddrolescale", "rs-prefill", "-n", ns, "--replicas=3")
    wait_for("spec.prefill.replicas 3", lambda: pdd(kube, ns, NAME)["spec"]["prefill"][
        "replicas"] == 3)
    wait_ready(kube, ns, NAME, operator)
    assert [p["metadata"]["name"] for p in pods_of(kube, ns, NAME, "prefill")] == [
        f"{NAME}-prefill-{i}" for i in range(3)]
    assert len(pods_of(kube, ns, NAME, "decode")) == 1, "decode left alone"
    scale = wait_for("the scale subresource reads 3 pods and the role's selector", lambda: (
        lambda s: s if s["status"].get("replicas") == 3 and s["status"].get("selector")
        else None)(scale_of(kube, ns, "rs-prefill")))
    assert scale["spec"]["replicas"] == 3
    selected = kube.json("get", "pods", "-n", ns, "-l", scale["status"]["selector"])["items"]
    assert sorted(p["metadata"]["name"] for p in selected) == [
        f"{NAME}-prefill-{i}" for i in range(3)]
    status = wait_for("status ready 3", lambda: (
        lambda s: s if s.get("readyReplicas") == 3 and s.get("applied") else None)(
        get(kube, ns, "rs-prefill").get("status") or {}))
    assert status["message"] == f"drives spec.prefill.replicas of PDDeployment {NAME}: 3"

    # A second object for the same role is not applied, and says which one is.
    kube.apply(role_scale("rs-prefill-2", "prefill", 5), "-n", ns)
    second = not_applied(kube, ns, "rs-prefill-2")
    assert "PDDRoleScale rs-prefill drives prefill of PDDeployment rs already" in second, second
    assert pdd(kube, ns, NAME)["spec"]["prefill"]["replicas"] == 3

    # Out of range: the API server refuses it, naming the field; nothing moves.
    out = kube("scale", "pddrolescale", "rs-prefill", "-n", ns, "--replicas=0", check=False)
    assert out.returncode != 0 and "spec.replicas" in out.stderr, out.stderr
    # Immutable target.
    moved = kube("patch", "pddrolescale", "rs-prefill", "-n", ns, "--type=merge", "-p",
                 '{"spec":{"role":"decode"}}', check=False)
    assert moved.returncode != 0 and "immutable" in moved.stderr, moved.stderr

    # The first goes: the second takes over and applies its own replicas.
    kube("delete", "pddrolescale", "rs-prefill", "-n", ns)
    wait_for("the second one drives prefill: 5",
             lambda: pdd(kube, ns, NAME)["spec"]["prefill"]["replicas"] == 5)
    wait_for("5 prefill pods", lambda: len(pods_of(kube, ns, NAME, "prefill")) == 5)
    kube("delete", "pddrolescale", "rs-prefill-2", "-n", ns)
    kube("delete", "pddeployment", NAME, "-n", ns, "--timeout=50s")


def test_a_role_scale_of_an_autoscaled_role_says_the_planner_drives_it(
        kube: Kubectl, operator: Operator, op_namespace: str) -> None:
    ns = op_namespace
    kube.apply(deployment(prefill={"minReplicas": 1, "maxReplicas": 2,
                                   "queuedPromptTokensPerReplica": 4096}), "-n", ns)
    kube.apply(role_scale("auto-prefill", "prefill", 2), "-n", ns)
    msg = not_applied(kube, ns, "auto-prefill")
    assert "spec.autoscaling.prefill of PDDeployment rs is enabled" in msg, msg
    assert pdd(kube, ns, NAME)["spec"]["prefill"]["replicas"] == 1
    # One for a deployment that does not exist says so.
    kube.apply({**role_scale("orphan", "decode", 2), "spec": {
        "deployment": "nope", "role": "decode", "replicas": 2}}, "-n", ns)
    msg = not_applied(kube, ns, "orphan")
    assert msg == "PDDeployment nope not found in this namespace", msg
    kube("delete", "pddrolescale", "--all", "-n", ns)
    kube("delete", "pddeployment", NAME, "-n", ns, "--timeout=50s")



def counter(op: Operator, name: str, labels: str) -> float:
    m = re.search(rf"^{name}\{{{re.escape(labels)}\}} (\S+)$", op.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


def pod_changes(op: Operator) -> float:
    """Pods the operator created or deleted so far."""
    return sum(counter(op, "pdd_operator_actions_total", f'kind="Pod",action="{a}"')
               for a in ("create", "delete"))


def passes(op: Operator) -> float:
    return counter(op, "pdd_operator_reconciles_total", 'result="ok"')


def conflict_on(k: Kubectl, ns: str, kind: str, name: str) -> dict[str, Any] | None:
    obj = k.json("get", kind, name, "-n", ns)
    return conditions(obj).get("ReplicasConflict")


def uids(k: Kubectl, ns: str) -> set[str]:
    return {p["metadata"]["uid"] for p in pods_of(k, ns, NAME)}


def test_kubectl_scale_pdd_beside_a_role_scale_moves_no_pod_and_is_reported(
        kube: Kubectl, operator: Operator, op_namespace: str) -> None:
    ns = op_namespace
    kube.apply(deployment(), "-n", ns)
    kube.apply(role_scale("rs-decode", "decode", 2), "-n", ns)
    wait_for("the role scale applied 2", lambda: (get(kube, ns, "rs-decode").get(
        "status") or {}).get("appliedReplicas") == 2)
    assert pdd(kube, ns, NAME)["spec"]["decode"]["replicas"] == 2, "written once"
    wait_ready(kube, ns, NAME, operator)
    before, changes = uids(kube, ns), pod_changes(operator)

    # decode through the PDDeployment's own scale subresource, as an HPA on it would.
    kube("scale", "pddeployment", NAME, "-n", ns, "--replicas=3")
    cond = wait_for("ReplicasConflict on the PDDeployment",
                    lambda: conflict_on(kube, ns, "pddeployment", NAME))
    mine = wait_for("ReplicasConflict on the PDDRoleScale",
                    lambda: conflict_on(kube, ns, "pddrolescale", "rs-decode"))
    for c in (cond, mine):
        assert c["status"] == "True" and c["reason"] == "SpecReplicasWritten", c
        assert f"set spec.decode.replicas of PDDeployment {NAME} to 3" in c["message"], c
        assert "PDDRoleScale rs-decode drives decode (2 replicas)" in c["message"], c
        assert "a writer outside pdd" not in c["message"], c  # the writer is named
    # Several periodic passes (the fixture's operator resyncs every 5 s) of both loops.
    start = passes(operator)
    wait_for("6 more reconcile passes", lambda: passes(operator) >= start + 6, timeout=90)
    assert pod_changes(operator) - changes <= 1
    assert uids(kube, ns) == before, "no pod created or deleted"
    assert pdd(kube, ns, NAME)["spec"]["decode"]["replicas"] == 3, "not written back"
    assert get(kube, ns, "rs-decode")["spec"]["replicas"] == 2
    uid = pdd(kube, ns, NAME)["metadata"]["uid"]
    warned = [e for e in events_of(kube, ns, NAME) if e.get("reason") == "ReplicasConflict"
              and e["involvedObject"].get("uid") == uid]
    assert len(warned) == 1 and warned[0].get("count", 1) == 1, warned
    assert "PDDRoleScale rs-decode" in warned[0]["message"], warned

    # The owner's own change is written (once) and clears the conflict on both objects.
    kube("scale", "pddrolescale", "rs-decode", "-n", ns, "--replicas=3")
    wait_for("conflict cleared", lambda: conflict_on(kube, ns, "pddeployment", NAME) is None
             and conflict_on(kube, ns, "pddrolescale", "rs-decode") is None)
    wait_for("3 decode pods", lambda: len(pods_of(kube, ns, NAME, "decode")) == 3)
    kube("delete", "pddrolescale", "rs-decode", "-n", ns)
    kube("delete", "pddeployment", NAME, "-n", ns, "--timeout=50s")


def test_scaling_a_pdd_whose_decode_the_planner_drives_is_reported(
        kube: Kubectl, operator: Operator, op_namespace: str) -> None:
    ns = op_namespace
    doc = deployment(intervalSeconds=1, decode={"minReplicas": 1, "maxReplicas": 2,
                                                 "sequencesPerReplica": 8})
    kube.apply(doc, "-n", ns)
    wait_for("the planner decided decode", lambda: (
        (pdd(kube, ns, NAME).get("status") or {}).get("autoscaling") or {}).get("decode"))
    wait_ready(kube, ns, NAME, operator)
    before = uids(kube, ns)
    kube("scale", "pddeployment", NAME, "-n", ns, "--replicas=2")
    cond = wait_for("ReplicasConflict on the PDDeployment",
                    lambda: conflict_on(kube, ns, "pddeployment", NAME))
    assert cond["reason"] == "ScaleSubresourceIgnored", cond
    assert "(through the scale subresource) set spec.decode.replicas to 2" in cond[
        "message"], cond
    assert "the planner drives decode" in cond["message"], cond
    start = passes(operator)
    wait_for("4 more reconcile passes", lambda: passes(operator) >= start + 4, timeout=90)
    assert uids(kube, ns) == before, "the write had no effect on pods"
    kube("delete", "pddeployment", NAME, "-n", ns, "--timeout=50s")
