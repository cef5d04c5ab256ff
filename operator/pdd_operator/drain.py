"""Scale-down without a lost request: which replica of a role goes, and when its pod is deleted.

Pure decisions over what the pods and the instances say; the reconciler does the I/O.

A role's replicas are the pods that hold an index (`serving.pdd.dev/replica`) and were not
chosen to go. With more of them than `replicas`, the ones to go are chosen: pods that serve
nothing first (terminating, ended, not Ready), then the least loaded (running + waiting
sequences), then the least cached (share of KV blocks in use, prefix-cache blocks included),
the highest index on a tie or where no load is known (what the operator did before). The
choice is written on the pod (`draining-since`, `drain-reason`) before anything else, so a
restarted operator keeps it; the pod is then deleted with the role's `drainSeconds` as grace
period: SIGTERM makes the instance refuse new work (503, which the router retries on another
replica, and /readyz 503, which takes it out of the router's pool and the Service), finish its
streams, let a decode read (or release) the KV it granted, and exit once idle; the kubelet
stops it at the bound. With fewer replicas than wanted, a marked pod not yet deleted is taken
back first, then the lowest free indices are filled, so indices may have holes after a drain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pdd_api import keys
from pdd_operator.rollout import pod_info

GRACE_MARGIN_S = 5  # after the instance's own bound: flushing logs, closing sockets
DRAINING = "Draining"  # event reasons
DRAIN_CANCELLED = "DrainCancelled"


@dataclass(frozen=True)
class Load:
    """What an instance reports of its work (the `load` object of its /readyz)."""

    running: int = 0
    waiting: int = 0
    free_blocks: int | None = None
    num_blocks: int | None = None

    @property
    def sequences(self) -> int:
        return self.running + self.waiting

    @property
    def kv_used(self) -> float:
        if not self.num_blocks or self.free_blocks is None:
            return 0.0
        return max(0.0, min(1.0, 1.0 - self.free_blocks / self.num_blocks))

    @classmethod
    def from_report(cls, report: object) -> Load | None:
        """The `load` object of an instance's /readyz; None for anything else."""
        if not isinstance(report, Mapping):
            return None

        def count(key: str) -> int | None:
            v = report.get(key)
            return v if type(v) is int and v >= 0 else None

        running, waiting = count("running"), count("waiting")
        if running is None or waiting is None:
            return None
        return cls(running, waiting, count("free_blocks"), count("num_blocks"))


@dataclass(frozen=True)
class Member:
    """A pod of the role that holds a replica index."""

    name: str
    uid: str
    index: int
    ready: bool = True
    terminating: bool = False
    ended: bool = False
    draining_since: str | None = None  # the annotation: chosen to go at this time

    @property
    def draining(self) -> bool:
        return self.draining_since is not None


def member(pod: Mapping[str, Any]) -> Member | None:
    """The pod as a holder of its replica index; None without a (numeric) index."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        index = int(labels[keys.LABEL_REPLICA])
    except (KeyError, TypeError, ValueError):
        return None
    info = pod_info(dict(pod))
    return Member(name=info.name, uid=info.uid, index=index, ready=info.ready,
                  terminating=info.terminating, ended=info.ended,
                  draining_since=(meta.get("annotations") or {}).get(
                      keys.ANNOTATION_DRAINING_SINCE))


@dataclass
class Indices:
    """One role's decision: the replica indices kept (desired pods), the pods to mark as
    going (with why), and marked pods taken back (a scale-up before they were deleted)."""

    keep: list[int]
    mark: list[tuple[Member, str]] = field(default_factory=list)
    unmark: list[Member] = field(default_factory=list)

    @property
    def contiguous(self) -> bool:
        return self.keep == list(range(len(self.keep)))


def _serving(m: Member) -> bool:
    return m.ready and not m.terminating and not m.ended


def victim_key(m: Member, loads: Mapping[str, Load]) -> tuple[int, int, float, int]:
    """Sort key: the first in this order goes first."""
    if not _serving(m):
        return (0, 0, 0.0, -m.index)
    load = loads.get(m.name)
    if load is None:
        return (2, 0, 0.0, -m.index)
    return (1, load.sequences, load.kv_used, -m.index)


def why_chosen(m: Member, loads: Mapping[str, Load]) -> str:
    if m.terminating:
        return "already terminating"
    if m.ended:
        return "ended"
    if not m.ready:
        return "not Ready"
    load = loads.get(m.name)
    if load is None:
        return "highest index (no load reported)"
    return (f"least loaded: {load.running} running, {load.waiting} waiting, "
            f"{load.kv_used:.0%} of KV blocks in use")


def needs_choice(replicas: int, members: Sequence[Member]) -> bool:
    """Whether some pod must be chosen to go (then loads are worth fetching)."""
    return sum(1 for m in members if not m.draining) > replicas


def replica_indices(replicas: int, members: Sequence[Member],
                    loads: Mapping[str, Load] | None = None) -> Indices:
    loads = loads or {}
    holders = [m for m in members if not m.draining]
    if len(holders) > replicas:
        ordered = sorted(holders, key=lambda m: victim_key(m, loads))
        going = ordered[:len(holders) - replicas]
        kept = sorted(m.index for m in ordered[len(going):])
        # A pod already terminating needs no mark: it goes anyway, its index is simply free.
        return Indices(kept, mark=[(m, why_chosen(m, loads)) for m in going
                                   if not m.terminating])
    keep = {m.index for m in holders}
    unmark: list[Member] = []
    taken_back = sorted((m for m in members if m.draining and not m.terminating
                         and not m.ended), key=lambda m: m.index)
    for m in taken_back:
        if len(keep) >= replicas:
            break
        keep.add(m.index)
        unmark.append(m)
    used = {m.index for m in members}
    i = 0
    while len(keep) < replicas:
        if i not in used and i not in keep:
            keep.add(i)
        i += 1
    return Indices(sorted(keep), unmark=unmark)


def grace_seconds(drain_seconds: int, since: str | None, now: datetime) -> int:
    """The deletion's grace period: what is left of the drain time counted from the mark
    (an operator restarted half way does not start it again), plus a margin."""
    left = float(drain_seconds)
    started = parse_time(since)
    if started is not None:
        left -= max(0.0, (now - started).total_seconds())
    return max(1, int(left + 0.999)) + GRACE_MARGIN_S


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def mark_patch(now: str, why: str) -> dict[str, object]:
    """The merge patch that records the choice on the pod."""
    return {"metadata": {"annotations": {keys.ANNOTATION_DRAINING_SINCE: now,
                                         keys.ANNOTATION_DRAIN_REASON: why}}}


def unmark_patch() -> dict[str, object]:
    return {"metadata": {"annotations": {keys.ANNOTATION_DRAINING_SINCE: None,
                                         keys.ANNOTATION_DRAIN_REASON: None}}}
