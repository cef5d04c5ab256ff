"""One role's replicas as the router sees them: which are ready, which routing plan each runs,
how much KV one sequence can hold there."""

from __future__ import annotations

import itertools


class Pool:
    """One role's replicas with their health, picked round robin among the healthy."""

    def __init__(self, role: str, urls: list[str], service: str) -> None:
        self.role = role
        self.static = urls
        self.service = service
        self.urls: list[str] = list(urls)
        self.healthy: dict[str, bool] = {}
        self.plans: dict[str, str] = {}  # replica -> digest of the routing plan it runs
        self.capacity: dict[str, int] = {}  # replica -> KV tokens one sequence can hold there
        self._counter = itertools.count()

    def pick(self, exclude: set[str] = frozenset(),  # type: ignore[assignment]
             plan: str | None = None, plans: set[str] | None = None) -> str | None:
        """Round robin among the ready replicas; with ``plan``, only among those running that
        routing plan (a prefill and a decode of different plans cannot hand KV over); with
        ``plans``, only among those running one of them."""
        ok = [u for u in self.urls if self.healthy.get(u) and u not in exclude
              and (plan is None or self.plans.get(u, plan) == plan)
              and (plans is None or u not in self.plans or self.plans[u] in plans)]
        if not ok:
            return None
        return ok[next(self._counter) % len(ok)]

    def mark(self, url: str, healthy: bool) -> None:
        self.healthy[url] = healthy

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
