"""Prefill-side bookkeeping of blocks held for a decode that may never come.

A prefill instance keeps a request's blocks until every rank has received the notifications the
plan promises it (`expectedNotifications`); if the decode instance dies or the router gives up,
the lease returns the blocks after `lease_seconds`. Time is passed in, so the table is pure.

Each holding carries the epoch of its allocation. A decode claims the blocks (naming the epoch
of its grant) right before it READs them; a claim pins them for the READ's time bound, so
neither the lease nor a release frees blocks a READ may still be copying, and a claim whose
epoch is no longer held is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pdd_sidecar.kv.errors import GRANT_REFUSED, LEASE_EXPIRED, PEER_GONE

log = logging.getLogger(__name__)

NOTIF_PREFIX = b"pdd1:"


def notif_message(request_id: str) -> bytes:
    return NOTIF_PREFIX + request_id.encode()


def parse_notif(message: bytes) -> str | None:
    if not message.startswith(NOTIF_PREFIX):
        return None
    return message[len(NOTIF_PREFIX) :].decode(errors="replace")


class Refusal(str):
    """Why a claim is refused (the text, as before), with its failure ``cause``
    (kv/errors.py): lease_expired or grant_refused."""

    cause: str

    def __new__(cls, message: str, cause: str) -> Refusal:
        out = super().__new__(cls, message)
        out.cause = cause
        return out


@dataclass
class Held:
    request_id: str
    blocks: list[int]
    deadline: float
    pending: dict[int, int] = field(default_factory=dict)  # rank -> notifications still due
    epoch: int = 0
    pinned_until: float = 0.0


class LeaseTable:
    """Requests whose blocks a prefill instance holds, released by notifications or by time."""

    def __init__(self, lease_seconds: float, expected: dict[int, int]) -> None:
        self.lease_seconds = lease_seconds
        self.expected = dict(expected)
        self._held: dict[str, Held] = {}
        self.expired_total = 0
        self.released_total = 0
        self.stray_notifications = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    @property
    def held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._held.values())

    def hold(self, request_id: str, blocks: list[int], now: float, epoch: int = 0) -> Held:
        if request_id in self._held:
            raise ValueError(f"request {request_id} already holds blocks")
        held = Held(request_id, list(blocks), now + self.lease_seconds, dict(self.expected),
                    epoch)
        self._held[request_id] = held
        return held

    def claim(self, request_id: str, epoch: int, now: float, hold_s: float) -> Refusal | None:
        """Pin a holding for a READ; the reason it cannot be read, or None."""
        held = self._held.get(request_id)
        if held is None or held.epoch != epoch:
            return Refusal(f"the blocks of request {request_id!r} (epoch {epoch}) were released "
                           f"or reused", GRANT_REFUSED)
        if held.deadline <= now:
            return Refusal(f"the lease of request {request_id!r} ran out", LEASE_EXPIRED)
        held.pinned_until = max(held.pinned_until, now + hold_s)
        held.deadline = max(held.deadline, held.pinned_until)
        return None

    def notified(self, request_id: str, rank: int) -> Held | None:
        """Count one notification; return the request once nothing more is due."""
        held = self._held.get(request_id)
        if held is None or held.pending.get(rank, 0) <= 0:
            self.stray_notifications += 1
            return None
        held.pending[rank] -= 1
        if any(held.pending.values()):
            return None
        self.released_total += 1
        return self._held.pop(request_id)

    def release(self, request_id: str, now: float = 0.0) -> Held | None:
        """Free now, unless a claimed READ may still be running: then at the end of its pin."""
        held = self._held.get(request_id)
        if held is None:
            return None
        if held.pinned_until > now:
            held.deadline = held.pinned_until
            return None
        return self._held.pop(request_id)

    def expire(self, now: float) -> list[Held]:
        gone = [h for h in self._held.values() if h.deadline <= now]
        for h in gone:
            del self._held[h.request_id]
            self.expired_total += 1
            due = {r: n for r, n in h.pending.items() if n}
            log.warning(
                "lease expired for request %s after %.1fs: freeing %d blocks, notifications "
                "still due %s",
                h.request_id,
                self.lease_seconds,
                len(h.blocks),
                due,
            )
        return gone

    @staticmethod
    def expiry_cause(held: Held) -> str:
        """What an expired holding says about the hand-off: a decode that claimed the blocks
        (so its READ began) and never said it was done is gone; else nobody came in time."""
        return PEER_GONE if held.pinned_until > 0 else LEASE_EXPIRED

    def next_deadline(self) -> float | None:
        return min((h.deadline for h in self._held.values()), default=None)
