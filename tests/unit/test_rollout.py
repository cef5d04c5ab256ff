"""The plan-changing roll policy (rollout.coordinate), run against a simulated cluster in which
pods turn Ready and disappear one event at a time in a random order, so the invariants are
checked at every state the operator can see, not only where a real cluster happens to pause.
Also: free GPUs per node, and the store with resourceVersions that are not numbers."""

from __future__ import annotations

import copy
import itertools
import random
from typing import Any

import pytest

from pdd_api import keys
from pdd_api.validation import parse_spec
from pdd_operator.builders import Owner, build, plan_hash
from pdd_operator.rollout import (
    Delete,
    coordinate,
    plan_role,
    pod_info,
    roll_starting,
    surge_fits,
)
from pdd_operator.store import Store

OWNER = Owner("demo", "ns1", "uid-1")
SPEC: dict[str, Any] = {
    "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"},
    "image": "pdd:0.1.0",
    "blockSize": 64,
    "prefill": {"replicas": 2, "tensorParallelSize": 2, "decodeContextParallelSize": 2},
    "decode": {"replicas": 2, "tensorParallelSize": 2, "decodeContextParallelSize": 2},
    "rollout": {"maxUnavailable": 1},
}
ROLES = ("prefill", "decode")


class World:
    """Pods as the API server holds them; `step` makes one thing happen."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.pods: dict[str, dict[str, Any]] = {}
        self.uids = itertools.count()
        self.log: list[str] = []

    def create(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        assert name not in self.pods, f"{name} created while it exists"
        p = copy.deepcopy(pod)
        p["metadata"]["uid"] = f"pod-{next(self.uids)}"
        p["status"] = {"phase": "Pending"}
        self.pods[name] = p
        self.log.append(f"create {name}")

    def delete(self, d: Delete) -> None:
        p = self.pods[d.name]
        assert p["metadata"]["uid"] == d.uid
        p["metadata"]["deletionTimestamp"] = "now"
        p["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
        self.log.append(f"delete {d.name} ({d.reason})")

    def step(self) -> bool:
        todo = [n for n, p in self.pods.items()
                if p["metadata"].get("deletionTimestamp") or p["status"]["phase"] == "Pending"]
        if not todo:
            return False
        name = self.rng.choice(sorted(todo))
        p = self.pods[name]
        if p["metadata"].get("deletionTimestamp"):
            del self.pods[name]
            self.log.append(f"gone {name}")
        else:
            p["status"] = {"phase": "Running",
                           "conditions": [{"type": "Ready", "status": "True"}]}
            self.log.append(f"ready {name}")
        return True

    def of(self, role: str) -> list[dict[str, Any]]:
        return [p for p in self.pods.values()
                if p["metadata"]["labels"][keys.LABEL_COMPONENT] == role]

    def ready_pairs(self) -> set[str]:
        """Plans with a Ready prefill and a Ready decode (what the router can pair)."""
        ready: dict[str, set[str]] = {r: set() for r in ROLES}
        for r in ROLES:
            for p in self.of(r):
                info = pod_info(p)
                if info.ready and info.plan:
                    ready[r].add(info.plan)
        return ready["prefill"] & ready["decode"]

    def draining_without_decode(self) -> list[str]:
        """Terminating prefills with no Ready decode of their plan: their last requests, whose
        KV they still hold, would find no decode to go on."""
        decodes = {pod_info(p).plan for p in self.of("decode") if pod_info(p).ready}
        return [p["metadata"]["name"] for p in self.of("prefill")
                if p["metadata"].get("deletionTimestamp") and pod_info(p).plan not in decodes]


def operator_pass(world: World, spec_doc: dict[str, Any], room: Any) -> str:
    spec = parse_spec(spec_doc)
    desired = build(OWNER, spec)
    current = plan_hash(desired.plan)
    roles, infos = {}, {}
    for r in ROLES:
        pods = world.of(r)
        index = [p for p in pods if keys.LABEL_SURGE not in p["metadata"]["labels"]]
        roles[r] = plan_role(desired.pods[r], index, OWNER.uid, spec.rollout.maxUnavailable,
                             OWNER.name)
        infos[r] = [pod_info(p) for p in pods]
    starting = roll_starting(current, infos, {r: getattr(spec, r).replicas for r in ROLES})
    if starting and callable(room):
        room = room()  # free GPUs are counted only when a roll starts
    roll = coordinate(current, {r: getattr(spec, r).replicas for r in ROLES}, roles, infos,
                      dict(desired.surge_pods), room if starting else None)
    for r in ROLES:
        for pod in roles[r].create:
            world.create(pod)
        for d in roll.allowed[r]:
            world.delete(d)
    for pod in roll.create:
        world.create(pod)
    for d in roll.delete:
        world.delete(d)
    return roll.mode


def converge(world: World, spec_doc: dict[str, Any], room: bool) -> None:
    for _ in range(500):
        operator_pass(world, spec_doc, room)
        if not world.step():
            operator_pass(world, spec_doc, room)
            if not world.step():
                return
    raise AssertionError("no convergence:\n" + "\n".join(world.log[-40:]))


def roll(seed: int, room: Any, replicas: dict[str, int]) -> tuple[World, list[str]]:
    old = copy.deepcopy(SPEC)
    for r, n in replicas.items():
        old[r]["replicas"] = n
    world = World(random.Random(seed))
    converge(world, old, room)
    new = copy.deepcopy(old)
    new["decode"]["decodeContextParallelSize"] = 1  # a new routing plan, same GPUs per pod
    new_hash = plan_hash(build(OWNER, parse_spec(new)).plan)
    old_hash = plan_hash(build(OWNER, parse_spec(old)).plan)
    world.log.clear()
    modes = []
    for _ in range(500):
        modes.append(operator_pass(world, new, room))
        pairs = world.ready_pairs()
        assert pairs, "no Ready pair:\n" + "\n".join(world.log[-30:])
        if not world.step():
            modes.append(operator_pass(world, new, room))
            if not world.step():
                break
        assert world.ready_pairs(), "no Ready pair:\n" + "\n".join(world.log[-30:])
        assert not world.draining_without_decode(), "\n".join(world.log[-30:])
    names = sorted(world.pods)
    assert names == sorted(f"demo-{r}-{i}" for r in ROLES for i in range(replicas[r])), names
    assert {pod_info(p).plan for p in world.pods.values()} == {new_hash}
    assert old_hash != new_hash
    return world, modes


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("replicas", [{"prefill": 1, "decode": 1}, {"prefill": 2, "decode": 3}])
def test_with_room_a_surge_pair_comes_up_before_any_old_pod_goes(
        seed: int, replicas: dict[str, int]) -> None:
    world, modes = roll(seed, True, replicas)
    log = world.log
    first_delete = next(i for i, e in enumerate(log) if e.startswith("delete"))
    surge_ready = [i for i, e in enumerate(log) if e.startswith("ready") and "surge" in e]
    assert len(surge_ready) == 2 and max(surge_ready) < first_delete, log
    assert any(e.startswith("create demo-prefill-surge") for e in log[:first_delete])
    assert "Surge" in modes and "RoleByRole" not in modes[:first_delete]
    # The last old decode goes only once no old prefill is left (a draining prefill still
    # hands KV to a decode of its plan).
    assert all(e.endswith("(Surge)") for e in log if "surge" in e and e.startswith("delete"))


@pytest.mark.parametrize("seed", range(12))
def test_without_room_roles_go_one_after_the_other(seed: int) -> None:
    replicas = {"prefill": 2, "decode": 2}
    world, modes = roll(seed, False, replicas)
    log = world.log
    assert not any("surge" in e for e in log), log
    assert set(modes) - {""} == {"RoleByRole"}
    first_decode_delete = next(i for i, e in enumerate(log)
                               if e.startswith("delete demo-decode"))
    new_prefill_ready = next(i for i, e in enumerate(log)
                             if e.startswith("ready demo-prefill"))
    assert new_prefill_ready < first_decode_delete, log


@pytest.mark.parametrize("seed", range(6))
def test_room_that_frees_up_mid_roll_does_not_switch_to_surge(seed: int) -> None:
    """GPUs freed by the first old pods going must not start a surge half way through."""
    asked: list[bool] = []

    def room() -> bool:
        asked.append(True)
        return len(asked) > 1  # no room when the roll starts, room ever after

    world, modes = roll(seed, room, {"prefill": 2, "decode": 2})
    assert not any("surge" in e for e in world.log), world.log
    assert set(modes) - {""} == {"RoleByRole"}


def test_single_replicas_without_room_still_converge() -> None:
    """No room and one pod per role: the gap cannot be avoided, but the roll finishes."""
    old = copy.deepcopy(SPEC)
    old["prefill"]["replicas"] = old["decode"]["replicas"] = 1
    world = World(random.Random(0))
    converge(world, old, False)
    new = copy.deepcopy(old)
    new["decode"]["decodeContextParallelSize"] = 1
    converge(world, new, False)
    assert sorted(world.pods) == ["demo-decode-0", "demo-prefill-0"]


def _node(name: str, gpus: int, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"pool": name}}, "spec": spec,
            "status": {"allocatable": {"nvidia.com/gpu": str(gpus)},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def _pod(gpus: int, node: str | None = None, phase: str = "Running",
         **spec: Any) -> dict[str, Any]:
    return {"spec": {"nodeName": node, **spec, "containers": [
        {"resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": phase}}


def test_surge_fits_counts_free_gpus_per_node() -> None:
    nodes = [_node("a", 8), _node("b", 8)]
    used = [_pod(6, "a"), _pod(4, "b"), _pod(8, "b", phase="Failed")]
    assert surge_fits([_pod(2), _pod(4)], nodes, used, "nvidia.com/gpu")  # 2 on a, 4 on b
    assert not surge_fits([_pod(4), _pod(4)], nodes, used, "nvidia.com/gpu")  # 2 + 4 free
    assert not surge_fits([_pod(3)], [_node("a", 8, unschedulable=True)], [], "nvidia.com/gpu")
    tainted = _node("t", 8, taints=[{"key": "gpu", "effect": "NoSchedule"}])
    assert not surge_fits([_pod(1)], [tainted], [], "nvidia.com/gpu")
    tolerant = _pod(1, tolerations=[{"key": "gpu", "operator": "Exists"}])
    assert surge_fits([tolerant], [tainted], [], "nvidia.com/gpu")
    assert not surge_fits([_pod(1, nodeSelector={"pool": "b"})], [_node("a", 8)], [],
                          "nvidia.com/gpu")


def _obj(name: str, uid: str, rv: str, phase: str = "Pending") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid, "resourceVersion": rv,
                         "labels": {keys.LABEL_INSTANCE: "demo"}},
            "status": {"phase": phase}}


def test_store_takes_resource_versions_as_opaque_strings() -> None:
    """No int() and no ordering: these versions would sort the wrong way as numbers and
    as text, and "x9" is no number at all."""
    store = Store()
    assert store.upsert("Pod", _obj("p", "u1", "x9"))
    assert store.upsert("Pod", _obj("p", "u1", "x10", "Running"))  # arrival order wins
    assert store.get("Pod", "ns", "p")["status"]["phase"] == "Running"  # type: ignore[index]
    # Our write's answer overtakes the watch: events before its version are older.
    assert store.upsert("Pod", _obj("p", "u1", "b-7", "Succeeded"), written=True)
    assert not store.upsert("Pod", _obj("p", "u1", "a-3", "Running"))
    assert store.upsert("Pod", _obj("p", "u1", "b-7", "Succeeded"))  # the watch caught up
    assert store.upsert("Pod", _obj("p", "u1", "c", "Failed"))
    # Deleted: a late event of that uid never brings it back; a new incarnation does.
    store.remove("Pod", _obj("p", "u1", "d"))
    assert not store.upsert("Pod", _obj("p", "u1", "c", "Failed"))
    assert store.get("Pod", "ns", "p") is None
    assert store.upsert("Pod", _obj("p", "u2", "e"), written=True)
    assert not store.upsert("Pod", _obj("p", "u1", "zz"))  # the old pod's late event
    store.remove("Pod", _obj("p", "u1", "zz"))  # its late DELETED leaves the new one
    assert store.get("Pod", "ns", "p")["metadata"]["uid"] == "u2"  # type: ignore[index]
    # A LIST is authoritative for what did not change while it was in flight.
    since = store.mark()
    store.upsert("Pod", _obj("q", "u3", "f"))
    store.replace_instance("Pod", "ns", "demo", [], since)
    assert store.get("Pod", "ns", "p") is None and store.get("Pod", "ns", "q") is not None
    store.replace_instance("Pod", "ns", "demo", [], store.mark())
    assert store.of_instance("Pod", "ns", "demo") == []


def test_store_write_floor_expires() -> None:
    store = Store(floor_seconds=0.0)
    store.upsert("Pod", _obj("p", "u1", "w"), written=True)
    assert store.upsert("Pod", _obj("p", "u1", "later", "Running"))


def test_store_write_answer_after_the_watch_showed_it() -> None:
    """The watch delivers the version we wrote before our write's answer comes back: later
    events of the object (a pod turning Ready) are taken at once, not dropped as older."""
    store = Store()
    assert store.upsert("Pod", _obj("p", "u1", "w1"))  # ADDED, before the POST's answer
    store.upsert("Pod", _obj("p", "u1", "w1"), written=True)
    assert store.upsert("Pod", _obj("p", "u1", "w2", "Running"))
    assert store.get("Pod", "ns", "p")["status"]["phase"] == "Running"  # type: ignore[index]
    # An answer the watch has gone past never replaces the newer version it showed.
    store.upsert("Pod", _obj("p", "u1", "w3", "Running"))
    assert not store.upsert("Pod", _obj("p", "u1", "w2"), written=True)
    assert store.get("Pod", "ns", "p")["metadata"]["resourceVersion"] == "w3"  # type: ignore[index]
    # A version the watch has not shown yet still sets the floor.
    store.upsert("Pod", _obj("p", "u1", "w5", "Succeeded"), written=True)
    assert not store.upsert("Pod", _obj("p", "u1", "w4", "Running"))
    # A new incarnation's write never matches the old one's versions.
    store.remove("Pod", _obj("p", "u1", "w6"))
    store.upsert("Pod", _obj("p", "u2", "w3"), written=True)
    assert not store.upsert("Pod", _obj("p", "u2", "w2"))


def test_store_keeps_objects_lean() -> None:
    """No managedFields, keys and short strings shared across objects; the caller's object is
    left as it was."""
    a = _obj("a", "u1", "1")
    a["metadata"]["managedFields"] = [{"manager": "pdd-operator"}]
    b = _obj("b", "u2", "2")
    store = Store()
    store.upsert("Pod", a)
    store.upsert("Pod", b)
    kept_a, kept_b = store.get("Pod", "ns", "a"), store.get("Pod", "ns", "b")
    assert kept_a is not None and kept_b is not None
    assert "managedFields" not in kept_a["metadata"] and "managedFields" in a["metadata"]
    assert kept_a == {**a, "metadata": {k: v for k, v in a["metadata"].items()
                                        if k != "managedFields"}}
    key_a = next(k for k in kept_a["status"] if k == "phase")
    key_b = next(k for k in kept_b["status"] if k == "phase")
    assert key_a is key_b and kept_a["status"]["phase"] is kept_b["status"]["phase"]
