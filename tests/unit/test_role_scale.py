"""role_scale.sync: which writes make a PDDeployment role follow its PDDRoleScale; and
replica_owner: one owner per role's replicas (planner > PDDRoleScale > spec), the writes of
anyone else reported once instead of written back on every pass."""

from __future__ import annotations

from typing import Any

import yaml

from pdd_api.crd import role_scale_crd
from pdd_api.validation import parse_spec
from pdd_operator.conditions import (
    ANOTHER_ROLE_SCALE,
    PLANNER_DRIVES_ROLE,
    REPLICAS_CONFLICT,
    SCALE_IGNORED,
    SPEC_REPLICAS_WRITTEN,
    with_replicas_conflict,
)
from pdd_operator.replica_owner import (
    PLANNER,
    ROLE_SCALE,
    SPEC,
    Writer,
    conflict,
    owner_of,
    ownership,
    replicas_writers,
)
from pdd_operator.role_scale import driver, refused, status_changed, sync


def deployment(prefill: int = 1, autoscaled: bool = False, **status: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"}, "image": "pdd:0.1.0",
        "prefill": {"replicas": prefill}, "decode": {"replicas": 1}}
    if autoscaled:
        spec["autoscaling"] = {"prefill": {"minReplicas": 1, "maxReplicas": 4,
                                           "queuedPromptTokensPerReplica": 4096}}
    return {"metadata": {"name": "ds", "namespace": "ns"}, "spec": spec,
            "status": {"prefill": {"replicas": 2, "readyReplicas": 1,
                                   "selector": "app=ds,role=prefill"}, **status}}


def scale(name: str = "ds-prefill", replicas: int | None = 3, role: str = "prefill",
          created: str = "2026-12-04T10:00:00Z", target: str = "ds") -> dict[str, Any]:
    spec: dict[str, Any] = {"deployment": target, "role": role}
    if replicas is not None:
        spec["replicas"] = replicas
    return {"metadata": {"name": name, "namespace": "ns", "generation": 4,
                         "creationTimestamp": created}, "spec": spec}


def test_replicas_that_differ_patch_only_the_role() -> None:
    s = scale()
    out = sync(s, deployment(prefill=1), [s])
    assert out.deployment_patch == {"spec": {"prefill": {"replicas": 3}}}
    assert out.fill_replicas is None
    assert out.status == {
        "replicas": 2, "readyReplicas": 1, "selector": "app=ds,role=prefill", "applied": True,
        "appliedReplicas": 3, "observedGeneration": 4, "conditions": [],
        "message": "spec.prefill.replicas of PDDeployment ds set to 3 (was 1)"}


def test_equal_replicas_write_nothing_but_status() -> None:
    s = scale(replicas=2)
    out = sync(s, deployment(prefill=2), [s])
    assert out.deployment_patch is None and out.fill_replicas is None
    assert out.status["message"] == "drives spec.prefill.replicas of PDDeployment ds: 2"
    assert status_changed(s, out.status)
    assert not status_changed({**s, "status": out.status}, out.status)


def test_left_out_replicas_are_filled_in_from_the_deployment() -> None:
    s = scale(replicas=None)
    out = sync(s, deployment(prefill=2), [s])
    assert out.fill_replicas == 2 and out.deployment_patch is None
    assert out.status["applied"] is True


def test_the_oldest_of_two_drives_the_role_and_the_other_says_so() -> None:
    old, new = scale("a-old", 2, created="2026-12-04T09:00:00Z"), scale("b-new", 5)
    assert driver([new, old], "ds", "prefill") is old
    out = sync(new, deployment(), [new, old])
    assert out.deployment_patch is None and out.fill_replicas is None
    assert out.status["applied"] is False
    assert out.status["message"] == (
        "PDDRoleScale a-old drives prefill of PDDeployment ds already: this one is not applied")
    # A decode one, or one of another deployment, is no rival; a deleting one steps aside.
    assert driver([new, scale("dec", role="decode", created="2000-01-01T00:00:00Z")],
                  "ds", "prefill") is new
    assert driver([new, scale("other", target="x", created="2000-01-01T00:00:00Z")],
                  "ds", "prefill") is new
    going = scale("a-old", 2, created="2026-12-04T09:00:00Z")
    going["metadata"]["deletionTimestamp"] = "2026-12-04T11:00:00Z"
    assert driver([new, going], "ds", "prefill") is new
    # Same creation second: the name decides.
    same_a, same_b = scale("a"), scale("b")
    assert driver([same_b, same_a], "ds", "prefill") is same_a


