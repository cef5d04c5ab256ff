"""Prefix cache: KV blocks of whole prompt units shared by requests that start alike.

A *unit* is one entry of a sequence's block table: ``block_size * dcp`` tokens (with DCP each
rank keeps its own chunk of the unit in the same block id, see kv/cache.py), so one hash chain
over units is correct for every layout. Unit ``i`` is keyed by ``H(key of unit i-1, its token
ids)``; the chain starts at a root digest of everything that makes KV comparable (weights, dtype,
block size, cache layout, plan, DCP), so an entry is never served across them.

Blocks are refcounted: a request's table holds one reference per block, cached or not. A block
whose count falls to zero goes back to the allocator unless it is cached; a cached one stays,
least recently used first in line for eviction, until an allocation needs its room. Only blocks
nobody references are evicted, so a block held for a decode (a lease, a claimed READ) is never
reused. Only whole units a request fully computed are cached, and a request only reads shared
units, never writes them: its suffix goes into blocks of its own.

A decode also keeps a finished sequence's last, partial unit as a *tail*: at most one per parent
(the key of the whole unit before it, or the root), with the token ids it holds. A chat's next
turn continues exactly that unit, so without it the turn would pull up to a unit of KV its decode
computed already. A tail is never shared: the one request whose prompt continues it adopts the
block (it leaves the store, the request holds the only reference and writes the rest of the
unit), so nobody else reads rows being overwritten. Unreferenced by definition, tails count as
free and are evicted before whole units. A prefill never uses tails: it computes its prompt's
last token anyway, and a partial unit saves it at most a unit of compute.

Pure Python (no torch): the allocator underneath is anything with ``allocate``/``free``.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pdd_sidecar.kv.errors import KVCacheFullError


class BlockAllocator(Protocol):
    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    def allocate(self, n: int) -> list[int]: ...

    def free(self, ids: Sequence[int]) -> None: ...


def chain_root(record: Mapping[str, Any]) -> bytes:
    """The digest every chain starts from; two instances share keys only if their records
    match field for field."""
    text = json.dumps(dict(record), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(b"pdd-prefix-v1\0" + text.encode()).digest()


def unit_keys(root: bytes, tokens: Sequence[int], unit_tokens: int) -> list[bytes]:
    """Keys of the whole units of ``tokens``, each chained to the one before."""
    keys: list[bytes] = []
    prev = root
    for start in range(0, len(tokens) - unit_tokens + 1, unit_tokens):
        h = hashlib.sha256(prev)
        h.update(array("q", tokens[start:start + unit_tokens]).tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys


@dataclass(frozen=True)
class TailHit:
    """A cached partial unit a prompt continues: its block and how many of its tokens match."""

    parent: bytes
    block: int
    tokens: int


def longest_run(index: Mapping[bytes, int], keys: Sequence[bytes]) -> list[int]:
    """What ``index`` holds for ``keys`` from the first, up to the first it lacks: a chain
    hit is a prefix of the chain (the device cache and the host tier alike)."""
    out: list[int] = []
    for k in keys:
        v = index.get(k)
        if v is None:
            break
        out.append(v)
    return out


class PrefixCache:
    """An allocator (same protocol as PagedKVCache's) whose blocks can outlive their request."""

    def __init__(self, allocator: BlockAllocator, unit_tokens: int, root: bytes) -> None:
        if unit_tokens <= 0:
            raise ValueError(f"unit_tokens must be > 0, got {unit_tokens}")
        self.allocator = allocator
        self.unit_tokens = unit_tokens
        self.root = root
        self._refs: dict[int, int] = {}  # block -> references (every allocated block)
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        # parent key -> (block, its token ids); unreferenced, LRU first
        self._tails: OrderedDict[bytes, tuple[int, tuple[int, ...]]] = OrderedDict()
        self.queried_tokens = 0
        self.hit_tokens = 0
        # Told of the units ``(key, block)`` and tails ``(parent, tokens, block)`` that
        # eviction takes, before their blocks go back: the host tier copies them out
        # (kv/host_tier.py). ``clear`` tells nobody.
        self.on_evict: Callable[[list[tuple[bytes, int]],
                                 list[tuple[bytes, tuple[int, ...], int]]], None] | None = None

    # -- the Allocator protocol

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have: free ones, cached ones nobody references and tails."""
        return self.allocator.num_free + len(self._evictable) + len(self._tails)

    @property
    def cached_blocks(self) -> int:
        return len(self._key_of)

    @property
    def tail_blocks(self) -> int:
        return len(self._tails)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks of one's own (one reference each), evicting the least recently used
        unreferenced cached blocks when the allocator lacks room."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise KVCacheFullError(f"KV cache full: requested {n} blocks, {self.num_free} free "
                                   f"or evictable of {self.num_blocks}")
        short = n - self.allocator.num_free
        if short > 0:
            self._evict(short)
        ids = self.allocator.allocate(n)
        for b in ids:
            self._refs[b] = 1
        return ids

    def free(self, ids: Sequence[int]) -> None:
        """Drop one reference to each block; a block nobody references goes back to the
        allocator, or, when cached, to the end of the eviction line (a table's later units
        ahead of its earlier ones, since they are the less likely to be shared)."""
        bad = sorted({b for b in ids if self._refs.get(b, 0) <= 0})
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"freeing blocks that are not allocated: {bad or sorted(ids)}")
        gone: list[int] = []
        for b in reversed(ids):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                del self._refs[b]
                if b in self._key_of:
                    self._evictable[b] = None
                else:
                    gone.append(b)
        if gone:
            self.allocator.free(sorted(gone))

    # -- sharing

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        return unit_keys(self.root, tokens, self.unit_tokens)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Blocks of the longest cached run of ``keys`` from the first; takes no reference."""
        return longest_run(self._by_key, keys)

    def lookup_tail(self, parent: bytes, tokens: Sequence[int]) -> TailHit | None:
        """The tail under ``parent`` when ``tokens`` (the prompt after the whole-unit hits)
        start with at least one of its tokens; takes nothing."""
        entry = self._tails.get(parent)
        if entry is None:
            return None
        block, held = entry
        m = 0
        for a, b in zip(held, tokens, strict=False):
            if a != b:
                break
            m += 1
        return TailHit(parent, block, m) if m else None

    def fits(self, hits: Sequence[int], n_new: int, tail: TailHit | None = None) -> bool:
        """Whether ``acquire(hits, n_new, tail=tail)`` would succeed now."""
        reclaimed = sum(1 for b in hits if b in self._evictable) + (tail is not None)
        return n_new <= self.num_free - reclaimed

    def acquire(self, hits: Sequence[int], n_new: int, query_tokens: int = 0,
                tail: TailHit | None = None) -> list[int]:
        """A table: a reference to each of ``hits`` (from ``lookup``, this turn), the adopted
        ``tail`` block (from ``lookup_tail``, this turn; it leaves the store), then ``n_new``
        blocks of one's own. Counts ``query_tokens`` looked up and the hit tokens."""
        if not self.fits(hits, n_new, tail):
            raise KVCacheFullError(f"KV cache full: requested {n_new} blocks besides "
                                   f"{len(hits)} cached, {self.num_free} free or evictable")
        if tail is not None and self._tails.get(tail.parent, (None,))[0] != tail.block:
            raise ValueError(f"block {tail.block} is not a cached tail")
        for b in hits:
            if b not in self._key_of:
                raise ValueError(f"block {b} is not cached")
        for b in hits:
            self._evictable.pop(b, None)
            self._refs[b] = self._refs.get(b, 0) + 1
        adopted: list[int] = []
        if tail is not None:
            del self._tails[tail.parent]
            self._refs[tail.block] = 1
            adopted.append(tail.block)
            self.hit_tokens += tail.tokens
        table = list(hits) + adopted + self.allocate(n_new)
        self.queried_tokens += query_tokens
        self.hit_tokens += len(hits) * self.unit_tokens
        return table

    def insert_tail(self, parent: bytes, tokens: Sequence[int], block: int) -> bool:
        """Keep ``block``, holding the KV of ``tokens`` (fewer than a unit) after the unit keyed
        ``parent``: the caller's reference, which must be the only one, moves to the store (the
        caller must not free it). A tail already under ``parent`` is replaced and freed. False,
        taking nothing, for a block others reference or that is cached whole, or no tokens."""
        if self._refs.get(block, 0) <= 0:
            raise ValueError(f"caching block {block}, which is not allocated")
        if not 0 < len(tokens) < self.unit_tokens:
            if tokens:
                raise ValueError(f"a tail holds fewer than {self.unit_tokens} tokens, "
                                 f"got {len(tokens)}")
            return False
        if self._refs[block] != 1 or block in self._key_of:
            return False
        old = self._tails.pop(parent, None)
        if old is not None:
            self.allocator.free([old[0]])
        del self._refs[block]
        self._tails[parent] = (block, tuple(tokens))
        return True

    def insert(self, keys: Sequence[bytes], table: Sequence[int]) -> None:
        """Cache ``table[i]`` under ``keys[i]``: the caller holds the table and has computed
        those whole units. A key cached already keeps its block (an identical prompt computed
        at the same time keeps its own copy, freed with it)."""
        for k, b in zip(keys, table, strict=False):
            if self._refs.get(b, 0) <= 0:
                raise ValueError(f"caching block {b}, which is not allocated")
            if k in self._by_key or b in self._key_of:
                continue
            self._by_key[k] = b
            self._key_of[b] = k

    def clear(self) -> None:
        """Forget every cached unit and tail; unreferenced ones go back to the allocator."""
        self._evict(len(self._tails) + len(self._evictable), tell=False)
        self._by_key.clear()
        self._key_of.clear()

    def _evict(self, n: int, tell: bool = True) -> None:
        """Tails go first: each holds less than a unit, and only one request can use it."""
        gone = []
        units: list[tuple[bytes, int]] = []
        tails: list[tuple[bytes, tuple[int, ...], int]] = []
        for _ in range(n):
            if self._tails:
                parent, (b, tokens) = self._tails.popitem(last=False)
                tails.append((parent, tokens, b))
            else:
                b, _none = self._evictable.popitem(last=False)
                key = self._key_of.pop(b)
                del self._by_key[key]
                units.append((key, b))
            gone.append(b)
        if tell and self.on_evict is not None and gone:
            self.on_evict(units, tails)
        if gone:
            self.allocator.free(sorted(gone))

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)
