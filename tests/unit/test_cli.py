"""`pdd` as users and CI pipelines call it: exit codes, stderr lines, plan output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pdd_api.crd import crd_yaml, role_scale_crd_yaml
from pdd_cli.main import main

from .conftest import EXAMPLES, ROOT

CRD_FILE = ROOT / "crds" / "serving.pdd.dev_pddeployments.yaml"


def write(tmp_path: Path, text: str) -> str:
    f = tmp_path / "in.yaml"
    f.write_text(text)
    return str(f)


def test_seven_reference_examples() -> None:
    names = {p.stem for p in EXAMPLES}
    assert names == {
        "p-tp4-dcp1-to-d-tp4-dcp1", "p-tp2-dcp1-to-d-tp4-dcp1", "p-tp4-dcp4-to-d-tp4-dcp4",
        "p-tp4-dcp1-to-d-tp4-dcp4", "p-tp4-dcp4-to-d-tp4-dcp1", "p-tp2-dcp2-to-d-tp4-dcp4",
        "p-tp2-dcp1-to-d-tp4-dcp4",
    }


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_examples_validate_and_plan(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "-f", str(example)]) == 0
    assert "1 document(s) valid" in capsys.readouterr().out
    assert main(["plan", "-f", str(example), "-o", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    doc = yaml.safe_load(example.read_text())["spec"]
    assert plan["version"] == 1 and plan["blockSize"] == doc["blockSize"]
    for role, key in (("prefill", "prefill"), ("decode", "decode")):
        assert plan[key]["tensorParallelSize"] == doc[role]["tensorParallelSize"]
    assert len(plan["decodeRanks"]) == doc["decode"]["tensorParallelSize"]
    assert main(["plan", "-f", str(example), "--tokens", "1000"]) == 0
    text = capsys.readouterr().out
    assert "decode rank" in text and "expected notifications" in text and "bytes for 1000" in text


def test_plan_text_shows_the_pr_picture(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = yaml.safe_load((ROOT / "manifests/examples/p-tp4-dcp4-to-d-tp4-dcp4.yaml").read_text())
    doc["spec"]["decode"] = {"tensorParallelSize": 2, "decodeContextParallelSize": 2}
    assert main(["plan", "-f", write(tmp_path, yaml.safe_dump(doc)), "--tokens", "256"]) == 0
    out = capsys.readouterr().out
    assert "D0 <- P0,P2; D1 <- P1,P3" in out
    # 256 tokens = 4 chunks: each decode rank holds 2 chunks = 128 tokens x 31104 bytes.
    assert "3,981,312" in out
    assert "total bytes per request: 7,962,624" in out


def test_validate_reports_every_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = (ROOT / "manifests/examples/p-tp4-dcp4-to-d-tp4-dcp4.yaml").read_text()
    bad = good.replace("name: p-tp4-dcp4-to-d-tp4-dcp4", "name: broken").replace(
        "decodeContextParallelSize: 4\n    resources:\n      limits:\n        nvidia.com/gpu: 4\n"
        "  decode",
        "decodeContextParallelSize: 2\n    resources:\n      limits:\n        nvidia.com/gpu: 4\n"
        "  decode",
    )
    bad2 = good.replace("name: p-tp4-dcp4-to-d-tp4-dcp4", "name: broken2").replace(
        "blockSize: 64", "blockSize: 60"
    ).replace("tensorParallelSize: 4\n    decodeContextParallelSize: 4\n    resources:\n"
              "      limits:\n        nvidia.com/gpu: 4\n  decode:",
              "tensorParallelSize: 4\n    decodeContextParallelSize: 4\n    resources:\n"
              "      limits:\n        nvidia.com/gpu: 4\n  decode:")
    bad2 = bad2.replace("  decode:\n    replicas: 1\n    tensorParallelSize: 4\n"
                        "    decodeContextParallelSize: 4",
                        "  decode:\n    replicas: 1\n    tensorParallelSize: 3\n"
                        "    decodeContextParallelSize: 3")
    f = write(tmp_path, good + "---\n" + bad + "---\n" + bad2)
    assert main(["validate", "-f", f]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"{f}: document 2 (broken): spec.prefill.decodeContextParallelSize: must be 1 or equal "
        "to tensorParallelSize (4), got 2",
        f"{f}: document 3 (broken2): spec.blockSize: must be a positive multiple of 16 and at "
        "most 1024, got 60",
        f"{f}: document 3 (broken2): spec.decode.resources.limits[nvidia.com/gpu]: must equal "
        "tensorParallelSize (3), got 4",
        f"{f}: document 3 (broken2): spec.decode.decodeContextParallelSize: must divide or be a "
        "multiple of spec.prefill.decodeContextParallelSize (4), got 3",
        f"{f}: 2 of 3 document(s) invalid",
    ]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("spec: [unclosed\n", "not valid YAML at line 2"),
        ("", "no YAML documents found"),
        ("a: b: c\n", "not valid YAML at line 1"),
    ],
)
def test_unusable_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, needle: str
) -> None:
    assert main(["validate", "-f", write(tmp_path, text)]) == 2
    assert needle in capsys.readouterr().err


def test_missing_file_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "-f", "/nonexistent/x.yaml"]) == 2
    assert "cannot read /nonexistent/x.yaml" in capsys.readouterr().err


def test_plan_of_invalid_spec_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "manifests/examples/p-tp2-dcp2-to-d-tp4-dcp4.yaml").read_text()
    bad = text.replace("decodeContextParallelSize: 2", "decodeContextParallelSize: 3")
    f = write(tmp_path, bad)
    assert main(["plan", "-f", f, "-o", "json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "spec.prefill.decodeContextParallelSize: must be 1 or equal" in captured.err


def test_committed_crd_is_generated(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == CRD_FILE.read_text(), "run `make crd` and commit the result"
    assert crd_yaml() == CRD_FILE.read_text()
    assert main(["crd", "--kind", "PDDRoleScale"]) == 0
    committed = (ROOT / "crds" / "serving.pdd.dev_pddrolescales.yaml").read_text()
    assert capsys.readouterr().out == committed == role_scale_crd_yaml(), "run `make crd`"


def test_crd_schema_is_structural_and_explains() -> None:
    crd = yaml.safe_load(CRD_FILE.read_text())
    version = crd["spec"]["versions"][0]
    schema = version["openAPIV3Schema"] if "openAPIV3Schema" in version else \
        version["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]
    prefill = spec["properties"]["prefill"]
    assert prefill["description"]
    for name, prop in prefill["properties"].items():
        assert prop.get("description"), f"spec.prefill.{name} has no description"
    assert prefill["properties"]["decodeContextParallelSize"]["default"] == 1
    assert spec["properties"]["blockSize"]["default"] == 64
    assert crd["spec"]["names"]["shortNames"] == ["pdd"]
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.decode.replicas",
        "statusReplicasPath": ".status.decode.replicas",
        "labelSelectorPath": ".status.decode.selector"}}
    cols = [c["name"] for c in version["additionalPrinterColumns"]]
    assert cols == ["P-TP", "P-DCP", "D-TP", "D-DCP", "Case", "Ready", "Age"]
    messages = [r["messageExpression"] for r in spec["x-kubernetes-validations"]]
    assert any("must be 1 or equal to tensorParallelSize" in m for m in messages)

    def walk(node: dict, path: str) -> None:
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        for key, child in node.get("properties", {}).items():
            walk(child, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(spec, "spec")
