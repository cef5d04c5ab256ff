"""Deployment modes beside the cluster-wide default: the namespaced overlay (Roles where the
base has a ClusterRole, `--namespace`), and cert-manager's CA injection (the operator serves a
mounted certificate and leaves the webhook configuration alone)."""

from __future__ import annotations

import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from localcluster import Cluster
from operator_fixtures import (  # noqa: F401  (fixtures)
    REPO_ROOT,
    Kubectl,
    Operator,
    kube,
    make_namespace,
    op_namespace,
    operator,
    pods_of,
    teardown_namespace,
    wait_for,
    wait_ready,
)

from pdd_operator.certs import make_bundle
from pdd_operator.config import Config
from pdd_operator.webhook import webhook_configuration

pytestmark = pytest.mark.integration
CLUSTER_SCOPED = {"namespaces", "nodes", "customresourcedefinitions",
                  "validatingwebhookconfigurations", "clusterkopfpeerings", "kopfpeerings"}
SPEC: dict[str, Any] = {
    "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"},
    "image": "pdd:0.1.0",
    "prefill": {"replicas": 1, "tensorParallelSize": 1, "decodeContextParallelSize": 1},
    "decode": {"replicas": 1, "tensorParallelSize": 1, "decodeContextParallelSize": 1},
}


def render(path: str) -> dict[tuple[str, str, str], dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(REPO_ROOT / path)],
                         capture_output=True, text=True, check=True)
    return {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d
            for d in yaml.safe_load_all(out.stdout) if d}


def verbs(rules: list[dict[str, Any]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for rule in rules:
        for res in rule["resources"]:
            out.setdefault(res, set()).update(rule["verbs"])
    return out


def test_namespaced_overlay_grants_namespaced_rights_by_role() -> None:
    base = render("manifests")
    objs = render("manifests/overlays/namespaced")
    wide = base[("ClusterRole", "", "pdd-operator")]["rules"]
    cluster_roles = {n for (k, _, n) in objs if k == "ClusterRole"}
    assert cluster_roles == {"pdd-operator-cluster", "pdd-edit", "pdd-view"}
    assert ("ClusterRoleBinding", "", "pdd-operator") not in objs
    narrow = objs[("ClusterRole", "", "pdd-operator-cluster")]["rules"]
    assert set(verbs(narrow)) == {"namespaces", "customresourcedefinitions",
                                  "validatingwebhookconfigurations"}
    for rule in narrow:
        if rule["resources"] == ["validatingwebhookconfigurations"]:
            assert rule["resourceNames"] == ["pdd-operator.serving.pdd.dev"]
            assert set(rule["verbs"]) == {"get", "patch"}
        else:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
    role = objs[("Role", "pdd-workloads", "pdd-operator-workloads")]
    binding = objs[("RoleBinding", "pdd-workloads", "pdd-operator-workloads")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pdd-operator",
                                    "namespace": "pdd-system"}]
    # Every namespaced rule of the cluster-wide role, in the served namespace only.
    for rule in wide:
        if not set(rule["resources"]) & CLUSTER_SCOPED:
            assert rule in role["rules"], rule
    assert verbs(role["rules"])["kopfpeerings"] >= {"get", "create", "patch"}
    args = objs[("Deployment", "pdd-system", "pdd-operator")]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert "--namespace=pdd-workloads" in args
    assert ("Namespace", "", "pdd-workloads") in objs
    # Optional: free GPUs for surge pods (reads nodes and every namespace's pods).
    cap = yaml.safe_load_all((REPO_ROOT / "manifests" / "components" / "gpu-capacity"
                              / "rbac.yaml").read_text())
    rules = next(d for d in cap if d["kind"] == "ClusterRole")["rules"]
    assert verbs(rules) == {"nodes": {"list"}, "pods": {"list"}}


def test_operator_with_namespace_ignores_other_namespaces(kube: Kubectl, operator: Operator,
                                                          op_namespace: str) -> None:
    other = make_namespace(kube, "other")
    try:
        doc = {"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
               "spec": SPEC}
        kube.apply({**doc, "metadata": {"name": "elsewhere"}}, "-n", other)
        kube.apply({**doc, "metadata": {"name": "here"}}, "-n", op_namespace)
        wait_ready(kube, op_namespace, "here", operator)  # the operator is at work...
        # ... two resync periods later, still nothing for the other namespace
        time.sleep(2 * operator.resync)
        assert pods_of(kube, other, "elsewhere") == []
        obj = kube.json("get", "pddeployment", "elsewhere", "-n", other)
        assert "status" not in obj and not obj["metadata"].get("finalizers"), obj
        assert kube.json("get", "configmaps", "-n", other, "-l",
                         "app.kubernetes.io/instance=elsewhere")["items"] == []
    finally:
        kube("delete", "namespace", other, "--wait=false", check=False)
        kube("delete", "pddeployment", "here", "-n", op_namespace, "--wait=false",
             check=False)


def test_cert_manager_component_injects_the_ca_and_mounts_the_certificate() -> None:
    objs = render("manifests/overlays/cert-manager")
    vwc = objs[("ValidatingWebhookConfiguration", "", "pdd-operator.serving.pdd.dev")]
    assert vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        "pdd-system/pdd-operator-webhook")
    cert = objs[("Certificate", "pdd-system", "pdd-operator-webhook")]
    assert objs[("Issuer", "pdd-system", cert["spec"]["issuerRef"]["name"])]
    assert "pdd-operator-webhook.pdd-system.svc" in cert["spec"]["dnsNames"]
    # The webhook the operator would write itself, less the caBundle cainjector fills in.
    cfg = Config(webhook_service="pdd-system/pdd-operator-webhook", webhook_port=9443)
    want = webhook_configuration(cfg, b"ca")["webhooks"]
    del want[0]["clientConfig"]["caBundle"]
    assert vwc["webhooks"] == want
    pod = objs[("Deployment", "pdd-system", "pdd-operator")]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert "--webhook-cert-dir=/etc/pdd-webhook-tls" in c["args"]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/pdd-webhook-tls")
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert vol["secret"]["secretName"] == cert["spec"]["secretName"]
    assert ("Role", "pdd-system", "pdd-operator") not in objs  # no TLS Secret of its own