def test_an_autoscaled_role_is_not_applied() -> None:
    s = scale()
    out = sync(s, deployment(autoscaled=True), [s])
    assert out.deployment_patch is None and out.fill_replicas is None
    assert out.status["applied"] is False
    assert "spec.autoscaling.prefill of PDDeployment ds is enabled" in out.status["message"]


def test_a_missing_or_invalid_deployment_is_said_and_nothing_written() -> None:
    s = scale()
    out = sync(s, None, [s])
    assert (out.deployment_patch, out.fill_replicas) == (None, None)
    assert out.status["message"] == "PDDeployment ds not found in this namespace"
    assert out.status["replicas"] == 0 and out.status["selector"] is None
    bad = deployment()
    bad["spec"]["decode"]["replicas"] = 0
    out = sync(s, bad, [s])
    assert out.deployment_patch is None
    assert "not valid" in out.status["message"]


def test_a_refused_patch_names_the_value_and_the_reason() -> None:
    s = scale(replicas=40)
    out = sync(s, deployment(), [s])
    st = refused(out, "ds", "prefill", 40, "spec.prefill: 40 pods need 40 GPUs")
    assert st["applied"] is False
    assert st["message"] == ("PDDeployment ds refused spec.prefill.replicas 40: "
                             "spec.prefill: 40 pods need 40 GPUs")


def test_the_crd_exposes_the_scale_subresource_an_hpa_uses() -> None:
    crd = yaml.safe_load(yaml.safe_dump(role_scale_crd()))
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["deployment", "role"]
    assert spec["properties"]["role"]["enum"] == ["prefill", "decode"]
    assert spec["properties"]["replicas"]["minimum"] == 1
    assert "oldSelf" in spec["x-kubernetes-validations"][0]["rule"]


def test_pdd_validate_checks_a_role_scale_as_its_crd_does() -> None:
    from pdd_api.validation import validate_document

    doc = {"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDRoleScale",
           "metadata": {"name": "ds-prefill"}, "spec": {"deployment": "ds", "role": "prefill"}}
    assert validate_document(doc) == []
    assert validate_document({**doc, "spec": {**doc["spec"], "replicas": 4}}) == []
    bad = {**doc, "spec": {"deployment": "Ds_1", "role": "both", "replicas": 0, "x": 1}}
    assert validate_document(bad) == [
        "spec.role: must be one of 'prefill' or 'decode', got 'both'",
        "spec.x: unknown field",
        "spec.deployment: must be a PDDeployment's name (a lowercase DNS label of at most 47 "
        "characters), got 'Ds_1'",
        "spec.replicas: must be between 1 and 64, got 0"]
    assert validate_document({**doc, "spec": {"role": "decode"}}) == ["spec.deployment: required"]
    assert validate_document({k: v for k, v in doc.items() if k != "spec"}) == ["spec: required"]
    # The CRD says the same bounds.
    spec = role_scale_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"]["properties"]
    assert (spec["replicas"]["minimum"], spec["replicas"]["maximum"]) == (1, 64)
    assert spec["deployment"]["maxLength"] == 47


# ---------------------------------------------------------------- one owner per role

NOW = "2026-12-06T05:00:00Z"


def applied(obj: dict[str, Any], replicas: int) -> dict[str, Any]:
    """A PDDRoleScale whose value the operator has written into the PDDeployment."""
    return {**obj, "status": {"appliedReplicas": replicas}}


def test_the_owner_is_the_planner_then_a_role_scale_then_the_spec() -> None:
    plain, auto = parse_spec(deployment()["spec"]), parse_spec(
        deployment(autoscaled=True)["spec"])
    s = scale()
    assert owner_of(plain, "prefill", None) == SPEC
    assert owner_of(plain, "prefill", s) == ROLE_SCALE
    assert owner_of(auto, "prefill", s) == PLANNER
    assert owner_of(auto, "prefill", None) == PLANNER
    assert owner_of(auto, "decode", None) == SPEC  # only prefill is autoscaled


