"""`pdd validate` reads a spec the way the API server does (each case is what a v1.33 API server
answered to a server-side dry run of the same spec): explicit nulls are dropped and defaults
apply, integral floats are integers unless a CEL rule reads them, integers stop at 64 bits, and
the PodSpec overlay's declared bounds hold. tests/integration/test_three_validators.py checks
the same over thousands of generated specs against a real API server."""

from __future__ import annotations

from typing import Any

import pytest
from spec_cases import with_

from pdd_api.structural import json_integer
from pdd_api.validation import parse_spec, validate_spec

SEC = "prefill.tolerations"
TPL = "prefill.template"


def tolerate(seconds: Any) -> dict[str, Any]:
    return with_(SEC, [{"key": "k", "operator": "Exists", "tolerationSeconds": seconds}])


ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("null without default", with_("model.source", None)),
    ("null object with default", with_("kvTransfer", None)),
    ("null enum with default", with_("model.dtype", None)),
    ("null bool with default", with_("router.enabled", None)),
    ("null optional object", with_("prefill.resources", None)),
    ("null map value", with_("prefill.nodeSelector", {"pool": None})),
    ("null quantity", with_("prefill.resources", {"limits": {"nvidia.com/gpu": None}})),
    ("null toleration field", with_(SEC, [{"operator": None}])),
    ("null owned pod field", with_(TPL, {"spec": {"hostname": None}})),
    ("null main-container image", with_(TPL, {"spec": {"containers": [
        {"name": "sidecar", "image": None}]}})),
    ("null in free-form overlay", with_(TPL, {"spec": {"volumes": None}})),
    ("null in affinity", with_("prefill.affinity", {"nodeAffinity": None})),
    ("64 labels and a null", with_(TPL, {"metadata": {"labels": {
        **{f"k{i}": "v" for i in range(64)}, "x": None}}})),
    ("integral float seconds", tolerate(1000.0)),
    ("near-integral float seconds", tolerate(2.000000001)),
    ("negative integral float", tolerate(-3.0)),
    ("negative zero", tolerate(-0.0)),
    ("largest float integer", tolerate(9007199254740991.0)),
    ("int64 min", tolerate(-(2**63))),
    ("int64 max", tolerate(2**63 - 1)),
    ("integral float quantity", with_("prefill.resources", {"requests": {"cpu": 2.0}})),
    ("16 containers", with_(TPL, {"spec": {"containers": [{"name": f"c{i}"}
                                                          for i in range(16)]}})),
]

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("null TP takes the default", with_("prefill.tensorParallelSize", None),
     "spec.prefill.decodeContextParallelSize: must be 1 or equal to tensorParallelSize (1), "
     "got 4"),
    ("null required", with_("model.name", None), "spec.model.name: required"),
    ("null role", with_("decode", None), "spec.decode: required"),
    ("null list item", with_(SEC, [None]), "spec.prefill.tolerations[0]: must be an object, "
     "got None"),
    ("null string item", with_("prefill.extraArgs", [None]),
     "spec.prefill.extraArgs[0]: must be a string, got None"),
    ("null unknown field", with_("prefill.foo", None), "spec.prefill.foo: unknown field"),
    ("float a rule reads", with_("prefill.tensorParallelSize", 4.0),
     "spec.prefill.tensorParallelSize: must be an integer, got 4.0"),
    ("float block size", with_("blockSize", 64.0), "spec.blockSize: must be an integer, got 64.0"),
    ("fractional float", tolerate(2.5),
     "spec.prefill.tolerations[0].tolerationSeconds: must be an integer, got 2.5"),
    ("not near enough", tolerate(2.00000001),
     "spec.prefill.tolerations[0].tolerationSeconds: must be an integer, got 2.00000001"),
    ("negative fraction", tolerate(-3.0000000001),
     "spec.prefill.tolerations[0].tolerationSeconds: must be an integer, got -3.0000000001"),
    ("float beyond 2^53", tolerate(float(2**53)),
     "spec.prefill.tolerations[0].tolerationSeconds: must be an integer, got "
     "9007199254740992.0"),
    ("beyond int64", tolerate(2**63),
     "spec.prefill.tolerations[0].tolerationSeconds: must be an integer between "
     f"{-(2**63)} and {2**63 - 1}, got {2**63}"),
    ("17 containers", with_(TPL, {"spec": {"containers": [{"name": f"c{i}"}
                                                          for i in range(17)]}}),
     "spec.prefill.template.spec.containers: must have at most 16 items, got 17"),
    ("container without name", with_(TPL, {"spec": {"containers": [{"name": None}]}}),
     "spec.prefill.template.spec.containers[0].name: required"),
    ("long container name", with_(TPL, {"spec": {"containers": [{"name": "c" * 64}]}}),
     f"spec.prefill.template.spec.containers[0].name: must be at most 63 characters, "
     f"got {'c' * 64!r}"),
    ("command item type", with_(TPL, {"spec": {"containers": [{"name": "c", "command": [1]}]}}),
     "spec.prefill.template.spec.containers[0].command[0]: must be a string, got 1"),
    ("null port", with_(TPL, {"spec": {"containers": [{"name": "c", "ports": [None]}]}}),
     "spec.prefill.template.spec.containers[0].ports[0]: must be an object, got None"),
    ("owned pod field type", with_(TPL, {"spec": {"hostname": 1}}),
     "spec.prefill.template.spec.hostname: must be a string, got 1"),
    ("65 labels", with_(TPL, {"metadata": {"labels": {f"k{i}": "v" for i in range(65)}}}),
     "spec.prefill.template.metadata.labels: must have at most 64 entries, got 65"),
]


@pytest.mark.parametrize("spec", [s for _, s in ACCEPTED], ids=[n for n, _ in ACCEPTED])
def test_accepted_like_the_api_server(spec: dict[str, Any]) -> None:
    assert validate_spec(spec) == []
    parse_spec(spec)


@pytest.mark.parametrize(("spec", "message"), [(s, m) for _, s, m in REFUSED],
                         ids=[n for n, _, _ in REFUSED])
def test_refused_like_the_api_server(spec: dict[str, Any], message: str) -> None:
    assert message in validate_spec(spec)


def test_null_means_absent_to_the_parsed_spec() -> None:
    spec = with_("decode.tensorParallelSize", None)
    spec["decode"]["decodeContextParallelSize"] = 1
    spec["prefill"]["nodeSelector"] = {"pool": None, "zone": "a"}
    parsed = parse_spec(spec)
    assert parsed.decode.tensorParallelSize == 1
    assert parsed.prefill.nodeSelector == {"zone": "a"}
    assert parse_spec(tolerate(1000.0)).prefill.tolerations[0].tolerationSeconds == 1000  # type: ignore[index]


@pytest.mark.parametrize(("value", "integer"), [
    (1.0, True), (-0.0, True), (2.000000001, True), (1000.0000001, True), (1e15 + 0.5, True),
    (2.00000001, False), (0.5, False), (1e-300, False), (-3.0000000001, False),
    (float(2**53), False), (-float(2**53), False), (float("inf"), False), (float("nan"), False),
])
def test_json_integer_is_the_api_servers(value: float, integer: bool) -> None:
    assert json_integer(value) is integer
