"""In-memory view of the objects the operator owns, fed by watch events and by write responses.

Reconciles read from here instead of listing the API on every pass; a periodic resync per
PDDeployment lists the real state and replaces its slice, so a missed event costs at most one
resync period. Write responses are stored at once so that a second reconcile right after a
delete sees the pod terminating and does not spend the rollout budget twice.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from pdd_api import keys

Obj = dict[str, Any]
Key = tuple[str, str]  # namespace, name


def _rv(obj: Obj) -> int | None:
    raw = obj.get("metadata", {}).get("resourceVersion")
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None


def instance_of(obj: Obj) -> str | None:
    return (obj.get("metadata", {}).get("labels") or {}).get(keys.LABEL_INSTANCE)


class Store:
    def __init__(self) -> None:
        self._objs: dict[str, dict[Key, Obj]] = defaultdict(dict)
        self._gone: dict[str, dict[Key, int]] = defaultdict(dict)
        self._by_instance: dict[tuple[str, str, str], set[str]] = defaultdict(set)

    def upsert(self, kind: str, obj: Obj) -> bool:
        """Keep the newest version; False when `obj` is older than what is known."""
        meta = obj.get("metadata", {})
        key = (meta.get("namespace", ""), meta.get("name", ""))
        rv = _rv(obj)
        current = self._objs[kind].get(key)
        if rv is not None:
            cur_rv = _rv(current) if current is not None else None
            if cur_rv is not None and rv < cur_rv:
                return False
            gone_rv = self._gone[kind].get(key)
            if gone_rv is not None and rv <= gone_rv:
                return False
        self._unindex(kind, key)
        self._objs[kind][key] = obj
        inst = instance_of(obj)
        if inst is not None:
            self._by_instance[(kind, key[0], inst)].add(key[1])
        return True

    def remove(self, kind: str, obj: Obj) -> None:
        meta = obj.get("metadata", {})
        key = (meta.get("namespace", ""), meta.get("name", ""))
        rv = _rv(obj)
        current = self._objs[kind].get(key)
        if current is not None and rv is not None:
            cur_rv = _rv(current)
            if cur_rv is not None and cur_rv > rv:
                return  # a newer object of the same name exists already
        self._unindex(kind, key)
        self._objs[kind].pop(key, None)
        if rv is not None:
            self._gone[kind][key] = rv

    def _unindex(self, kind: str, key: Key) -> None:
        old = self._objs[kind].get(key)
        if old is not None:
            inst = instance_of(old)
            if inst is not None:
                self._by_instance[(kind, key[0], inst)].discard(key[1])

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        return self._objs[kind].get((namespace, name))

    def of_instance(self, kind: str, namespace: str, instance: str) -> list[Obj]:
        names = sorted(self._by_instance.get((kind, namespace, instance), ()))
        return [self._objs[kind][(namespace, n)] for n in names]

    def replace_instance(self, kind: str, namespace: str, instance: str,
                         objs: list[Obj], list_rv: int | None = None) -> None:
        """Authoritative state from a LIST at `list_rv`: anything not listed and not newer than
        the list is gone."""
        listed = {o["metadata"]["name"] for o in objs}
        for name in list(self._by_instance.get((kind, namespace, instance), ())):
            cached = self._objs[kind].get((namespace, name))
            newer = (cached is not None and list_rv is not None
                     and (_rv(cached) or 0) > list_rv)
            if name not in listed and not newer:
                self._unindex(kind, (namespace, name))
                self._objs[kind].pop((namespace, name), None)
        for o in objs:
            self.upsert(kind, o)

    def count(self, kind: str) -> int:
        return len(self._objs[kind])
