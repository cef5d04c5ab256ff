"""Chaos: the operator SIGKILLed at random points while PDDeployments are applied, scaled, rolled
and deleted still converges to exactly the objects the builders describe.

A seeded schedule (PDD_CHAOS_SEED) applies PDD_CHAOS_DEPLOYMENTS copies of the examples under new
names, scales their decode role through the scale subresource, rolls them (decode DCP flipped
between 1 and tp, which changes the routing plan and rolls both roles; an image change; a decode
env change), deletes some and re-creates a few deleted names (a new uid while the old objects may
still await garbage collection). PDD_CHAOS_KILLS SIGKILLs (default 8 to keep the tier short; 50
by hand) land at random delays after random operations, each followed at once by a restart, so
kills hit start-up, listing, passes with writes in flight and idle periods. Then the operator
runs undisturbed and the namespace must hold exactly the desired objects: for each live
PDDeployment the kinds and names `builders.build` yields plus the grant-key Secret, pods with the
desired spec hash, nothing of a deleted PDDeployment left (kube-controller-manager's garbage
collector), no duplicate pods, status for the current generation with consistent conditions.
It stays so a resync period later, and three more kills of the converged operator replace no
pod. Knobs: PDD_CHAOS_KILLS, _SEED, _DEPLOYMENTS, _OPERATIONS, _MAX_DELAY, _CONVERGE_TIMEOUT;
the figures (kills, divergences right after the chaos and at the end, seconds to converge) are
printed (`-s`) and written to chaos.json in the test's tmp_path.

The pods land on fake nodes of this module's own (tainted, so no other test's pods go there), so
the GPUs the examples ask for never run out and other tests keep the shared nodes' GPUs.
"""

from __future__ import annotations

import copy
import json
import os
import random
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import pytest
from localcluster import FAKE_NODE_ANNOTATION, Cluster
from operator_fixtures import (  # noqa: F401  (fixtures)
    EXAMPLES,
    GROUP,
    PLURAL,
    VERSION,
    Kubectl,
    Operator,
    conditions,
    kube,
    load_example,
    make_namespace,
    teardown_namespace,
    wait_for,
)

from pdd_api import keys
from pdd_api.models import PDDeploymentSpec
from pdd_api.validation import validate_spec
from pdd_operator.builders import Owner, build, grant_secret_name, is_subset, selector

pytestmark = pytest.mark.integration

KILLS = int(os.environ.get("PDD_CHAOS_KILLS", "8"))
SEED = int(os.environ.get("PDD_CHAOS_SEED", "1206"))
DEPLOYMENTS = int(os.environ.get("PDD_CHAOS_DEPLOYMENTS", "20"))
OPERATIONS = int(os.environ.get("PDD_CHAOS_OPERATIONS", str(3 * DEPLOYMENTS)))
CONVERGE_TIMEOUT = float(os.environ.get("PDD_CHAOS_CONVERGE_TIMEOUT", "180"))
# Seconds after an operation (or start-up) a kill may wait: a pass takes about that long here.
MAX_KILL_DELAY = float(os.environ.get("PDD_CHAOS_MAX_DELAY", "2.5"))
NODES, NODE_GPUS = 4, 128
TAINT_KEY = "serving.pdd.dev/chaos"
MERGE = "application/merge-patch+json"
# Everything a PDDeployment owns, and the router's ReplicaSets (owned by its Deployment).
RESOURCES = ("pods", "services", "configmaps", "deployments.apps", "secrets",
             "networkpolicies.networking.k8s.io", "replicasets.apps")
ASSESSED_CONDITIONS = ("Validated", "RoutingReady", "PrefillAvailable", "DecodeAvailable")


# ----------------------------------------------------------------------------- the nodes


def node_body(name: str, namespace: str) -> dict[str, Any]:
    resources = {"cpu": "256", "memory": "2Ti", "pods": "110", "ephemeral-storage": "1Ti",
                 "nvidia.com/gpu": str(NODE_GPUS)}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {FAKE_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {TAINT_KEY: namespace, "kubernetes.io/hostname": name,
                       "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"},
        },
        "spec": {"taints": [{"key": TAINT_KEY, "value": namespace, "effect": "NoSchedule"}]},
        "status": {"capacity": resources, "allocatable": dict(resources)},
    }


def nodes_ready(k: Kubectl, namespace: str) -> bool:
    items = k.json("get", "nodes", "-l", f"{TAINT_KEY}={namespace}")["items"]
    ready = [n for n in items for c in n["status"].get("conditions") or []
             if c["type"] == "Ready" and c["status"] == "True"]
    return len(ready) == NODES


