"""`spec.engine: vllm` on the local control plane: the API server (CEL, then the operator's
webhook) accepts and refuses exactly what `pdd validate` does, with its words, and the operator
runs a vLLM deployment as `vllm serve` pods (Running on fake GPU nodes; nothing runs vLLM) with
pdd's router in front in vLLM-protocol mode."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_fixtures import (  # noqa: F401  (fixtures)
    Kubectl,
    Operator,
    conditions,
    kube,
    op_namespace,
    operator,
    pods_of,
    wait_ready,
)
from spec_cases import INVALID, VALID_EDGES

from pdd_api.rules import check_rules

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "manifests" / "samples" / "vllm-engine.yaml"
VLLM_INVALID = [(n, s, m) for n, s, m in INVALID if s.get("engine") is not None]
VLLM_VALID = [s for s in VALID_EDGES if s.get("engine") is not None]


def document(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
            "metadata": {"name": name}, "spec": spec}


def pdd_validate(doc: dict[str, Any], tmp: Path) -> tuple[int, list[str]]:
    path = tmp / "doc.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = subprocess.run([sys.executable, "-m", "pdd_cli.main", "validate", "-f", str(path)],
                         capture_output=True, text=True)
    prefix = f"{path}: document 1 ({doc['metadata']['name']}): "
    return out.returncode, [line[len(prefix):] for line in out.stderr.splitlines()
                            if line.startswith(prefix)]


def test_cases_cover_both_vllm_rules() -> None:
    messages = " ".join(m for _, _, m in VLLM_INVALID)
    assert "with engine vllm, must divide" in messages and "spec.router.image" in messages
    assert len(VLLM_VALID) >= 3


@pytest.mark.parametrize(("spec", "message"), [(s, m) for _, s, m in VLLM_INVALID],
                         ids=[n for n, _, _ in VLLM_INVALID])
def test_api_server_refuses_like_pdd_validate(spec: dict[str, Any], message: str,
                                              kube: Kubectl, operator: Operator,
                                              op_namespace: str, tmp_path: Path) -> None:
    doc = document("bad", spec)
    code, problems = pdd_validate(doc, tmp_path)
    assert (code, problems) == (1, [message])
    out = kube.apply(doc, "-n", op_namespace, check=False)
    assert out.returncode != 0
    if check_rules(spec) == [message]:  # value rules: CEL says pdd validate's words
        assert message in out.stderr, out.stderr
    else:  # schema problems: the API server's own words, naming the field
        assert message.split(":")[0] in out.stderr, out.stderr
    assert kube.maybe("get", "pddeployment", "bad", "-n", op_namespace) is None


@pytest.mark.parametrize("spec", VLLM_VALID)
def test_api_server_accepts_like_pdd_validate(spec: dict[str, Any], kube: Kubectl,
                                              operator: Operator, op_namespace: str,
                                              tmp_path: Path) -> None:
    doc = document("edge", spec)
    assert pdd_validate(doc, tmp_path) == (0, [])
    out = kube.apply(doc, "-n", op_namespace, "--dry-run=server", check=False)
    assert out.returncode == 0, out.stderr


def test_operator_runs_vllm_pods_behind_the_router(kube: Kubectl, operator: Operator,
                                                   op_namespace: str) -> None:
    ns, doc = op_namespace, copy.deepcopy(yaml.safe_load(SAMPLE.read_text()))
    name, spec = doc["metadata"]["name"], doc["spec"]
    kube.apply(doc, "-n", ns)
    obj = wait_ready(kube, ns, name, operator)
    assert all(c["status"] == "True" for c in conditions(obj).values())
    assert obj["status"]["routingSummary"] == "D0 <- P0,P2; D1 <- P1,P3"
    for role in ("prefill", "decode"):
        rs = spec[role]
        pods = pods_of(kube, ns, name, role)
        assert [p["metadata"]["name"] for p in pods] == [
            f"{name}-{role}-{i}" for i in range(rs["replicas"])]
        for pod in pods:
            assert pod["status"]["phase"] == "Running"
            c = pod["spec"]["containers"][0]
            assert c["image"] == spec["image"]
            argv = c["command"]
            assert argv[:3] == ["vllm", "serve", spec["model"]["name"]]
            tp, dcp = str(rs["tensorParallelSize"]), str(rs["decodeContextParallelSize"])
            assert argv[argv.index("--tensor-parallel-size") + 1] == tp
            assert argv[argv.index("--decode-context-parallel-size") + 1] == dcp
            assert argv[argv.index("--cp-kv-cache-interleave-size") + 1] == str(
                spec["blockSize"])
            assert json.loads(argv[argv.index("--kv-transfer-config") + 1])[
                "kv_connector"] == "NixlConnector"
            env = {e["name"]: e for e in c["env"]}
            assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"][
                "fieldPath"] == "status.podIP"
            assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == str(
                spec["kvTransfer"]["sideChannelPort"])
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            assert c["resources"]["limits"]["nvidia.com/gpu"] == tp
            assert {v["name"] for v in pod["spec"]["volumes"]} >= {"dshm"}
            assert not any("configMap" in v or "secret" in v for v in pod["spec"]["volumes"])
    router = kube.json("get", "deployment", name, "-n", ns)
    rc = router["spec"]["template"]["spec"]["containers"][0]
    assert rc["image"] == spec["router"]["image"]
    renv = {e["name"]: e.get("value") for e in rc["env"]}
    assert renv["PDD_ROUTER_UPSTREAM_PROTOCOL"] == "vllm"
    assert renv["PDD_DECODE_URLS"].count("http://") == spec["decode"]["replicas"] + 1  # surge
