"""The router's routing policies over a Pool, with the instances' prefix caches simulated: a
replica holds a prompt's prefix if an earlier request with that prefix was routed there and
its cache (least recently used out) has not dropped it since."""

from __future__ import annotations

import random
from collections import Counter, OrderedDict

import pytest

from pdd_api.models import ROUTER_POLICIES
from pdd_sidecar.env import ConfigError, RouterSettings
from pdd_sidecar.serve.router.replica_pool import Pool
from pdd_sidecar.serve.router.routing_policy import (
    CacheAware,
    PrefixIndex,
    ReplicaLoad,
    block_keys,
    make_policy,
)

BLOCK = 16
PREFIX_BLOCKS = 4


def _pool(role: str, urls: list[str], policy: str, plans: dict[str, str] | None = None) -> Pool:
    pool = Pool(role, urls, "", make_policy(policy, BLOCK))
    for url in urls:
        pool.mark(url, True)
        if plans and url in plans:
            pool.plans[url] = plans[url]
    return pool


def _route(pool: Pool, prompt: list[int]) -> str:
    """One request through the pool, start to finish: where it went."""
    url = pool.pick(prompt_ids=prompt)
    assert url is not None
    pool.started(url, prompt)
    pool.finished(url)
    return url


class SimulatedCache:
    """An instance's prefix cache that holds `capacity` prefixes, least recently used out."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: OrderedDict[int, None] = OrderedDict()

    def serve(self, prefix: int) -> bool:
        hit = prefix in self.held
        self.held[prefix] = None
        self.held.move_to_end(prefix)
        while len(self.held) > self.capacity:
            self.held.popitem(last=False)
        return hit


def _prompt(prefix: int, rng: random.Random) -> list[int]:
    """The prefix's whole blocks, then a question of its own shorter than a block (a tail no
    cache keys)."""
    shared = [1000 * (prefix + 1) + i for i in range(PREFIX_BLOCKS * BLOCK)]
    return shared + [rng.randrange(50_000) for _ in range(rng.randrange(1, BLOCK))]


def _prefix_hit_ratio(policy: str, seed: int) -> float:
    """Two prefill replicas, 8 prefixes x 8 requests in random order; each cache has room for
    half the prefixes. The ratio is over the prefix tokens that any cache could have held:
    those of every request but the first of its prefix (that one misses wherever it goes)."""
    rng = random.Random(seed)
    urls = ["p0", "p1"]
    pool = _pool("prefill", urls, policy)
    caches = {u: SimulatedCache(capacity=4) for u in urls}
    order = [p for p in range(8) for _ in range(8)]
    rng.shuffle(order)
    seen: set[int] = set()
    hit = possible = 0
    for prefix in order:
        prompt = _prompt(prefix, rng)
        url = pool.pick(prompt_ids=prompt)
        assert url is not None
        pool.started(url, prompt)
        was_hit = caches[url].serve(prefix)
        pool.finished(url)
        if prefix in seen:
            possible += PREFIX_BLOCKS * BLOCK
            hit += PREFIX_BLOCKS * BLOCK if was_hit else 0
        seen.add(prefix)
    return hit / possible


@pytest.mark.parametrize("seed", range(5))
def test_cache_aware_hits_the_prefix_cache_where_round_robin_misses_half(seed: int) -> None:
    cache_aware = _prefix_hit_ratio("cache-aware", seed)
    round_robin = _prefix_hit_ratio("round-robin", seed)
    assert cache_aware >= 0.9
    assert 0.25 <= round_robin <= 0.75
    assert cache_aware - round_robin >= 0.2


def test_new_prefixes_spread_over_the_replicas() -> None:
    pool = _pool("prefill", ["p0", "p1"], "cache-aware")
    rng = random.Random(0)
    chosen = Counter()
    for prefix in range(8):
        chosen[_route(pool, _prompt(prefix, rng))] += 1
    assert chosen == {"p0": 4, "p1": 4}



def test_a_burst_sharing_a_new_prefix_follows_its_first_request_while_in_flight() -> None:
    """Nothing of the prefix is computed yet: the first request records it when sent, so the
    next ones, all still in flight, go where it went (its prefill computes the prefix once)
    until that one is busier than the idle one by more than the allowance."""
    rng = random.Random(2)
    pool = _pool("prefill", ["p0", "p1"], "cache-aware")
    policy = pool.policy
    assert isinstance(policy, CacheAware)
    picks = []
    for _ in range(policy.balance_abs + 3):
        prompt = _prompt(5, rng)
        url = pool.pick(prompt_ids=prompt)
        assert url is not None
        pool.started(url, prompt)  # none finishes
        picks.append(url)
    first = picks[0]
    assert picks[:policy.balance_abs + 1] == [first] * (policy.balance_abs + 1)
    assert first not in picks[policy.balance_abs + 1:]

@pytest.mark.parametrize("policy", ["cache-aware", "least-loaded"])
def test_an_overloaded_replica_stops_receiving_new_requests(policy: str) -> None:
    """p0 holds the prefix every request shares, but its queue grows past the bound: new
    requests go elsewhere, the prefix notwithstanding, until it drains."""
    rng = random.Random(1)
    pool = _pool("prefill", ["p0", "p1", "p2"], policy)
    prompt = _prompt(0, rng)
    pool.started("p0", prompt)
    pool.finished("p0")
    for _ in range(20):  # stuck: twenty requests in flight there
        pool.started("p0")
    picks = []
    for _ in range(30):
        prompt = _prompt(0, rng)
        url = pool.pick(prompt_ids=prompt)
        assert url is not None
        pool.started(url, prompt)  # these stay in flight too
        picks.append(url)
    assert "p0" not in picks
    assert set(picks) == {"p1", "p2"}
    for _ in range(20):
        pool.finished("p0")
    assert pool.pick(prompt_ids=_prompt(0, rng)) == "p0"  # drained: the least loaded again


def test_the_instance_reported_queue_counts_as_load_too() -> None:
    """Another router's requests show only in what the replica reports."""
    pool = _pool("prefill", ["p0", "p1"], "cache-aware")
    prompt = _prompt(0, random.Random(2))
    pool.started("p0", prompt)
    pool.finished("p0")
    assert pool.pick(prompt_ids=prompt) == "p0"
    pool.report("p0", {"running": 30, "waiting": 12, "free_blocks": 10, "num_blocks": 100})
    assert {pool.pick(prompt_ids=prompt) for _ in range(4)} == {"p1"}


