"""Starts anywhere: on a cluster that has the PDDeployment CRD and nothing else of ours (no kopf
peering CRDs), `python -m pdd_operator` without --standalone warns once, naming the missing CRD
and how to enable HA, and reconciles.

The shared control plane has the peering CRDs (other tests need them), so the operator talks to
it through a proxy that hides the kopf.dev group exactly as an API server without it answers:
absent from discovery, a plain-text `404 page not found` for its paths.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hiding_proxy import HidingProxy
from localcluster import Cluster
from operator_fixtures import (  # noqa: F401  (fixtures)
    Kubectl,
    Operator,
    kube,
    make_namespace,
    teardown_namespace,
    wait_ready,
)

pytestmark = pytest.mark.integration

DOC = {
    "apiVersion": "serving.pdd.dev/v1alpha1",
    "kind": "PDDeployment",
    "metadata": {"name": "anywhere"},
    "spec": {
        "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"},
        "image": "pdd:0.1.0",
        "prefill": {"replicas": 1, "tensorParallelSize": 1},
        "decode": {"replicas": 1, "tensorParallelSize": 1},
    },
}


def test_runs_standalone_with_one_warning_without_peering_crd(cluster: Cluster, kube: Kubectl,
                                                              tmp_path: Path) -> None:
    proxy = HidingProxy(cluster.kubeconfig, {"kopf.dev"}).start()
    ns = make_namespace(kube, "opsa")
    op = Operator(cluster, ns, tmp_path / "op", webhook=False, standalone=False,
                  env={"KUBECONFIG": str(proxy.kubeconfig(tmp_path / "kubeconfig"))})
    try:
        op.start()
        kube.apply(DOC, "-n", ns)
        wait_ready(kube, ns, "anywhere", op)
        assert any(r.startswith("GET /apis/kopf.dev") for r in proxy.requests), proxy.requests
        log = op.log(10_000)
        warnings = [line for line in log.splitlines() if "peering" in line.lower()]
        assert len(warnings) == 1, log
        assert "running standalone" in warnings[0], warnings
        assert "kopfpeerings.kopf.dev" in warnings[0], warnings
        assert "manifests/base/kopf-peering.yaml" in warnings[0], warnings
        assert "Traceback" not in log and "JSONDecodeError" not in log, log
        assert op.alive()
    finally:
        teardown_namespace(kube, ns, op)
        proxy.stop()
