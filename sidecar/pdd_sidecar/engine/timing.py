"""Where one request's time to its first tokens went: the stamps, the stage names, the arithmetic.

Each process stamps ``time.monotonic()`` at fixed points (instances on ``Sequence.extra``, the
router on its ``Trip``) and turns them into millisecond durations before they leave it: the
router, the instances and the ranks of one instance need not share a clock (pods, hosts). The
router then lays the durations end to end; a stage it cannot see directly (a network hop, the
HTTP handling on the far side) is the remainder of an interval it did time, so the stages add up
to the TTFT the router saw. Pure: no torch, importable by the router.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdd_sidecar.engine.scheduler import Sequence, StepPlan

# Sequence.extra keys (instance side).
RECEIVED = "t_received"  # the HTTP handler took the request
ADMITTED = "t_admitted"  # decode: blocks allocated, pull handed to the ranks
HANDLED = "t_handled"  # prefill: the driver took it into its scheduler
PLANNED = "t_planned"  # prefill: the first step plan that holds a chunk of it was made
STEP_START = "t_step_start"  # the first step that ran this sequence began
LAUNCHED = "t_launched"  # prefill: the host finished launching the step that chose its token
STEP_END = "t_step_end"  # the step that chose its first token ended, sampling included
CLAIM_SECONDS = "claim_seconds"  # in a rank's pull stats: pull started -> claim answered
# Counts for the request's trace (serve/instance/spans.py): the prefill steps that ran a chunk
# of its prompt; on a decode, the draft tokens speculation proposed and those it kept.
CHUNKS = "chunks"
SPEC_DRAFT_TOKENS = "spec_draft_tokens"
SPEC_ACCEPTED_TOKENS = "spec_accepted_tokens"

# Trip.stamps keys (router side).
R_RECEIVED = "received"
R_PREFILL_SENT = "prefill_sent"
R_PREFILL_GOT = "prefill_got"
R_DECODE_SENT = "decode_sent"
R_FIRST_TOKEN = "first_token"
R_SECOND_TOKEN = "second_token"  # the decode's first token, handed to the client

PREFILL_STAGES = ("queue", "compute")
# Within those two (not laid end to end with the rest): the queue's wait for the driver to take
# the request (``inbox``), then for its first step's plan (``gather``: the rest of a burst
# arriving, steps ahead of it), and the compute's host launch (``launch``: first step's start until
# the last step was enqueued) and what followed it (``to_host``: the device finishing, the token
# copied back and the driver hearing of it). Where the host, not the device, held a prompt.
PREFILL_DETAIL = ("inbox", "gather", "launch", "to_host")
# Each of PREFILL_STAGES and PREFILL_DETAIL: from one stamp to another.
PREFILL_SPANS = (("queue", RECEIVED, STEP_START), ("compute", STEP_START, STEP_END),
                 ("inbox", RECEIVED, HANDLED), ("gather", HANDLED, PLANNED),
                 ("launch", STEP_START, LAUNCHED), ("to_host", LAUNCHED, STEP_END))
DECODE_STAGES = ("queue", "claim", "read", "join", "first_step")
# The first token is the prefill's: the client has it while the hand-off runs. These add up to
# ``ttft``; all of STAGES, laid end to end, to ``second_token``.
TTFT_STAGES = ("router_to_prefill", "prefill_queue", "prefill_compute", "prefill_to_router",
               "to_client")
HANDOFF_STAGES = ("grant_to_decode", "decode_queue", "claim", "read", "join", "first_step",
                  "decode_to_client")
STAGES = TTFT_STAGES + HANDOFF_STAGES
# A prompt its decode prefilled itself (local_prefill): the first token is the decode's, and
# these add up to ``ttft``; the decode's PREFILL_DETAIL comes beside them as ``local_inbox``..
LOCAL_STAGES = ("router_to_decode", "local_queue", "local_compute", "decode_to_client")


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def mark_step_start(plan: StepPlan, now: float) -> None:
    """Called as a step begins: the first stamp of each kind wins, so a prompt's first chunk and
    a decode sequence's first fed token are what stay."""
    for seq in plan.pulls:
        seq.extra.setdefault(ADMITTED, now)
    for chunk in plan.prefill:
        extra = chunk.seq.extra
        extra.setdefault(STEP_START, now)
        extra[CHUNKS] = extra.get(CHUNKS, 0) + 1
    for entry in plan.decode:
        entry.seq.extra.setdefault(STEP_START, now)


