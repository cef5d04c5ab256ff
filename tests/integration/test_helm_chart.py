"""The Helm chart charts/pdd: lint, the same objects as the kustomize base, namespaced mode, and
an install on the local control plane whose RBAC really runs the operator in its namespace.

helm is built from its Go module by `make helm` into .cache/cluster/bin, like the control
plane's binaries; the module fixture builds it when missing and fails (never skips) when it
cannot."""

from __future__ import annotations

import copy
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_env import operator_config
from operator_fixtures import (  # noqa: F401  (fixtures)
    REPO_ROOT,
    Kubectl,
    Operator,
    kube,
    load_example,
    make_namespace,
    teardown_namespace,
    wait_ready,
)

from pdd_operator.__main__ import parse as parse_operator_args
from pdd_operator.config import Config

pytestmark = pytest.mark.integration

CHART = REPO_ROOT / "charts" / "pdd"
HELM = REPO_ROOT / ".cache" / "cluster" / "bin" / "helm"
Key = tuple[str, str, str]


@pytest.fixture(scope="module")
def helm() -> Path:
    if not HELM.exists():
        proc = subprocess.run(["make", "-s", "helm"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=3000, check=False)
        if proc.returncode != 0 or not HELM.exists():
            pytest.fail(f"`make helm` failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                        f"{proc.stderr[-3000:]}", pytrace=False)
    return HELM


def run_helm(helm: Path, *args: str, kubeconfig: str | None = None,
             check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HELM_CACHE_HOME": str(REPO_ROOT / ".cache" / "helm" / "cache"),
           "HELM_CONFIG_HOME": str(REPO_ROOT / ".cache" / "helm" / "config"),
           "HELM_DATA_HOME": str(REPO_ROOT / ".cache" / "helm" / "data")}
    if kubeconfig:
        env["KUBECONFIG"] = kubeconfig
    proc = subprocess.run([str(helm), *args], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    if check:
        assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def render(helm: Path, *sets: str, namespace: str = "pdd-system") -> dict[Key, dict[str, Any]]:
    args = ["template", "pdd", str(CHART), "-n", namespace, "--include-crds"]
    for s in sets:
        args += ["--set", s]
    return by_key(yaml.safe_load_all(run_helm(helm, *args).stdout))


def by_key(docs: Any) -> dict[Key, dict[str, Any]]:
    out: dict[Key, dict[str, Any]] = {}
    for d in docs:
        if d:
            key = (d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"])
            assert key not in out, f"{key} rendered twice"
            out[key] = d
    return out


def kustomize_base() -> dict[Key, dict[str, Any]]:
    proc = subprocess.run(["kubectl", "kustomize", str(REPO_ROOT / "manifests" / "base")],
                          capture_output=True, text=True, check=True, timeout=120)
    return by_key(yaml.safe_load_all(proc.stdout))


def effective_operator_options(args: list[str]) -> dict[str, Any]:
    """What the operator does with these arguments (an option left out means its default)."""
    parsed, defaults = parse_operator_args(args), Config()
    out: dict[str, Any] = {}
    for attr in ("namespace", "resync_seconds", "metrics_port", "liveness_port",
                 "webhook_port", "webhook_host", "webhook_service", "webhook_config_name",
                 "tls_secret", "peering", "priority", "standalone", "concurrency"):
        value = getattr(parsed, attr)
        fallback = {"namespace": None, "peering": defaults.peering_name,
                    "priority": None}.get(attr, getattr(defaults, attr, None))
        out[attr] = fallback if value is None else value
    return out


def normalised(obj: dict[str, Any]) -> dict[str, Any]:
    """Drop what only says who installed it (Helm's labels) and what the operator reads the
    same either way (argument spelling, the image pull policy default)."""
    obj = copy.deepcopy(obj)
    labels = obj["metadata"].pop("labels", {}) or {}
    kept = {k: v for k, v in labels.items()
            if not k.startswith(("helm.sh/", "app.kubernetes.io/managed-by",
                                 "app.kubernetes.io/instance"))}
    if kept:
        obj["metadata"]["labels"] = kept
    if obj["kind"] == "CustomResourceDefinition":
        # The chart's crds/ are verbatim copies (Helm never templates them); kustomize stamps
        # its common label on them.
        obj["metadata"].pop("labels", None)
    if obj["kind"] == "Deployment":
        for c in obj["spec"]["template"]["spec"]["containers"]:
            c["args"] = effective_operator_options(c.get("args", []))
            c.pop("imagePullPolicy", None)
    return obj


def test_lint(helm: Path) -> None:
    for sets in ([], ["--set", "namespaced=true", "--set", "watchNamespaces={a,b}"],
                 ["--set", "webhook.enabled=false,peering.enabled=false,replicaCount=1"]):
        proc = run_helm(helm, "lint", "--strict", str(CHART), *sets)
        assert "0 chart(s) failed" in proc.stdout


def test_chart_crds_are_the_committed_ones() -> None:
    for crd in ("serving.pdd.dev_pddeployments.yaml", "serving.pdd.dev_pddrolescales.yaml"):
        assert (CHART / "crds" / crd).read_text() == (REPO_ROOT / "crds" / crd).read_text()
    assert (CHART / "crds" / "kopf-peering.yaml").read_text() == (
        REPO_ROOT / "manifests" / "base" / "kopf-peering.yaml").read_text()


def test_default_values_render_the_kustomize_base(helm: Path) -> None:
    chart = render(helm, "createNamespace=true")
    base = kustomize_base()
    assert sorted(chart) == sorted(base)
    for key, want in base.items():
        assert normalised(chart[key]) == normalised(want), key


def test_namespaced_mode_uses_roles_in_the_watched_namespaces(helm: Path) -> None:
    objs = render(helm, "namespaced=true", "watchNamespaces={team-a,team-b}", namespace="ops")
    cluster_roles = {n for (k, _, n) in objs if k == "ClusterRole"}
    assert cluster_roles == {"pdd-operator-ops", "pdd-edit", "pdd-view"}
    narrow = objs[("ClusterRole", "", "pdd-operator-ops")]["rules"]
    assert {r for rule in narrow for r in rule["resources"]} == {
        "namespaces", "customresourcedefinitions", "validatingwebhookconfigurations"}
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in narrow
               if rule["resources"] != ["validatingwebhookconfigurations"])
    wide = render(helm)[("ClusterRole", "", "pdd-operator")]["rules"]
    for ns in ("team-a", "team-b"):
        role = objs[("Role", ns, "pdd-operator-workloads")]
        binding = objs[("RoleBinding", ns, "pdd-operator-workloads")]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pdd-operator",
                                        "namespace": "ops"}]
        assert binding["roleRef"]["name"] == "pdd-operator-workloads"
        # Every namespaced rule of the cluster-wide role, and no cluster-scoped resource.
        namespaced = [r for r in wide if not set(r["resources"]) & {
            "namespaces", "nodes", "customresourcedefinitions",
            "validatingwebhookconfigurations", "clusterkopfpeerings", "kopfpeerings"}]
        assert all(r in role["rules"] for r in namespaced)
    assert ("Role", "ops", "pdd-operator-workloads") not in objs
    dep = objs[("Deployment", "ops", "pdd-operator")]
    opts = effective_operator_options(dep["spec"]["template"]["spec"]["containers"][0]["args"])
    assert opts["namespace"] == ["team-a", "team-b"]
    assert opts["webhook_config_name"] == "pdd-operator.ops.serving.pdd.dev"
    assert opts["webhook_service"] == "ops/pdd-operator-webhook"

    only_release = render(helm, "namespaced=true", "rbac.clusterScoped=false",
                          "rbac.userRoles=false", "webhook.enabled=false", namespace="ops")
    assert {k for (k, _, _) in only_release}.isdisjoint({"ClusterRole", "ClusterRoleBinding"})
    assert ("Role", "ops", "pdd-operator-workloads") in only_release
    dep = only_release[("Deployment", "ops", "pdd-operator")]
    opts = effective_operator_options(dep["spec"]["template"]["spec"]["containers"][0]["args"])
    assert opts["namespace"] == ["ops"] and opts["webhook_port"] == 0
    assert ("Service", "ops", "pdd-operator-webhook") not in only_release


@pytest.mark.parametrize("sets", [[], ["operatorName=llm-operator"]])
def test_the_operator_knows_its_namespace_and_label_for_the_scrape_rule(
        helm: Path, sets: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """What the data-plane NetworkPolicy admits scrapes from (builders.Scraper) is the
    release's namespace and the operator pods' own label, whatever operatorName says."""
    name = sets[0].split("=")[1] if sets else "pdd-operator"
    dep = render(helm, *sets, namespace="team-ops")[("Deployment", "team-ops", name)]
    cfg = operator_config(dep, monkeypatch)
    assert cfg.operator_namespace == "team-ops"
    assert cfg.operator_name == dep["spec"]["template"]["metadata"]["labels"][
        "app.kubernetes.io/name"] == name


def test_cluster_mode_install_dry_run_on_the_server(helm: Path, kube: Kubectl) -> None:
    # A namespace of its own: the kustomize test's pdd-system may still be terminating, and a
    # namespace Helm did not create cannot be taken into the release.
    ns = f"pdd-dry-{os.getpid()}"
    proc = run_helm(helm, "install", "pdd", str(CHART), "-n", ns, "--dry-run=server",
                    "--set", "createNamespace=true", kubeconfig=str(kube.cluster.kubeconfig))
    assert "STATUS: pending-install" in proc.stdout
    assert by_key(yaml.safe_load_all(proc.stdout.split("MANIFEST:", 1)[1].split("NOTES:")[0]))


@pytest.fixture
def release_ns(kube: Kubectl) -> Iterator[str]:
    ns = make_namespace(kube, "helm")
    yield ns
    kube("delete", "clusterrolebinding,clusterrole", f"pdd-operator-{ns}", "--ignore-not-found",
         check=False)
    teardown_namespace(kube, ns, None)


def can_i(kube: Kubectl, ns: str, verb: str, what: str, where: str | None,
          *extra: str) -> bool:
    args = ["auth", "can-i", verb, what, f"--as=system:serviceaccount:{ns}:pdd-operator", *extra]
    args += ["-n", where] if where else []
    return kube(*args, check=False).stdout.strip() == "yes"


def test_namespaced_install_runs_the_operator_with_its_rbac(
    helm: Path, kube: Kubectl, release_ns: str, tmp_path: Path
) -> None:
    ns, cfg = release_ns, str(kube.cluster.kubeconfig)
    run_helm(helm, "install", "pdd", str(CHART), "-n", ns, "--set", "namespaced=true",
             "--set", "rbac.userRoles=false", "--set", "replicaCount=1", kubeconfig=cfg)
    listed = run_helm(helm, "list", "-n", ns, "-o", "yaml", kubeconfig=cfg).stdout
    assert [r["status"] for r in yaml.safe_load(listed)] == ["deployed"]
    assert can_i(kube, ns, "create", "pods", ns)
    assert can_i(kube, ns, "patch", "pddeployments.serving.pdd.dev", ns, "--subresource=status")
    assert not can_i(kube, ns, "create", "pods", "default")
    assert not can_i(kube, ns, "list", "pddeployments.serving.pdd.dev", None, "--all-namespaces")
    webhook = f"validatingwebhookconfigurations/pdd-operator.{ns}.serving.pdd.dev"
    assert can_i(kube, ns, "patch", webhook, None)  # the chart's own configuration only
    assert not can_i(kube, ns, "patch", "validatingwebhookconfigurations/other", None)
    assert not can_i(kube, ns, "create", "validatingwebhookconfigurations", None)

    # The operator itself, as that ServiceAccount: the chart's RBAC is enough to reconcile.
    token = kube("create", "token", "pdd-operator", "-n", ns, "--duration=1h").stdout.strip()
    own = yaml.safe_load(Path(cfg).read_text())
    own["users"] = [{"name": "sa", "user": {"token": token}}]
    for ctx in own["contexts"]:
        ctx["context"]["user"] = "sa"
    sa_cfg = tmp_path / "kubeconfig"
    sa_cfg.write_text(yaml.safe_dump(own))
    op = Operator(kube.cluster, ns, tmp_path / "logs", env={"KUBECONFIG": str(sa_cfg)},
                  webhook=False)
    op.start()
    try:
        doc = load_example(REPO_ROOT / "manifests/examples/p-tp2-dcp2-to-d-tp4-dcp4.yaml")
        kube.apply(doc, "-n", ns)
        obj = wait_ready(kube, ns, doc["metadata"]["name"], op)
        assert obj["status"]["routingCase"] == "sharded-to-sharded"
        assert "Forbidden" not in op.log(tail=400), op.log()
        kube("delete", "pddeployment", doc["metadata"]["name"], "-n", ns, "--wait=true",
             "--timeout=60s")
    finally:
        op.stop()
    run_helm(helm, "uninstall", "pdd", "-n", ns, kubeconfig=cfg)
    assert kube("get", "deployment", "pdd-operator", "-n", ns, check=False).returncode != 0


def test_service_monitor_selects_the_operator_metrics_service(helm: Path) -> None:
    objs = render(helm, "metrics.serviceMonitor.enabled=true",
                  "metrics.serviceMonitor.labels.release=prom", namespace="mon")
    mon = objs[("ServiceMonitor", "mon", "pdd-operator")]
    assert mon["metadata"]["labels"]["release"] == "prom"
    services = [o for (kind, ns, _), o in objs.items() if kind == "Service"
                and ns in mon["spec"]["namespaceSelector"]["matchNames"]
                and mon["spec"]["selector"]["matchLabels"].items()
                <= o["metadata"].get("labels", {}).items()]
    assert [s["metadata"]["name"] for s in services] == ["pdd-operator-metrics"]
    assert {e["port"] for e in mon["spec"]["endpoints"]} <= {
        p["name"] for p in services[0]["spec"]["ports"]}
