"""The data-plane NetworkPolicy as the node's network applies it: the planner's scrape rule
admits a pod labelled as the operator in the operator's namespace and refuses the same label in
any other namespace (a tenant can set any label on its own pods, never its namespace's
`kubernetes.io/metadata.name`).

The policy is the builders' own object, applied to a stand-in instance (an HTTP server with an
instance's labels), so no model has to load. A node whose network does not enforce
NetworkPolicy (the CNI bridge plugin, for one) lets a deny-all policy through too: the test
finds that out first with a canary and skips, saying so, rather than passing without a check.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import harness
import pytest

from pdd_api import keys
from pdd_api.validation import parse_spec
from pdd_operator.builders import Owner, Scraper, build_network_policies

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

INSTANCE = "netpol"
SERVE = ["python", "-m", "http.server", str(keys.HTTP_PORT)]


def pod(name: str, namespace: str, labels: dict[str, str], command: list[str],
        restart: str = "Always") -> str:
    return json.dumps({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "restartPolicy": restart,
            "containers": [{"name": "main", "image": harness.sidecar_image(),
                            "imagePullPolicy": "Never", "command": command}],
        },
    })


def reaches(stack: harness.Stack, namespace: str, labels: dict[str, str], ip: str) -> bool:
    """Whether a pod with these labels in this namespace opens a TCP connection to ip:8000."""
    name = f"client-{uuid.uuid4().hex[:6]}"
    probe = ("import socket,sys\n"
             "try:\n"
             f"    socket.create_connection(({ip!r}, {keys.HTTP_PORT}), timeout=5).close()\n"
             "except OSError:\n"
             "    sys.exit(1)\n")
    stack.kubectl("apply", "-f", "-",
                  input=pod(name, namespace, labels, ["python", "-c", probe], "Never"))
    phase = stack.wait(f"client {namespace}/{name} done", lambda: (
        (p := stack.get("pod", name, namespace)) is not None
        and p.get("status", {}).get("phase") in ("Succeeded", "Failed")
        and p["status"]["phase"]), 180)
    return bool(phase == "Succeeded")


def serving(stack: harness.Stack, name: str, namespace: str, labels: dict[str, str]) -> str:
    stack.kubectl("apply", "-f", "-", input=pod(name, namespace, labels, SERVE))

    def ip() -> str:
        p = stack.get("pod", name, namespace) or {}
        st = p.get("status", {})
        ready = st.get("phase") == "Running" and st.get("podIP")
        return str(st["podIP"]) if ready else ""

    return str(stack.wait(f"{namespace}/{name} running", ip, 180))


def dataplane_policy(namespace: str, operator_namespace: str) -> dict[str, Any]:
    spec = parse_spec({"model": {"name": "m"}, "image": harness.sidecar_image(),
                       "prefill": {"replicas": 1}, "decode": {"replicas": 1},
                       "autoscaling": {"decode": {"maxReplicas": 2}}})
    owner = Owner(INSTANCE, namespace, "not-a-pddeployment")
    policy = next(p for p in build_network_policies(owner, spec, Scraper(operator_namespace))
                  if p["metadata"]["name"] == f"{INSTANCE}-dataplane")
    policy["metadata"].pop("ownerReferences", None)  # no such owner: keep it from the collector
    return policy


def test_the_scrape_rule_refuses_a_look_alike_operator_in_another_namespace(
        stack: harness.Stack, namespace: str) -> None:
    suffix = uuid.uuid4().hex[:6]
    ops, tenant = f"e2e-ops-{suffix}", f"e2e-tenant-{suffix}"
    for ns in (ops, tenant):
        stack.create_namespace(ns)
    try:
        canary = serving(stack, "canary", namespace, {"canary": "yes"})
        stack.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "deny-canary", "namespace": namespace},
            "spec": {"podSelector": {"matchLabels": {"canary": "yes"}},
                     "policyTypes": ["Ingress"], "ingress": []}}))
        if reaches(stack, tenant, {}, canary):
            pytest.skip("the node's network does not enforce NetworkPolicy (a deny-all policy "
                        "let a connection through): nothing here can refuse the look-alike")
        instance = {keys.LABEL_NAME: keys.APP_NAME, keys.LABEL_INSTANCE: INSTANCE,
                    keys.LABEL_COMPONENT: "decode"}
        target = serving(stack, f"{INSTANCE}-decode-0", namespace, instance)
        stack.kubectl("apply", "-f", "-", input=json.dumps(dataplane_policy(namespace, ops)))
        operator = {keys.LABEL_NAME: keys.OPERATOR_APP_NAME}
        assert reaches(stack, ops, operator, target), "the operator's own pods are admitted"
        assert not reaches(stack, tenant, operator, target), "a look-alike elsewhere is not"
        assert not reaches(stack, ops, {keys.LABEL_NAME: "something-else"}, target)
    finally:
        for ns in (ops, tenant):
            stack.kubectl("delete", "namespace", ns, "--wait=false", check=False)
