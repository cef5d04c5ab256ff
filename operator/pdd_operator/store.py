"""In-memory view of the objects the operator owns, fed by watch events and by write responses.

Reconciles read from here instead of listing the API on every pass; a periodic resync per
PDDeployment lists the real state and replaces its slice, so a missed event costs at most one
resync period. Write responses are stored at once so that a second reconcile right after a
delete sees the pod terminating and does not spend the rollout budget twice.

resourceVersions are opaque strings (the API promises nothing about their order), so what is
newer is decided without comparing them:
- a watch delivers one object's versions in order; a write response may overtake the watch
  events before it. After our own write, watch events of that object are taken as older until
  the watch delivers the version we wrote (same resourceVersion, compared for equality only),
  or for `floor_seconds` at most (a watch that re-listed may skip it);
- the watch may as well deliver the version we wrote before our write's response comes back
  (two connections, one event loop; common when hundreds of objects are written at once). The
  last few versions the watch delivered per object are kept: a response whose version the
  watch has already shown sets no floor (waiting for that version again would drop every later
  event of the object, a pod turning Ready included, for `floor_seconds`), and one the watch
  has gone past is older than what is held;
- a deleted object's uid is remembered: a late event of it never brings it back, and a late
  event of an earlier incarnation never replaces the one we just created;
- a LIST is authoritative for what did not change in the store while it was in flight
  (a local sequence number, taken before the request, tells).
Objects are kept lean (see `lean`): a copy, so `get` may return another dict than was given.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from pdd_api import keys

Obj = dict[str, Any]
Key = tuple[str, str]  # namespace, name
SEEN_VERSIONS = 4  # per object: the watch's last versions, newest last


_SHARED: dict[str, str] = {}
SHARED_MAX = 100_000  # distinct strings kept for sharing; then the table starts over
SHARED_LEN = 64  # longer strings are rarely repeated across objects


class Lean(dict):  # type: ignore[type-arg]
    """An object `lean` made: kept as it is when it reaches the store (a LIST's pages are
    leaned as they come, kube.Kube.list_rv's `keep`, then stored)."""


def lean(obj: Obj) -> Obj:
    """A copy of an API object for keeping: without metadata.managedFields (who set which
    field, never read here: about a third of a pod), and with its keys and short strings
    shared with every other object kept (each JSON answer brings its own copies of "metadata",
    "nvidia.com/gpu", an image name...). Halves what hundreds of pods take in memory. An object
    already lean is returned as it is."""
    if isinstance(obj, Lean):
        return obj
    meta = obj.get("metadata")
    if isinstance(meta, dict) and "managedFields" in meta:
        obj = {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
    if len(_SHARED) > SHARED_MAX:
        _SHARED.clear()
    return Lean(_share(obj))


def _share(value: Any) -> Any:
    if isinstance(value, dict):
        return {_SHARED.setdefault(k, k) if isinstance(k, str) else k: _share(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_share(v) for v in value]
    if isinstance(value, str) and len(value) <= SHARED_LEN:
        return _SHARED.setdefault(value, value)
    return value


def instance_of(obj: Obj) -> str | None:
    return (obj.get("metadata", {}).get("labels") or {}).get(keys.LABEL_INSTANCE)


def _uid(obj: Obj | None) -> str | None:
    raw = (obj or {}).get("metadata", {}).get("uid")
    return str(raw) if raw else None


def _rv(obj: Obj | None) -> str | None:
    raw = (obj or {}).get("metadata", {}).get("resourceVersion")
    return str(raw) if raw is not None and raw != "" else None


@dataclass
class _Floor:
    uid: str | None
    rv: str | None
    until: float


class Store:
    def __init__(self, floor_seconds: float = 10.0) -> None:
        self.floor_seconds = floor_seconds
        self._objs: dict[str, dict[Key, Obj]] = defaultdict(dict)
        self._seq_of: dict[str, dict[Key, int]] = defaultdict(dict)
        self._floors: dict[str, dict[Key, _Floor]] = defaultdict(dict)
        self._gone: dict[str, dict[Key, set[str]]] = defaultdict(dict)
        self._by_instance: dict[tuple[str, str, str], set[str]] = defaultdict(set)
        self._seen: dict[str, dict[Key, tuple[str | None, tuple[str, ...]]]] = defaultdict(dict)
        self._seq = 0

    def mark(self) -> int:
        """Taken before a LIST request: see `replace_instance`."""
        return self._seq

    def _bump(self, kind: str, key: Key) -> None:
        self._seq += 1
        self._seq_of[kind][key] = self._seq

    def upsert(self, kind: str, obj: Obj, *, written: bool = False) -> bool:
        """Keep the newest version; False when `obj` is older than what is known. `written`:
        the API server's answer to our own write (or a fresh read), newer than any watch event
        still in flight for it."""
        meta = obj.get("metadata", {})
        key = (meta.get("namespace", ""), meta.get("name", ""))
        uid, rv = _uid(obj), _rv(obj)
        if uid is not None and uid in self._gone[kind].get(key, ()):
            return False
        current = self._objs[kind].get(key)
        floor = self._floors[kind].get(key)
        if not written and floor is not None:
            if time.monotonic() >= floor.until:
                floor = None
                self._floors[kind].pop(key, None)
            elif uid != floor.uid:
                if _uid(current) == floor.uid:
                    return False  # an earlier incarnation's late event
            elif rv is not None and rv == floor.rv:
                self._floors[kind].pop(key, None)  # the watch caught up with our write
            else:
                return False
        if written:
            seen_uid, seen = self._seen[kind].get(key, (None, ()))
            if rv is not None and seen_uid == uid and rv in seen:
                if rv != seen[-1]:
                    return False  # the watch has shown newer versions already
                self._floors[kind].pop(key, None)
            else:
                self._floors[kind][key] = _Floor(uid, rv, time.monotonic() + self.floor_seconds)
        else:
            self._saw(kind, key, uid, rv)
        self._set(kind, key, obj)
        return True

    def _saw(self, kind: str, key: Key, uid: str | None, rv: str | None) -> None:
        if rv is None:
            return
        seen_uid, seen = self._seen[kind].get(key, (None, ()))
        if seen_uid != uid:
            seen = ()
        self._seen[kind][key] = (uid, (*seen[1 - SEEN_VERSIONS:], rv))

    def _set(self, kind: str, key: Key, obj: Obj) -> None:
        obj = lean(obj)
        self._unindex(kind, key)
        self._objs[kind][key] = obj
        self._bump(kind, key)
        inst = instance_of(obj)
        if inst is not None:
            self._by_instance[(kind, key[0], inst)].add(key[1])

    def remove(self, kind: str, obj: Obj) -> None:
        meta = obj.get("metadata", {})
        key = (meta.get("namespace", ""), meta.get("name", ""))
        uid = _uid(obj)
        if uid is not None:
            gone = self._gone[kind].setdefault(key, set())
            gone.add(uid)
            if len(gone) > 16:
                gone.discard(next(iter(gone)))
        current = self._objs[kind].get(key)
        if current is not None and uid is not None and _uid(current) not in (None, uid):
            return  # a newer object of the same name exists already
        self._unindex(kind, key)
        self._objs[kind].pop(key, None)
        self._floors[kind].pop(key, None)
        self._seen[kind].pop(key, None)
        self._bump(kind, key)

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
                         objs: list[Obj], since: int | None = None) -> None:
        """Authoritative state from a LIST whose request started at `mark()` = `since`:
        anything not listed and not changed in the store since then is gone; a listed object
        replaces ours unless ours changed since then (a newer event or write)."""
        def changed(name: str) -> bool:
            return since is not None and self._seq_of[kind].get((namespace, name), 0) > since

        listed = {o["metadata"]["name"] for o in objs}
        for name in list(self._by_instance.get((kind, namespace, instance), ())):
            if name not in listed and not changed(name):
                self._unindex(kind, (namespace, name))
                self._objs[kind].pop((namespace, name), None)
                self._floors[kind].pop((namespace, name), None)
                self._seen[kind].pop((namespace, name), None)
        for o in objs:
            key = (namespace, o["metadata"]["name"])
            if changed(key[1]):
                continue
            if _uid(o) is not None and _uid(o) in self._gone[kind].get(key, ()):
                continue
            self._floors[kind].pop(key, None)
            self._saw(kind, key, _uid(o), _rv(o))
            self._set(kind, key, o)

    def count(self, kind: str) -> int:
        return len(self._objs[kind])
