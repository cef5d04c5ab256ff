"""Multi-node instances end to end (docs/lws.md): a PDDeployment whose role sets ``gpusPerPod``
below its TP is applied through the API; the operator renders a LeaderWorkerSet, the LWS
controller makes each group's leader and worker pods (through StatefulSets), the real node's
kubelet runs them as containers, each pod in a network namespace of its own, and the ranks of
one instance meet across pods at ``LWS_LEADER_ADDRESS``.

Through the router Service, a completion must equal the single-process reference, and every
decode rank must receive exactly the routing plan's minimum bytes (as the router reports them
and as the decode leader's metrics count them). A deleted worker pod must bring its whole group
back as LWS's ``RecreateGroupOnPodRestart`` says (a new leader too), serving the reference again.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import harness
import pytest
from localcluster import DEFAULT_BIN_DIR, _env_path, ensure_lws

from pdd_api.routing import bytes_per_decode_rank, load_plan
from pdd_sidecar.model.config import builtin_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# 270 byte-tokens: five 64-token blocks, the last one partial, so every DCP rank holds KV.
PROMPT = harness.prompt_ids("The quick brown fox jumps over the lazy dog. " * 6)
MAX_TOKENS = 8
BLOCK = 64
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
HTTP_PORT = 8000
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"

Side = tuple[int, int, int | None]  # tp, dcp, gpusPerPod (None: one pod per instance)


def spec(name: str, prefill: Side, decode: Side) -> dict[str, Any]:
    def role(side: Side) -> dict[str, Any]:
        tp, dcp, per_pod = side
        out: dict[str, Any] = {
            "replicas": 1,
            "tensorParallelSize": tp,
            "decodeContextParallelSize": dcp,
            "resources": {"limits": {"nvidia.com/gpu": per_pod or tp}},
            # Every completion moves the whole prompt's KV, held to the plan's minimum bytes;
            # the prefix cache would reuse the repeated prompt (tested in the dataplane tier).
            "prefixCache": False,
        }
        if per_pod is not None:
            out["gpusPerPod"] = per_pod
        return out

    return {
        "apiVersion": "serving.pdd.dev/v1alpha1",
        "kind": "PDDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"},
            "image": "pdd:0.1.0",
            "blockSize": BLOCK,
            "kvTransfer": {"backend": "UCX", "sideChannelPort": 5600},
            "prefill": role(prefill),
            "decode": role(decode),
            # Through the hand-off these tests check, never prefilled on the decode.
            "router": {"localPrefillTokens": 0},
        },
    }


@dataclass
class Deployment:
    stack: harness.Stack
    namespace: str
    doc: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.doc["metadata"]["name"])

    @property
    def dtype(self) -> str:
        return harness.spec_dtype(self.doc)

    def wait_ready(self) -> None:
        self.stack.wait_ready(self.name, self.namespace, timeout=600)

    def pods(self, role: str) -> list[dict[str, Any]]:
        """The role's live pods (not terminating), leader first."""
        out = self.stack.kubectl(
            "get", "pods", "-n", self.namespace, "-o", "json",
            "-l", f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component={role}",
        )  # fmt: skip
        items = [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]
        return sorted(items, key=lambda p: p["metadata"]["name"])

    def plan_text(self) -> str:
        pod = self.stack.get("pod", f"{self.name}-decode-0", self.namespace)
        assert pod is not None
        cm_name = next(v["configMap"]["name"] for v in pod["spec"]["volumes"]
                       if v["name"] == "routing")  # fmt: skip
        cm = self.stack.get("configmap", cm_name, self.namespace)
        assert cm is not None
        return str(cm["data"]["routing.json"])

    def leader_url(self, role: str) -> str:
        """At the leader's pod IP: the node's pods are reachable from the host, which does not
        resolve cluster names."""
        n = f"{self.name}-{role}"
        pod = self.stack.get("pod", f"{n}-0", self.namespace)
        assert pod is not None, f"no leader pod {n}-0"
        return f"http://{pod['status']['podIP']}:{HTTP_PORT}"

    def transfer_bytes_metric(self) -> dict[int, float]:
        """The decode leader's pdd_kv_transfer_bytes per rank (every rank of the instance,
        those on worker pods included)."""
        with urllib.request.urlopen(self.leader_url("decode") + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[int, float] = {}
        for m in re.finditer(r'^pdd_kv_transfer_bytes_total\{rank="(\d+)"\} (\S+)$', text, re.M):
            out[int(m.group(1))] = float(m.group(2))
        return out

    def check_completion(self) -> tuple[int, int]:
        """One completion through the router: the reference's tokens, and per decode rank
        the plan's minimum bytes in the router's answer and in the decode leader's metrics.
        Returns (bytes moved, minimum)."""
        model = builtin_config()
        per_token = model.num_hidden_layers * model.latent_dim * DTYPE_BYTES[self.dtype]
        need = bytes_per_decode_rank(load_plan(self.plan_text()), len(PROMPT), per_token)
        before = self.transfer_bytes_metric()
        result = self.stack.complete(self.name, self.namespace, PROMPT, MAX_TOKENS)
        after = self.transfer_bytes_metric()
        assert result["choices"][0]["token_ids"] == harness.reference(
            PROMPT, MAX_TOKENS, self.dtype
        )
        ranks = sorted(result["pdd"]["transfer"]["ranks"], key=lambda r: r["rank"])
        moved = [r["bytes"] for r in ranks]
        assert [r["rank"] for r in ranks] == list(range(len(need))), ranks
        assert moved == need, f"bytes per decode rank {moved} != plan minimum {need}"
        counted = [after.get(r, 0) - before.get(r, 0) for r in range(len(need))]
        assert counted == need, f"decode metrics counted {counted}, plan minimum {need}"
        return sum(moved), sum(need)


def deploy(stack: harness.Stack, namespace: str, doc: dict[str, Any]) -> Deployment:
    stack.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc))
    dep = Deployment(stack, namespace, doc)
    dep.wait_ready()
    return dep


