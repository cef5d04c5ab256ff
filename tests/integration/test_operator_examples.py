"""Each reference example, reconciled by the real operator on the local control plane: exactly
the pods, env, Services and routing ConfigMap the contract names, pods Running on fake GPU nodes,
and conditions that reach Ready once the pods are Ready."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from operator_fixtures import (  # noqa: F401  (fixtures)
    EXAMPLES,
    Kubectl,
    Operator,
    conditions,
    env_of,
    events_of,
    kube,
    load_example,
    op_namespace,
    operator,
    pods_of,
    routing_cm,
    wait_for,
    wait_ready,
)

from pdd_operator.hashing import content_hash

pytestmark = pytest.mark.integration


def pdd_plan_json(path: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "pdd_cli.main", "plan", "-f", str(path), "-o",
                          "json"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example(path: Path, kube: Kubectl, operator: Operator, op_namespace: str) -> None:
    ns, doc = op_namespace, load_example(path)
    name, spec = doc["metadata"]["name"], doc["spec"]
    kube("apply", "-n", ns, "-f", str(path))
    # kstatus conventions: plain `kubectl wait` understands the Ready condition.
    kube("wait", f"pddeployment/{name}", "-n", ns, "--for=condition=Ready", "--timeout=55s")
    obj = wait_ready(kube, ns, name, operator)
    plan = json.loads(pdd_plan_json(path))
    table = kube("get", "pdd", name, "-n", ns).stdout.splitlines()
    assert table[0].split() == ["NAME", "P-TP", "P-DCP", "D-TP", "D-DCP", "CASE", "READY", "AGE"]
    row = table[1].split()
    assert row[:7] == [name, str(spec["prefill"]["tensorParallelSize"]),
                       str(spec["prefill"]["decodeContextParallelSize"]),
                       str(spec["decode"]["tensorParallelSize"]),
                       str(spec["decode"]["decodeContextParallelSize"]), plan["case"], "True"], (
        json.dumps(kube.json("get", "pdd", name, "-n", ns)["status"], indent=1))

    summary = "; ".join(
        f"D{d['rank']} <- " + ",".join(f"P{r['prefillRank']}" for r in d["reads"])
        for d in plan["decodeRanks"])
    status = obj["status"]
    assert status["observedGeneration"] == obj["metadata"]["generation"]
    assert status["routingCase"] == plan["case"]
    assert status["routingSummary"] == summary
    conds = conditions(obj)
    assert sorted(conds) == sorted(["Validated", "RoutingReady", "PrefillAvailable",
                                    "DecodeAvailable", "Disaggregated", "Ready"])
    assert all(c["status"] == "True" for c in conds.values()), conds
    assert conds["RoutingReady"]["message"] == f"{plan['case']}: {summary}"

    cm = routing_cm(kube, ns, name)
    assert cm["data"] == {"routing.json": pdd_plan_json(path)}

    nodes = {n["metadata"]["name"]: n for n in kube.json("get", "nodes")["items"]}
    for role in ("prefill", "decode"):
        rs = spec[role]
        pods = pods_of(kube, ns, name, role)
        assert [p["metadata"]["name"] for p in pods] == [
            f"{name}-{role}-{i}" for i in range(rs["replicas"])]
        assert status[role] == {
            "replicas": rs["replicas"], "readyReplicas": rs["replicas"],
            "updatedReplicas": rs["replicas"],
            "selector": f"app.kubernetes.io/name=pdd,app.kubernetes.io/instance={name},"
                        f"app.kubernetes.io/component={role}"}
        for i, pod in enumerate(pods):
            assert pod["status"]["phase"] == "Running"
            node = nodes[pod["spec"]["nodeName"]]
            assert int(node["status"]["allocatable"]["nvidia.com/gpu"]) >= rs[
                "tensorParallelSize"]
            labels = pod["metadata"]["labels"]
            assert labels["app.kubernetes.io/name"] == "pdd"
            assert labels["app.kubernetes.io/instance"] == name
            assert labels["app.kubernetes.io/component"] == role
            assert labels["serving.pdd.dev/replica"] == str(i)
            owner = pod["metadata"]["ownerReferences"][0]
            assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
                "PDDeployment", name, obj["metadata"]["uid"], True)
            c = pod["spec"]["containers"][0]
            tp = str(rs["tensorParallelSize"])
            assert c["resources"]["limits"]["nvidia.com/gpu"] == tp
            assert c["resources"]["requests"]["nvidia.com/gpu"] == tp
            extra = {"PDD_PREFILL_SERVICE": f"{name}-prefill.{ns}.svc"} if role == "decode" else {}
            plan_hash = content_hash(cm["data"]["routing.json"], length=10)
            assert labels["serving.pdd.dev/plan-hash"] == plan_hash
            extra["PDD_PLAN_HASH"] = plan_hash
            assert env_of(pod) == {
                **extra,
                "PDD_ROLE": role,
                "PDD_REPLICA": str(i),
                "PDD_TP_SIZE": tp,
                "PDD_DCP_SIZE": str(rs["decodeContextParallelSize"]),
                "PDD_BLOCK_SIZE": str(spec["blockSize"]),
                "PDD_ROUTING_FILE": "/etc/pdd/routing.json",
                "PDD_SIDE_CHANNEL_PORT": str(spec["kvTransfer"]["sideChannelPort"]),
                "PDD_HTTP_PORT": "8000",
                "PDD_MODEL_NAME": spec["model"]["name"],
                "PDD_DTYPE": "bfloat16",
                "PDD_GRANT_KEY_FILE": "/etc/pdd-grant/grant.key",
                "POD_IP": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}},
                "PDD_POD_NAME": {"fieldRef": {"apiVersion": "v1",
                                              "fieldPath": "metadata.name"}},
                "PDD_NAMESPACE": {"fieldRef": {"apiVersion": "v1",
                                               "fieldPath": "metadata.namespace"}},
            }
            mounts = {m["name"]: m for m in c["volumeMounts"]}
            assert mounts["routing"]["mountPath"] == "/etc/pdd"
            assert mounts["grant-key"]["mountPath"] == "/etc/pdd-grant"
            assert mounts["grant-key"]["readOnly"] is True
            assert mounts["dshm"]["mountPath"] == "/dev/shm"
            vols = {v["name"]: v for v in pod["spec"]["volumes"]}
            assert vols["routing"]["configMap"]["name"] == cm["metadata"]["name"]
            assert vols["grant-key"]["secret"]["secretName"] == f"{name}-grant-key"
            assert vols["dshm"]["emptyDir"] == {"medium": "Memory"}
            assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
            assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
            assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        svc = kube.json("get", "service", f"{name}-{role}", "-n", ns)
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == {"app.kubernetes.io/name": "pdd",
                                           "app.kubernetes.io/instance": name,
                                           "app.kubernetes.io/component": role}

    router = kube.json("get", "deployment", name, "-n", ns)
    renv = env_of(router["spec"]["template"])
    for role in ("prefill", "decode"):  # the replicas, then the role's surge pod
        assert renv[f"PDD_{role.upper()}_URLS"] == ",".join(
            f"http://{name}-{role}-{i}.{name}-{role}.{ns}.svc:8000"
            for i in [*range(spec[role]["replicas"]), "surge"])
    rsvc = kube.json("get", "service", name, "-n", ns)
    assert rsvc["spec"]["selector"]["app.kubernetes.io/component"] == "router"

    reasons = {e["reason"] for e in events_of(kube, ns, name)}
    assert {"Created", "Ready"} <= reasons

    # Free the GPUs for the next example: deletion is garbage collection of owned objects.
    kube("delete", "pddeployment", name, "-n", ns, "--timeout=50s")
    wait_for(f"{name}'s pods gone", lambda: not pods_of(kube, ns, name), timeout=60)


def test_metrics_count_reconciles(operator: Operator) -> None:
    text = operator.metrics()
    ok = [line for line in text.splitlines()
          if line.startswith('pdd_operator_reconciles_total{result="ok"}')]
    assert ok and float(ok[0].split()[-1]) > 0, text[:2000]
    assert "pdd_operator_reconcile_duration_seconds_bucket" in text
    assert 'pdd_operator_managed_objects{kind="Pod"}' in text