@pytest.mark.parametrize("policy", ["cache-aware", "least-loaded"])
def test_a_decode_with_fewer_free_blocks_gets_fewer_new_sequences(policy: str) -> None:
    pool = _pool("decode", ["d-full", "d-free"], policy)
    pool.report("d-full", {"running": 0, "waiting": 0, "free_blocks": 200, "num_blocks": 1000})
    pool.report("d-free", {"running": 0, "waiting": 0, "free_blocks": 900, "num_blocks": 1000})
    got = Counter()
    for _ in range(40):  # long generations: every sequence stays in flight
        url = pool.pick()
        assert url is not None
        pool.started(url)
        got[url] += 1
    assert got["d-full"] > 0  # not starved, only given less
    assert got["d-full"] * 2 < got["d-free"]


def test_round_robin_is_blind_to_free_blocks() -> None:
    """The control of the test above: without a load-aware policy the share is even."""
    pool = _pool("decode", ["d-full", "d-free"], "round-robin")
    pool.report("d-full", {"running": 0, "waiting": 0, "free_blocks": 200, "num_blocks": 1000})
    pool.report("d-free", {"running": 0, "waiting": 0, "free_blocks": 900, "num_blocks": 1000})
    got = Counter()
    for _ in range(40):
        url = pool.pick()
        assert url is not None
        pool.started(url)
        got[url] += 1
    assert got == {"d-full": 20, "d-free": 20}


def test_a_finished_request_no_longer_counts() -> None:
    pool = _pool("decode", ["d0", "d1"], "least-loaded")
    pool.started("d0")
    assert {pool.pick() for _ in range(3)} == {"d1"}
    pool.finished("d0")
    assert {pool.pick() for _ in range(4)} == {"d0", "d1"}


