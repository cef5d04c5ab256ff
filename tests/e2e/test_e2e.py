"""The whole path as a user meets it: ``kubectl apply`` of a PDDeployment -> operator -> pods
with the injected routing -> the real node's kubelet and containerd -> sidecar containers ->
NIXL hand-off -> completion through the router Service, compared token for token with the
single-process reference.

The reference deployment (P TP2/DCP2 -> D TP4/DCP4) is deployed once and then taken through
the lifecycle tests in file order (delete a decode pod, change decode DCP under traffic, scale
decode), each of which starts by waiting for the deployment to be Ready, so each checks its own
claim.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import harness
import pytest

from pdd_api.models import GPU_RESOURCE as GPU

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REFERENCE_EXAMPLE = "p-tp2-dcp2-to-d-tp4-dcp4"
# One per routing case family that is not the reference's: sharded->replicated and
# replicated->sharded (the reference itself is sharded->sharded).
CONFIGS = [REFERENCE_EXAMPLE, "p-tp4-dcp4-to-d-tp4-dcp1", "p-tp2-dcp1-to-d-tp4-dcp4"]
# 270 byte-tokens: five 64-token blocks, the last one partial, so every DCP rank holds KV.
PROMPT = harness.prompt_ids("The quick brown fox jumps over the lazy dog. " * 6)
MAX_TOKENS = 8


@dataclass
class Deployment:
    stack: harness.Stack
    namespace: str
    name: str
    doc: dict[str, Any]

    @property
    def dtype(self) -> str:
        return harness.spec_dtype(self.doc)

    def reference(self) -> list[int]:
        return harness.reference(PROMPT, MAX_TOKENS, self.dtype)

    def complete(self) -> dict[str, Any]:
        return self.stack.complete(self.name, self.namespace, PROMPT, MAX_TOKENS)

    def get(self) -> dict[str, Any]:
        obj = self.stack.get("pddeployment", self.name, self.namespace)
        assert obj is not None
        return obj

    def patch(self, spec: dict[str, Any]) -> None:
        self.stack.kubectl(
            "patch", "pddeployment", self.name, "-n", self.namespace, "--type", "merge",
            "-p", json.dumps({"spec": spec}),
        )  # fmt: skip

    def pod(self, role: str, index: int) -> dict[str, Any] | None:
        return self.stack.get("pod", f"{self.name}-{role}-{index}", self.namespace)

    def routing(self) -> dict[str, Any]:
        """The plan decode-0 runs with: the routing ConfigMap its pod mounts (named by plan
        hash, `<name>-routing-<hash>`); {} while there is no such pod (mid-roll)."""
        pod = self.pod("decode", 0)
        if pod is None:
            return {}
        name = next(v["configMap"]["name"] for v in pod["spec"]["volumes"]
                    if v["name"] == "routing")
        cm = self.stack.get("configmap", name, self.namespace)
        return dict(json.loads(cm["data"]["routing.json"])) if cm is not None else {}

    def wait_ready(self) -> None:
        self.stack.wait_ready(self.name, self.namespace, timeout=600)


def deploy(stack: harness.Stack, namespace: str, example: str) -> Deployment:
    text, doc = harness.example(example)
    stack.kubectl("apply", "-n", namespace, "-f", "-", input=text)
    dep = Deployment(stack, namespace, doc["metadata"]["name"], doc)
    dep.wait_ready()
    return dep


def pod_ready(pod: dict[str, Any] | None) -> bool:
    conds = ((pod or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def served_by(result: dict[str, Any], pod: dict[str, Any]) -> bool:
    """The router reports the decode URL it used, by pod DNS name or by pod IP."""
    url = (result.get("pdd") or {}).get("decode", "")
    host = url.split("//", 1)[-1].split(":", 1)[0]
    return host.split(".")[0] == pod["metadata"]["name"] or host == pod["status"].get("podIP")


@dataclass
class Request:
    started: float
    ok: bool
    tokens: list[int] | None = None
    result: dict[str, Any] | None = None
    error: str = ""


@dataclass
class Traffic:
    """Requests one after another through the router Service until stopped; a failed request
    is recorded (with its start time) and the next one follows shortly."""

    dep: Deployment
    requests: list[Request] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(180)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                r = self.dep.stack.complete(self.dep.name, self.dep.namespace, PROMPT, MAX_TOKENS,
                                            60)
                toks = list(r["choices"][0]["token_ids"])
                self.requests.append(Request(t, True, toks, r))
            except Exception as e:  # noqa: BLE001 - every failure kind counts as failed
                self.requests.append(Request(t, False, error=f"{type(e).__name__}: {e}"))
                self._stop.wait(0.5)

    def after(self, t: float) -> list[Request]:
        return [r for r in list(self.requests) if r.started >= t]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def reference_deployment(stack: harness.Stack) -> Iterator[Deployment]:
    ns = f"e2e-ref-{uuid.uuid4().hex[:6]}"
    stack.create_namespace(ns)
    try:
        yield deploy(stack, ns, REFERENCE_EXAMPLE)
    finally:
        stack.kubectl("delete", "namespace", ns, "--timeout=120s", check=False)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("example", CONFIGS)
def test_reference_configuration_completion_equals_reference(
    request: pytest.FixtureRequest, stack: harness.Stack, example: str
) -> None:
    if example == REFERENCE_EXAMPLE:
        dep: Deployment = request.getfixturevalue("reference_deployment")
        ns = None
    else:
        ns = f"e2e-{uuid.uuid4().hex[:6]}"
        stack.create_namespace(ns)
        dep = deploy(stack, ns, example)
    try:
        status = dep.get()["status"]
        assert status["routingCase"] == dep.routing()["case"]
        result = dep.complete()
        assert result["choices"][0]["token_ids"] == dep.reference()
        # The KV really moved: every decode rank received some (five blocks >= any DCP size).
        ranks = result["pdd"]["transfer"]["ranks"]
        assert len(ranks) == dep.doc["spec"]["decode"]["tensorParallelSize"]
        assert all(r["bytes"] > 0 for r in ranks), ranks
    finally:
        if ns is not None:
            # Wait, so the next configuration does not share the CPU with this one's exit.
            stack.kubectl("delete", "namespace", ns, "--timeout=120s", check=False)


def test_delete_decode_pod_under_traffic(reference_deployment: Deployment) -> None:
    dep = reference_deployment
    dep.wait_ready()
    old = dep.pod("decode", 0)
    assert old is not None and dep.get()["spec"]["decode"]["replicas"] == 1
    gap: dict[str, Any] = {}

    def recreated_and_ready() -> bool:
        conds = {c["type"]: c for c in dep.get()["status"].get("conditions", [])}
        if conds.get("DecodeAvailable", {}).get("status") == "False" and not gap:
            gap.update(conds["DecodeAvailable"])
        pod = dep.pod("decode", 0)
        new = pod is not None and pod["metadata"]["uid"] != old["metadata"]["uid"]
        return bool(gap) and new and pod_ready(pod) and dep.stack.is_ready(dep.name, dep.namespace)

    with Traffic(dep) as traffic:
        time.sleep(1)
        dep.stack.kubectl("delete", "pod", old["metadata"]["name"], "-n", dep.namespace,
                          "--wait=false")  # fmt: skip
        dep.stack.wait(
            "decode pod recreated after a visible gap",
            recreated_and_ready,
            600,
            progress=lambda: dep.stack.progress_line(dep.name, dep.namespace),
        )
        dep.wait_ready()
        t_back = time.monotonic()
        dep.stack.wait("3 requests after recovery", lambda: len(traffic.after(t_back)) >= 3, 300)
    assert gap["status"] == "False" and gap.get("reason"), gap
    later = traffic.after(t_back)
    assert all(r.ok for r in later), [r.error for r in later if not r.ok]
    assert all(r.tokens == dep.reference() for r in later)


def test_change_decode_dcp_4_to_1_under_traffic(reference_deployment: Deployment) -> None:
    """A routing-plan change rolls both roles: a surge pair on the new plan (the stack has
    GPUs to spare), then the replicas. Requests keep flowing throughout: none fails and every
    completion equals the reference, on the old plan and on the new."""
    dep = reference_deployment
    dep.wait_ready()
    before = dep.routing()
    assert before["decode"]["decodeContextParallelSize"] == 4
    old_uid = dep.pod("decode", 0)["metadata"]["uid"]  # type: ignore[index]
    surge_seen: set[str] = set()

    def new_plan_running() -> bool:
        surge_seen.update(r for r in ("prefill", "decode")
                          if dep.stack.get("pod", f"{dep.name}-{r}-surge", dep.namespace))
        plan = dep.routing()
        pod = dep.pod("decode", 0)
        if pod is None or pod["metadata"]["uid"] == old_uid or not pod_ready(pod):
            return False
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        return (
            plan.get("decode", {}).get("decodeContextParallelSize") == 1
            and env.get("PDD_DCP_SIZE") == "1"
            and dep.stack.is_ready(dep.name, dep.namespace)
        )

    # The surge this test is about needs a free pair's GPUs: the namespaces of earlier tests
    # may still be ending (their pods drain), and without room the roll goes role by role,
    # which with one replica a role leaves a gap by design (docs/operator.md).
    spec = dep.get()["spec"]
    pair = sum(float(spec[r]["resources"]["limits"][GPU]) for r in ("prefill", "decode"))
    dep.stack.wait(f"{pair:.0f} free GPUs for a surge pair", lambda: dep.stack.free_gpus() >= pair,
                   300)
    with Traffic(dep) as traffic:
        dep.stack.wait("3 requests before the change", lambda: len(traffic.requests) >= 3, 300)
        t_patch = time.monotonic()
        dep.patch({"decode": {"decodeContextParallelSize": 1}})
        dep.stack.wait("the roll to DCP 1 done", new_plan_running, 900,
                       progress=lambda: dep.stack.progress_line(dep.name, dep.namespace))
        dep.wait_ready()
        t_done = time.monotonic()
        dep.stack.wait("3 requests after the roll", lambda: len(traffic.after(t_done)) >= 3,
                       300)
    during = traffic.after(t_patch)
    failed = [r for r in traffic.requests if not r.ok]
    print(f"plan-changing roll under traffic: {len(traffic.requests)} requests "
          f"({len(during)} from the change on, {len(traffic.after(t_done))} after it), "
          f"{len(failed)} failed; roll took {t_done - t_patch:.0f}s")
    if failed:
        print("failed requests (seconds after the change):",
              [(round(r.started - t_patch, 1), r.error) for r in failed])
        print(dep.stack.diagnostics(400))
    assert not failed, [r.error for r in failed]
    assert all(r.tokens == dep.reference() for r in traffic.requests)
    assert surge_seen == {"prefill", "decode"}, "the roll surged a new pair first"
    after = dep.routing()
    assert (before["case"], after["case"]) == ("sharded-to-sharded", "sharded-to-replicated")
    # A new conversation after the roll runs on the new plan: replicated decode KV, so every
    # decode rank receives the same bytes. (The traffic's repeated prompt may move nothing:
    # the decode keeps the KV of what it served and takes the prompt from its prefix cache.)
    prompt = [251, *PROMPT]
    result = dep.stack.complete(dep.name, dep.namespace, prompt, MAX_TOKENS)
    assert result["choices"][0]["token_ids"] == harness.reference(prompt, MAX_TOKENS, dep.dtype)
    per_rank = [r["bytes"] for r in result["pdd"]["transfer"]["ranks"]]
    assert len(set(per_rank)) == 1 and per_rank[0] > 0, per_rank


def test_scale_decode_1_to_2_under_traffic(reference_deployment: Deployment) -> None:
    dep = reference_deployment
    dep.wait_ready()
    assert dep.get()["spec"]["decode"]["replicas"] == 1
    with Traffic(dep) as traffic:
        time.sleep(1)
        dep.patch({"decode": {"replicas": 2}})
        new_pod = dep.stack.wait(
            "decode-1 Ready",
            lambda: (lambda p: p if pod_ready(p) else None)(dep.pod("decode", 1)),
            600,
            progress=lambda: dep.stack.progress_line(dep.name, dep.namespace),
        )
        t_ready = time.monotonic()
        dep.stack.wait("6 requests after the new replica was Ready",
                       lambda: len(traffic.after(t_ready)) >= 6, 300)
        # The traffic repeats one prompt, which the cache-aware router keeps on the decode
        # that holds it; new conversations go by load, so the new replica takes some once the
        # router (which a scale rolls) knows it.
        deadline = time.monotonic() + 300
        salt = 0
        while True:
            salt += 1
            prompt = [salt % 250 + 1, *PROMPT]
            result = dep.stack.complete(dep.name, dep.namespace, prompt, MAX_TOKENS)
            if served_by(result, new_pod):
                assert result["choices"][0]["token_ids"] == harness.reference(
                    prompt, MAX_TOKENS, dep.dtype)
                break
            assert time.monotonic() < deadline, (
                f"no new conversation went to the new decode replica in {salt} tries")
            time.sleep(1)
    later = traffic.after(t_ready)
    assert later, "no request after the new replica was Ready"
    assert all(r.ok for r in later), [r.error for r in later if not r.ok]
    assert all(r.tokens == dep.reference() for r in later)
    assert dep.get()["status"]["decode"]["readyReplicas"] == 2
