"""held_names.HeldNames: many first-write checks of one kind and namespace cost one LIST."""

from __future__ import annotations

import asyncio
from typing import Any

from pdd_operator.held_names import HeldNames
from pdd_operator.kube import PriorityGate


class FakeApi:
    def __init__(self, names: dict[str, dict[str, Any]]) -> None:
        self.gate = PriorityGate(1)
        self.names = names
        self.calls: list[tuple[str, ...]] = []

    async def get(self, kind: str, namespace: str | None, name: str, *,
                  metadata_only: bool = False) -> dict[str, Any] | None:
        self.calls.append(("get", kind, name))
        return self.names.get(name)

    async def list_objects(self, kind: str, namespace: str | None = None,
                           selector: str | None = None, *,
                           metadata_only: bool = False) -> list[dict[str, Any]]:
        assert metadata_only, "a LIST of every object of the kind reads metadata only"
        self.calls.append(("list", kind))
        return list(self.names.values())


def _obj(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"app": "someone-else"}}}


def test_queued_asks_are_answered_by_one_list() -> None:
    api = FakeApi({"a-3": _obj("a-3"), "other": _obj("other")})

    async def scenario() -> list[Any]:
        await api.gate.acquire(0)  # the API is busy: the asks queue
        held = HeldNames(api, list_from=4)
        asks = [asyncio.create_task(held.get("Service", "ns", f"a-{i}")) for i in range(10)]
        await asyncio.sleep(0)
        api.gate.release(0)
        return list(await asyncio.gather(*asks))

    found = asyncio.run(scenario())
    assert api.calls == [("list", "Service")]
    assert [f is not None for f in found] == [i == 3 for i in range(10)]
    assert found[3]["metadata"]["name"] == "a-3"


def test_few_asks_are_a_get_each() -> None:
    api = FakeApi({"b": _obj("b")})

    async def scenario() -> list[Any]:
        held = HeldNames(api, list_from=4)
        return list(await asyncio.gather(held.get("ConfigMap", "ns", "a"),
                                         held.get("ConfigMap", "ns", "b")))

    assert asyncio.run(scenario()) == [None, _obj("b")]
    assert sorted(api.calls) == [("get", "ConfigMap", "a"), ("get", "ConfigMap", "b")]


def test_a_failed_list_fails_every_ask() -> None:
    class Broken(FakeApi):
        async def list_objects(self, *a: Any, **k: Any) -> list[dict[str, Any]]:
            raise RuntimeError("forbidden")

    api = Broken({})

    async def scenario() -> list[Any]:
        await api.gate.acquire(0)
        held = HeldNames(api, list_from=2)
        asks = [asyncio.create_task(held.get("Service", "ns", n)) for n in ("x", "y", "z")]
        await asyncio.sleep(0)
        api.gate.release(0)
        return list(await asyncio.gather(*asks, return_exceptions=True))

    assert all(isinstance(r, RuntimeError) for r in asyncio.run(scenario()))
