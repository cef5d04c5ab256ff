"""The TTFT breakdown's arithmetic (engine/timing.py): stages laid end to end add up to the
TTFT and to the decode's first token, remainders never go negative, and what an instance did
not report is left out."""

from __future__ import annotations

from pdd_sidecar.engine import timing as T
from pdd_sidecar.engine.scheduler import DecodeEntry, PrefillChunk, Sequence, StepPlan


def stamps(**ms: float) -> dict[str, float]:
    return {k: v / 1e3 for k, v in ms.items()}


def test_stages_add_up_to_the_ttft_then_to_the_decode_token() -> None:
    """The first token is the prefill's, handed over before the hand-off begins: the first
    stages add up to the TTFT, all of them to the decode's first token."""
    s = stamps(received=100, prefill_sent=102, prefill_got=150, first_token=151,
               decode_sent=152, second_token=200)
    out = T.request_timing(s, {"queue": 5.0, "compute": 40.0},
                           {"queue": 1.0, "claim": 3.0, "read": 10.0, "join": 2.0,
                            "first_step": 20.0})
    assert out["router_to_prefill"] == 2.0 and out["prefill_to_router"] == 3.0
    assert out["to_client"] == 1.0 and out["ttft"] == 51.0
    assert out["grant_to_decode"] == 1.0 and out["decode_queue"] == 1.0
    assert out["decode_to_client"] == 12.0 and out["second_token"] == 100.0
    assert set(out) == {*T.STAGES, "ttft", "second_token"}
    assert abs(sum(out[k] for k in T.TTFT_STAGES) - out["ttft"]) < 1e-6
    assert abs(sum(out[k] for k in T.STAGES) - out["second_token"]) < 1e-6


def test_the_prefill_detail_is_passed_on_beside_its_stages_not_added_to_them() -> None:
    s = stamps(received=100, prefill_sent=102, prefill_got=150, first_token=151)
    out = T.request_timing(s, {"queue": 5.0, "compute": 40.0, "inbox": 1.0, "launch": 2.5,
                               "to_host": -3, "other": 9.0}, None)
    assert out["prefill_inbox"] == 1.0 and out["prefill_launch"] == 2.5
    assert "prefill_to_host" not in out and "prefill_other" not in out
    assert out["prefill_to_router"] == 3.0 and out["ttft"] == 51.0


def test_a_prompt_run_again_after_the_first_token_counts_in_the_hand_off() -> None:
    """The prefill stamps of a second try come after the first token: they are not the TTFT's
    stages, and the hand-off's first stage covers them."""
    s = stamps(received=0, prefill_sent=60, prefill_got=90, first_token=40, decode_sent=91,
               second_token=120)
    out = T.request_timing(s, {"queue": 5.0, "compute": 20.0}, None)
    assert out["ttft"] == 40.0 and out["grant_to_decode"] == 51.0
    assert not {"router_to_prefill", "prefill_queue", "prefill_to_router", "to_client"} & set(out)
    assert out["second_token"] == 120.0 and out["decode_to_client"] == 29.0


def test_without_a_decode_or_instance_figures() -> None:
    s = stamps(received=0, prefill_sent=1, prefill_got=30, first_token=31)
    out = T.request_timing(s, None, None)
    assert out == {"router_to_prefill": 1.0, "prefill_to_router": 29.0, "to_client": 1.0,
                   "ttft": 31.0}
    bogus = T.request_timing(s, {"queue": -4, "compute": True}, None)
    assert "prefill_queue" not in bogus and "prefill_compute" not in bogus
    assert T.request_timing({"received": 1.0}, None, None) == {}
    # A decode that has not sent its first token yet: its stages, no remainder.
    opened = T.request_timing({**s, "decode_sent": 0.032}, None, {"queue": 1.0})
    assert opened["grant_to_decode"] == 1.0 and opened["decode_queue"] == 1.0
    assert "decode_to_client" not in opened and "second_token" not in opened


def test_instance_stamps() -> None:
    seq = Sequence("a", [1, 2, 3], 4, 3)
    seq.extra[T.RECEIVED] = 10.0
    plan = StepPlan(prefill=[PrefillChunk(seq, 0, [1, 2])])
    T.mark_step_start(plan, 10.5)
    T.mark_step_start(StepPlan(prefill=[PrefillChunk(seq, 2, [3])]), 11.0)
    T.mark_sampled([seq], 11.25)
    T.mark_sampled([seq], 12.0)
    assert T.prefill_timing(seq.extra) == {"queue": 500.0, "compute": 750.0}
    seq.extra[T.HANDLED] = 10.125
    seq.extra[T.LAUNCHED] = 11.0625
    assert T.prefill_timing(seq.extra) == {"queue": 500.0, "compute": 750.0, "inbox": 125.0,
                                           "launch": 562.5, "to_host": 187.5}
    T.mark_planned(plan, 10.375)
    T.mark_planned(StepPlan(prefill=[PrefillChunk(seq, 2, [3])]), 10.75)  # the first plan stays
    assert T.prefill_timing(seq.extra)["gather"] == 250.0

    dec = Sequence("b", [], 4, 3, source=object(), first_token=7)
    dec.extra[T.RECEIVED] = 1.0
    T.mark_step_start(StepPlan(pulls=[dec]), 1.002)
    dec.extra["transfer"] = {0: {"claim_seconds": 0.003, "seconds": 0.010},
                             1: {"claim_seconds": 0.001, "seconds": 0.020}}
    T.mark_step_start(StepPlan(decode=[DecodeEntry(dec, 7, 3)]), 1.040)
    T.mark_sampled([dec], 1.050)
    assert T.decode_timing(dec.extra) == {"queue": 2.0, "claim": 1.0, "read": 20.0,
                                          "join": 17.0, "first_step": 10.0}


def test_a_prompt_prefilled_on_its_decode_adds_up_to_the_ttft() -> None:
    """local_prefill: no prefill round trip; the decode's queue and compute (a prefill's
    stages) and the hops around them add up to the TTFT, the detail beside them."""
    s = stamps(received=100, decode_sent=101, first_token=140, second_token=150)
    out = T.request_timing(s, None, {"queue": 12.0, "compute": 20.0, "gather": 9.0,
                                     "launch": 2.0})
    assert out["router_to_decode"] == 1.0
    assert out["local_queue"] == 12.0 and out["local_compute"] == 20.0
    assert out["local_gather"] == 9.0 and out["local_launch"] == 2.0
    assert out["decode_to_client"] == 7.0
    assert out["ttft"] == 40.0 and out["second_token"] == 50.0
    assert abs(sum(out[k] for k in T.LOCAL_STAGES) - out["ttft"]) < 1e-6
    assert not {"router_to_prefill", "grant_to_decode", "decode_queue"} & set(out)
    # What the decode did not report is left out; the remainder never goes negative.
    bare = T.request_timing(s, None, {"queue": 60.0})
    assert bare["decode_to_client"] == 0.0 and "local_compute" not in bare


def test_a_decode_reports_a_prompt_it_prefilled_as_a_prefill_would() -> None:
    extra = {T.RECEIVED: 1.0, T.HANDLED: 1.002, T.PLANNED: 1.010, T.STEP_START: 1.011,
             T.LAUNCHED: 1.015, T.STEP_END: 1.030}
    assert T.decode_timing(extra, prefilled_here=True) == T.prefill_timing(extra)
    assert T.decode_timing(extra, prefilled_here=True)["queue"] == 11.0
    assert "queue" not in T.decode_timing(extra)  # pulled: queue is received -> admitted