def mark_planned(plan: StepPlan, now: float) -> None:
    """Called as a prefill plan is made, before the driver decides to run it."""
    for chunk in plan.prefill:
        chunk.seq.extra.setdefault(PLANNED, now)


def mark_sampled(seqs: Iterable[Sequence], now: float) -> None:
    """Called once tokens are chosen, before anyone is told of them."""
    for seq in seqs:
        seq.extra.setdefault(STEP_END, now)


def count_speculation(extra: dict[str, Any], drafted: int, accepted: int) -> None:
    """One verify step of a sequence: ``drafted`` tokens proposed, ``accepted`` kept."""
    extra[SPEC_DRAFT_TOKENS] = extra.get(SPEC_DRAFT_TOKENS, 0) + drafted
    extra[SPEC_ACCEPTED_TOKENS] = extra.get(SPEC_ACCEPTED_TOKENS, 0) + accepted


def prefill_timing(extra: Mapping[str, Any]) -> dict[str, float]:
    """The prefill instance's part: received -> first chunk's step, then -> last chunk sampled."""
    return {name: _ms(extra[end] - extra[start]) for name, start, end in PREFILL_SPANS
            if start in extra and end in extra}


def slowest_pull(transfer: Mapping[Any, Any]) -> tuple[float, float] | None:
    """(claim, READ) seconds of the rank whose claim + READ took longest: the one the sequence
    waited for."""
    pairs = [(float(t.get(CLAIM_SECONDS, 0.0)), float(t.get("seconds", 0.0)))
             for t in transfer.values() if t]
    return max(pairs, key=sum) if pairs else None


def decode_timing(extra: Mapping[str, Any], prefilled_here: bool = False) -> dict[str, float]:
    """The decode instance's part. ``join`` is what is left between admission and the first
    step once the slowest rank's claim and READ are taken out: pull threads picking the job up,
    notifying the prefill, the driver hearing of it, the step boundary. A prompt it prefilled
    itself (``prefilled_here``) pulled nothing: its part is a prefill's (``prefill_timing``)."""
    if prefilled_here:
        return prefill_timing(extra)
    out: dict[str, float] = {}
    received, admitted = extra.get(RECEIVED), extra.get(ADMITTED)
    start, end = extra.get(STEP_START), extra.get(STEP_END)
    if received is not None and admitted is not None:
        out["queue"] = _ms(admitted - received)
    pull = slowest_pull(extra.get("transfer") or {})
    if pull is not None:
        out["claim"], out["read"] = _ms(pull[0]), _ms(pull[1])
    if admitted is not None and start is not None:
        out["join"] = _ms(max(0.0, start - admitted - sum(pull or (0.0, 0.0))))
    if start is not None and end is not None:
        out["first_step"] = _ms(end - start)
    return out


def _parts(reported: Any, names: tuple[str, ...]) -> dict[str, float]:
    """An instance's numbers, only those that are non-negative numbers (it may be old or odd)."""
    if not isinstance(reported, dict):
        return {}
    return {k: float(v) for k in names if isinstance(v := reported.get(k), int | float)
            and not isinstance(v, bool) and v >= 0}


