"""How the router chooses among the replicas a request may go to (`PDD_ROUTER_POLICY`).

The rules of who may serve a request (ready, not tried yet, running the right routing plan)
are the pool's; a policy only orders what is left:

- ``round-robin``: in turn, blind to cache and load.
- ``least-loaded``: the lowest load score (below), ties in turn.
- ``cache-aware`` (default): a prefill goes where the longest whole-block prefix of the prompt
  was routed before, since that replica's prefix cache most likely still holds it; unless that
  replica is overloaded (its busy count exceeds the least busy candidate's by more than
  `CacheAware.balance_abs` and by more than `balance_rel` times), then, as with no match at all,
  to the least loaded. A decode goes the same way by the tokens whose KV each decode holds:
  the prompt and generated tokens of the sequences it finished (`Pool.served`), so the
  follow-up turn of a conversation goes to the decode that served it and pulls only the new
  tokens' KV; a first turn, matching nothing, goes by load.

Load score: ``(busy + 1) / free``, where ``busy`` is the larger of the requests this router has
in flight there (fresh) and the running + waiting sequences the replica last reported on
/readyz (slow, but it counts other routers' requests too), and ``free`` the fraction of its KV
blocks it last reported free (1 when unknown, at least `MIN_FREE_FRACTION`). A replica with a
quarter of its blocks free thus takes about a quarter of the new sequences of an empty one.

A router of several workers (`PDD_ROUTER_WORKERS`) has one index per worker, each seeing the
requests of its own connections. There a prompt that matches nothing goes to the replica its
first block hashes to among the candidates (rendezvous hashing, which every worker computes
alike with no state shared), unless that one is overloaded: a conversation's next turn, on
whichever worker it lands, goes where its first turn went.

The prefix index is an approximate prefix tree flattened into hashes: block i of a prompt is
keyed by the hash of (key of block i-1, its tokens), so one key stands for the whole prefix up
to it. Each replica keeps the keys of the prompts routed there, least recently used first out,
at most as many as it has KV blocks (its `kv_capacity_tokens` over the block size;
`DEFAULT_TRACKED_BLOCKS` until it reports them).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdd_api.models import ROUTER_POLICIES

MIN_FREE_FRACTION = 0.02
DEFAULT_TRACKED_BLOCKS = 1 << 16


@dataclass
class ReplicaLoad:
    """What the router knows of one replica's load."""

    outstanding: int = 0  # requests this router has in flight there
    running: int = 0  # the rest as the replica reported them on its last probe
    waiting: int = 0
    free_blocks: int | None = None
    num_blocks: int | None = None

    @property
    def busy(self) -> int:
        return max(self.outstanding, self.running + self.waiting)

    @property
    def free_fraction(self) -> float:
        if self.free_blocks is None or not self.num_blocks:
            return 1.0
        return max(MIN_FREE_FRACTION, min(1.0, self.free_blocks / self.num_blocks))

    @property
    def score(self) -> float:
        return (self.busy + 1) / self.free_fraction