@pytest.fixture
def chaos_namespace(kube: Kubectl) -> Iterator[str]:
    ns = make_namespace(kube, "opchaos")
    names = [f"{ns}-node-{i}" for i in range(NODES)]
    kube.apply([node_body(n, ns) for n in names])
    try:
        wait_for("the chaos nodes Ready", lambda: nodes_ready(kube, ns), timeout=90)
        yield ns
    finally:
        teardown_namespace(kube, ns, None)
        try:
            wait_for(f"the pods of {ns} gone", lambda: not kube.json(
                "get", "pods", "-n", ns)["items"], timeout=120, interval=2)
        except AssertionError:
            pass  # the pod garbage collector removes pods of deleted nodes anyway
        kube("delete", "node", *names, "--ignore-not-found", "--wait=false", check=False)


# ----------------------------------------------------------------------------- the schedule


@dataclass
class Chaos:
    """The live cluster through the Python client (a kubectl process per operation would cost
    more CPU than the operator on this machine), and what the schedule did."""

    cluster: Cluster
    namespace: str
    rng: random.Random
    live: dict[str, str] = field(default_factory=dict)  # name -> uid
    deleted_uids: set[str] = field(default_factory=set)
    ever: set[str] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=dict)
    rounds: int = 0

    def __post_init__(self) -> None:
        from kubernetes import client, config

        api = config.new_client_from_config(str(self.cluster.kubeconfig))
        self.custom = client.CustomObjectsApi(api)
        self.api = api

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def get(self, name: str) -> dict[str, Any]:
        return cast(dict[str, Any], self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name))

    def patch(self, name: str, body: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name,
                                                   body, _content_type=MERGE)

    def apply(self, name: str, example: Path) -> None:
        doc = copy.deepcopy(load_example(example))
        doc["metadata"] = {"name": name, "namespace": self.namespace}
        for role in ("prefill", "decode"):
            doc["spec"][role]["nodeSelector"] = {TAINT_KEY: self.namespace}
            doc["spec"][role]["tolerations"] = [
                {"key": TAINT_KEY, "operator": "Equal", "value": self.namespace,
                 "effect": "NoSchedule"}]
        from kubernetes.client.rest import ApiException

        def create() -> dict[str, Any] | None:
            try:
                return cast(dict[str, Any], self.custom.create_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, doc))
            except ApiException as exc:
                if exc.status != 409:  # a re-created name: the old one may still be going
                    raise
                return None

        out = wait_for(f"create {name}", create, timeout=60, interval=0.5)
        self.live[name] = out["metadata"]["uid"]
        self.ever.add(name)
        self._count("apply")

    def scale(self, name: str) -> None:
        current = self.get(name)["spec"]["decode"]["replicas"]
        replicas = self.rng.choice([r for r in (1, 2, 3) if r != current])
        self.custom.patch_namespaced_custom_object_scale(
            GROUP, VERSION, self.namespace, PLURAL, name, {"spec": {"replicas": replicas}},
            _content_type=MERGE)
        self._count("scale")

    def roll(self, name: str) -> None:
        spec = self.get(name)["spec"]
        self.rounds += 1
        kind = self.rng.choice(["dcp", "image", "env"])
        if kind == "dcp":
            d = spec["decode"]
            flipped = 1 if d["decodeContextParallelSize"] != 1 else d["tensorParallelSize"]
            candidate = copy.deepcopy(spec)
            candidate["decode"]["decodeContextParallelSize"] = flipped
            if not validate_spec(candidate):
                self.patch(name, {"spec": {"decode": {"decodeContextParallelSize": flipped}}})
                self._count("roll-dcp")
                return
            kind = "image"
        if kind == "image":
            self.patch(name, {"spec": {"image": f"pdd:0.1.{self.rounds}"}})
        else:
            self.patch(name, {"spec": {"decode": {"env": [
                {"name": "CHAOS_ROUND", "value": str(self.rounds)}]}}})
        self._count(f"roll-{kind}")

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        self.deleted_uids.add(self.live.pop(name))
        self._count("delete")


