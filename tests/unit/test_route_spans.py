"""The router's routing-decision span says why (serve/router/spans.py): the chosen replica's
cache-hit tokens against the best candidate's, its load, and the reason."""

from __future__ import annotations

from pdd_sidecar.serve.router.replica_pool import Pool
from pdd_sidecar.serve.router.routing_policy import ReplicaLoad, make_policy
from pdd_sidecar.serve.router.spans import decision

A, B = "http://p0:8000", "http://p1:8000"
PROMPT = list(range(100))  # 6 whole blocks of 16


def pool(policy: str = "cache-aware") -> Pool:
    p = Pool("prefill", [A, B], "", make_policy(policy, 16))
    p.healthy = {A: True, B: True}
    return p


def test_a_prefix_owner_is_chosen_for_its_cache() -> None:
    p = pool()
    p.started(A, PROMPT)
    p.finished(A)
    url = p.pick(prompt_ids=PROMPT)
    assert url == A
    d = decision(p, url, p.candidates(), PROMPT)
    assert (d["pdd.route.reason"], d["pdd.route.cache_hit_tokens"],
            d["pdd.route.best_cache_hit_tokens"], d["pdd.route.candidates"]) == (
        "prefix_match", 96, 96, 2)
    assert d["pdd.route.policy"] == "cache-aware" and d["pdd.route.replica"] == A


def test_an_overloaded_owner_is_passed_over_and_the_span_says_so() -> None:
    p = pool()
    p.started(A, PROMPT)
    p.load[A] = ReplicaLoad(outstanding=40)
    url = p.pick(prompt_ids=PROMPT)
    assert url == B
    d = decision(p, url, p.candidates(), PROMPT)
    assert (d["pdd.route.reason"], d["pdd.route.cache_hit_tokens"],
            d["pdd.route.best_cache_hit_tokens"]) == ("overloaded_prefix_owner", 0, 96)
    assert d["pdd.route.load.busy"] == 0


def test_no_match_is_by_load_and_other_policies_name_themselves() -> None:
    p = pool()
    d = decision(p, A, p.candidates(), PROMPT)
    assert (d["pdd.route.reason"], d["pdd.route.cache_hit_tokens"]) == ("least_loaded", 0)
    assert decision(pool("round-robin"), A, [A, B], PROMPT)["pdd.route.reason"] == "round_robin"
    assert decision(pool("least-loaded"), A, [A, B], None)["pdd.route.reason"] == "least_loaded"