def check_groups(dep: Deployment, role: str, side: Side) -> list[dict[str, Any]]:
    """The role runs as one LWS group of tp/gpusPerPod pods, each on its own pod IP, with
    LWS's env and the group index as PDD_REPLICA; returns the pods, leader first."""
    tp, _dcp, per_pod = side
    assert per_pod is not None
    lws = dep.stack.get("leaderworkerset", f"{dep.name}-{role}", dep.namespace)
    assert lws is not None, f"no LeaderWorkerSet {dep.name}-{role}"
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == tp // per_pod
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    pods = dep.pods(role)
    base = f"{dep.name}-{role}-0"
    assert [p["metadata"]["name"] for p in pods] == [base] + [
        f"{base}-{k}" for k in range(1, tp // per_pod)
    ]
    assert len({p["status"]["podIP"] for p in pods}) == len(pods)
    for k, pod in enumerate(pods):
        assert pod["metadata"]["labels"][LWS_NAME_LABEL] == f"{dep.name}-{role}"
        assert pod["metadata"]["labels"][GROUP_INDEX_LABEL] == "0"
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "StatefulSet"
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["LWS_WORKER_INDEX"] == str(k)
        assert env["LWS_LEADER_ADDRESS"] == f"{base}.{dep.name}-{role}.{dep.namespace}"
    # The leader lists every rank's side channel on the pod that holds it.
    with urllib.request.urlopen(dep.leader_url(role) + "/v1/info", timeout=10) as r:
        info = json.loads(r.read())
    assert info["pods"] == tp // per_pod
    hosts = [h for h, _port in info["rank_endpoints"]]
    ips = {p["status"]["podIP"]: k for k, p in enumerate(pods)}
    names = {f"{p['metadata']['name']}.{dep.name}-{role}.{dep.namespace}.svc": k
             for k, p in enumerate(pods)}  # fmt: skip
    holders = [ips.get(h, names.get(h)) for h in hosts]
    assert holders == [r // per_pod for r in range(tp)], (hosts, ips)
    return pods


@pytest.fixture(scope="module")
def lws(stack: harness.Stack) -> None:
    """The LeaderWorkerSet controller on the stack's control plane (its CRD, its webhooks);
    left running with the stack, which stops it with the rest."""
    assert stack.cluster is not None
    ensure_lws(stack.cluster.state_dir, _env_path("PDD_CLUSTER_BIN", DEFAULT_BIN_DIR),
               log=lambda m: stack.say(f"  lws: {m}"))  # fmt: skip


def _namespace(stack: harness.Stack) -> str:
    ns = f"e2e-lws-{uuid.uuid4().hex[:6]}"
    stack.create_namespace(ns)
    return ns


@pytest.fixture(scope="module")
def decode_spanning(stack: harness.Stack, lws: None) -> Iterator[Deployment]:
    """P TP2 (one pod) -> D TP4/DCP4 on two pods of two ranks each: replicated -> sharded."""
    ns = _namespace(stack)
    try:
        yield deploy(stack, ns, spec("lws-d", (2, 1, None), (4, 4, 2)))
    finally:
        stack.kubectl("delete", "namespace", ns, "--timeout=120s", check=False)


def test_prefill_spanning_two_pods_serves_the_reference_with_minimum_bytes(
    stack: harness.Stack, lws: None
) -> None:
    """P TP4/DCP4 on two pods of two ranks each -> D TP2/DCP2 (one pod): sharded -> sharded,
    each decode rank reading from prefill ranks on both pods."""
    ns = _namespace(stack)
    try:
        p_side: Side = (4, 4, 2)
        dep = deploy(stack, ns, spec("lws-p", p_side, (2, 2, None)))
        assert dep.stack.get("leaderworkerset", f"{dep.name}-decode", ns) is None
        check_groups(dep, "prefill", p_side)
        moved, minimum = dep.check_completion()
        print(f"\nP TP4/DCP4 x2 pods -> D TP2/DCP2: bytes moved {moved} / minimum {minimum}")
    finally:
        # Wait, so the next deployment does not share the CPU with this one's exit.
        stack.kubectl("delete", "namespace", ns, "--timeout=120s", check=False)


def test_decode_spanning_two_pods_serves_the_reference_with_minimum_bytes(
    decode_spanning: Deployment,
) -> None:
    dep = decode_spanning
    assert dep.stack.get("leaderworkerset", f"{dep.name}-prefill", dep.namespace) is None
    check_groups(dep, "decode", (4, 4, 2))
    moved, minimum = dep.check_completion()
    print(f"\nP TP2 -> D TP4/DCP4 x2 pods: bytes moved {moved} / minimum {minimum}")


def test_deleted_worker_pod_recreates_its_group_which_serves_again(
    decode_spanning: Deployment,
) -> None:
    """RecreateGroupOnPodRestart: deleting the worker pod makes LWS delete the group's leader
    too, so both come back as new pods (a restarted worker alone would leave the leader's
    uid unchanged), and the instance serves the reference again."""
    dep = decode_spanning
    dep.wait_ready()
    leader, worker = dep.pods("decode")
    old = {leader["metadata"]["uid"], worker["metadata"]["uid"]}
    t0 = time.monotonic()
    dep.stack.kubectl("delete", "pod", worker["metadata"]["name"], "-n", dep.namespace,
                      "--wait=false")  # fmt: skip

    def recreated() -> bool:
        pods = dep.pods("decode")
        fresh = len(pods) == 2 and not ({p["metadata"]["uid"] for p in pods} & old)
        ready = all(
            any(c["type"] == "Ready" and c["status"] == "True"
                for c in (p.get("status") or {}).get("conditions") or [])
            for p in pods
        )  # fmt: skip
        return fresh and ready and dep.stack.is_ready(dep.name, dep.namespace)

    dep.stack.wait("the decode group recreated and Ready", recreated, 600,
                   progress=lambda: dep.stack.progress_line(dep.name, dep.namespace))  # fmt: skip
    dep.wait_ready()
    t_ready = time.monotonic()
    moved, minimum = dep.check_completion()
    t_served = time.monotonic()
    print(
        f"\nworker pod deleted: group recreated and Ready after {t_ready - t0:.1f}s, "
        f"first completion after {t_served - t0:.1f}s (bytes {moved} / minimum {minimum})"
    )
    check_groups(dep, "decode", (4, 4, 2))