def schedule(chaos: Chaos, names: list[str]) -> Iterator[Callable[[], None]]:
    """The operations, drawn from the seeded generator as the live set evolves (consume it
    lazily): every name is applied once, then scale / roll / delete / re-create at random."""
    rng = chaos.rng
    pending = list(names)
    gone: list[str] = []

    def example(name: str) -> Path:
        return EXAMPLES[names.index(name) % len(EXAMPLES)]

    for step in range(OPERATIONS):
        left = OPERATIONS - step
        if pending and (not chaos.live or rng.random() < len(pending) / left * 1.5):
            name = pending.pop(0)
            yield partial(chaos.apply, name, example(name))
            continue
        live = sorted(chaos.live)
        r = rng.random()
        if gone and r < 0.05:
            yield partial(chaos.apply, gone.pop(rng.randrange(len(gone))), rng.choice(EXAMPLES))
        elif r < 0.15 and len(live) > 1:
            gone.append(rng.choice(live))
            yield partial(chaos.delete, gone[-1])
        elif r < 0.55:
            yield partial(chaos.scale, rng.choice(live))
        else:
            yield partial(chaos.roll, rng.choice(live))
    for name in pending:  # OPERATIONS smaller than the deployments: apply the rest
        yield partial(chaos.apply, name, example(name))


@dataclass(frozen=True, order=True)
class KillPoint:
    """`delay` seconds after an operation, or after the operator (restarted just before) is up:
    start-up takes seconds here, so without the latter most kills would hit start-up."""

    delay: float
    after_startup: bool


def kill_points(rng: random.Random, kills: int, operations: int) -> dict[int, list[KillPoint]]:
    """After which operation each kill lands, and when."""
    points: dict[int, list[KillPoint]] = {}
    for _ in range(kills):
        points.setdefault(rng.randrange(operations), []).append(
            KillPoint(rng.uniform(0, MAX_KILL_DELAY), rng.random() < 0.75))
    return points


def live_endpoint(op: Operator) -> bool:
    try:
        url = f"http://127.0.0.1:{op.liveness_port}/healthz"
        with urllib.request.urlopen(url, timeout=0.3) as r:
            return bool(r.status == 200)
    except OSError:
        return False


# ----------------------------------------------------------------------------- the verdict


def _owner_uids(obj: dict[str, Any], kind: str = "PDDeployment") -> list[str]:
    return [r["uid"] for r in obj["metadata"].get("ownerReferences") or []
            if r.get("kind") == kind]


def divergences(k: Kubectl, ns: str, ever: set[str], deleted_uids: set[str]) -> list[str]:
    """Every way the namespace differs from what the live PDDeployments describe."""
    pdds = {p["metadata"]["name"]: p for p in k.json("get", "pddeployments", "-n", ns)["items"]}
    listed = k.json("get", ",".join(RESOURCES), "-n", ns)["items"]
    by_uid = {p["metadata"]["uid"]: p for p in pdds.values()}
    out: list[str] = []
    owned: dict[str, dict[tuple[str, str], dict[str, Any]]] = {u: {} for u in by_uid}
    for obj in listed:
        kind, name = obj["kind"], obj["metadata"]["name"]
        ref = f"{kind}/{name}"
        uids = _owner_uids(obj)
        if obj["metadata"].get("deletionTimestamp"):
            out.append(f"{ref}: still terminating")
        if len(uids) > 1:
            out.append(f"{ref}: owned by {len(uids)} PDDeployments")
        for uid in uids:
            if uid in owned:
                owned[uid][(kind, name)] = obj
            else:
                gone = "a deleted" if uid in deleted_uids else "an unknown"
                out.append(f"{ref}: orphan of {gone} PDDeployment (uid {uid})")
        inst = (obj["metadata"].get("labels") or {}).get(keys.LABEL_INSTANCE)
        if inst in ever and inst not in pdds:
            out.append(f"{ref}: left over from deleted PDDeployment {inst}")
    for name, body in sorted(pdds.items()):
        out += [f"{name}: {d}" for d in assess(body, owned[body["metadata"]["uid"]], listed)]
    return out


