"""The kustomize base: `kubectl apply -k manifests/` works on the local control plane, the
operator Deployment runs as non-root with probes, and the RBAC is enough for the operator to do
its whole job while denying what it does not need (the operator runs here with nothing but the
ServiceAccount's token)."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from localcluster import Cluster
from operator_fixtures import (  # noqa: F401  (fixtures)
    CRD_FILE,
    REPO_ROOT,
    Kubectl,
    Operator,
    install_crd,
    kube,
    make_namespace,
    teardown_namespace,
    wait_for,
    wait_ready,
)

pytestmark = pytest.mark.integration
SA = "system:serviceaccount:pdd-system:pdd-operator"


def rendered() -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(REPO_ROOT / "manifests")],
                         capture_output=True, text=True, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_base_renders_with_crd_in_sync() -> None:
    docs = rendered()
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
    assert "Namespace/pdd-system" in kinds and "ServiceAccount/pdd-operator" in kinds
    assert "Deployment/pdd-operator" in kinds and "ClusterRole/pdd-operator" in kinds
    crd = next(d for d in docs if d["kind"] == "CustomResourceDefinition"
               and d["metadata"]["name"] == "pddeployments.serving.pdd.dev")
    committed = yaml.safe_load(CRD_FILE.read_text())
    crd["metadata"].pop("labels", None)
    assert crd == committed, "manifests/base/crd.yaml differs from crds/ (copy it over)"
    role_scale = next(d for d in docs if d["kind"] == "CustomResourceDefinition"
                      and d["metadata"]["name"] == "pddrolescales.serving.pdd.dev")
    role_scale["metadata"].pop("labels", None)
    assert role_scale == yaml.safe_load(
        (REPO_ROOT / "crds" / "serving.pdd.dev_pddrolescales.yaml").read_text())
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    c = pod["containers"][0]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["livenessProbe"] and c["readinessProbe"]
    assert c["command"] == ["python", "-m", "pdd_operator"]
    vwc = next(d for d in docs if d["kind"] == "ValidatingWebhookConfiguration")
    assert vwc["metadata"]["name"] == "pdd-operator.serving.pdd.dev"
    assert vwc["webhooks"] == [], "nothing calls a webhook before an operator serves it"
    for d in docs:
        if d["kind"] in ("Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"):
            assert d["metadata"]["namespace"] == "pdd-system", d["metadata"]


@pytest.fixture(scope="module")
def applied(kube: Kubectl) -> Iterator[None]:
    wait_for("an earlier pdd-system to finish terminating", lambda: (
        (ns := kube.maybe("get", "namespace", "pdd-system")) is None
        or ns["status"].get("phase") != "Terminating"), timeout=120)
    kube("apply", "-k", str(REPO_ROOT / "manifests"))
    yield
    kube("delete", "namespace", "pdd-system", "--wait=false", check=False)
    kube("delete", "clusterrolebinding,clusterrole", "pdd-operator", "--ignore-not-found",
         check=False)
    kube("delete", "clusterrole", "pdd-edit", "pdd-view", "--ignore-not-found", check=False)
    kube("delete", "validatingwebhookconfiguration", "pdd-operator.serving.pdd.dev",
         "--ignore-not-found", check=False)
    install_crd(kube)  # leave the committed CRD, with its kubectl apply history gone


def test_apply_k_creates_the_operator(kube: Kubectl, applied: None) -> None:
    dep = wait_for("operator deployment available", lambda: (
        (d := kube.maybe("get", "deployment", "pdd-operator", "-n", "pdd-system"))
        and d.get("status", {}).get("availableReplicas") == 2 and d), timeout=90)
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "pdd-operator"
    kube("wait", "--for=condition=Established", "crd/pddeployments.serving.pdd.dev")


@pytest.mark.parametrize("verb,resource,allowed", [
    ("create", "pods", True), ("delete", "pods", True), ("patch", "services", True),
    ("create", "configmaps", True), ("create", "deployments.apps", True),
    ("patch", "pddeployments.serving.pdd.dev/status", True), ("create", "events", True),
    ("patch", "events", True), ("delete", "events", False),
    ("delete", "pddeployments.serving.pdd.dev", False),
    # grant-key Secrets: created once, listed as metadata only, never changed or deleted
    ("create", "secrets", True), ("patch", "secrets", False), ("update", "secrets", False),
    ("delete", "secrets", False), ("create", "networkpolicies.networking.k8s.io", True),
    ("create", "clusterroles.rbac.authorization.k8s.io", False), ("delete", "nodes", False),
    ("update", "pddeployments.serving.pdd.dev", False),
    # the shipped webhook configuration, and only it: no create, no other configuration
    ("patch", "validatingwebhookconfigurations/pdd-operator.serving.pdd.dev", True),
    ("patch", "validatingwebhookconfigurations/someone-elses", False),
    ("create", "validatingwebhookconfigurations", False),
])
def test_rbac_is_least_privilege(kube: Kubectl, applied: None, verb: str, resource: str,
                                 allowed: bool) -> None:
    out = kube("auth", "can-i", verb, resource, "-n", "default", f"--as={SA}", check=False)
    assert out.stdout.strip() == ("yes" if allowed else "no"), (verb, resource, out.stderr)


@pytest.mark.parametrize("role,verb,resource,allowed", [
    ("edit", "create", "pddeployments.serving.pdd.dev", True),
    ("edit", "update", "pddeployments.serving.pdd.dev --subresource=scale", True),
    ("edit", "patch", "pddeployments.serving.pdd.dev --subresource=status", False),
    ("view", "list", "pddeployments.serving.pdd.dev", True),
    ("view", "create", "pddeployments.serving.pdd.dev", False),
])
def test_users_get_pddeployments_through_edit_and_view(kube: Kubectl, applied: None, role: str,
                                                       verb: str, resource: str,
                                                       allowed: bool) -> None:
    ns = "default"
    user = f"pdd-{role}-user"
    kube("create", "rolebinding", user, f"--clusterrole={role}", f"--user={user}", "-n", ns,
         check=False)
    try:
        def answer() -> bool:
            out = kube("auth", "can-i", verb, *resource.split(), "-n", ns, f"--as={user}",
                       check=False)
            return out.stdout.strip() == ("yes" if allowed else "no")

        # the aggregation controller fills edit/view from pdd-edit/pdd-view shortly after apply
        wait_for(f"{role} may {'' if allowed else 'not '}{verb} {resource}", answer, timeout=30)
    finally:
        kube("delete", "rolebinding", user, "-n", ns, "--ignore-not-found", check=False)


def sa_kubeconfig(cluster: Cluster, kube: Kubectl, path: Path) -> Path:
    token = kube("create", "token", "pdd-operator", "-n", "pdd-system").stdout.strip()
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    cl = admin["clusters"][0]
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [cl],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": cl["name"], "user": "sa"}}],
    }))
    return path


def test_operator_works_with_only_its_rbac(cluster: Cluster, kube: Kubectl, applied: None,
                                           tmp_path: Path) -> None:
    ns = make_namespace(kube, "oprbac")
    cfg = sa_kubeconfig(cluster, kube, tmp_path / "sa.kubeconfig")
    secret = f"pdd-test-tls-{ns}"
    op = Operator(cluster, ns, tmp_path, env={"KUBECONFIG": str(cfg),
                                              "PDD_TLS_SECRET": f"pdd-system/{secret}"},
                  standalone=False)
    op.webhook_config = "pdd-operator.serving.pdd.dev"  # the shipped one: all its RBAC allows
    shipped = kube.json("get", "validatingwebhookconfiguration", op.webhook_config)
    assert not shipped.get("webhooks"), "shipped empty"
    try:
        op.start()
        doc = next(d for d in yaml.safe_load_all(
            (REPO_ROOT / "manifests/examples/p-tp2-dcp1-to-d-tp4-dcp1.yaml").read_text()) if d)
        kube.apply(doc, "-n", ns)
        obj = wait_ready(kube, ns, doc["metadata"]["name"], op)
        assert obj["status"]["routingCase"] == "replicated-to-replicated"
        tls = kube.json("get", "secret", secret, "-n", "pdd-system")
        vwc = kube.json("get", "validatingwebhookconfiguration", op.webhook_config)
        assert vwc["webhooks"][0]["clientConfig"]["caBundle"] == tls["data"]["ca.crt"]
        assert base64.b64decode(tls["data"]["tls.crt"]).startswith(b"-----BEGIN CERTIFICATE")
        assert kube.maybe("get", "kopfpeering", "pdd-operator", "-n", ns) is not None
        assert kube.maybe("get", "secret", f"{doc['metadata']['name']}-grant-key", "-n", ns)
        assert "Forbidden" not in op.log(tail=400), op.log()
    finally:
        teardown_namespace(kube, ns, op)
        kube("delete", "secret", secret, "-n", "pdd-system", "--ignore-not-found", check=False)
