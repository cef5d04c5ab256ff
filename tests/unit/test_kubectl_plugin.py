"""`kubectl pdd`: the pure parts (which routing ConfigMap is live, the plan and status reports)
on objects the operator's own builders produce, and the installed entry point."""

from __future__ import annotations

import copy
import importlib
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdd_api.validation import parse_spec
from pdd_cli import kubectl_plugin as kp
from pdd_cli.diagram import render_diagram
from pdd_operator import builders

from .conftest import ROOT

EXAMPLE = ROOT / "manifests/examples/p-tp4-dcp4-to-d-tp4-dcp1.yaml"


def _objects(name: str = "demo", uid: str = "uid-1") -> tuple[dict[str, Any], Any]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": name, "namespace": "ns1", "uid": uid, "generation": 3}
    doc["spec"]["decode"]["replicas"] = 2
    desired = builders.build(builders.Owner(name, "ns1", uid), parse_spec(doc["spec"]))
    return doc, desired


def _running(pod: dict[str, Any], ip: str) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    pod["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    pod["spec"]["nodeName"] = "fake-1"
    pod["status"] = {"phase": "Running", "podIP": ip,
                     "conditions": [{"type": "Ready", "status": "True"}]}
    return pod


def test_entry_point_is_declared_and_loads() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["kubectl-pdd"].split(":")
    assert getattr(importlib.import_module(module), func) is kp.main


def test_routing_volume_name_matches_the_operator() -> None:
    _, desired = _objects()
    pod = desired.pods["decode"][0]
    assert kp.routing_volume_configmap(pod) == desired.configmap["metadata"]["name"]
    assert kp.ROUTING_VOLUME == builders.ROUTING_VOLUME


def test_mounted_configmap_wins_and_foreign_ones_are_ignored() -> None:
    doc, desired = _objects()
    live = desired.configmap
    old = copy.deepcopy(live)
    old["metadata"]["name"] = "demo-routing-old"
    old["metadata"]["creationTimestamp"] = "2030-01-01T00:00:00Z"  # newer, but nobody mounts it
    foreign = copy.deepcopy(live)
    foreign["metadata"]["name"] = "demo-routing-x"
    foreign["metadata"]["ownerReferences"] = [{"uid": "someone-else"}]
    pods = [_running(desired.pods["prefill"][0], "10.0.0.1")]
    assert kp.pick_routing_configmap(doc, [old, foreign, live], pods) is live
    # No pods yet: the newest owned one, never the foreign one.
    assert kp.pick_routing_configmap(doc, [old, foreign, live], []) is old
    with pytest.raises(kp.PluginError, match="no routing ConfigMap owned by it"):
        kp.pick_routing_configmap(doc, [foreign], pods)


def test_plan_report_lists_every_rank_with_its_pods_and_ports() -> None:
    doc, desired = _objects()
    plan = desired.plan
    ips = {("prefill", 0): "10.0.0.1", ("decode", 0): "10.0.1.1", ("decode", 1): "10.0.1.2"}
    pods = [_running(desired.pods[role][i], ip) for (role, i), ip in ips.items()]
    out = kp.plan_report(doc, desired.configmap, pods)
    assert render_diagram(plan).split("\n", 1)[1] in out
    base = doc["spec"]["kvTransfer"]["sideChannelPort"] if "kvTransfer" in doc["spec"] else 5600
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln[:1] in "PD" and ln[1:2].isdigit()}
    assert len(rows) == plan.prefill.tensor_parallel_size + plan.decode.tensor_parallel_size
    for rank in range(plan.prefill.tensor_parallel_size):
        assert f"demo-prefill-0 10.0.0.1:{base + rank}" in rows[f"P{rank}"]
    for d in plan.decode_ranks:
        row = rows[f"D{d.rank}"]
        assert f"demo-decode-0 10.0.1.1:{base + d.rank}, demo-decode-1 10.0.1.2:" in row
        for r in d.reads:
            assert f"P{r.prefill_rank} [" in row


def test_plan_report_refuses_a_configmap_that_is_no_plan() -> None:
    doc, desired = _objects()
    cm = copy.deepcopy(desired.configmap)
    cm["data"]["routing.json"] = '{"version": 1}'
    with pytest.raises(ValueError, match="malformed routing plan"):
        kp.plan_report(doc, cm, [])


def test_status_report_shows_roles_pods_conditions_and_latest_events() -> None:
    doc, desired = _objects()
    doc["status"] = {
        "observedGeneration": 2, "routingCase": desired.plan.case,
        "routingSummary": desired.plan.summary(),
        "prefill": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
        "conditions": [{"type": "Ready", "status": "False", "reason": "DecodeUnavailable",
                        "message": "0/2 decode pods ready"}],
    }
    pods = [_running(desired.pods["prefill"][0], "10.0.0.1")]
    events = [{"type": "Normal", "reason": f"Step{i}", "message": f"m{i}",
               "lastTimestamp": f"2026-01-01T00:00:{i:02d}Z",
               "involvedObject": {"kind": "PDDeployment", "name": "demo"}} for i in range(15)]
    out = kp.status_report(doc, pods, events, limit=4)
    assert "generation 3, observed 2  (operator has not caught up)" in out
    assert desired.plan.summary() in out
    assert "DecodeUnavailable" in out and "0/2 decode pods ready" in out
    assert "demo-prefill-0" in out and "10.0.0.1" in out and "fake-1" in out
    shown = [f"Step{i}" for i in range(15) if f"Step{i} " in out]
    assert shown == ["Step11", "Step12", "Step13", "Step14"]
    decode_row = next(ln for ln in out.splitlines() if ln.split()[:1] == ["decode"])
    assert decode_row.split()[3:] == [str(doc["spec"]["decode"]["replicas"]), "0", "0", "0",
                                      "90%-of-GPU", "-", "auto"]


