"""`spec.router.apiKeySecretRef` as a user meets it: a Secret of keys, a PDDeployment that names
it, and requests through the router Service. Without a key 401, with one 200; a rotated Secret
takes effect without a restart (the kubelet swaps the mounted files), a key taken out of it is
refused, and a Secret left without keys refuses everyone until keys are back (fail closed)."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from typing import Any

import harness
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SECRET = "llm-keys"
# The kubelet's sync period on the real node is 10 s; a mounted Secret follows within a few.
ROTATION_S = 180


def secret_doc(namespace: str, keys_text: str) -> str:
    return json.dumps({
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": SECRET, "namespace": namespace},
        "data": {"keys": base64.b64encode(keys_text.encode()).decode()},
    })


def call(stack: harness.Stack, name: str, namespace: str, key: str | None,
         path: str = "/v1/models", body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """(status, parsed body) of one request through the router Service."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(stack.router_url(name, namespace) + path, headers=headers,
                                 data=json.dumps(body).encode() if body is not None else None)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_api_keys_from_a_secret_rotate_revoke_and_fail_closed(
        stack: harness.Stack, namespace: str) -> None:
    _, doc = harness.example("p-tp2-dcp1-to-d-tp4-dcp1")
    name = doc["metadata"]["name"]
    doc["metadata"]["namespace"] = namespace
    doc["spec"]["image"] = harness.sidecar_image()
    doc["spec"]["router"] = {"apiKeySecretRef": {"name": SECRET}}
    stack.kubectl("apply", "-f", "-", input=secret_doc(namespace, "sk-one\nsk-two\n"))
    stack.kubectl("apply", "-f", "-", input=json.dumps(doc))
    stack.wait_ready(name, namespace, timeout=600)

    def status(key: str | None) -> int:
        return call(stack, name, namespace, key)[0]

    def becomes(key: str, code: int, what: str) -> None:
        stack.wait(what, lambda: status(key) == code, ROTATION_S)

    code, body = call(stack, name, namespace, None)
    assert code == 401, body
    assert body["error"]["code"] == "invalid_api_key", body
    code, body = call(stack, name, namespace, "sk-wrong")
    assert code == 401 and body["error"]["code"] == "invalid_api_key", body
    assert status("sk-one") == 200 and status("sk-two") == 200
    prompt = harness.prompt_ids("The quick brown fox")
    code, body = call(stack, name, namespace, "sk-one", "/v1/completions",
                      {"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert code == 200 and len(body["choices"][0]["token_ids"]) == 4, body

    # rotation: sk-one out, sk-three in, sk-two kept; the router pod is not restarted
    router_pods = {p["metadata"]["uid"] for p in router_pods_of(stack, name, namespace)}
    stack.kubectl("apply", "-f", "-", input=secret_doc(namespace, "sk-three\nsk-two\n"))
    becomes("sk-three", 200, "the rotated key accepted")
    becomes("sk-one", 401, "the removed key refused")
    assert status("sk-two") == 200
    assert {p["metadata"]["uid"] for p in router_pods_of(stack, name, namespace)} == router_pods

    # every key removed: nobody gets in, not even with a key that used to work
    stack.kubectl("apply", "-f", "-", input=secret_doc(namespace, "# all revoked\n"))
    becomes("sk-two", 401, "a Secret without keys refusing every key")
    assert status("sk-three") == 401 and status(None) == 401
    assert stack.router_ready(name, namespace), "probes stay open"

    stack.kubectl("apply", "-f", "-", input=secret_doc(namespace, "sk-four\n"))
    becomes("sk-four", 200, "keys back")
    assert status("sk-two") == 401


def router_pods_of(stack: harness.Stack, name: str, namespace: str) -> list[dict[str, Any]]:
    out = stack.kubectl("get", "pods", "-n", namespace, "-o", "json", "-l",
                        f"app.kubernetes.io/instance={name},app.kubernetes.io/component=router")
    pods: list[dict[str, Any]] = json.loads(out)["items"]
    assert pods, "no router pod"
    return pods
