"""Whether kopf peering has paused this replica, read from the peering object.

kopf pauses its own watches and handlers in every replica but the leader; the operator's
periodic pass runs outside kopf (a kopf timer would put a finalizer on every PDDeployment, so
deleting one would need a running operator), so it asks the same question kopf does: is there
a live peer with a higher priority, or another live peer with mine?
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any


def _dead(peer: Mapping[str, Any], now: datetime.datetime) -> bool:
    seen = peer.get("lastseen")
    if not isinstance(seen, str):
        return False
    try:
        last = datetime.datetime.fromisoformat(seen)
    except ValueError:
        return False
    if last.tzinfo is None:
        last = last.replace(tzinfo=datetime.UTC)
    return last + datetime.timedelta(seconds=int(peer.get("lifetime", 60))) <= now


def paused(status: Mapping[str, Any] | None, priority: int,
           now: datetime.datetime | None = None) -> bool:
    """`status` is the peering object's status: {identity: {priority, lifetime, lastseen}};
    this replica's own entry (same priority) counts once."""
    now = now or datetime.datetime.now(datetime.UTC)
    live = [p for p in (status or {}).values()
            if isinstance(p, Mapping) and not _dead(p, now)]
    higher = any(int(p.get("priority", 0)) > priority for p in live)
    same = sum(1 for p in live if int(p.get("priority", 0)) == priority)
    return higher or same > 1
