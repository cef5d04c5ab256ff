"""The Argo CD health check (manifests/argocd/health.lua), run with lupa against PDDeployment
objects recorded from the local control plane, the way Argo CD runs it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdd_operator.conditions import STUCK_REASONS

lupa = pytest.importorskip("lupa")

ARGO = Path(__file__).resolve().parents[2] / "manifests" / "argocd"
LUA = (ARGO / "health.lua").read_text()
CASES = yaml.safe_load((ARGO / "health_test.yaml").read_text())["tests"]


def to_lua(rt: Any, value: Any) -> Any:
    if isinstance(value, dict):
        return rt.table_from({k: to_lua(rt, v) for k, v in value.items()})
    if isinstance(value, list):
        return rt.table_from([to_lua(rt, v) for v in value])
    return value


def health(obj: dict[str, Any]) -> dict[str, Any]:
    rt = lupa.LuaRuntime(unpack_returned_tuples=True)
    rt.globals()["obj"] = to_lua(rt, obj)
    result = rt.execute(LUA)
    return dict(result.items())


@pytest.mark.parametrize("case", CASES, ids=lambda c: Path(c["inputPath"]).stem)
def test_recorded_objects(case: dict[str, Any]) -> None:
    obj = yaml.safe_load((ARGO / case["inputPath"]).read_text())
    got = health(obj)
    want = case["healthStatus"]
    assert got["status"] == want["status"], got
    if "message" in want:
        assert got["message"] == want["message"]
    else:
        assert got["message"], "every verdict explains itself"


def test_degraded_messages_name_the_problem() -> None:
    unsched = yaml.safe_load((ARGO / "testdata/degraded-unschedulable.yaml").read_text())
    assert "big-decode-0 is Pending (Unschedulable)" in health(unsched)["message"]
    invalid = yaml.safe_load((ARGO / "testdata/degraded-invalid.yaml").read_text())
    assert "decodeContextParallelSize" in health(invalid)["message"]


def test_ready_for_an_older_generation_is_not_healthy() -> None:
    obj = yaml.safe_load((ARGO / "testdata/healthy.yaml").read_text())
    for c in obj["status"]["conditions"]:
        c["observedGeneration"] = obj["metadata"]["generation"] - 1
    assert health(obj)["status"] == "Progressing"


def test_lua_stuck_reasons_match_the_operator() -> None:
    lua_reasons = set(re.findall(r"(\w+) = true", LUA))
    assert lua_reasons == set(STUCK_REASONS) - {"InvalidSpec"}


def test_argocd_cm_patch_embeds_the_same_lua() -> None:
    patch = yaml.safe_load((ARGO / "argocd-cm-patch.yaml").read_text())
    assert patch["data"]["resource.customizations.health.serving.pdd.dev_PDDeployment"] == LUA


def test_stalled_is_degraded_with_the_api_message() -> None:
    obj = yaml.safe_load((ARGO / "testdata/degraded-stalled-quota.yaml").read_text())
    got = health(obj)
    assert got["status"] == "Degraded"
    assert "exceeded quota: gpus" in got["message"]
    for c in obj["status"]["conditions"]:
        if c["type"] == "Stalled":
            c["status"] = "False"
    assert health(obj)["status"] == "Progressing"
