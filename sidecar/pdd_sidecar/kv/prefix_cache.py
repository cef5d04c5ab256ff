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

Pure Python (no torch): the allocator underneath is anything with ``allocate``/``free``.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
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
        self.queried_tokens = 0
        self.hit_tokens = 0

    # -- the Allocator protocol

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have: free ones and cached ones nobody references."""
        return self.allocator.num_free + len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        return len(self._key_of)

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
        hits: list[int] = []
        for k in keys:
            b = self._by_key.get(k)
            if b is None:
                break
            hits.append(b)
        return hits

    def fits(self, hits: Sequence[int], n_new: int) -> bool:
        """Whether ``acquire(hits, n_new)`` would succeed now."""
        reclaimed = sum(1 for b in hits if b in self._evictable)
        return n_new <= self.num_free - reclaimed

    def acquire(self, hits: Sequence[int], n_new: int, query_tokens: int = 0) -> list[int]:
        """A table: a reference to each of ``hits`` (from ``lookup``, this turn), then
        ``n_new`` blocks of one's own. Counts ``query_tokens`` looked up and the hit tokens."""
        if not self.fits(hits, n_new):
            raise KVCacheFullError(f"KV cache full: requested {n_new} blocks besides "
                                   f"{len(hits)} cached, {self.num_free} free or evictable")
        for b in hits:
            if b not in self._key_of:
                raise ValueError(f"block {b} is not cached")
            self._evictable.pop(b, None)
            self._refs[b] = self._refs.get(b, 0) + 1
        table = list(hits) + self.allocate(n_new)
        self.queried_tokens += query_tokens
        self.hit_tokens += len(hits) * self.unit_tokens
        return table

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
        """Forget every cached unit; unreferenced ones go back to the allocator."""
        self._evict(len(self._evictable))
        self._by_key.clear()
        self._key_of.clear()

    def _evict(self, n: int) -> None:
        gone = []
        for _ in range(n):
            b, _none = self._evictable.popitem(last=False)
            del self._by_key[self._key_of.pop(b)]
            gone.append(b)
        if gone:
            self.allocator.free(sorted(gone))

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)
