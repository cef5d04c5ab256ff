"""The PDDeployment CRD as a real API server serves it: it installs, its CEL rules reject bad
specs on a server-side dry run with the designed messages (no operator running), and
``kubectl get pdd`` shows the printer columns."""

from __future__ import annotations

import copy
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from localcluster import Cluster

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = REPO_ROOT / "crds" / "serving.pdd.dev_pddeployments.yaml"
EXAMPLES = sorted((REPO_ROOT / "manifests" / "examples").glob("*.yaml"))
CRD_NAME = "pddeployments.serving.pdd.dev"


def load_example(name: str | None = None) -> dict[str, Any]:
    paths = [p for p in EXAMPLES if name is None or p.stem == name]
    assert paths, f"no example manifest {name or '*'} under manifests/examples"
    docs = [d for d in yaml.safe_load_all(paths[0].read_text()) if d]
    return next(d for d in docs if d.get("kind") == "PDDeployment")


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> dict[str, Any]:
    assert CRD_FILE.exists(), f"{CRD_FILE} is missing (make crd)"
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{CRD_NAME}")
    # Established can precede discovery by a moment; kubectl resolves "pdd" via discovery.
    deadline = time.monotonic() + 30
    while cluster.kubectl("get", "pdd", "-A", check=False).returncode != 0:
        assert time.monotonic() < deadline, "kubectl never resolved the short name pdd"
        time.sleep(0.5)
    return yaml.safe_load(CRD_FILE.read_text())


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"crd-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def dry_run(
    cluster: Cluster, namespace: str, obj: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl(
        "apply",
        "--dry-run=server",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps(obj),
        check=False,
    )


def test_crd_is_established(cluster: Cluster, crd: dict[str, Any]) -> None:
    served = cluster.kubectl_json("get", "crd", CRD_NAME)
    assert served["spec"]["names"]["shortNames"] == ["pdd"]
    assert served["spec"]["scope"] == "Namespaced"
    version = next(v for v in served["spec"]["versions"] if v["name"] == "v1alpha1")
    assert version["served"] and version["storage"]
    assert "status" in version.get("subresources", {})


def test_invalid_dcp_is_rejected_by_cel(
    cluster: Cluster, crd: dict[str, Any], namespace: str
) -> None:
    obj = copy.deepcopy(load_example())
    obj["metadata"]["name"] = "bad-dcp"
    obj["spec"]["prefill"]["tensorParallelSize"] = 4
    obj["spec"]["prefill"]["decodeContextParallelSize"] = 2
    obj["spec"]["prefill"]["resources"] = {"limits": {"nvidia.com/gpu": 4}}
    proc = dry_run(cluster, namespace, obj)
    assert proc.returncode != 0, f"an invalid spec was accepted:\n{proc.stdout}"
    assert (
        "spec.prefill.decodeContextParallelSize: must be 1 or equal to tensorParallelSize (4), "
        "got 2" in proc.stderr
    ), proc.stderr
    # A dry run must not have stored anything.
    got = cluster.kubectl("get", "pdd", "bad-dcp", "-n", namespace, check=False)
    assert got.returncode != 0 and "NotFound" in got.stderr


def test_every_example_passes_server_dry_run(
    cluster: Cluster, crd: dict[str, Any], namespace: str
) -> None:
    assert EXAMPLES, "no examples under manifests/examples"
    for path in EXAMPLES:
        proc = cluster.kubectl(
            "apply", "--dry-run=server", "-n", namespace, "-f", str(path), check=False
        )
        assert proc.returncode == 0, f"{path.name} rejected:\n{proc.stderr}"


def test_valid_is_accepted_and_printer_columns_show(
    cluster: Cluster, crd: dict[str, Any], namespace: str
) -> None:
    obj = load_example()
    name = obj["metadata"]["name"]
    assert dry_run(cluster, namespace, obj).returncode == 0
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))

    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    out = cluster.kubectl("get", "pdd", name, "-n", namespace).stdout.splitlines()
    header, row = out[0], out[1]
    for column in columns:
        assert column["name"].upper() in header, (column["name"], header)
    for wanted in ("CASE", "READY", "AGE"):
        assert wanted in header, header

    # The values: every integer column is a TP/DCP size taken from the spec.
    wide = cluster.kubectl_json("get", "pdd", name, "-n", namespace)
    cells = row.split()
    assert cells[0] == name
    for column in columns:
        if column["type"] != "integer":
            continue
        field_path = column["jsonPath"].lstrip(".").split(".")
        value: Any = wide
        for key in field_path:
            value = value[key]
        index = header.split().index(column["name"].upper())
        assert cells[index] == str(value), (column["name"], header, row)


def test_name_length_is_checked_by_cel_with_pdd_validate_words(
    cluster: Cluster, crd: dict[str, Any], namespace: str
) -> None:
    from pdd_api.validation import validate_name

    obj = copy.deepcopy(load_example())
    long = "n" * 48
    obj["metadata"]["name"] = long
    proc = dry_run(cluster, namespace, obj)
    assert proc.returncode != 0, f"a 48-character name was accepted:\n{proc.stdout}"
    [words] = validate_name(long)
    assert words in proc.stderr, proc.stderr
    obj["metadata"]["name"] = "n" * 47
    assert dry_run(cluster, namespace, obj).returncode == 0