def test_status_report_shows_the_planners_replicas_and_why() -> None:
    doc, _ = _objects()
    doc["spec"]["autoscaling"] = {"decode": {"minReplicas": 1, "maxReplicas": 6},
                                  "prefill": {"enabled": False, "maxReplicas": 2}}
    doc["status"] = {
        "decode": {"replicas": 2, "readyReplicas": 2},
        "autoscaling": {"decode": {
            "desiredReplicas": 3, "reason": "ScaledUp", "lastScaleTime": "2026-12-04T03:00:00Z",
            "message": "decode 2→3: TPOT p90 0.061 s > 0.05 s, KV 0.83"}},
    }
    out = kp.status_report(doc, [], [])
    decode_row = next(ln for ln in out.splitlines() if ln.split()[:1] == ["decode"])
    assert decode_row.split()[3] == "3"  # what will be built, not spec.decode.replicas
    auto = out.split("AUTOSCALING", 1)[1].split("PODS", 1)[0]
    row = next(ln for ln in auto.splitlines() if ln.split()[:1] == ["decode"])
    assert row.split()[:8] == ["decode", "pdd", "2", "3", "1", "6", "ScaledUp",
                               "2026-12-04T03:00:00Z"]
    assert "TPOT p90 0.061 s > 0.05 s, KV 0.83" in row
    prefill = next(ln for ln in auto.splitlines() if ln.split()[:1] == ["prefill"])
    assert prefill.split()[1] == "spec" and "HPA/KEDA" in prefill
    del doc["spec"]["autoscaling"]
    assert "AUTOSCALING" not in kp.status_report(doc, [], [])
    # A PDDRoleScale the operator applies names itself as the role's scaler; one it does not
    # apply (status.applied false) is not the scaler.
    name = doc["metadata"]["name"]
    scales = [{"metadata": {"name": "hpa-prefill"},
               "spec": {"deployment": name, "role": "prefill", "replicas": 2},
               "status": {"applied": True, "message": f"drives spec.prefill.replicas of "
                          f"PDDeployment {name}: 2"}},
              {"metadata": {"name": "second"}, "spec": {"deployment": name, "role": "decode"},
               "status": {"applied": False, "message": "not applied"}}]
    auto = kp.status_report(doc, [], [], role_scales=scales).split("AUTOSCALING", 1)[1]
    prefill = next(ln for ln in auto.splitlines() if ln.split()[:1] == ["prefill"])
    assert prefill.split()[1] == "PDDRoleScale/hpa-prefill" and "drives spec.prefill" in prefill
    decode = next(ln for ln in auto.splitlines() if ln.split()[:1] == ["decode"])
    assert decode.split()[1] == "spec"
    assert "AUTOSCALING" not in kp.status_report(doc, [], [], role_scales=scales[1:])
    # Someone set spec.prefill.replicas under the PDDRoleScale: the operator keeps building
    # the PDDRoleScale's 2, and DESIRED says so in both tables.
    doc["spec"]["prefill"]["replicas"] = 5
    out = kp.status_report(doc, [], [], role_scales=scales)
    roles, auto = out.split("AUTOSCALING", 1)
    assert next(ln for ln in roles.splitlines() if ln.split()[:1] == ["prefill"]).split()[3] == "2"
    assert next(ln for ln in auto.splitlines() if ln.split()[:1] == ["prefill"]).split()[3] == "2"


@pytest.mark.parametrize(("role_spec", "shown"), [
    ({}, ("90%-of-GPU", "-", "auto")),
    ({"gpuMemoryUtilization": 0.85, "hostKVCacheGiB": 0}, ("85%-of-GPU", "-", "auto")),
    ({"gpuMemoryUtilization": 0.85, "kvCacheBlocks": 4096, "hostKVCacheGiB": 1.5,
      "kvCacheDtype": "fp8"}, ("4096-blocks", "1.5GiB/rank", "fp8")),
])
def test_status_report_shows_how_each_roles_kv_memory_is_sized(
        role_spec: dict[str, Any], shown: tuple[str, str, str]) -> None:
    doc, _ = _objects()
    doc["spec"]["prefill"].update(role_spec)
    out = kp.status_report(doc, [], [])
    header = next(ln for ln in out.splitlines() if ln.split()[:1] == ["ROLE"])
    assert header.split()[-3:] == ["KV-POOL", "HOST-KV", "KV-DTYPE"]
    prefill_row = next(ln for ln in out.splitlines() if ln.split()[:1] == ["prefill"])
    assert tuple(prefill_row.split()[-3:]) == shown


def test_validate_is_pdd_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kp.main(["validate", "-f", str(EXAMPLE)]) == 0
    assert "1 document(s) valid" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["blockSize"] = 60
    bad.write_text(yaml.safe_dump(doc))
    assert kp.main(["validate", "-f", str(bad)]) == 1
    assert "spec.blockSize" in capsys.readouterr().err


def test_unreachable_cluster_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": "x"}}],
    }))
    import urllib3

    urllib3.disable_warnings()
    assert kp.main(["--kubeconfig", str(cfg), "status", "demo"]) == 1
    assert "cannot reach the API server" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["-n", "ns1", "plan", "x"], ["plan", "x", "-n", "ns1"],
                                  ["--namespace", "other", "status", "x", "-n", "ns1"]])
def test_namespace_flag_on_either_side_of_the_subcommand(argv: list[str]) -> None:
    assert kp.parser().parse_args(argv).namespace == "ns1"
    assert kp.parser().parse_args(["plan", "x"]).namespace is None
