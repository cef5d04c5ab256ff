"""The pod runner on its own, with a pod that is not pdd's sidecar: what the spec says is what
runs, readiness comes from the probe, names resolve through the runner's DNS, and a deleted pod
leaves nothing behind. Cheap (python -m http.server), so it runs before the model-loading tests.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import urllib.error
import urllib.request
from typing import Any

import harness
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PORT = 8123


def objects(ns: str) -> list[dict[str, Any]]:
    labels = {"app": "web", "app.kubernetes.io/name": "pdd"}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "www"},
         "data": {"index.html": "v1\n"}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
         "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"app": "web"},
                  "ports": [{"name": "http", "port": PORT}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web-vip"},
         "spec": {"selector": {"app": "web"},
                  "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-0", "labels": labels},
         "spec": {
             "hostname": "web-0", "subdomain": "web",
             "containers": [{
                 "name": "main", "image": "pdd:0.1.0",
                 "command": ["python", "-m", "http.server", "$(PORT)"],
                 "args": ["--directory", "/srv/www"],
                 "env": [{"name": "PORT", "value": str(PORT)},
                         {"name": "POD_IP",
                          "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                 "ports": [{"name": "http", "containerPort": PORT}],
                 "volumeMounts": [{"name": "www", "mountPath": "/srv/www", "readOnly": True}],
                 "readinessProbe": {"httpGet": {"path": "/ready.txt", "port": "http"},
                                    "periodSeconds": 1, "failureThreshold": 1},
             }],
             "volumes": [{"name": "www", "configMap": {"name": "www"}}],
         }},
    ]  # fmt: skip


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def ready(pod: dict[str, Any] | None) -> bool:
    conds = ((pod or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def test_pod_runs_as_written_and_is_ready_only_when_its_probe_passes(
    stack: harness.Stack, namespace: str
) -> None:
    ns = namespace
    stack.kubectl(
        "apply",
        "-n",
        ns,
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects(ns)}),
    )
    pod_url = f"http://web-0.web.{ns}.svc:{PORT}"
    # Serving through the pod's DNS name on the port from $(PORT): the process runs, with the
    # ConfigMap at its mountPath, in a network namespace reachable at the name the runner
    # published.
    stack.wait("web-0 serving index.html", lambda: fetch(pod_url + "/index.html") == (200, "v1\n"),
               120)  # fmt: skip
    pod = stack.get("pod", "web-0", ns)
    assert pod is not None
    node = stack.get("node", pod["spec"]["nodeName"], "")
    assert node is not None
    assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(
        node["spec"]["podCIDR"]
    )
    # Serving is not ready: the readiness probe asks for /ready.txt, which is not there.
    assert fetch(pod_url + "/ready.txt")[0] == 404
    assert pod["status"]["phase"] == "Running"
    assert not ready(pod), pod["status"]["conditions"]
    # The ConfigMap update reaches the mounted directory; the probe passes; the pod turns Ready.
    stack.kubectl(
        "patch",
        "configmap",
        "www",
        "-n",
        ns,
        "--type",
        "merge",
        "-p",
        json.dumps({"data": {"index.html": "v1\n", "ready.txt": "ok\n"}}),
    )
    stack.wait("web-0 Ready", lambda: ready(stack.get("pod", "web-0", ns)), 120)
    # ClusterIP Service: port 80 -> targetPort "http" on the ready endpoint.
    stack.wait("ClusterIP proxy", lambda: fetch(f"http://web-vip.{ns}.svc/ready.txt")[0] == 200, 60)

    # Deletion: the process stops, the pod goes, its network namespace and names go too.
    ip = pod["status"]["podIP"]
    stack.kubectl("delete", "pod", "web-0", "-n", ns, "--timeout=60s")
    assert stack.get("pod", "web-0", ns) is None
    stack.wait("web-0 name unpublished",
               lambda: f"web-0.web.{ns}.svc" not in open("/etc/hosts").read(), 30)  # fmt: skip
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert ip.replace(".", "-") not in netns
    assert fetch(pod_url.replace(f"web-0.web.{ns}.svc", ip) + "/index.html")[0] == 0


def test_pod_without_pdd_label_is_refused(stack: harness.Stack, namespace: str) -> None:
    pod = objects(namespace)[-1]
    pod["metadata"] = {"name": "stranger", "labels": {"app": "other"}}
    stack.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))
    got = stack.wait(
        "stranger failed",
        lambda: (lambda p: p if (p or {}).get("status", {}).get("phase") == "Failed" else None)(
            stack.get("pod", "stranger", namespace)
        ),
        60,
    )
    assert got["status"]["reason"] == "NotAPddPod"
