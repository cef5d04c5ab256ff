"""Who holds a name the operator is about to write first, asked once for many.

Before its first write of a Service, ConfigMap or NetworkPolicy the operator reads the name
(an object without our labels must not be taken over). One GET each made those reads half of
the requests of hundreds of new PDDeployments, and their first passes (which write status only
at the end) waited on them. Asks for one kind and namespace that queue together are answered
by one metadata-only LIST, made after every one of them was asked (as fresh as a GET each);
a few are still answered by a GET each, since a LIST reads every object of the kind there.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from pdd_operator.kube import PRIORITY_OBJECT

Obj = dict[str, Any]
LIST_FROM = 8  # queued asks of one kind and namespace from which one LIST answers them all


class _Api(Protocol):
    gate: Any

    async def get(self, kind: str, namespace: str | None, name: str, *,
                  metadata_only: bool = False) -> Obj | None: ...

    async def list_objects(self, kind: str, namespace: str | None = None,
                           selector: str | None = None, *,
                           metadata_only: bool = False) -> list[Obj]: ...


class HeldNames:
    def __init__(self, kube: _Api, list_from: int = LIST_FROM) -> None:
        self.kube = kube
        self.list_from = list_from
        self._asks: dict[tuple[str, str], list[tuple[str, asyncio.Future[Obj | None]]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        """The object of that name (its metadata at least), None when there is none."""
        key = (kind, namespace)
        fut: asyncio.Future[Obj | None] = asyncio.get_running_loop().create_future()
        asks = self._asks.setdefault(key, [])
        asks.append((name, fut))
        if len(asks) == 1:
            task = asyncio.get_running_loop().create_task(self._answer(key))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await fut

    async def _answer(self, key: tuple[str, str]) -> None:
        kind, namespace = key
        # Wait for a turn at the gate as a request would: asks of the same kind arriving
        # meanwhile join this one.
        await self.kube.gate.acquire(PRIORITY_OBJECT)
        self.kube.gate.release(PRIORITY_OBJECT)
        asks = self._asks.pop(key, [])
        try:
            if len(asks) >= self.list_from:
                items = await self.kube.list_objects(kind, namespace, metadata_only=True)
                by_name = {o["metadata"]["name"]: o for o in items}
                found = [by_name.get(name) for name, _ in asks]
            else:
                found = list(await asyncio.gather(*(
                    self.kube.get(kind, namespace, name, metadata_only=True)
                    for name, _ in asks)))
        except Exception as exc:  # noqa: BLE001 - every asker sees the failure
            for _, fut in asks:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, fut), obj in zip(asks, found, strict=True):
            if not fut.done():
                fut.set_result(obj)
