"""An instance request is counted once with its outcome, and its error answer and status are
what its span reads (serve/instance/common.py RequestRecord)."""

from __future__ import annotations

import json

import pytest

from pdd_sidecar.engine.worker import RequestError
from pdd_sidecar.metrics import InstanceMetrics
from pdd_sidecar.serve.instance.common import RequestRecord

pytestmark = pytest.mark.dataplane


def _count(m: InstanceMetrics, role: str, outcome: str) -> float:
    value = m.registry.get_sample_value(
        "pdd_requests_total", {"role": role, "endpoint": role, "outcome": outcome})
    return value or 0.0


def test_a_failed_request_is_counted_as_an_error_with_its_status() -> None:
    m = InstanceMetrics("decode")
    rec = RequestRecord(m, "decode")
    response = rec.failed(RequestError("max_new_tokens: must be >= 1, got 0", 400,
                                       "invalid_request"))
    rec.close()
    assert (response.status, rec.status, rec.outcome) == (400, 400, "error")
    assert rec.error == "max_new_tokens: must be >= 1, got 0"
    assert json.loads(response.text)["error"]["message"] == rec.error
    assert _count(m, "decode", "error") == 1 and _count(m, "decode", "ok") == 0
    assert m.registry.get_sample_value(
        "pdd_request_seconds_count", {"role": "decode", "endpoint": "decode"}) == 1


def test_an_answered_request_is_counted_once_as_ok() -> None:
    m = InstanceMetrics("prefill")
    rec = RequestRecord(m, "prefill")
    rec.ok()
    rec.close()
    assert (rec.status, rec.error) == (200, None)
    assert _count(m, "prefill", "ok") == 1 and _count(m, "prefill", "error") == 0


def test_a_request_that_ended_before_an_answer_is_an_error() -> None:
    """Cancelled (the client went away) or failed outside the handler's own errors: nothing
    called ``ok`` or ``failed``, and it still counts, as an error of status 500."""
    m = InstanceMetrics("decode")
    rec = RequestRecord(m, "decode")
    rec.close()
    assert (rec.status, rec.outcome) == (500, "error")
    assert _count(m, "decode", "error") == 1
