"""The autoscaling planner: each role's replicas from its own recent metrics, as a pure function.

Prefill saturates on prompt compute (TTFT, prompt tokens per second, queued prompt tokens),
decode on running sequences and their KV (TPOT, KV blocks in use), so each role is decided
alone. Where a metric measures load against a per-instance capacity (prefill's prompt tokens
per second, decode's KV blocks), the planner predicts the instances the load needs, as
Dynamo's planner does, rather than reacting to latency once it has already risen: up at the
first sample that asks for clearly more, beyond the noise of the samples before it (a burst
shorter than an instance's start-up is otherwise over before it is answered), up after two
samples in a row for a marginal breach (one is noise), and down, after a whole stabilization
window, straight to what that window's peak needed under the scale-down headroom. Latency alone
predicts nothing about how many instances fewer would do, so a role read only on latency steps
down one at a time. When the
metrics are missing or stale, nothing moves. The operator fetches the samples and applies the
decision; bench/autoscale_sim.py drives the same function with a trace, so it must stay free
of I/O and clocks (``now`` is an argument).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pdd_api.models import (
    AutoscalingSpec,
    DecodeAutoscaling,
    LatencyTarget,
    PDDeploymentSpec,
    PrefillAutoscaling,
    RoleAutoscaling,
)

Role = Literal["prefill", "decode"]

SCALED_UP, SCALED_DOWN = "ScaledUp", "ScaledDown"
AT_MAXIMUM, AT_MINIMUM = "AtMaximum", "AtMinimum"
STABLE, METRICS_UNAVAILABLE = "Stable", "MetricsUnavailable"
# Not a decision's reason: the Autoscaling condition's while a role decides on a sample that only
# part of its instances answered (Decision.partial).
METRICS_PARTIAL = "MetricsPartial"
REASONS = (SCALED_UP, SCALED_DOWN, AT_MAXIMUM, AT_MINIMUM, STABLE, METRICS_UNAVAILABLE)

# Samples in a row over a target that make a breach sustained (one is noise).
SUSTAINED_SAMPLES = 2
# A sample older than this many intervals says nothing about now.
STALE_INTERVALS = 3.0
# One instance fewer only if the load would then sit below this share of every target, so a
# step down does not land right on a target and bounce back up.
SCALE_DOWN_HEADROOM = 0.8
# A capacity metric that asks for more than current x this acts on one sample: a clear jump, not
# noise around the target (marginal breaches still wait for SUSTAINED_SAMPLES).
CLEAR_MARGIN = 1.2
# A latency ratio asks for at most this many times the measured instances per decision: latency
# is not linear in replicas, and the next interval corrects an undershoot.
MAX_LATENCY_FACTOR = 2.0
# A clear jump acts on one sample only when it also stands above the noise of the samples before
# it: their mean plus this many standard deviations of the load they asked for. Arrival noise
# (Poisson arrivals of prompts of mixed lengths) spreads one interval's rate by tens of per cent
# at tens of requests an interval, so a fixed margin alone lets noise jump to its peak and hold
# it a whole window; a jump within the noise waits for a second sample (SUSTAINED_SAMPLES).
JUMP_NOISE_SIGMAS = 5.0
# The samples the noise is read from: those of the last this many intervals before the latest,
# and at least JUMP_NOISE_SAMPLES of them (fewer: no one-sample jump).
JUMP_NOISE_INTERVALS = 20
JUMP_NOISE_SAMPLES = 10


@dataclass(frozen=True)
class Sample:
    """One scrape of one role, summed over its ready instances (and the router's histograms).

    ``time`` is in seconds on the caller's clock, the one ``now`` uses. ``replicas`` is how
    many instances the sample measured (0: none was ready, the sample is unusable). A latency of
    None means no request finished in the interval (no load), not a missing metric: a missing
    scrape is a missing sample. ``answered`` is set when only some of the ready instances
    answered the scrape (enough of them, see pdd_operator.autoscale_metrics): the sums are then
    theirs scaled up to ``replicas``, and decisions on it are marked partial.
    """

    time: float
    replicas: int
    latency: float | None = None  # TTFT (prefill) or TPOT (decode), seconds, at the percentile
    queued_prompt_tokens: float | None = None  # prefill: prompt tokens waiting, all instances
    # prefill: prompt tokens arriving per second over the interval, all instances (computed
    # plus the queue's growth)
    prompt_tokens_per_second: float | None = None
    kv_blocks_used: float | None = None  # decode: blocks held by live sequences, all instances
    kv_blocks_total: float | None = None  # decode: blocks of all instances
    running_sequences: float | None = None
    waiting_sequences: float | None = None
    answered: int | None = None  # instances that answered, when fewer than replicas

    @property
    def partial(self) -> bool:
        return self.answered is not None and self.answered < self.replicas


@dataclass(frozen=True)
class Decision:
    """What the planner wants for one role, why, and the numbers behind it (for the status,
    the Event and the condition message)."""

    role: Role
    current: int
    desired: int
    reason: str
    message: str
    metrics: dict[str, float] = field(default_factory=dict)
    partial: bool = False  # decided on a sample only part of the instances answered

    @property
    def direction(self) -> Literal["up", "down", "none"]:
        if self.desired > self.current:
            return "up"
        return "down" if self.desired < self.current else "none"


@dataclass(frozen=True)
class _Load:
    """A sample read against the role's targets: each metric's need in instances."""

    breaches: tuple[str, ...]  # metric descriptions over target, e.g. "TPOT p90 0.061 s > 0.05 s"
    need: int  # instances the breached metrics ask for (the measured count when none)
    clear: int  # instances the breached capacity metrics ask for (0: none breached)
    fits_one_fewer: bool  # every metric stays under SCALE_DOWN_HEADROOM with one fewer
    # instances every capacity metric fits under SCALE_DOWN_HEADROOM (None: the role has no
    # capacity metric, or latency is too close to its bound for any step down)
    down_to: int | None
    floor: int  # decode: instances its live sequences' KV needs at the target share (else 0)
    demand: float  # instances the capacity metrics ask for, unrounded (0: none configured)
    metrics: dict[str, float]
    summary: str  # all values, e.g. "TPOT p90 0.031 s, KV 0.42, 12 running"


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def _latency_name(role: Role) -> str:
    return "TTFT" if role == "prefill" else "TPOT"


def _pct(t: LatencyTarget) -> str:
    p = t.percentile
    return f"p{int(p)}" if p == int(p) else f"p{p:g}"


def _latency(role: Role, target: LatencyTarget | None, s: Sample,
             out: dict[str, float], parts: list[str], breaches: list[str]) -> tuple[int, bool]:
    if target is None or s.latency is None:
        return s.replicas, True
    name = f"{_latency_name(role)} {_pct(target)}"
    out[f"{_latency_name(role).lower()}Seconds"] = s.latency
    parts.append(f"{name} {_fmt(s.latency)} s")
    ratio = s.latency / target.seconds
    need = s.replicas
    if ratio > 1:
        breaches.append(f"{name} {_fmt(s.latency)} s > {_fmt(target.seconds)} s")
        need = max(s.replicas + 1, math.ceil(s.replicas * min(ratio, MAX_LATENCY_FACTOR)))
    return need, ratio <= SCALE_DOWN_HEADROOM


def _read(role: Role, spec: PrefillAutoscaling | DecodeAutoscaling, s: Sample,
          current: int) -> _Load:
    out: dict[str, float] = {"replicas": float(s.replicas)}
    parts: list[str] = []
    breaches: list[str] = []
    fewer = max(1, current - 1)
    target = spec.ttft if isinstance(spec, PrefillAutoscaling) else spec.tpot
    need, fits = _latency(role, target, s, out, parts, breaches)
    clear = 0
    down: list[int] = []
    floor = 0
    demand = 0.0
    if isinstance(spec, PrefillAutoscaling) and s.prompt_tokens_per_second is not None:
        rate = s.prompt_tokens_per_second
        out["promptTokensPerSecond"] = rate
        parts.append(f"{_fmt(rate)} prompt tokens/s")
        per_s = spec.promptTokensPerSecondPerReplica
        if per_s is not None:
            demand = max(demand, rate / per_s)
            want = math.ceil(rate / per_s - 1e-9)
            if rate > per_s * s.replicas:
                breaches.append(f"prompt tokens {_fmt(rate / s.replicas)}/s/replica > {per_s}")
                need = max(need, want)
                clear = max(clear, want)
            fits = fits and rate <= per_s * fewer * SCALE_DOWN_HEADROOM
            down.append(math.ceil(rate / (per_s * SCALE_DOWN_HEADROOM) - 1e-9))
    if isinstance(spec, PrefillAutoscaling) and s.queued_prompt_tokens is not None:
        q = s.queued_prompt_tokens
        out["queuedPromptTokens"] = q
        parts.append(f"{_fmt(q)} prompt tokens queued")
        per = spec.queuedPromptTokensPerReplica
        if per is not None:
            if q > per * s.replicas:
                breaches.append(f"queued prompt tokens {_fmt(q / s.replicas)}/replica > {per}")
                need = max(need, math.ceil(q / per))
            fits = fits and q <= per * fewer * SCALE_DOWN_HEADROOM
            if down:
                down.append(math.ceil(q / (per * SCALE_DOWN_HEADROOM) - 1e-9))
    if isinstance(spec, DecodeAutoscaling):
        used, total = s.kv_blocks_used, s.kv_blocks_total
        if used is not None and total:
            util = used / total
            per_instance = total / s.replicas
            target_blocks = per_instance * spec.kvCacheUtilization
            floor = math.ceil(used / target_blocks - 1e-9)
            demand = max(demand, used / target_blocks)
            out["kvCacheUtilization"] = util
            parts.append(f"KV {util:.2f}")
            if util > spec.kvCacheUtilization:
                breaches.append(f"KV {util:.2f} > {_fmt(spec.kvCacheUtilization)}")
                need = max(need, floor)
                clear = max(clear, floor)
            fits = fits and used <= target_blocks * fewer * SCALE_DOWN_HEADROOM
            down.append(math.ceil(used / (target_blocks * SCALE_DOWN_HEADROOM) - 1e-9))
            if spec.tpot is not None and s.latency is not None:
                # Decode's step time grows slower than its batch: TPOT scaled by the batch per
                # instance over-estimates, so the projection errs on the side of keeping.
                down.append(math.ceil(s.replicas * s.latency
                                      / (spec.tpot.seconds * SCALE_DOWN_HEADROOM) - 1e-9))
        if s.running_sequences is not None:
            out["runningSequences"] = s.running_sequences
            parts.append(f"{_fmt(s.running_sequences)} running")
        per_seq = spec.sequencesPerReplica
        if per_seq is not None and s.running_sequences is not None:
            seqs = s.running_sequences + (s.waiting_sequences or 0.0)
            demand = max(demand, seqs / per_seq)
            want = math.ceil(seqs / per_seq - 1e-9)
            if seqs > per_seq * s.replicas:
                breaches.append(f"sequences {_fmt(seqs / s.replicas)}/replica > {per_seq}")
                need = max(need, want)
                clear = max(clear, want)
            fits = fits and seqs <= per_seq * fewer * SCALE_DOWN_HEADROOM
            down.append(math.ceil(seqs / (per_seq * SCALE_DOWN_HEADROOM) - 1e-9))
    if s.waiting_sequences is not None:
        out["waitingSequences"] = s.waiting_sequences
    if floor:
        out["floorReplicas"] = float(floor)
    lat_ok = target is None or s.latency is None or (
        s.latency <= target.seconds * SCALE_DOWN_HEADROOM)
    down_to = max(down) if down and lat_ok else None
    return _Load(tuple(breaches), need, clear, fits, down_to, floor, demand, out,
                 ", ".join(parts) or "no load")


def beyond_noise(demand: float, before: Sequence[float]) -> bool:
    """Whether ``demand`` stands out of the noise of the demands ``before`` it (oldest first):
    above their highest by more than JUMP_NOISE_SIGMAS of their noise, with at least
    JUMP_NOISE_SAMPLES of them to read it from. The noise is read from the differences of
    consecutive samples (von Neumann's estimator: a mean square difference of 2 sigma^2), so a
    steady ramp of load is not taken for noise and a jump off a ramp still acts at once."""
    if len(before) < JUMP_NOISE_SAMPLES:
        return False
    sigma = math.sqrt(statistics.fmean((b - a) ** 2 for a, b in zip(before, before[1:],
                                                                    strict=False)) / 2)
    return demand > max(before) + JUMP_NOISE_SIGMAS * sigma


def _usable(s: Sample, now: float, interval: float) -> bool:
    return s.replicas > 0 and now - s.time <= STALE_INTERVALS * interval and s.time <= now


def decide(role: Role, spec: PrefillAutoscaling | DecodeAutoscaling, current: int,
           history: Sequence[Sample], now: float, *, interval: float, stabilization: float,
           last_scale_time: float | None = None) -> Decision:
    """One role's desired replicas.

    ``current`` is the replicas the operator builds now (the last decision, or the spec's seed),
    ``history`` that role's samples, oldest first (at least the stabilization window's worth
    is useful; older ones are ignored), ``now`` and ``last_scale_time`` on the samples' clock,
    ``interval`` and ``stabilization`` in seconds (spec.autoscaling's). Returns ``desired``
    within [minReplicas, maxReplicas]: above ``current`` at once when a capacity metric asks
    for more than CLEAR_MARGIN x current and beyond the noise of the samples before
    (beyond_noise), or after a sustained breach (by the instances the
    load needs); below it after a stabilization window that fitted fewer (the window's peak
    need where the load is measured against a capacity, else one fewer); ``current``
    otherwise. Pure: same arguments, same decision.
    """
    lo, hi = spec.minReplicas, max(spec.minReplicas, spec.maxReplicas)
    part: Sample | None = None

    def done(desired: int, reason: str, why: str, metrics: dict[str, float]) -> Decision:
        head = f"{role} {current}→{desired}" if desired != current else f"{role} {current}"
        if part is not None:
            why += f" (metrics from {part.answered} of {part.replicas} instances)"
        return Decision(role, current, desired, reason, f"{head}: {why}", metrics,
                        partial=part is not None)

    if current < lo:
        return done(lo, SCALED_UP, f"below minReplicas {lo}", {})
    if current > hi:
        return done(hi, SCALED_DOWN, f"above maxReplicas {hi}", {})
    recent = [s for s in history if s.time <= now]
    latest = recent[-1] if recent else None
    if latest is None or not _usable(latest, now, interval):
        why = ("no metrics yet" if latest is None else
               "no ready instance measured" if latest.replicas <= 0 else
               f"last metrics {_fmt(now - latest.time)} s old")
        return done(current, METRICS_UNAVAILABLE, f"holding, {why}", {})
    load = _read(role, spec, latest, current)
    metrics = dict(load.metrics)
    if latest.partial:
        part = latest
        metrics["answeredReplicas"] = float(latest.answered or 0)

    # Up: a capacity metric that asks for clearly more, beyond the noise of the samples before,
    # acts on this sample; any breach acts once it has held for SUSTAINED_SAMPLES, on the
    # smaller of the samples' asks.
    before = [_read(role, spec, s, current).demand for s in recent[:-1]
              if s.replicas > 0 and s.time >= now - JUMP_NOISE_INTERVALS * interval]
    clear = load.clear if (load.clear > current * CLEAR_MARGIN
                           and beyond_noise(load.demand, before)) else 0
    sustained: int | None = None
    tail = recent[-SUSTAINED_SAMPLES:]
    if len(tail) == SUSTAINED_SAMPLES and all(_usable(s, now, interval) for s in tail):
        loads = [load if s is latest else _read(role, spec, s, current) for s in tail]
        if all(x.breaches for x in loads):
            sustained = min(x.need for x in loads)
    want = max(clear, sustained or 0)
    if want or sustained is not None:
        why = ", ".join(load.breaches)
        if want > current:
            if current >= hi:
                return done(current, AT_MAXIMUM, f"{why}; at maxReplicas {hi}", metrics)
            return done(min(want, hi), SCALED_UP, why, metrics)
        return done(current, STABLE, f"{why}; {current} requested, waiting for them",
                    metrics)

    # Down: only after a whole window, all of it covered by samples, a whole window after the
    # role's last change; to the window's peak need where the role's load has a capacity
    # metric, else one instance.
    window = [s for s in recent if s.time >= now - stabilization] or [latest]
    covered = (stabilization <= 0 or (
        recent[0].time <= now - stabilization + interval
        and all(b.time - a.time <= STALE_INTERVALS * interval
                for a, b in zip(window, window[1:], strict=False))))
    reads = [_read(role, spec, s, current) for s in window if s.replicas > 0]
    ok = covered and len(reads) == len(window)
    peak = [x.down_to for x in reads]
    to = max(lo, load.floor, *(p for p in peak if p is not None)) if peak and ok and all(
        p is not None for p in peak) else None
    if to is None and ok and all(x.fits_one_fewer for x in reads):
        to = max(lo, current - 1)
    if to is not None and to >= current and current <= lo:
        return done(current, AT_MINIMUM, f"{load.summary}; at minReplicas {lo}", metrics)
    settled = last_scale_time is None or now - last_scale_time >= stabilization
    if to is not None and to < current and settled and to >= load.floor:
        return done(to, SCALED_DOWN,
                    f"{load.summary} for {_fmt(stabilization)} s, fits {to}", metrics)
    return done(current, STABLE, load.summary, metrics)


def plan(autoscaling: AutoscalingSpec, current: Mapping[str, int],
         history: Mapping[str, Sequence[Sample]], now: float,
         last_scale_time: Mapping[str, float | None] | None = None) -> dict[str, Decision]:
    """Decisions for every role whose autoscaling is on (absent or disabled: no entry).

    ``current`` and ``history`` by role name; a role missing from ``history`` has no samples
    (MetricsUnavailable)."""
    out: dict[str, Decision] = {}
    last = last_scale_time or {}
    roles: tuple[tuple[Role, PrefillAutoscaling | DecodeAutoscaling | None], ...] = (
        ("prefill", autoscaling.prefill), ("decode", autoscaling.decode))
    for role, spec in roles:
        if spec is None or not spec.enabled:
            continue
        out[role] = decide(role, spec, current[role], history.get(role, ()), now,
                           interval=float(autoscaling.intervalSeconds),
                           stabilization=float(autoscaling.scaleDownStabilizationSeconds),
                           last_scale_time=last.get(role))
    return out


def role_autoscaling(spec: PDDeploymentSpec, role: str) -> (
        PrefillAutoscaling | DecodeAutoscaling | None):
    """The role's autoscaling when pdd's planner drives it, else None (spec replicas rule)."""
    a = spec.autoscaling
    r = None if a is None else (a.prefill if role == "prefill" else a.decode)
    return r if r is not None and r.enabled else None


def clamp(spec: RoleAutoscaling, replicas: int) -> int:
    return min(max(replicas, spec.minReplicas), max(spec.minReplicas, spec.maxReplicas))


def effective_replicas(spec: PDDeploymentSpec, status: Mapping[str, Any] | None) -> dict[str, int]:
    """Instances to build per role: the planner's status.autoscaling.<role>.desiredReplicas
    where autoscaling drives the role (spec.<role>.replicas, clamped, until it has decided),
    spec.<role>.replicas elsewhere. Spec is never written, so a GitOps sync of the same
    manifest changes nothing."""
    out: dict[str, int] = {}
    auto = (status or {}).get("autoscaling") or {}
    for role in ("prefill", "decode"):
        seed = getattr(spec, role).replicas
        r = role_autoscaling(spec, role)
        if r is None:
            out[role] = seed
            continue
        desired = (auto.get(role) or {}).get("desiredReplicas")
        if not isinstance(desired, int) or isinstance(desired, bool):
            desired = seed
        out[role] = clamp(r, desired)
    return out


def with_replicas(spec: PDDeploymentSpec, replicas: Mapping[str, int]) -> PDDeploymentSpec:
    """The spec the builders see: the same, with the roles' replicas replaced."""
    update = {role: getattr(spec, role).model_copy(update={"replicas": n})
              for role, n in replicas.items() if getattr(spec, role).replicas != n}
    return spec.model_copy(update=update) if update else spec
