"""The operator Deployment's environment as the kubelet fills it in (values and the downward
API's fields), so tests read the configuration a shipped manifest really gives the operator."""

from __future__ import annotations

from typing import Any

import pytest

from pdd_operator.config import Config


def downward_env(deployment: dict[str, Any]) -> dict[str, str]:
    meta = {"metadata.namespace": deployment["metadata"]["namespace"],
            "metadata.name": f"{deployment['metadata']['name']}-abc12"}
    out = {}
    for e in deployment["spec"]["template"]["spec"]["containers"][0].get("env") or []:
        ref = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if ref or "value" in e:
            out[e["name"]] = meta[ref] if ref else str(e["value"])
    return out


def operator_config(deployment: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Config:
    for name, value in downward_env(deployment).items():
        monkeypatch.setenv(name, value)
    return Config.from_env()