@pytest.mark.parametrize("policy", ROUTER_POLICIES)
def test_plan_filter_and_exclusion_hold_under_every_policy(policy: str) -> None:
    rng = random.Random(3)
    plans = {"p-old": "old", "p-new": "new", "p-other": "new"}
    pool = _pool("prefill", list(plans), policy, plans)
    prompt = _prompt(0, rng)
    pool.started("p-old", prompt)  # the prefix lives on a replica of the other plan
    pool.finished("p-old")
    for _ in range(6):
        assert pool.pick(plans={"new"}, prompt_ids=prompt) in {"p-new", "p-other"}
        assert pool.pick(plan="new", prompt_ids=prompt) in {"p-new", "p-other"}
        assert pool.pick({"p-new"}, plans={"new"}, prompt_ids=prompt) == "p-other"
    assert pool.pick({"p-new", "p-other"}, plans={"new"}, prompt_ids=prompt) is None
    assert pool.pick(plans={"old"}, prompt_ids=prompt) == "p-old"
    pool.mark("p-old", False)
    assert pool.pick(plans={"old"}, prompt_ids=prompt) is None
    pool.started("p-new")
    pool.started("p-new")  # loaded, and still the only choice left
    assert pool.pick({"p-other"}, prompt_ids=prompt) == "p-new"


def test_the_index_holds_no_more_blocks_than_the_replica() -> None:
    pool = _pool("prefill", ["p0"], "cache-aware")
    pool.capacity["p0"] = 3 * BLOCK
    pool.started("p0", list(range(8 * BLOCK)))
    policy = pool.policy
    assert isinstance(policy, CacheAware)
    assert policy.index.size("p0") == 3


def test_a_replica_back_from_not_ready_is_taken_as_cold() -> None:
    pool = _pool("prefill", ["p0", "p1"], "cache-aware")
    prompt = _prompt(0, random.Random(4))
    pool.started("p1", prompt)
    pool.finished("p1")
    policy = pool.policy
    assert isinstance(policy, CacheAware)
    keys = policy.index.keys(prompt)
    assert policy.index.match("p1", keys) == PREFIX_BLOCKS
    pool.mark("p1", False)
    pool.mark("p1", True)
    assert policy.index.match("p1", keys) == 0


def test_block_keys_stand_for_the_whole_prefix() -> None:
    a = list(range(40))
    b = [99] + a[1:]
    assert len(block_keys(a, BLOCK)) == 2  # whole blocks only
    assert block_keys(a, BLOCK)[0] != block_keys(b, BLOCK)[0]
    assert block_keys(a, BLOCK)[1] != block_keys(b, BLOCK)[1]  # same tokens, other prefix
    assert block_keys(a + [7], BLOCK) == block_keys(a, BLOCK)


def test_the_index_matches_the_longest_prefix_and_stays_bounded() -> None:
    index = PrefixIndex(BLOCK, max_blocks=8)
    long = list(range(6 * BLOCK))
    index.record("p", index.keys(long))
    assert index.match("p", index.keys(long[:3 * BLOCK] + [5] * BLOCK)) == 3
    assert index.match("q", index.keys(long)) == 0
    other = [7] * (6 * BLOCK)
    index.record("p", index.keys(other))
    assert index.size("p") == 8
    # The tails go first: the shared leading blocks of the first prompt are still there.
    assert index.match("p", index.keys(long)) == 2
    index.record("p", index.keys(long), limit=4)
    assert index.size("p") == 4


def test_load_score_weighs_in_flight_and_free_blocks() -> None:
    assert ReplicaLoad(outstanding=3).score == 4
    assert ReplicaLoad(outstanding=1, running=5, waiting=2).busy == 7
    assert ReplicaLoad(free_blocks=25, num_blocks=100).score == 4
    assert ReplicaLoad(free_blocks=0, num_blocks=100).score == 50


def test_router_settings_name_the_key_and_value_of_a_bad_policy() -> None:
    env = {"PDD_PREFILL_URLS": "p:1", "PDD_DECODE_URLS": "d:1"}
    assert RouterSettings.from_env(env).router_policy == "cache-aware"
    assert RouterSettings.from_env({**env, "PDD_ROUTER_POLICY": "least-loaded",
                                    "PDD_BLOCK_SIZE": "32"}).block_size == 32
    with pytest.raises(ConfigError, match="PDD_ROUTER_POLICY: must be one of cache-aware, "
                                          "least-loaded, round-robin, got 'random'"):
        RouterSettings.from_env({**env, "PDD_ROUTER_POLICY": "random"})
    with pytest.raises(ValueError, match="random"):
        make_policy("random", BLOCK)


