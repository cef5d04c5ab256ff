"""The CRD's CEL rules and `pdd validate` say the same thing, word for word, for every value
rule; structural problems (types, unknown or missing fields) are rejected by the API server's
schema with the field named. Server-side dry runs: no operator, nothing stored."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from localcluster import Cluster
from spec_cases import INVALID, VALID_EDGES
from test_crd import crd, namespace  # noqa: F401  (fixtures)

from pdd_api.rules import check_rules

pytestmark = pytest.mark.integration


def document(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.pdd.dev/v1alpha1",
        "kind": "PDDeployment",
        "metadata": {"name": name},
        "spec": spec,
    }


def dry_run(cluster: Cluster, namespace: str, doc: dict[str, Any]) -> tuple[int, str]:
    proc = cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(doc),
        check=False,
    )
    return proc.returncode, proc.stderr


@pytest.mark.parametrize(("spec", "message"), [(s, m) for _, s, m in INVALID],
                         ids=[n for n, _, _ in INVALID])
def test_api_server_rejects_like_pdd_validate(
    cluster: Cluster, crd: dict[str, Any], namespace: str, spec: dict[str, Any], message: str
) -> None:
    name = re.sub(r"[^a-z0-9]+", "-", message.split(":")[0].lower()).strip("-")[:40]
    code, err = dry_run(cluster, namespace, document(name, spec))
    assert code != 0, f"accepted: {message}"
    if check_rules(spec) == [message]:
        assert message in err, f"CEL said:\n{err}\npdd validate says:\n{message}"
    else:
        field = message.split(":")[0].split("[")[0]
        assert field.removeprefix("spec.").split(".")[-1] in err, err


@pytest.mark.parametrize("spec", VALID_EDGES)
def test_api_server_accepts_valid_edges(
    cluster: Cluster, crd: dict[str, Any], namespace: str, spec: dict[str, Any]
) -> None:
    code, err = dry_run(cluster, namespace, document("edge", spec))
    assert code == 0, err
