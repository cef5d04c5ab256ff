"""One role's replicas as the router sees them: which are ready, which routing plan each runs,
how much KV one sequence can hold there, how loaded each is; and the routing policy that
chooses among those a request may go to (serve/router/routing_policy.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdd_sidecar.serve.router.routing_policy import ReplicaLoad, RoutingPolicy, make_policy


class Pool:
    """One role's replicas with their health and load; the policy picks among the healthy."""

    def __init__(self, role: str, urls: list[str], service: str,
                 policy: RoutingPolicy | None = None) -> None:
        self.role = role
        self.static = urls
        self.service = service
        self.urls: list[str] = list(urls)
        self.healthy: dict[str, bool] = {}
        self.plans: dict[str, str] = {}  # replica -> digest of the routing plan it runs
        self.capacity: dict[str, int] = {}  # replica -> KV tokens one sequence can hold there
        self.load: dict[str, ReplicaLoad] = {}
        self.local_prefill: set[str] = set()  # decodes that prefill a prompt themselves
        # replica -> tokens its prefix cache reuses at a time (block size x DCP), as it says
        self.cache_unit: dict[str, int] = {}
        self.policy = policy if policy is not None else make_policy("cache-aware", 64)

    def pick(self, exclude: set[str] = frozenset(),  # type: ignore[assignment]
             plan: str | None = None, plans: set[str] | None = None,
             prompt_ids: Sequence[int] | None = None) -> str | None:
        """The policy's choice among the ready replicas; with ``plan``, only among those
        running that routing plan (a prefill and a decode of different plans cannot hand KV
        over); with ``plans``, only among those running one of them."""
        ok = self.candidates(exclude, plan, plans)
        if not ok:
            return None
        return self.policy.choose(ok, self.load, prompt_ids)

    def candidates(self, exclude: set[str] = frozenset(),  # type: ignore[assignment]
                   plan: str | None = None, plans: set[str] | None = None) -> list[str]:
        """The ready replicas ``pick`` would choose among; asking moves no policy's turn."""
        return [u for u in self.urls if self.healthy.get(u) and u not in exclude
                and (plan is None or self.plans.get(u, plan) == plan)
                and (plans is None or u not in self.plans or self.plans[u] in plans)]

    def mark(self, url: str, healthy: bool) -> None:
        if healthy and self.healthy.get(url) is False:
            self.policy.forget(url)  # back from not ready: it may have restarted, cache empty
        self.healthy[url] = healthy

    def _load(self, url: str) -> ReplicaLoad:
        return self.load.setdefault(url, ReplicaLoad())

    def started(self, url: str, prompt_ids: Sequence[int] | None = None) -> None:
        """A request was sent to this replica (with its prompt, for a prefill)."""
        load = self._load(url)
        load.outstanding += 1
        if prompt_ids:
            self.policy.routed(url, prompt_ids, self.capacity.get(url))

    def served(self, url: str, token_ids: Sequence[int]) -> None:
        """A decode finished a sequence, holding the KV of these tokens now (for a follow-up
        turn that extends them)."""
        if token_ids:
            self.policy.routed(url, token_ids, self.capacity.get(url))

    def cached_by(self, prompt_ids: Sequence[int],
                  urls: Sequence[str] | None = None) -> dict[str, int]:
        """The prompt's tokens each replica (default: the ready ones that prefill themselves)
        would reuse: the policy's estimate in whole units of its prefix cache (a DCP decode
        keeps block size x DCP tokens a unit; a partial unit is computed again)."""
        urls = self.local_candidates() if urls is None else urls
        return {u: c - c % self.cache_unit.get(u, 1)
                for u, c in self.policy.cached_tokens(urls, prompt_ids).items()}

    def local_candidates(self) -> list[str]:
        """The ready replicas that prefill a prompt themselves (a decode whose /readyz says
        ``local_prefill``)."""
        return [u for u in self.candidates() if u in self.local_prefill]

    def finished(self, url: str) -> None:
        load = self._load(url)
        load.outstanding = max(0, load.outstanding - 1)

    def report(self, url: str, reported: Mapping[str, Any]) -> None:
        """The replica's own account of its load (the `load` object of its /readyz)."""
        load = self._load(url)

        def count(key: str) -> int | None:
            v = reported.get(key)
            return v if type(v) is int and v >= 0 else None

        load.running = count("running") or 0
        load.waiting = count("waiting") or 0
        load.free_blocks = count("free_blocks")
        load.num_blocks = count("num_blocks")

    def prune(self) -> None:
        """Drop what is kept about replicas no longer listed."""
        for url in [u for u in self.load if u not in self.urls]:
            if not self.load[url].outstanding:
                del self.load[url]
                self.policy.forget(url)

    def largest_capacity(self) -> int | None:
        """The most KV tokens one sequence can hold on any ready replica; None when a ready
        replica does not say (or none is ready), so nothing is refused on a guess."""
        ready = [u for u in self.urls if self.healthy.get(u)]
        if not ready or any(u not in self.capacity for u in ready):
            return None
        return max(self.capacity[u] for u in ready)

    def ready_plans(self) -> set[str] | None:
        """The routing plans some ready replica runs; None when a ready replica does not say
        (then nothing can be excluded)."""
        ready = [u for u in self.urls if self.healthy.get(u)]
        if any(u not in self.plans for u in ready):
            return None
        return {self.plans[u] for u in ready}