def test_the_builders_get_the_owners_replicas() -> None:
    plain = parse_spec(deployment(prefill=1)["spec"])
    assert ownership(plain, "prefill", None, None).replicas == 1
    # A role scale's applied value, whatever the spec says (an outside write is not followed).
    assert ownership(plain, "prefill", None, applied(scale(replicas=3), 3)).replicas == 3
    # One the PDDeployment has not accepted yet (or refused) is not built; nor a left-out one.
    assert ownership(plain, "prefill", None, scale(replicas=3)).replicas == 1
    assert ownership(plain, "prefill", None, applied(scale(replicas=40), 3)).replicas == 3
    assert ownership(plain, "prefill", None, scale(replicas=None)).replicas == 1
    auto = parse_spec(deployment(autoscaled=True)["spec"])
    decided = {"autoscaling": {"prefill": {"desiredReplicas": 4}}}
    owned = ownership(auto, "prefill", decided, scale(replicas=2))
    assert (owned.owner, owned.replicas, owned.scale) == (PLANNER, 4, "ds-prefill")


def test_managed_fields_name_the_last_writer_of_each_roles_replicas() -> None:
    body = {"metadata": {"managedFields": [
        {"manager": "kubectl-client-side-apply", "operation": "Update",
         "fieldsV1": {"f:spec": {"f:prefill": {"f:replicas": {}}, "f:image": {}}}},
        {"manager": "kube-controller-manager", "operation": "Update", "subresource": "scale",
         "fieldsV1": {"f:spec": {"f:decode": {"f:replicas": {}}}}},
        {"manager": "pdd-operator", "operation": "Update", "subresource": "status",
         "fieldsV1": {"f:status": {"f:decode": {"f:replicas": {}}}}}]}}
    writers = replicas_writers(body)
    assert writers == {"prefill": Writer("kubectl-client-side-apply"),
                       "decode": Writer("kube-controller-manager", "scale")}
    assert str(writers["decode"]) == (
        "kube-controller-manager (through the scale subresource)")
    assert replicas_writers({"metadata": {}}) == {}


def test_an_outside_write_while_a_role_scale_drives_is_a_conflict_naming_both() -> None:
    s = applied(scale(replicas=3), 3)
    spec = parse_spec(deployment(prefill=5)["spec"])  # someone set 5 after we wrote 3
    owned = ownership(spec, "prefill", None, s)
    assert owned.replicas == 3
    found = conflict(owned, Writer("kubectl"), "ds")
    assert found is not None
    assert found[0] == SPEC_REPLICAS_WRITTEN
    assert found[1].startswith("kubectl set spec.prefill.replicas of PDDeployment ds to 5, "
                               "but PDDRoleScale ds-prefill drives prefill (3 replicas)")
    # Not yet applied (a new or rescaled PDDRoleScale): its own write is due, no conflict.
    for fresh in (scale(replicas=3), applied(scale(replicas=3), 2)):
        assert conflict(ownership(spec, "prefill", None, fresh), Writer("kubectl"), "ds") is None
    # Equal: nothing to say.
    same = ownership(parse_spec(deployment(prefill=3)["spec"]), "prefill", None, s)
    assert conflict(same, Writer("kubectl"), "ds") is None
    # The spec owning the role: any writer is fine.
    free = ownership(spec, "prefill", None, None)
    assert conflict(free, Writer("kubectl", "scale"), "ds") is None


def test_writes_the_planner_overrides_are_reported() -> None:
    auto = parse_spec(deployment(autoscaled=True)["spec"])
    owned = ownership(auto, "prefill", None, scale())
    found = conflict(owned, None, "ds")
    assert found is not None and found[0] == PLANNER_DRIVES_ROLE
    assert found[1].startswith("PDDRoleScale ds-prefill sets prefill replicas, but the planner "
                               "drives prefill")
    # An HPA (or KEDA, or kubectl scale) on the PDDeployment's own scale subresource.
    alone = ownership(auto, "prefill", None, None)
    hpa = conflict(alone, Writer("kube-controller-manager", "scale"), "ds")
    assert hpa is not None and hpa[0] == SCALE_IGNORED
    assert hpa[1].startswith("kube-controller-manager (through the scale subresource) set "
                             "spec.prefill.replicas to 1, but the planner drives prefill")
    # The manifest's own value is the planner's seed, not a conflict.
    assert conflict(alone, Writer("argocd-controller"), "ds") is None


