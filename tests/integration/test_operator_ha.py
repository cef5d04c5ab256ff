"""HA: two operator replicas with kopf peering; only the higher priority one acts, and the other
takes over when it dies."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from localcluster import Cluster
from operator_fixtures import (  # noqa: F401  (fixtures)
    Kubectl,
    Operator,
    kube,
    make_namespace,
    pods_of,
    teardown_namespace,
    wait_for,
    wait_ready,
)

pytestmark = pytest.mark.integration

DOC = {
    "apiVersion": "serving.pdd.dev/v1alpha1",
    "kind": "PDDeployment",
    "metadata": {"name": "ha"},
    "spec": {
        "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"},
        "image": "pdd:0.1.0",
        "prefill": {"replicas": 1, "tensorParallelSize": 1},
        "decode": {"replicas": 1, "tensorParallelSize": 1},
    },
}


def reconciles(op: Operator) -> float:
    m = re.search(r'^pdd_operator_reconciles_total\{result="ok"\} (\S+)$', op.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


def test_only_the_leader_acts_and_a_follower_takes_over(cluster: Cluster, kube: Kubectl,
                                                        tmp_path: Path) -> None:
    ns = make_namespace(kube, "opha")
    env = {"PDD_PEERING_LIFETIME": "10"}
    follower = Operator(cluster, ns, tmp_path / "a", webhook=False, env=env, priority=10,
                        standalone=False)
    leader = Operator(cluster, ns, tmp_path / "b", webhook=False, env=env, priority=20,
                      standalone=False)
    try:
        follower.start()
        leader.start()
        wait_for("the low-priority replica to pause",
                 lambda: "Pausing operations in favour of" in follower.log(400), timeout=60)
        kube.apply(DOC, "-n", ns)
        wait_ready(kube, ns, "ha", leader)
        assert reconciles(leader) > 0
        assert reconciles(follower) == 0, follower.log()

        leader.stop(kill=True)
        wait_for("the follower to resume", lambda: "Resuming operations" in follower.log(400),
                 timeout=90)
        old = pods_of(kube, ns, "ha", "decode")[0]["metadata"]["uid"]
        kube("delete", "pod", "ha-decode-0", "-n", ns, "--wait=false")
        wait_for("ha-decode-0 recreated by the new leader",
                 lambda: [p["metadata"]["uid"] for p in pods_of(kube, ns, "ha", "decode")
                          if p["metadata"]["uid"] != old])
        wait_ready(kube, ns, "ha", follower)
        assert reconciles(follower) > 0
    finally:
        leader.stop(kill=True)
        teardown_namespace(kube, ns, follower)