def request_timing(stamps: Mapping[str, float], prefill: Any = None,
                   decode: Any = None) -> dict[str, float]:
    """The router's breakdown of one request, in milliseconds (keys in ``STAGES`` plus ``ttft``
    and, once the decode's first token reached the client, ``second_token``; the prefill's
    ``PREFILL_DETAIL`` as ``prefill_inbox`` and so on, parts of its queue and compute).

    ``prefill_to_router`` is the prefill round trip less the instance's queue and compute (both
    hops, HTTP handling, signing the grant); ``to_client`` the router's work from the prefill's
    answer to handing its token to the client. The hand-off runs after that: ``grant_to_decode``
    until the decode request is sent, the decode's own stages, and ``decode_to_client``, the
    decode round trip less those stages (writing its first line, both hops) plus the router's
    work until the client has that token (a prompt run again on another prefill after a failed
    hand-off counts in ``grant_to_decode``). Stages the router could not time are left out."""
    s = stamps
    out: dict[str, float] = {}
    if R_RECEIVED not in s or R_FIRST_TOKEN not in s:
        return out
    first = s[R_FIRST_TOKEN]
    if R_PREFILL_SENT not in s and s.get(R_DECODE_SENT, first + 1) <= first:
        return _local_timing(s, decode)
    # After a hand-off that failed, the prompt ran again on another prefill once the client
    # had its first token: that prefill's stamps are the hand-off's time, not the TTFT's.
    again = s.get(R_PREFILL_GOT, first) > first
    if R_PREFILL_SENT in s and not again:
        out["router_to_prefill"] = _ms(s[R_PREFILL_SENT] - s[R_RECEIVED])
    if R_PREFILL_SENT in s and R_PREFILL_GOT in s and not again:
        pre = _parts(prefill, PREFILL_STAGES)
        for k, v in {**pre, **_parts(prefill, PREFILL_DETAIL)}.items():
            out[f"prefill_{k}"] = v
        round_ms = _ms(s[R_PREFILL_GOT] - s[R_PREFILL_SENT])
        out["prefill_to_router"] = max(0.0, round(round_ms - sum(pre.values()), 3))
        out["to_client"] = _ms(first - s[R_PREFILL_GOT])
    out["ttft"] = _ms(first - s[R_RECEIVED])
    if R_DECODE_SENT in s and s[R_DECODE_SENT] >= first:
        out["grant_to_decode"] = _ms(s[R_DECODE_SENT] - first)
        dec = _parts(decode, DECODE_STAGES)
        for k, v in dec.items():
            out["decode_queue" if k == "queue" else k] = v
        if R_SECOND_TOKEN in s:
            rest = _ms(s[R_SECOND_TOKEN] - s[R_DECODE_SENT])
            out["decode_to_client"] = max(0.0, round(rest - sum(dec.values()), 3))
            out["second_token"] = _ms(s[R_SECOND_TOKEN] - s[R_RECEIVED])
    return out


def _local_timing(s: Mapping[str, float], decode: Any) -> dict[str, float]:
    """``request_timing`` of a prompt its decode prefilled itself: ``router_to_decode`` until
    the decode request was sent, the decode's queue and compute (a prefill's stages, and their
    detail beside them), and ``decode_to_client``, the rest of the decode round trip until the
    client had the first token (both hops, HTTP handling, the router's work)."""
    first = s[R_FIRST_TOKEN]
    out = {"router_to_decode": _ms(s[R_DECODE_SENT] - s[R_RECEIVED])}
    own = _parts(decode, PREFILL_STAGES)
    out |= {f"local_{k}": v for k, v in {**own, **_parts(decode, PREFILL_DETAIL)}.items()}
    out["decode_to_client"] = max(0.0, round(_ms(first - s[R_DECODE_SENT]) - sum(own.values()), 3))
    out["ttft"] = _ms(first - s[R_RECEIVED])
    if R_SECOND_TOKEN in s:
        out["second_token"] = _ms(s[R_SECOND_TOKEN] - s[R_RECEIVED])
    return out
