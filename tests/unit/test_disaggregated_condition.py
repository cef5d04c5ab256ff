"""The Disaggregated condition: False (NoPrefillReady) while no prefill pod is ready, saying
what the router does meanwhile; a Warning event when every prefill is lost; kubectl pdd status
shows it."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pdd_cli.kubectl_plugin import request_paths, status_report
from pdd_operator.conditions import DISAGGREGATED, NO_PREFILL_READY, disaggregated_condition

from .test_conditions import conds, doc, status_for  # noqa: F401  (doc: a fixture)


@pytest.mark.parametrize("prefill, decode, mode, ok, words", [
    (1, 1, "fallback", True, "1 prefill pod ready"),
    (2, 0, "refuse", True, "2 prefill pods ready"),
    (0, 1, "fallback", False, "prefills requests on the decode pods"),
    (0, 1, "refuse", False, "refuses requests with 503"),
    (0, 0, "fallback", False, "no decode pod is ready either"),
])
def test_the_condition_says_what_the_router_does(prefill: int, decode: int, mode: str,
                                                 ok: bool, words: str) -> None:
    got_ok, reason, message = disaggregated_condition(prefill, decode, mode)
    assert got_ok is ok
    assert reason == ("PrefillReady" if ok else NO_PREFILL_READY)
    assert words in message


def test_losing_every_prefill_turns_it_false(doc: dict[str, Any]) -> None:  # noqa: F811
    up = status_for(doc, {"prefill": ["ready"], "decode": ["ready", "ready"]})
    assert conds(up)[DISAGGREGATED]["status"] == "True"
    down = status_for(doc, {"prefill": ["starting"], "decode": ["ready", "ready"]},
                      previous=up)
    c = conds(down)[DISAGGREGATED]
    assert (c["status"], c["reason"]) == ("False", NO_PREFILL_READY)
    assert "decode pods" in c["message"]


def _pdd(status: str, local: int | None = None) -> dict[str, Any]:
    router = {} if local is None else {"localPrefillTokens": local}
    return {"metadata": {"name": "demo", "namespace": "ns"}, "spec": {"router": router},
            "status": {"conditions": [{"type": DISAGGREGATED, "status": status,
                                       "reason": "NoPrefillReady" if status == "False"
                                       else "PrefillReady", "message": "no prefill pod is "
                                       "ready: the router prefills requests on the decode"}]}}


def test_kubectl_pdd_status_shows_the_request_path() -> None:
    assert "NOT DISAGGREGATED (NoPrefillReady)" in request_paths(_pdd("False"))
    assert "at most 256 uncached tokens" in request_paths(_pdd("True"))
    assert "never on the decode" in request_paths(_pdd("True", 0))
    report = status_report(copy.deepcopy(_pdd("False")), [], [])
    assert "NOT DISAGGREGATED" in report and "Disaggregated" in report