def assess(body: dict[str, Any], have: dict[tuple[str, str], dict[str, Any]],
           listed: list[dict[str, Any]]) -> list[str]:
    meta = body["metadata"]
    name, ns, uid, gen = meta["name"], meta["namespace"], meta["uid"], meta["generation"]
    spec = PDDeploymentSpec.model_validate(body["spec"])
    desired = build(Owner(name, ns, uid), spec)
    want: dict[tuple[str, str], dict[str, Any] | None] = {
        (o["kind"], o["metadata"]["name"]): o for o in desired.owned_non_pods()}
    for by_index in desired.pods.values():
        want.update({("Pod", p["metadata"]["name"]): p for p in by_index.values()})
    want[("Secret", grant_secret_name(name))] = None  # random content: existence only
    out = [f"missing {kind}/{n}" for kind, n in sorted(set(want) - set(have))]
    out += [f"unexpected {kind}/{n}" for kind, n in sorted(set(have) - set(want))]
    for key in sorted(set(want) & set(have)):
        w, h = want[key], have[key]
        ref = f"{key[0]}/{key[1]}"
        ctrl = [r["uid"] for r in h["metadata"].get("ownerReferences") or [] if r.get("controller")]
        if ctrl != [uid]:
            out.append(f"{ref}: controller references {ctrl}, not [{uid}]")
        if w is None:
            continue
        if key[0] == "Pod":
            hw = w["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH]
            hh = (h["metadata"].get("annotations") or {}).get(keys.ANNOTATION_SPEC_HASH)
            if hh != hw:
                out.append(f"{ref}: spec hash {hh}, desired {hw}")
        elif not is_subset(w, h):
            out.append(f"{ref}: differs from the builders' object")
    for role in ("prefill", "decode"):  # duplicates under other names, our labels
        pods = [o for o in listed if o["kind"] == "Pod" and (o["metadata"].get("labels") or {})
                .get(keys.LABEL_COMPONENT) == role and o["metadata"]["labels"].get(
                    keys.LABEL_INSTANCE) == name]
        if len(pods) != getattr(spec, role).replicas:
            out.append(f"{len(pods)} {role} pods, spec asks {getattr(spec, role).replicas}")
    out += assess_router(name, spec.router.replicas if spec.router.enabled else 0, have, listed)
    out += assess_status(body, gen, spec)
    return out


def assess_router(name: str, replicas: int, have: dict[tuple[str, str], dict[str, Any]],
                  listed: list[dict[str, Any]]) -> list[str]:
    """The router's ReplicaSets and pods belong to the current Deployment of that name (not to
    one of an earlier PDDeployment of the same name) and there are as many as it asks."""
    dep = have.get(("Deployment", name))
    dep_uid = dep["metadata"]["uid"] if dep is not None else None
    rlabels = {k: v for k, v in selector(Owner(name, "", ""), keys.COMPONENT_ROUTER).items()}
    out: list[str] = []
    rs_uids = set()
    for obj in listed:
        if obj["kind"] != "ReplicaSet" or (obj["metadata"].get("labels") or {}).get(
                keys.LABEL_INSTANCE) != name:
            continue
        if _owner_uids(obj, "Deployment") != [dep_uid]:
            out.append(f"ReplicaSet/{obj['metadata']['name']} not owned by Deployment/{name}")
        rs_uids.add(obj["metadata"]["uid"])
    pods = [o for o in listed if o["kind"] == "Pod" and all(
        (o["metadata"].get("labels") or {}).get(k) == v for k, v in rlabels.items())]
    for pod in pods:
        if not set(_owner_uids(pod, "ReplicaSet")) <= rs_uids or not _owner_uids(
                pod, "ReplicaSet"):
            out.append(f"router Pod/{pod['metadata']['name']} of no current ReplicaSet")
    if len(pods) != replicas:
        out.append(f"{len(pods)} router pods, want {replicas}")
    return out


def assess_status(body: dict[str, Any], gen: int, spec: PDDeploymentSpec) -> list[str]:
    status = body.get("status") or {}
    out: list[str] = []
    if status.get("observedGeneration") != gen:
        out.append(f"status.observedGeneration {status.get('observedGeneration')}, "
                   f"generation {gen}")
    conds = conditions(body)
    for t in (*ASSESSED_CONDITIONS, "Ready"):
        c = conds.get(t)
        if c is None:
            out.append(f"no {t} condition")
        elif c.get("observedGeneration") != gen:
            out.append(f"{t}.observedGeneration {c.get('observedGeneration')}, generation {gen}")
    ready = conds.get("Ready", {}).get("status")
    parts_true = all(conds.get(t, {}).get("status") == "True" for t in ASSESSED_CONDITIONS)
    if (ready == "True") != parts_true:
        out.append(f"Ready={ready} but " + ", ".join(
            f"{t}={conds.get(t, {}).get('status')}" for t in ASSESSED_CONDITIONS))
    if ready != "True":
        c = conds.get("Ready", {})
        out.append(f"Ready={ready} ({c.get('reason')}: {c.get('message')})")
    if "Stalled" in conds and conds["Stalled"]["status"] == "True":
        out.append(f"Stalled: {conds['Stalled'].get('message')}")
    for role in ("prefill", "decode"):
        want = getattr(spec, role).replicas
        got = status.get(role) or {}
        for f in ("replicas", "readyReplicas", "updatedReplicas"):
            if got.get(f) != want:
                out.append(f"status.{role}.{f} {got.get(f)}, spec replicas {want}")
    return out


def pod_uids(k: Kubectl, ns: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"]
            for p in k.json("get", "pods", "-n", ns)["items"]}


# ----------------------------------------------------------------------------- the test


def test_sigkill_at_random_points_converges_to_exactly_the_desired_objects(
        cluster: Cluster, kube: Kubectl, chaos_namespace: str, tmp_path: Path) -> None:
    ns = chaos_namespace
    chaos = Chaos(cluster, ns, random.Random(SEED))
    points = kill_points(random.Random(SEED + 1), KILLS, OPERATIONS)
    names = [f"chaos-{i:02d}" for i in range(DEPLOYMENTS)]
    op = Operator(cluster, ns, tmp_path, webhook=False)
    op.start()
    figures: dict[str, Any] = {"seed": SEED, "kills": 0, "kills_after_startup": 0}
    try:
        t0 = time.monotonic()
        for step, action in enumerate(schedule(chaos, names)):
            action()
            mark = time.monotonic()
            for point in sorted(points.get(step, [])):
                if point.after_startup:
                    wait_for("the restarted operator up", lambda: live_endpoint(op)
                             or not op.alive(), timeout=90, interval=0.1)
                    mark = time.monotonic()
                time.sleep(max(0.0, mark + point.delay - time.monotonic()))
                figures["kills_after_startup"] += live_endpoint(op)
                assert op.alive(), f"the operator died on its own:\n{op.log()}"
                op.stop(kill=True)
                assert op.proc is not None and op.proc.returncode == -9
                figures["kills"] += 1
                op.start(wait=False)
        figures["chaos_s"] = round(time.monotonic() - t0, 1)
        figures["operations"] = dict(sorted(chaos.counts.items()))
        figures["live"] = len(chaos.live)
        figures["deleted"] = len(chaos.deleted_uids)

        # Undisturbed from here: the operator restarted last must bring everything in line.
        t1 = time.monotonic()
        op.wait_ready()
        figures["divergences_after_chaos"] = len(
            divergences(kube, ns, chaos.ever, chaos.deleted_uids))
        last: list[str] = []

        def converged() -> bool:
            nonlocal last
            assert op.alive(), f"the operator died undisturbed:\n{op.log()}"
            last = divergences(kube, ns, chaos.ever, chaos.deleted_uids)
            return not last

        try:
            wait_for("convergence", converged, timeout=CONVERGE_TIMEOUT, interval=2)
        except AssertionError as exc:
            figures["divergences"] = len(last)
            raise AssertionError(
                f"{exc} ({json.dumps(figures)}); "
                f"{len(last)} divergences:\n" + "\n".join(last[:80])
                + f"\noperator log:\n{op.log(120)}") from None
        figures["converge_s"] = round(time.monotonic() - t1, 1)
        figures["divergences"] = 0
        # Still exact a resync period later: nothing flaps once converged.
        time.sleep(2 * op.resync)
        again = divergences(kube, ns, chaos.ever, chaos.deleted_uids)
        assert not again, "diverged again after converging:\n" + "\n".join(again)
        assert figures["kills"] == KILLS

        # Killing a converged operator replaces nothing: the same pods after restarts.
        uids = pod_uids(kube, ns)
        for _ in range(3):
            op.stop(kill=True)
            op.start()
            time.sleep(chaos.rng.uniform(0, MAX_KILL_DELAY))
        time.sleep(op.resync)
        again = divergences(kube, ns, chaos.ever, chaos.deleted_uids)
        assert not again, "diverged after idle restarts:\n" + "\n".join(again)
        assert pod_uids(kube, ns) == uids, "pods were replaced after idle restarts"

        # The verdict can fail: with the operator dead, a deleted pod and a new generation show.
        op.stop(kill=True)
        victim = sorted(chaos.live)[0]
        pod = f"{victim}-decode-0"
        kube("delete", "pod", pod, "-n", ns, "--wait=false")
        chaos.roll(victim)
        seen = "\n".join(divergences(kube, ns, chaos.ever, chaos.deleted_uids))
        assert f"Pod/{pod}" in seen and f"{victim}: status.observedGeneration" in seen, seen
        assert chaos.counts.get("apply", 0) >= DEPLOYMENTS
    finally:
        print(f"\nchaos figures: {json.dumps(figures)}")
        (tmp_path / "chaos.json").write_text(json.dumps(figures))
        op.stop()