def rendezvous(url: str, key: int) -> int:
    """The replica's weight for a key, the same in every process (str hashes are salted per
    process; block keys, hashes of ints, are not)."""
    digest = hashlib.blake2b(f"{url}#{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def block_keys(prompt_ids: Sequence[int], block_size: int) -> list[int]:
    """One key per whole block of the prompt, each standing for the prefix up to that block."""
    keys: list[int] = []
    key = 0
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        key = hash((key, tuple(prompt_ids[start:start + block_size])))
        keys.append(key)
    return keys


class PrefixIndex:
    """The block keys of the prompts routed to each replica, LRU-bounded per replica."""

    def __init__(self, block_size: int, max_blocks: int = DEFAULT_TRACKED_BLOCKS) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._held: dict[str, OrderedDict[int, None]] = {}

    def keys(self, prompt_ids: Sequence[int]) -> list[int]:
        return block_keys(prompt_ids, self.block_size)

    def match(self, url: str, keys: Sequence[int]) -> int:
        """Whole blocks of the prompt the replica was last seen with, from the start."""
        held = self._held.get(url)
        if not held:
            return 0
        for n in range(len(keys), 0, -1):  # a key stands for its whole prefix
            if keys[n - 1] in held:
                return n
        return 0

    def record(self, url: str, keys: Sequence[int], limit: int | None = None) -> None:
        held = self._held.setdefault(url, OrderedDict())
        # Longest first, so the shared leading blocks are the most recently used and the
        # tails go first, as an instance's own cache evicts them.
        for key in reversed(keys):
            held[key] = None
            held.move_to_end(key)
        bound = min(self.max_blocks, limit) if limit else self.max_blocks
        while len(held) > bound:
            held.popitem(last=False)

    def size(self, url: str) -> int:
        return len(self._held.get(url, ()))

    def forget(self, url: str) -> None:
        self._held.pop(url, None)


class RoutingPolicy:
    """Round robin: the base every policy falls back to for a tie."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def _in_turn(self, candidates: Sequence[str]) -> str:
        return candidates[next(self._turn) % len(candidates)]

    def choose(self, candidates: Sequence[str], loads: Mapping[str, ReplicaLoad],
               prompt_ids: Sequence[int] | None = None) -> str:
        return self._in_turn(candidates)

    def routed(self, url: str, prompt_ids: Sequence[int], capacity_tokens: int | None) -> None:
        """A prompt was sent to this replica (which holds at most that many tokens of KV)."""

    def forget(self, url: str) -> None:
        """The replica restarted or left: what it held is gone."""

    def cached_tokens(self, urls: Sequence[str], prompt_ids: Sequence[int]) -> dict[str, int]:
        """The prompt's tokens each replica most likely caches (a policy that tracks no
        prefixes knows of none)."""
        return dict.fromkeys(urls, 0)


class LeastLoaded(RoutingPolicy):
    name = "least-loaded"

    def _key(self, url: str, loads: Mapping[str, ReplicaLoad]) -> tuple[float, ...]:
        return (loads.get(url, ReplicaLoad()).score,)

    def _least_loaded(self, candidates: Sequence[str],
                      loads: Mapping[str, ReplicaLoad]) -> str:
        keyed = {u: self._key(u, loads) for u in candidates}
        best = min(keyed.values())
        return self._in_turn([u for u in candidates if keyed[u] == best])

    def choose(self, candidates: Sequence[str], loads: Mapping[str, ReplicaLoad],
               prompt_ids: Sequence[int] | None = None) -> str:
        return self._least_loaded(candidates, loads)


class CacheAware(LeastLoaded):
    name = "cache-aware"

    def __init__(self, block_size: int, balance_abs: int = 8, balance_rel: float = 1.5,
                 max_blocks: int = DEFAULT_TRACKED_BLOCKS, shared: bool = False) -> None:
        super().__init__()
        self.index = PrefixIndex(block_size, max_blocks)
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.shared = shared  # one of several workers: fresh prompts by rendezvous hashing

    def _key(self, url: str, loads: Mapping[str, ReplicaLoad]) -> tuple[float, ...]:
        # Equally loaded: the replica tracking fewer blocks takes a new prefix, so the
        # prefixes spread over the caches instead of piling up on one.
        return (*super()._key(url, loads), self.index.size(url))

    def overloaded(self, url: str, candidates: Sequence[str],
                   loads: Mapping[str, ReplicaLoad]) -> bool:
        busy = loads.get(url, ReplicaLoad()).busy
        least = min(loads.get(u, ReplicaLoad()).busy for u in candidates)
        return busy > least + self.balance_abs and busy > least * self.balance_rel

    def choose(self, candidates: Sequence[str], loads: Mapping[str, ReplicaLoad],
               prompt_ids: Sequence[int] | None = None) -> str:
        if not prompt_ids:
            return self._least_loaded(candidates, loads)
        keys = self.index.keys(prompt_ids)
        matched = {u: self.index.match(u, keys) for u in candidates}
        longest = max(matched.values())
        if longest:
            url = self._least_loaded([u for u in candidates if matched[u] == longest], loads)
        elif self.shared and keys:
            url = max(candidates, key=lambda u: rendezvous(u, keys[0]))
        else:
            return self._least_loaded(candidates, loads)
        if self.overloaded(url, candidates, loads):
            return self._least_loaded(candidates, loads)
        return url

    def routed(self, url: str, prompt_ids: Sequence[int], capacity_tokens: int | None) -> None:
        limit = capacity_tokens // self.index.block_size if capacity_tokens else None
        self.index.record(url, self.index.keys(prompt_ids), limit or None)

    def forget(self, url: str) -> None:
        self.index.forget(url)

    def cached_tokens(self, urls: Sequence[str], prompt_ids: Sequence[int]) -> dict[str, int]:
        """Whole blocks of the prompt routed to each replica before (prompts and, for a decode,
        the answers it finished), from the start; the prompt's blocks hashed once."""
        keys = self.index.keys(prompt_ids)
        return {u: self.index.match(u, keys) * self.index.block_size for u in urls}


def make_policy(name: str, block_size: int, shared: bool = False) -> RoutingPolicy:
    """``shared``: the router is one of several workers on one port."""
    if name == "round-robin":
        return RoutingPolicy()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "cache-aware":
        return CacheAware(block_size, shared=shared)
    raise ValueError(f"routing policy: must be one of {', '.join(ROUTER_POLICIES)}, got {name!r}")
