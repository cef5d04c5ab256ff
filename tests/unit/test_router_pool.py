"""The router's replica choice during a plan-changing roll: a prefill is chosen only where a
ready decode runs its routing plan, since KV cannot be handed across plans."""

from __future__ import annotations

from pdd_sidecar.serve.router import Pool


def _pool(role: str, plans: dict[str, str | None]) -> Pool:
    pool = Pool(role, list(plans), "")
    for url, plan in plans.items():
        pool.mark(url, True)
        if plan is not None:
            pool.plans[url] = plan
    return pool


def test_prefill_is_chosen_only_with_a_ready_decode_of_its_plan() -> None:
    prefill = _pool("prefill", {"p-old": "old", "p-new": "new"})
    decode = _pool("decode", {"d-old": "old", "d-new": "new"})
    decode.mark("d-new", False)  # the new plan's decode is still starting
    assert decode.ready_plans() == {"old"}
    assert {prefill.pick(plans=decode.ready_plans()) for _ in range(4)} == {"p-old"}
    decode.mark("d-new", True)
    assert {prefill.pick(plans=decode.ready_plans()) for _ in range(4)} == {"p-old", "p-new"}
    decode.mark("d-old", False)
    decode.mark("d-new", False)
    assert prefill.pick(plans=decode.ready_plans()) is None


def test_replicas_that_do_not_report_a_plan_exclude_nothing() -> None:
    prefill = _pool("prefill", {"p1": "a", "p2": None})
    decode = _pool("decode", {"d1": None})
    assert decode.ready_plans() is None
    assert {prefill.pick(plans=decode.ready_plans()) for _ in range(4)} == {"p1", "p2"}