def test_sync_writes_once_then_reports_an_outside_write_instead_of_writing_back() -> None:
    s = scale(replicas=3)
    first = sync(s, deployment(prefill=1), [s], Writer("kubectl"), NOW)
    assert first.deployment_patch == {"spec": {"prefill": {"replicas": 3}}}
    assert first.status["appliedReplicas"] == 3 and first.status["conditions"] == []
    # Someone sets spec.prefill.replicas to 5 afterwards: no patch, a condition naming them.
    s = {**s, "status": first.status}
    out = sync(s, deployment(prefill=5), [s], Writer("kubectl"), NOW)
    assert out.deployment_patch is None
    assert out.status["applied"] is True and out.status["appliedReplicas"] == 3
    [cond] = out.status["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == (
        REPLICAS_CONFLICT, "True", SPEC_REPLICAS_WRITTEN)
    assert "kubectl set spec.prefill.replicas of PDDeployment ds to 5" in cond["message"]
    assert out.status["message"] == cond["message"]
    # The same pass again changes nothing (no loop, no status rewrite).
    again = sync({**s, "status": out.status}, deployment(prefill=5), [s], Writer("kubectl"),
                 "2026-12-06T06:00:00Z")
    assert again.deployment_patch is None and again.status == out.status
    # The PDDRoleScale's own value changes (its HPA scaled it): written, conflict gone.
    rescaled = {**scale(replicas=4), "status": out.status}
    out = sync(rescaled, deployment(prefill=5), [rescaled], Writer("kubectl"), NOW)
    assert out.deployment_patch == {"spec": {"prefill": {"replicas": 4}}}
    assert out.status["appliedReplicas"] == 4 and out.status["conditions"] == []


def test_a_role_scale_the_planner_or_an_older_one_overrides_carries_the_condition() -> None:
    s = scale()
    out = sync(s, deployment(autoscaled=True), [s], None, NOW)
    [cond] = out.status["conditions"]
    assert cond["reason"] == PLANNER_DRIVES_ROLE and out.deployment_patch is None
    old, new = scale("a-old", 2, created="2026-12-04T09:00:00Z"), scale("b-new", 5)
    [cond] = sync(new, deployment(), [new, old], None, NOW).status["conditions"]
    assert cond["reason"] == ANOTHER_ROLE_SCALE and "a-old" in cond["message"]


def test_the_deployment_condition_joins_the_roles_and_keeps_its_transition_time() -> None:
    base = {"conditions": [{"type": "Ready", "status": "True"}]}
    assert with_replicas_conflict(base, [], 3, None, NOW) is base
    found = [(SPEC_REPLICAS_WRITTEN, "prefill: a"), (SCALE_IGNORED, "decode: b")]
    out = with_replicas_conflict(base, found, 3, None, NOW)
    cond = out["conditions"][-1]
    assert (cond["type"], cond["reason"], cond["message"]) == (
        REPLICAS_CONFLICT, SPEC_REPLICAS_WRITTEN, "prefill: a; decode: b")
    later = with_replicas_conflict(base, found, 3, out, "2026-12-06T07:00:00Z")
    assert later["conditions"][-1]["lastTransitionTime"] == NOW


def test_a_conflict_two_passes_read_before_its_patch_is_posted_once() -> None:
    """Passes that read the status from before the first one's patch post one event."""
    import asyncio

    from pdd_operator.conditions import REPLICAS_CONFLICT
    from pdd_operator.reconciler import Reconciler

    posted: list[tuple[str, str]] = []

    class Kube:
        async def post_event(self, body: Any, kind: str, reason: str, message: str) -> None:
            posted.append((reason, message))

    def conflict(message: str) -> dict[str, Any]:
        return {"conditions": [{"type": REPLICAS_CONFLICT, "status": "True",
                                "reason": "SpecReplicasWritten", "message": message}]}

    async def passes() -> None:
        rec = Reconciler(Kube())  # type: ignore[arg-type]
        body = {"metadata": {"uid": "u1", "namespace": "ns", "name": "ds"}}
        for new in (conflict("kubectl set 3"), conflict("kubectl set 3"), {},
                    conflict("kubectl set 3"), conflict("kubectl set 4")):
            rec._transition_events(body, {}, new)
            await asyncio.sleep(0)
        await asyncio.gather(*rec._background)

    asyncio.run(passes())
    assert posted == [(REPLICAS_CONFLICT, "kubectl set 3"), (REPLICAS_CONFLICT, "kubectl set 3"),
                      (REPLICAS_CONFLICT, "kubectl set 4")]
