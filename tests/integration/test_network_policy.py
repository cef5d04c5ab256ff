"""The operator's own namespace reaches the data-plane NetworkPolicy it writes: run with
PDD_OPERATOR_NAMESPACE (as the chart and manifests/ set it from the downward API), the planner's
scrape rule names that namespace by the label the API server puts on every namespace; run
without it (outside a cluster, no service account) the rule is left out."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from localcluster import Cluster
from operator_fixtures import (  # noqa: F401  (fixtures)
    Kubectl,
    Operator,
    kube,
    make_namespace,
    teardown_namespace,
    wait_for,
    wait_ready,
)

from pdd_api import keys

pytestmark = pytest.mark.integration

DOC: dict[str, Any] = {
    "apiVersion": "serving.pdd.dev/v1alpha1",
    "kind": "PDDeployment",
    "metadata": {"name": "scraped"},
    "spec": {
        "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"},
        "image": "pdd:0.1.0",
        "prefill": {"replicas": 1, "tensorParallelSize": 1},
        "decode": {"replicas": 1, "tensorParallelSize": 1},
        "autoscaling": {"decode": {"maxReplicas": 2}},
    },
}


def scrape_rules(kube: Kubectl, ns: str) -> list[dict[str, Any]]:
    policy = kube.json("get", "networkpolicy", "scraped-dataplane", "-n", ns)
    return [r for r in policy["spec"]["ingress"]
            if r.get("ports") == [{"protocol": "TCP", "port": keys.HTTP_PORT}]]


@pytest.mark.parametrize("own_namespace", [True, False])
def test_the_scrape_rule_names_the_operators_namespace(
        cluster: Cluster, kube: Kubectl, tmp_path: Path, own_namespace: bool) -> None:
    ns = make_namespace(kube, "netpol")
    ops = make_namespace(kube, "netpol-ops")
    env = {"PDD_OPERATOR_NAMESPACE": ops} if own_namespace else {}
    op = Operator(cluster, ns, tmp_path, webhook=False, env=env)
    try:
        op.start()
        kube.apply(copy.deepcopy(DOC), "-n", ns)
        wait_ready(kube, ns, "scraped", op)
        wait_for("the data-plane policy", lambda: kube.maybe(
            "get", "networkpolicy", "scraped-dataplane", "-n", ns))
        rules = scrape_rules(kube, ns)
        if not own_namespace:
            assert rules == []
            return
        [rule] = rules
        [peer] = rule["from"]
        assert peer["podSelector"] == {"matchLabels": {keys.LABEL_NAME: "pdd-operator"}}
        selector = peer["namespaceSelector"]["matchLabels"]
        assert selector == {keys.LABEL_NAMESPACE_NAME: ops}
        labels = kube.json("get", "namespace", ops)["metadata"]["labels"]
        assert labels[keys.LABEL_NAMESPACE_NAME] == ops, "the label the selector relies on"
    finally:
        teardown_namespace(kube, ns, op)
        kube("delete", "namespace", ops, "--wait=false", check=False)
