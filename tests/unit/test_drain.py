"""Scale-down decisions (pdd_operator/drain.py): which replica goes, which indices stay, and
the deletion's grace period, over tables."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from pdd_api import keys
from pdd_operator import drain
from pdd_operator.drain import Load, Member, replica_indices

NOW = datetime(2026, 12, 4, 3, 0, 0, tzinfo=UTC)


def m(index: int, **kw: object) -> Member:
    return Member(name=f"x-decode-{index}", uid=f"u{index}", index=index, **kw)  # type: ignore[arg-type]


def load(running: int, waiting: int = 0, free: int | None = None,
         total: int | None = None) -> Load:
    return Load(running, waiting, free, total)


@pytest.mark.parametrize(("replicas", "members", "loads", "keep", "marked"), [
    # no loads known: the highest index goes (the operator's behaviour before drains)
    (2, [m(0), m(1), m(2)], {}, [0, 1], [2]),
    (1, [m(0), m(1), m(2)], {}, [0], [2, 1]),
    # the least loaded goes, wherever it is
    (2, [m(0), m(1), m(2)], {"x-decode-0": load(0), "x-decode-1": load(5),
                             "x-decode-2": load(3)}, [1, 2], [0]),
    # waiting sequences count as load
    (2, [m(0), m(1), m(2)], {"x-decode-0": load(1, 4), "x-decode-1": load(2),
                             "x-decode-2": load(3)}, [0, 2], [1]),
    # equal sequences: the least cached (KV blocks in use) goes
    (2, [m(0), m(1), m(2)], {"x-decode-0": load(1, 0, 10, 100),
                             "x-decode-1": load(1, 0, 90, 100),
                             "x-decode-2": load(1, 0, 50, 100)}, [0, 2], [1]),
    # a pod that serves nothing goes before any loaded one
    (2, [m(0), m(1, ready=False), m(2)], {"x-decode-0": load(0), "x-decode-2": load(0)},
     [0, 2], [1]),
    (2, [m(0), m(1), m(2, ended=True)], {"x-decode-0": load(9), "x-decode-1": load(9)},
     [0, 1], [2]),
    # an instance that answered idle goes before one that did not answer
    (2, [m(0), m(1), m(2)], {"x-decode-0": load(0)}, [1, 2], [0]),
    # a terminating pod (not ours to drain) frees its index without a mark
    (2, [m(0), m(1, terminating=True), m(2)], {"x-decode-0": load(0), "x-decode-2": load(7)},
     [0, 2], []),
])
def test_victims(replicas: int, members: list[Member], loads: dict[str, Load],
                 keep: list[int], marked: list[int]) -> None:
    d = replica_indices(replicas, members, loads)
    assert d.keep == keep
    assert [v.index for v, _ in d.mark] == marked
    assert not d.unmark


@pytest.mark.parametrize(("replicas", "members", "keep", "unmarked"), [
    # steady: nothing to do, indices 0..n-1
    (3, [m(0), m(1), m(2)], [0, 1, 2], []),
    # a marked pod is not a replica; its index stays taken while it drains
    (2, [m(0, draining_since="t"), m(1), m(2)], [1, 2], []),
    # a scale-up fills the lowest free index, never one a draining pod holds
    (3, [m(0, draining_since="t", terminating=True), m(1), m(2)], [1, 2, 3], []),
    (3, [m(1), m(2)], [0, 1, 2], []),
    # ... but first takes back a marked pod not yet deleted
    (3, [m(0, draining_since="t"), m(1), m(2)], [0, 1, 2], [0]),
    # a pod deleted by a failure or a roll keeps its index (recreated there)
    (3, [m(0), m(1, terminating=True), m(2)], [0, 1, 2], []),
    # from nothing
    (2, [], [0, 1], []),
])
def test_indices(replicas: int, members: list[Member], keep: list[int],
                 unmarked: list[int]) -> None:
    d = replica_indices(replicas, members)
    assert d.keep == keep
    assert [u.index for u in d.unmark] == unmarked
    assert not d.mark


def test_level_based_after_the_mark() -> None:
    """The pass after the mark decides the same (the annotation is the state): the marked pod
    is no replica, nothing new is marked, the kept indices do not move."""
    loads = {"x-decode-0": load(0), "x-decode-1": load(4), "x-decode-2": load(4)}
    first = replica_indices(2, [m(0), m(1), m(2)], loads)
    assert [v.index for v, _ in first.mark] == [0]
    again = replica_indices(2, [m(0, draining_since="t"), m(1), m(2)], {})
    assert again.keep == first.keep == [1, 2]
    assert not again.mark and not again.unmark
    gone = replica_indices(2, [m(1), m(2)], {})
    assert gone.keep == [1, 2] and not gone.contiguous


def test_why_chosen_names_the_figures() -> None:
    why = drain.why_chosen(m(0), {"x-decode-0": load(1, 2, 25, 100)})
    assert why == "least loaded: 1 running, 2 waiting, 75% of KV blocks in use"
    assert drain.why_chosen(m(3), {}) == "highest index (no load reported)"
    assert drain.why_chosen(m(1, ready=False), {}) == "not Ready"


@pytest.mark.parametrize(("since", "seconds", "grace"), [
    (None, 120, 125),
    ((NOW - timedelta(seconds=30)).isoformat(), 120, 95),
    ((NOW - timedelta(seconds=500)).isoformat(), 120, 6),  # past the time: stop soon
    ("2026-12-04T02:59:00Z", 120, 65),
    ("not a time", 60, 65),
])
def test_grace(since: str | None, seconds: int, grace: int) -> None:
    assert drain.grace_seconds(seconds, since, NOW) == grace


@pytest.mark.parametrize(("report", "want"), [
    ({"running": 2, "waiting": 1, "free_blocks": 30, "num_blocks": 40}, Load(2, 1, 30, 40)),
    ({"running": 0, "waiting": 0}, Load(0, 0)),
    ({"running": -1, "waiting": 0}, None),
    ({"running": True, "waiting": 0}, None),
    ("busy", None),
])
def test_load_from_report(report: object, want: Load | None) -> None:
    assert Load.from_report(report) == want


def test_member_of_pod() -> None:
    pod = {"metadata": {"name": "x-prefill-4", "uid": "u", "labels": {keys.LABEL_REPLICA: "4"},
                        "annotations": {keys.ANNOTATION_DRAINING_SINCE: "2026-12-04T03:00:00Z"}},
           "status": {"phase": "Running",
                      "conditions": [{"type": "Ready", "status": "True"}]}}
    got = drain.member(pod)
    assert got == Member("x-prefill-4", "u", 4, ready=True,
                         draining_since="2026-12-04T03:00:00Z")
    assert drain.member({"metadata": {"name": "x-prefill-surge", "labels": {}}}) is None


def test_patches() -> None:
    p = drain.mark_patch("2026-12-04T03:00:00Z", "not Ready")
    assert p["metadata"]["annotations"] == {  # type: ignore[index]
        keys.ANNOTATION_DRAINING_SINCE: "2026-12-04T03:00:00Z",
        keys.ANNOTATION_DRAIN_REASON: "not Ready"}
    assert set(drain.unmark_patch()["metadata"]["annotations"].values()) == {None}  # type: ignore[index]


def test_desired_with_a_hole() -> None:
    """Pods at the kept indices only; the router lists every index up to the highest (a hole
    rolls nothing), and the indices 0..n-1 give the very objects `build` gives."""
    from pdd_api.validation import parse_spec
    from pdd_operator.builders import Owner, build, pod_name, with_indices

    owner = Owner("x", "ns", "uid-1")
    spec = parse_spec({"model": {"name": "m"}, "image": "img",
                       "prefill": {"replicas": 1}, "decode": {"replicas": 2}})
    desired = build(owner, spec)
    same = with_indices(owner, spec, desired, {"decode": [0, 1]})
    assert same.pods == desired.pods and same.router_deployment == desired.router_deployment
    holed = with_indices(owner, spec, desired, {"decode": [1, 2]})
    assert sorted(holed.pods["decode"]) == [1, 2]
    assert holed.pods["decode"][2]["metadata"]["name"] == pod_name("x", "decode", 2)
    assert holed.pods["decode"][1] is desired.pods["decode"][1]
    assert sorted(desired.pods["decode"]) == [0, 1]  # the shared one is untouched

    def urls(d: object, env_name: str) -> list[str]:
        c = d.router_deployment["spec"]["template"]["spec"]["containers"][0]  # type: ignore[attr-defined]
        return next(e["value"] for e in c["env"] if e["name"] == env_name).split(",")

    assert len(urls(desired, keys.ENV_DECODE_URLS)) == 3  # 0, 1 and the surge pod
    got = urls(holed, keys.ENV_DECODE_URLS)
    assert len(got) == 4 and any("x-decode-2." in u for u in got)
    assert urls(holed, keys.ENV_PREFILL_URLS) == urls(desired, keys.ENV_PREFILL_URLS)


def test_plan_role_over_a_hole() -> None:
    """The role plan walks the kept indices: pods 1 and 2 kept, the marked pod 0 deleted as
    a scale-down, nothing created at index 0."""
    from pdd_api.validation import parse_spec
    from pdd_operator.builders import Owner, build, with_indices
    from pdd_operator.rollout import plan_role

    owner = Owner("x", "ns", "uid-1")
    def doc(n: int) -> dict:  # type: ignore[type-arg]
        return {"model": {"name": "m"}, "image": "img", "prefill": {"replicas": 1},
                "decode": {"replicas": n}}

    spec = parse_spec(doc(2))
    desired = with_indices(owner, spec, build(owner, spec), {"decode": [1, 2]})

    def running(pod: dict, uid: str) -> dict:  # type: ignore[type-arg]
        out = {**pod, "metadata": {**pod["metadata"], "uid": uid,
                                   "ownerReferences": [owner.reference()]},
               "status": {"phase": "Running",
                          "conditions": [{"type": "Ready", "status": "True"}]}}
        return out

    gone = build(owner, parse_spec(doc(3))).pods["decode"][0]
    observed = [running(gone, "u0"), running(desired.pods["decode"][1], "u1"),
                running(desired.pods["decode"][2], "u2")]
    rp = plan_role(desired.pods["decode"], observed, owner.uid, 1, owner.name)
    assert [(d.name, d.reason) for d in rp.delete] == [("x-decode-0", "ScaleDown")]
    assert not rp.create and rp.ready == 2 and rp.replicas == 2


def test_fetch_loads_reads_readyz_and_skips_the_silent() -> None:
    """Loads come from each pod's /readyz (a 503 of a draining instance too); a pod that does
    not answer, has no IP or is terminating has none."""
    import asyncio
    import socket

    from aiohttp import web

    from pdd_operator.drain_io import fetch_loads

    async def run() -> dict[str, Load]:
        async def readyz(request: web.Request) -> web.Response:
            return web.json_response({"ready": False, "load": {
                "running": 3, "waiting": 1, "free_blocks": 10, "num_blocks": 40}}, status=503)

        app = web.Application()
        app.router.add_get("/readyz", readyz)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        with socket.socket() as s:  # a port nobody listens on (the same for every pod)
            s.bind(("127.0.0.2", 0))
            silent = s.getsockname()[0]
        pods = [{"metadata": {"name": "a"}, "status": {"podIP": "127.0.0.1"}},
                {"metadata": {"name": "b"}, "status": {"podIP": silent}},
                {"metadata": {"name": "c"}, "status": {}},
                {"metadata": {"name": "d", "deletionTimestamp": "t"},
                 "status": {"podIP": "127.0.0.1"}}]
        try:
            return await fetch_loads(pods, port=port, timeout_s=0.5)
        finally:
            await runner.cleanup()

    got = asyncio.run(run())
    assert got == {"a": Load(3, 1, 10, 40)}
    assert got["a"].kv_used == 0.75
