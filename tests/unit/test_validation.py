"""Every rule rejects with its exact message; valid edges pass; all problems come at once."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from spec_cases import BASE, INVALID, VALID_EDGES, with_

from pdd_api.rules import RULES, default_of
from pdd_api.validation import (
    InvalidSpecError,
    parse_spec,
    validate_document,
    validate_name,
    validate_spec,
)


@pytest.mark.parametrize(("spec", "message"), [(s, m) for _, s, m in INVALID],
                         ids=[n for n, _, _ in INVALID])
def test_invalid_spec_rejected_with_exact_message(spec: dict[str, Any], message: str) -> None:
    assert validate_spec(spec) == [message]
    with pytest.raises(InvalidSpecError) as info:
        parse_spec(spec)
    assert info.value.problems == [message]


def test_at_least_thirty_invalid_cases() -> None:
    assert len(INVALID) >= 30


def test_all_problems_reported_at_once() -> None:
    spec = with_("prefill.decodeContextParallelSize", 2)
    spec["blockSize"] = 100
    spec["decode"] = {"tensorParallelSize": 3, "decodeContextParallelSize": 3, "foo": 1}
    problems = validate_spec(spec)
    assert sorted(problems) == sorted([
        "spec.decode.foo: unknown field",
        "spec.blockSize: must be a positive multiple of 16 and at most 1024, got 100",
        "spec.prefill.decodeContextParallelSize: must be 1 or equal to tensorParallelSize (4), "
        "got 2",
        "spec.decode.decodeContextParallelSize: must divide or be a multiple of "
        "spec.prefill.decodeContextParallelSize (2), got 3",
    ])


@pytest.mark.parametrize("spec", VALID_EDGES)
def test_valid_edges_accepted(spec: dict[str, Any]) -> None:
    assert validate_spec(spec) == []
    parse_spec(spec)


def test_defaults_match_the_design() -> None:
    spec = parse_spec(BASE)
    assert spec.blockSize == 64
    assert spec.kvTransfer.backend == "UCX" and spec.kvTransfer.sideChannelPort == 5600
    assert spec.decode.replicas == 1 and spec.router.enabled and spec.rollout.maxUnavailable == 1
    assert default_of("prefill.decodeContextParallelSize") == 1


def test_document_level_checks(valid_doc: dict[str, Any]) -> None:
    assert validate_document(valid_doc) == []
    doc = copy.deepcopy(valid_doc)
    doc["apiVersion"] = "serving.pdd.dev/v1"
    doc["kind"] = "Deployment"
    doc["metadata"]["name"] = "Bad_Name"
    assert validate_document(doc) == [
        "apiVersion: must be serving.pdd.dev/v1alpha1, got 'serving.pdd.dev/v1'",
        "kind: must be PDDeployment, got 'Deployment'",
        "metadata.name: must be a lowercase DNS label (a-z, 0-9, '-') of at most 47 "
        "characters, got 'Bad_Name'",
    ]
    del doc["spec"]
    assert "spec: required" in validate_document(doc)
    assert validate_document([1]) == ["<document>: must be an object, got [1]"]


def test_every_rule_has_a_cel_twin_with_the_same_message_prefix() -> None:
    for rule in RULES:
        cel = rule.cel()
        assert cel["messageExpression"].startswith(f"'spec.{rule.field}")
        assert cel["fieldPath"] == f".{rule.field}"


@pytest.mark.parametrize(("name", "role", "per_pod", "ok"), [
    ("a" * 41, "prefill", 2, True), ("a" * 42, "prefill", 2, False),
    ("a" * 42, "decode", 1, False), ("a" * 47, "prefill", 4, True),  # 4 = TP: one pod
    ("a" * 47, "prefill", None, True)])
def test_a_spec_whose_roles_span_pods_limits_the_name_to_41(name: str, role: str,
                                                            per_pod: int | None,
                                                            ok: bool) -> None:
    doc = {"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
           "metadata": {"name": name}, "spec": copy.deepcopy(BASE)}
    if per_pod is not None:
        doc["spec"][role]["gpusPerPod"] = per_pod
    want = [] if ok else [
        "metadata.name: must be at most 41 characters when a role spans pods (gpusPerPod "
        "below tensorParallelSize: LeaderWorkerSet pods carry it in 63-character labels), "
        f"got '{name}'"]
    assert validate_document(doc) == want
    assert validate_name(name, doc["spec"]) == want
    assert validate_name(name) == []