def test_operator_serves_a_mounted_certificate_and_leaves_the_webhook_alone(
        cluster: Cluster, kube: Kubectl, tmp_path: Path) -> None:
    ns = make_namespace(kube, "certdir")
    bundle = make_bundle(["127.0.0.1", "localhost"])
    certs = Path(tempfile.mkdtemp(dir=tmp_path))
    (certs / "tls.crt").write_bytes(bundle.cert_pem)
    (certs / "tls.key").write_bytes(bundle.key_pem)
    (certs / "ca.crt").write_bytes(bundle.ca_pem)
    op = Operator(cluster, ns, tmp_path / "logs", env={"PDD_WEBHOOK_CERT_DIR": str(certs)})
    try:
        op.start()
        # It serves exactly the mounted certificate (verified against its CA) ...
        ctx = ssl.create_default_context(cadata=bundle.ca_pem.decode())
        with socket.create_connection(("127.0.0.1", op.webhook_port), timeout=5) as s:
            with ctx.wrap_socket(s, server_hostname="127.0.0.1") as tls:
                served = tls.getpeercert(binary_form=True)
        assert served == ssl.PEM_cert_to_DER_cert(bundle.cert_pem.decode())
        # ... writes no webhook configuration of its own (cert-manager's cainjector would
        # fill the shipped one), and reconciles as usual.
        kube.apply({"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
                    "metadata": {"name": "certs"}, "spec": SPEC}, "-n", ns)
        wait_ready(kube, ns, "certs", op)
        assert kube.maybe("get", "validatingwebhookconfiguration", op.webhook_config) is None
        assert "managed outside the operator" in op.log(200)
    finally:
        teardown_namespace(kube, ns, op)

    # Without the files it refuses to start, naming what is missing.
    empty = Path(tempfile.mkdtemp(dir=tmp_path))
    bad = Operator(cluster, ns, tmp_path / "logs2", env={"PDD_WEBHOOK_CERT_DIR": str(empty)})
    bad.start(wait=False)
    wait_for("the operator to report the missing certificate",
             lambda: "lacks" in bad.log(200), timeout=60)
    assert str(empty / "tls.crt") in bad.log(200)
    bad.stop()


def test_operator_runs_with_only_the_namespaced_overlays_rbac(
        cluster: Cluster, kube: Kubectl, tmp_path: Path) -> None:
    """The overlay's Role (bound in a test namespace) and its cluster-scoped rules, for a
    ServiceAccount of the test's own: the operator serves a PDDeployment and rolls a plan change
    with them alone. It cannot count free GPUs (no cluster-wide pod or node list), so the roll
    goes role by role and says why."""
    ns = make_namespace(kube, "nsrbac")
    objs = render("manifests/overlays/namespaced")
    sa, cluster_role = "pdd-op", f"pdd-test-cluster-{ns}"
    role_rules = objs[("Role", "pdd-workloads", "pdd-operator-workloads")]["rules"]
    cluster_rules = objs[("ClusterRole", "", "pdd-operator-cluster")]["rules"]
    subject = [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]
    kube.apply([
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "workloads", "namespace": ns}, "rules": role_rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "workloads", "namespace": ns}, "subjects": subject,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                     "name": "workloads"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": cluster_role}, "rules": cluster_rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": cluster_role}, "subjects": subject,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": cluster_role}},
    ])
    token = kube("create", "token", sa, "-n", ns).stdout.strip()
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    cl = admin["clusters"][0]
    cfg = tmp_path / "sa.kubeconfig"
    cfg.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa", "clusters": [cl],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": cl["name"], "user": "sa"}}]}))
    op = Operator(cluster, ns, tmp_path / "logs", webhook=False,
                  env={"KUBECONFIG": str(cfg)}, standalone=False)
    try:
        op.start()
        kube.apply({"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
                    "metadata": {"name": "nsrbac"},
                    "spec": {**SPEC, "decode": {**SPEC["decode"], "replicas": 2},
                             "prefill": {**SPEC["prefill"], "replicas": 2}}}, "-n", ns)
        wait_ready(kube, ns, "nsrbac", op)
        assert kube.maybe("get", "kopfpeering", "pdd-operator", "-n", ns) is not None
        kube("patch", "pddeployment", "nsrbac", "-n", ns, "--type=merge", "-p",
             '{"spec": {"blockSize": 32}}')
        wait_ready(kube, ns, "nsrbac", op, timeout=120)
        pods = pods_of(kube, ns, "nsrbac")
        assert len({p["metadata"]["labels"]["serving.pdd.dev/plan-hash"] for p in pods}) == 1
        msgs = [e["message"] for e in kube.json("get", "events", "-n", ns)["items"]
                if e["reason"] == "PlanRoll"]
        assert any("role by role" in m and "free GPUs unknown" in m for m in msgs), msgs
    finally:
        teardown_namespace(kube, ns, op)
        kube("delete", "clusterrolebinding,clusterrole", cluster_role, "--ignore-not-found",
             check=False)
