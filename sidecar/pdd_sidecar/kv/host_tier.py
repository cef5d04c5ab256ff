"""The host-memory tier under the prefix cache: rank 0's index of the KV blocks kept in host
memory after the device prefix cache let them go, and the copies each rank runs for it.

Why: a prefix evicted from the device is ~40x cheaper to copy back over PCIe than to compute
again (on one H200 a 32k-token V2-Lite prefix is ~1 GB: ~20 ms at the pinned copy rate against
~850 ms of prefill), and long chats or shared documents outgrow HBM long before host memory.

An entry is what the device cache keys: a whole unit under its chain key (kv/prefix_cache.py),
or on a decode a tail (a finished conversation's last partial unit, under its parent key, with
its token ids). So a host block is found only by the same chain, which starts at the digest of
weights, dtype, block size, layout and plan: never served across them. Each entry is one *slot*
id, the same on every rank; every rank keeps its own chunk of the unit in its own host pool
(kv/host_pool.py), as each keeps its own chunk of a device block. The index lives on rank 0,
beside the prefix cache; the copies travel to every rank in the step command, as block tables
do (``TierOps``).

- **Offload**: a unit or tail the device cache evicts gets a slot (a free one, else the least
  recently used entry's) and a device → host copy, queued until the next step command, which
  runs it before anything else: the evicted block is handed out in the same plan, and the first
  write to it comes with that command or a later one. A key the host holds already is only
  touched (its KV is the same tokens').
- **Load**: admission continues the chain in the host index after the device hits; each host
  hit gets a fresh block of the request's table and a host → device copy in the same command
  as the request's first step. The block is the request's alone until the step that computed
  after it caches it, so nobody reads it before the copy.
- A slot a queued load reads is *pinned*: no offload takes it until the command carrying the
  load is built (after that, the ranks run copies in command order, on one stream).

Pure Python (no torch).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from pdd_sidecar.kv.prefix_cache import PrefixCache, TailHit, longest_run

GIB = 1 << 30


def host_slots(gib: float, bytes_per_block: int) -> int:
    """Host blocks ``gib`` GiB hold (per rank): ``floor(GiB / bytes per block)``."""
    if gib < 0:
        raise ValueError(f"host KV cache size must be >= 0 GiB, got {gib}")
    if bytes_per_block <= 0:
        raise ValueError(f"bytes per block must be > 0, got {bytes_per_block}")
    return int(gib * GIB) // bytes_per_block


@dataclass(frozen=True)
class HostTail:
    """A host-held partial unit a prompt continues: its slot and how many tokens match."""

    parent: bytes
    slot: int
    tokens: int


@dataclass
class TierOps:
    """The copies of one step command, per rank: offloads ``(device block, slot)`` run first,
    then loads ``(slot, device block)``."""

    offloads: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.loads)

    def to_command(self) -> dict[str, list[tuple[int, int]]]:
        return {"offloads": list(self.offloads), "loads": list(self.loads)}


class HostTier:
    """Rank 0's index of the host slots: whole units by key, tails by parent, one LRU line."""

    def __init__(self, num_slots: int, unit_tokens: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.unit_tokens = unit_tokens
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest first
        self._by_key: dict[bytes, int] = {}
        self._tails: dict[bytes, tuple[int, tuple[int, ...]]] = {}
        # slot -> ("unit", key) | ("tail", parent); least recently used first
        self._lru: OrderedDict[int, tuple[str, bytes]] = OrderedDict()
        self._pins: dict[int, int] = {}
        self._ops = TierOps()
        self._loading: list[int] = []  # slots pinned by queued loads, unpinned by ``take``
        self.hit_tokens = 0  # prompt tokens whose KV was loaded from here
        self.offloaded_blocks = 0
        self.loaded_blocks = 0
        self.dropped_blocks = 0  # evicted from the device with every slot pinned

    @property
    def used_slots(self) -> int:
        return len(self._lru)

    # -- lookups (rank 0's admission)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Slots of the longest run of ``keys`` from the first; takes nothing."""
        return longest_run(self._by_key, keys)

    def lookup_tail(self, parent: bytes, tokens: Sequence[int]) -> HostTail | None:
        """The host tail under ``parent`` when ``tokens`` start with at least one of its."""
        entry = self._tails.get(parent)
        if entry is None:
            return None
        slot, held = entry
        m = 0
        for a, b in zip(held, tokens, strict=False):
            if a != b:
                break
            m += 1
        return HostTail(parent, slot, m) if m else None

    @contextmanager
    def pinned(self, slots: Sequence[int]) -> Iterator[None]:
        """``slots`` stay in the index meanwhile (an allocation in between may spill)."""
        for s in slots:
            self._pins[s] = self._pins.get(s, 0) + 1
        try:
            yield
        finally:
            self._unpin(slots)

    def load(self, slots: Sequence[int], blocks: Sequence[int], tokens: int) -> None:
        """Queue ``slots[i]`` → ``blocks[i]`` for the next command (fresh blocks the caller
        holds alone), counting ``tokens`` hit; the slots stay pinned until ``take``."""
        if len(slots) != len(blocks):
            raise ValueError(f"{len(slots)} slots for {len(blocks)} blocks")
        for s, b in zip(slots, blocks, strict=True):
            if s not in self._lru:
                raise ValueError(f"host slot {s} holds nothing")
            self._lru.move_to_end(s)
            self._pins[s] = self._pins.get(s, 0) + 1
            self._loading.append(s)
            self._ops.loads.append((s, b))
        self.loaded_blocks += len(slots)
        self.hit_tokens += tokens

    def drop_loads(self, blocks: Sequence[int]) -> int:
        """Forget the queued loads into ``blocks`` (a request that leaves before its first
        command: its blocks go back, and a load sent later would overwrite their next owner's
        KV); their slots are unpinned. How many were dropped."""
        gone = set(blocks)
        keep = [(s, b) for s, b in self._ops.loads if b not in gone]
        dropped = [s for s, b in self._ops.loads if b in gone]
        if not dropped:
            return 0
        self._ops.loads = keep
        for s in dropped:
            self._loading.remove(s)
        self._unpin(dropped)
        self.loaded_blocks -= len(dropped)
        return len(dropped)

    # -- spills (the device prefix cache's evictions)

    def spill(self, units: Sequence[tuple[bytes, int]],
              tails: Sequence[tuple[bytes, tuple[int, ...], int]] = ()) -> None:
        """Units ``(key, block)`` and tails ``(parent, tokens, block)`` the device cache is
        evicting, their blocks not yet handed out: each gets a slot and a queued offload, units
        in the order of their blocks."""
        for parent, tokens, block in tails:
            old = self._tails.get(parent)
            if old is not None and old[1] == tuple(tokens):
                self._lru.move_to_end(old[0])
                continue
            if old is not None:  # the newer tail of that conversation wins, in its slot
                if old[0] in self._pins:
                    self.dropped_blocks += 1
                    continue
                self._forget(old[0])
            slot = self._slot()
            if slot is None:
                self.dropped_blocks += 1
                continue
            self._tails[parent] = (slot, tuple(tokens))
            self._lru[slot] = ("tail", parent)
            self._ops.offloads.append((block, slot))
            self.offloaded_blocks += 1
        # By device block: a table's units are mostly one ascending run of blocks, evicted later
        # units first; taken in block order they get ascending slots too, so their offload and a
        # later load back into a fresh run of blocks are a few long copies (kv/host_pool.py).
        for key, block in sorted(units, key=lambda u: u[1]):
            have = self._by_key.get(key)
            if have is not None:
                self._lru.move_to_end(have)
                continue
            slot = self._slot()
            if slot is None:
                self.dropped_blocks += 1
                continue
            self._by_key[key] = slot
            self._lru[slot] = ("unit", key)
            self._ops.offloads.append((block, slot))
            self.offloaded_blocks += 1

    # -- the step command

    def take(self) -> TierOps:
        """The copies queued since the last command (offloads first); the loads' slots are
        unpinned, since every later copy runs after these on every rank."""
        ops, self._ops = self._ops, TierOps()
        loading, self._loading = self._loading, []
        self._unpin(loading)
        return ops

    def pending(self) -> bool:
        return bool(self._ops)

    # -- internals

    def _slot(self) -> int | None:
        """A free slot, else the least recently used unpinned entry's; None if all are
        pinned."""
        if self._free:
            return self._free.pop()
        for slot in self._lru:
            if slot not in self._pins:
                self._forget(slot)
                return self._free.pop()
        return None

    def _forget(self, slot: int) -> None:
        kind, key = self._lru.pop(slot)
        if kind == "unit":
            del self._by_key[key]
        else:
            del self._tails[key]
        self._free.append(slot)

    def _unpin(self, slots: Sequence[int]) -> None:
        for s in slots:
            n = self._pins[s] - 1
            if n:
                self._pins[s] = n
            else:
                del self._pins[s]


def load_from_host(pc: PrefixCache, tier: HostTier, prompt: Sequence[int], hits: Sequence[int],
                   host: Sequence[int], n_new: int, tail: TailHit | None,
                   host_tail: HostTail | None) -> list[int]:
    """A request's table when its prefix goes on in host memory: the device ``hits``, a fresh
    block for each ``host`` slot (a load queued into it), then the tail (the device one it
    adopts, or a fresh block the ``host_tail`` is loaded into) and the rest of its own blocks.
    The slots are pinned meanwhile: the allocation may spill, and must not take them."""
    slots = [*host, *([host_tail.slot] if host_tail is not None else [])]
    with tier.pinned(slots):
        table = pc.acquire(hits, n_new, len(prompt), tail)
    h, k = len(hits), len(host)
    if tail is not None:  # acquire puts the adopted tail right after the device hits
        table = [*table[:h], *table[h + 1:h + 1 + k], table[h], *table[h + 1 + k:]]
    if slots:
        tokens = k * tier.unit_tokens + (host_tail.tokens if host_tail is not None else 0)
        tier.load(slots, table[h:h + len(slots)], tokens)
    return table