def _turns(n: int, rng: random.Random) -> list[list[int]]:
    """A chat's prompts: each turn's prompt is the one before, its completion and new tokens."""
    prompts = [[rng.randrange(50_000) for _ in range(2 * BLOCK + 5)]]
    for _ in range(n - 1):
        completion = [rng.randrange(50_000) for _ in range(BLOCK)]
        prompts.append(prompts[-1] + completion + [rng.randrange(50_000) for _ in range(9)])
    return prompts


def test_a_follow_up_turn_goes_to_the_decode_that_served_the_conversation() -> None:
    """Four decodes, six chats of five turns interleaved: every turn after the first goes where
    the chat's last turn was decoded, whose cache holds its prompt and generated tokens."""
    rng = random.Random(3)
    pool = _pool("decode", ["d0", "d1", "d2", "d3"], "cache-aware")
    chats = [_turns(5, rng) for _ in range(6)]
    home: dict[int, str] = {}
    for turn in range(5):
        for c, chat in enumerate(chats):
            prompt = chat[turn]
            url = pool.pick(prompt_ids=prompt)
            assert url is not None
            if turn:
                assert url == home[c], (turn, c)
            home[c] = url
            pool.started(url)
            pool.finished(url)
            # What it then holds: the prompt and the completion but its last token.
            pool.served(url, chat[turn + 1][:len(prompt) + BLOCK - 1] if turn < 4 else prompt)
    assert len(set(home.values())) == 4  # first turns spread by load and index size


def test_a_decode_is_matched_by_what_it_served_not_by_what_it_was_sent() -> None:
    """Sending a prompt records nothing for a decode (it may fail or be cancelled); only a
    finished sequence does."""
    rng = random.Random(4)
    pool = _pool("decode", ["d0", "d1"], "cache-aware")
    chat = _turns(2, rng)
    pool.started("d1", chat[0])
    pool.finished("d1")
    pool.served("d0", chat[1][:len(chat[0]) + BLOCK - 1])
    assert {pool.pick(prompt_ids=chat[1]) for _ in range(4)} == {"d0"}


def test_an_overloaded_decode_loses_its_follow_up_turns_to_the_least_loaded() -> None:
    rng = random.Random(5)
    pool = _pool("decode", ["d0", "d1", "d2"], "cache-aware")
    chat = _turns(2, rng)
    pool.served("d0", chat[1][:len(chat[0]) + BLOCK - 1])
    for _ in range(20):
        pool.started("d0")
    assert pool.pick(prompt_ids=chat[1]) in {"d1", "d2"}
    for _ in range(20):
        pool.finished("d0")
    assert pool.pick(prompt_ids=chat[1]) == "d0"


def test_workers_of_one_router_send_a_conversation_to_the_same_replicas() -> None:
    """Two workers, each its own index: a first turn on one and its next turn on the other go
    to the same prefill and decode (rendezvous hashing on the first block), where two routers
    that each pick a fresh prompt by load alone part ways; an overloaded choice still yields."""
    urls = ["p0", "p1", "p2", "p3"]
    rng = random.Random(3)

    def workers(shared: bool) -> tuple[Pool, Pool]:
        return tuple(Pool("prefill", urls, "", make_policy("cache-aware", BLOCK, shared))
                     for _ in range(2))  # type: ignore[return-value]

    def first_then_next(shared: bool) -> list[tuple[str, str]]:
        a, b = workers(shared)
        for pool in (a, b):
            for u in urls:
                pool.mark(u, True)
        _route(b, _prompt(99, rng))  # the other worker's connections brought it a prompt first
        pairs = []
        for prefix in range(12):
            first = _prompt(prefix, rng)
            nxt = first + [rng.randrange(50_000) for _ in range(2 * BLOCK)]
            pairs.append((_route(a, first), _route(b, nxt)))
        return pairs

    shared = first_then_next(True)
    assert all(x == y for x, y in shared), shared
    assert len({x for x, _ in shared}) > 1  # the hash still spreads prefixes
    assert any(x != y for x, y in first_then_next(False))
    pool = Pool("prefill", urls, "", make_policy("cache-aware", BLOCK, True))
    for u in urls:
        pool.mark(u, True)
    prompt = _prompt(0, rng)
    chosen = pool.pick(prompt_ids=prompt)
    assert chosen is not None
    for _ in range(20):  # that replica's queue grows past the bound: the prompt goes elsewhere
        pool.started(chosen)
    assert pool.pick(prompt_ids=prompt) not in (chosen, None)
