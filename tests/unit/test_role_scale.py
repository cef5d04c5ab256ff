"""role_scale.sync: which writes make a PDDeployment role follow its PDDRoleScale."""

from __future__ import annotations

from typing import Any

import yaml

from pdd_api.crd import role_scale_crd
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
        "observedGeneration": 4,
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
