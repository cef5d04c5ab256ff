"""`kubectl pdd` against the local control plane: kubectl finds the plugin on PATH, and the plan
and status it prints are those of the objects the real operator made (pods, IPs, the routing
ConfigMap they mount, conditions, events)."""

from __future__ import annotations

import copy
import os
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_fixtures import (  # noqa: F401  (fixtures)
    REPO_ROOT,
    Kubectl,
    Operator,
    events_of,
    kube,
    load_example,
    op_namespace,
    operator,
    pods_of,
    wait_for,
    wait_ready,
)

from pdd_api.plan import RoutingPlan
from pdd_cli.diagram import render_diagram

pytestmark = pytest.mark.integration

NAME = "pr-example"


def plugin_dir(tmp: Path) -> Path:
    """A `kubectl-pdd` on PATH that runs the console script pyproject.toml declares, as pip's
    generated wrapper does (the venv may predate the entry point)."""
    target = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"][
        "kubectl-pdd"]
    module, func = target.split(":")
    exe = tmp / "kubectl-pdd"
    exe.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\n"
                   f"sys.exit({func}())\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return tmp


def run(kube: Kubectl, path: Path, *args: str,
        kubeconfig: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{path}{os.pathsep}{os.environ['PATH']}",
           "KUBECONFIG": kubeconfig or str(kube.cluster.kubeconfig)}
    return subprocess.run(["kubectl", "pdd", *args], capture_output=True, text=True, env=env,
                          timeout=60, check=False)


@pytest.fixture(scope="module")
def deployed(kube: Kubectl, operator: Operator, op_namespace: str) -> dict[str, Any]:
    doc = load_example(REPO_ROOT / "manifests/examples/p-tp4-dcp4-to-d-tp4-dcp4.yaml")
    doc = copy.deepcopy(doc)
    doc["metadata"]["name"] = NAME
    doc["spec"]["decode"].update(replicas=2, tensorParallelSize=2, decodeContextParallelSize=2,
                                 resources={"limits": {"nvidia.com/gpu": 2}})
    kube.apply(doc, "-n", op_namespace)
    wait_ready(kube, op_namespace, NAME, operator)
    wait_for("pod IPs", lambda: all(p["status"].get("podIP")
                                    for p in pods_of(kube, op_namespace, NAME)))
    return doc


def test_plan_shows_the_live_routing_rank_by_rank(
    kube: Kubectl, op_namespace: str, deployed: dict[str, Any], tmp_path: Path
) -> None:
    ns, path = op_namespace, plugin_dir(tmp_path)
    pods = pods_of(kube, ns, NAME)
    mounted = {v["configMap"]["name"] for p in pods for v in p["spec"]["volumes"]
               if v["name"] == "routing"}
    assert len(mounted) == 1
    cm = kube.json("get", "configmap", mounted.pop(), "-n", ns)
    plan = RoutingPlan.from_json(cm["data"]["routing.json"])

    proc = run(kube, path, "plan", NAME, "-n", ns)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"{ns}/{NAME}: P TP4/DCP4 -> D TP2/DCP2  (ConfigMap {cm['metadata']['name']})" in out
    assert render_diagram(plan).split("\n", 1)[1] in out
    assert "D0 <- P0 [g%4==0], P2 [g%4==2]" in out and "D1 <- P1 [g%4==1], P3 [g%4==3]" in out
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln[:1] in "PD" and ln[1:2].isdigit()}
    assert sorted(rows) == ["D0", "D1", "P0", "P1", "P2", "P3"]
    port = deployed["spec"]["kvTransfer"]["sideChannelPort"]
    for p in pods:
        role = p["metadata"]["labels"]["app.kubernetes.io/component"]
        tag = "P" if role == "prefill" else "D"
        tp = deployed["spec"][role]["tensorParallelSize"]
        for rank in range(tp):
            assert f"{p['metadata']['name']} {p['status']['podIP']}:{port + rank}" in rows[
                f"{tag}{rank}"]

    proc = run(kube, path, "plan", NAME, "-n", ns, "-o", "json")
    assert proc.returncode == 0 and proc.stdout.strip() == cm["data"]["routing.json"]


def test_status_shows_roles_pods_conditions_events(
    kube: Kubectl, op_namespace: str, deployed: dict[str, Any], tmp_path: Path
) -> None:
    ns, path = op_namespace, plugin_dir(tmp_path)
    proc = run(kube, path, "status", NAME, "-n", ns, "--events", "50")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    section = {h: out.index(h) for h in ("PODS", "CONDITIONS")}
    pod_rows = out[section["PODS"] + 2:section["CONDITIONS"] - 1]
    pods = kube.json("get", "pods", "-n", ns, "-l",
                     f"app.kubernetes.io/instance={NAME},app.kubernetes.io/name=pdd")["items"]
    assert {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods} >= {
        "prefill", "decode"}
    assert sorted(r.split()[0] for r in pod_rows) == sorted(p["metadata"]["name"] for p in pods)
    for p in pods:
        row = next(r for r in pod_rows if r.split()[0] == p["metadata"]["name"])
        assert p["status"]["podIP"] in row.split() and p["spec"]["nodeName"] in row.split()
    obj = kube.json("get", "pdd", NAME, "-n", ns)
    for c in obj["status"]["conditions"]:
        assert any(ln.split()[:2] == [c["type"], c["status"]] for ln in out), c["type"]
    reasons = {e["reason"] for e in events_of(kube, ns, NAME)}
    assert reasons and all(any(f" {r} " in ln for ln in out) for r in reasons)
    decode = next(ln for ln in out if ln.split()[:1] == ["decode"])
    assert decode.split()[1:] == ["2", "2", "2", "2", "2", "2", "90%-of-GPU", "-", "auto"]


def test_namespace_from_the_kubeconfig_context_and_errors(
    kube: Kubectl, op_namespace: str, deployed: dict[str, Any], tmp_path: Path
) -> None:
    path = plugin_dir(tmp_path)
    cfg = yaml.safe_load(Path(kube.cluster.kubeconfig).read_text())
    current = cfg["current-context"]
    for ctx in cfg["contexts"]:
        if ctx["name"] == current:
            ctx["context"]["namespace"] = op_namespace
    own = tmp_path / "kubeconfig"
    own.write_text(yaml.safe_dump(cfg))
    proc = run(kube, path, "plan", NAME, kubeconfig=str(own))
    assert proc.returncode == 0 and f"{op_namespace}/{NAME}:" in proc.stdout, proc.stderr
    proc = run(kube, path, "status", "no-such-pdd", "-n", op_namespace)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"kubectl pdd status: pddeployment {op_namespace}/no-such-pdd not found")
    example = REPO_ROOT / "manifests/examples/p-tp2-dcp2-to-d-tp4-dcp4.yaml"
    proc = run(kube, path, "validate", "-f", str(example))
    assert proc.returncode == 0 and "1 document(s) valid" in proc.stdout
