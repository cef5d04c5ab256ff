"""Autoscaling at scale, simulated: pdd's planner against a static count and against scaling
on request count alone, each held to the planner's attainment, over days of Poisson traffic
with bursts, at the measured start-up and at a large instance's.

    python bench/autoscale_sim.py [--quick] [--json out.json] [--seeds 1,2,3] [--ready-s 70,600]

Why a simulation: a day of traffic on hundreds of GPUs cannot be run for each change of the
planner, and the question (does scaling on what each role saturates on beat scaling on request
count, and by how much against a fixed count) is about the decisions, not the kernels. The
per-replica model is taken from measured figures, read from the JSON the GPU benches wrote
(each figure and its file are printed and kept in the output):

- prefill step time for n prompt tokens: the affine fit through bench/engine.py's two prefill
  points (docs/gpu_engine_h200.json), chunks of at most the larger point's tokens;
- decode step time by batch and context: bench/engine.py's CUDA-graph table, interpolated in
  log(batch) and log(context) (same file);
- a decode instance's KV pool (tokens, blocks) and the time from start to ready of `pdd serve`:
  bench/kv_tiers.py's default stack on one H200 (docs/kv_tiers_h200_a_d.json); --ready-s adds
  other start-ups (600 s by default: a large multi-GPU instance, assumed);
- at most the largest measured decode batch running per decode instance.

The traffic: each second, each request class's arrivals are a Poisson count at the day
shape's rate (bursts included), one draw per seed. They form a cohort (a fluid within the
second). Prefill is one FIFO of prompt tokens over the ready prefill instances; a cohort's
TTFT is its own prefill time, plus the M/G/1 wait of an instance at the second's utilization
(Pollaczek-Khinchine over the classes' prefill times), plus how long the backlog kept it
beyond its arrival second. Decode admits cohorts FIFO while sequences and KV fit; a running
cohort advances one token per step, the step time set by the batch per instance and the mean
context; its TPOT is (last token - first token) / (output tokens - 1), so time spent waiting
for a decode slot counts. A new instance costs GPU time from the decision and serves after the
start-up; one scaled down stops taking work at once and costs GPU time while it drains.

Policies, on the same arrivals, each deciding every interval:
- planner: pdd_api.autoscale.plan itself, fed the samples the operator would scrape, its
  capacity targets a share of the measured per-instance figures;
- static: per role the fewest instances whose TTFT (prefill) or TPOT (decode) attainment
  reaches the planner's, by bisection (and the peak sizing at --static-utilization, shown);
- requests: an HPA-like rule on requests in flight per ready replica, its threshold tuned per
  role by bisection to the planner's attainment, then both scaled by one factor toward the
  planner's GPU-hours (misses at equal cost).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

from pdd_api.autoscale import Sample, plan  # noqa: E402
from pdd_api.models import (  # noqa: E402
    AutoscalingSpec,
    DecodeAutoscaling,
    LatencyTarget,
    PrefillAutoscaling,
)

ENGINE_JSON = ROOT / "docs" / "gpu_engine_h200.json"
KV_TIERS_JSON = ROOT / "docs" / "kv_tiers_h200_a_d.json"


# ------------------------------------------------------------------ the measured model


@dataclass(frozen=True)
class Figures:
    """Per-instance model; `sources` says where each figure comes from."""

    prefill_fixed_s: float
    prefill_per_token_s: float
    prefill_chunk: int
    decode_ms: dict[tuple[int, int], float]  # (batch, context) -> step ms
    decode_max_batch: int
    kv_pool_tokens: float
    kv_block_tokens: int
    ready_s: float
    gpus_per_instance: int
    sources: dict[str, str] = field(default_factory=dict)

    def prefill_step_s(self, tokens: float) -> float:
        return self.prefill_fixed_s + self.prefill_per_token_s * tokens

    @property
    def prefill_tokens_per_s(self) -> float:
        """One instance's throughput with its queue full (full chunks back to back)."""
        return self.prefill_chunk / self.prefill_step_s(self.prefill_chunk)

    def prefill_own_s(self, prompt: int) -> float:
        """A prompt's TTFT on an idle instance: its chunks back to back."""
        full, rest = divmod(prompt, self.prefill_chunk)
        return full * self.prefill_step_s(self.prefill_chunk) + (
            self.prefill_step_s(rest) if rest else 0.0)

    @cached_property
    def _axes(self) -> tuple[list[int], list[int]]:
        return sorted({b for b, _ in self.decode_ms}), sorted({c for _, c in self.decode_ms})

    def decode_step_s(self, batch: float, context: float) -> float:
        batches, contexts = self._axes

        def around(xs: list[int], x: float) -> tuple[int, int, float]:
            x = min(max(x, xs[0]), xs[-1])
            i = max(1, min(len(xs) - 1, bisect.bisect_left(xs, x)))
            lo, hi = xs[i - 1], xs[i]
            return lo, hi, (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))

        b0, b1, fb = around(batches, max(batch, 1.0))
        c0, c1, fc = around(contexts, max(context, 1.0))

        def at(b: int, c: int) -> float:
            got = self.decode_ms.get((b, c))
            if got is not None:
                return got
            # Not measured (KV over the budget): the same batch's longest measured context,
            # scaled by the context as the measured points below it grow.
            known = sorted((cc, ms) for (bb, cc), ms in self.decode_ms.items() if bb == b)
            (ca, ma), (cb, mb) = known[-2], known[-1]
            return mb + (mb - ma) * (math.log(c) - math.log(cb)) / (math.log(cb) - math.log(ca))

        lo = at(b0, c0) * (1 - fc) + at(b0, c1) * fc
        hi = at(b1, c0) * (1 - fc) + at(b1, c1) * fc
        return (lo * (1 - fb) + hi * fb) / 1000.0


def load_figures(engine: Path = ENGINE_JSON, kv_tiers: Path = KV_TIERS_JSON,
                 gpus_per_instance: int = 1) -> Figures:
    eng = json.loads(engine.read_text())
    pre = sorted(eng["prefill"], key=lambda r: r["tokens"])
    (n0, t0), (n1, t1) = ((p["tokens"], p["ms"] / 1000) for p in (pre[0], pre[-1]))
    per_token = (t1 - t0) / (n1 - n0)
    decode = {(int(d["batch"]), int(d["context"])): float(d["graph_ms"])
              for d in eng["decode"] if d.get("graph_ms")}
    kv = json.loads(kv_tiers.read_text())
    stack = kv["stacks"]["defaults"]
    dec = stack["decode"]
    block = int(round(dec["pdd_kv_pool_tokens"] / dec["pdd_kv_blocks_total"]))
    rel = lambda p: str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)  # noqa: E731
    device = eng.get("device", "?")
    return Figures(
        prefill_fixed_s=t0 - per_token * n0, prefill_per_token_s=per_token, prefill_chunk=n1,
        decode_ms=decode, decode_max_batch=max(b for b, _ in decode),
        kv_pool_tokens=float(dec["pdd_kv_pool_tokens"]), kv_block_tokens=block,
        ready_s=float(stack["ready_s"]), gpus_per_instance=gpus_per_instance,
        sources={
            "prefill": f"{rel(engine)} prefill ({device}): {n0} tokens {t0 * 1000:.1f} ms, "
                       f"{n1} tokens {t1 * 1000:.1f} ms -> step = "
                       f"{(t0 - per_token * n0) * 1000:.1f} ms + {per_token * 1e6:.2f} us/token, "
                       f"chunks of {n1}",
            "decode": f"{rel(engine)} decode graph_ms, batch x context: " + ", ".join(
                f"{b}x{c // 1024}k {ms:.1f}" for (b, c), ms in sorted(decode.items())),
            "decode_max_batch": f"{rel(engine)}: largest measured decode batch",
            "kv_pool": f"{rel(kv_tiers)} stacks.defaults.decode: pdd_kv_pool_tokens "
                       f"{dec['pdd_kv_pool_tokens']:.0f} in {dec['pdd_kv_blocks_total']:.0f} "
                       "blocks",
            "ready": f"{rel(kv_tiers)} stacks.defaults.ready_s: pdd serve start to ready "
                     f"{stack['ready_s']:.1f} s ({kv['config'].get('device')})",
            "gpus_per_instance": "one GPU per instance, as measured (tp 1)",
        })


# ------------------------------------------------------------------ the trace


@dataclass(frozen=True)
class RequestClass:
    name: str
    prompt: int
    output: int
    share: float


CLASSES = (RequestClass("chat", 1024, 256, 0.70), RequestClass("rag", 4096, 256, 0.25),
           RequestClass("long", 16384, 512, 0.05))


# Misses of requests arriving this long after a burst still count as the burst's (a start-up
# of the large instances, and its queue draining).
BURST_AFTERMATH_S = 900.0


@dataclass(frozen=True)
class Spike:
    start: float
    seconds: float
    kind: str  # "rate": every class x factor; "long": long prompts added at factor x the rate
    factor: float


@dataclass(frozen=True)
class Trace:
    seconds: int
    peak_rps: float
    trough_rps: float
    spikes: tuple[Spike, ...]

    def near_burst(self, t: float) -> bool:
        """Whether t is in a burst or the BURST_AFTERMATH_S after it."""
        return any(s.start <= t < s.start + s.seconds + BURST_AFTERMATH_S for s in self.spikes)

    def rates(self, t: float) -> list[float]:
        """Requests per second of each class at time t (day shape: trough at 0, peak at the
        middle)."""
        base = self.trough_rps + (self.peak_rps - self.trough_rps) * 0.5 * (
            1 - math.cos(2 * math.pi * t / self.seconds))
        out = [base * c.share for c in CLASSES]
        for s in self.spikes:
            if s.start <= t < s.start + s.seconds:
                if s.kind == "rate":
                    out = [r * s.factor for r in out]
                else:
                    out[-1] += base * s.factor
        return out


def make_trace(seconds: int, peak_rps: float, spikes: int, seed: int,
               spike_factor: float = 1.5, long_factor: float = 0.1,
               spike_seconds: float = 60.0) -> Trace:
    """Peak 10x the trough; `spikes` minute-long bursts at seeded times, alternately every
    class x `spike_factor` and a burst of long prompts adding `long_factor` x the rate."""
    rng = random.Random(seed)
    starts = sorted(rng.uniform(0.05, 0.95) * seconds for _ in range(spikes))
    return Trace(seconds, peak_rps, peak_rps / 10.0, tuple(
        Spike(s, spike_seconds, "rate" if i % 2 == 0 else "long",
              spike_factor if i % 2 == 0 else long_factor) for i, s in enumerate(starts)))


def poisson(rng: random.Random, lam: float) -> int:
    """One Poisson draw: inversion below 10, else Hormann's transformed rejection (PTRS, the
    method numpy uses), exact for any mean."""
    if lam <= 0:
        return 0
    if lam < 10:
        limit, k, prod = math.exp(-lam), 0, rng.random()
        while prod > limit:
            prod *= rng.random()
            k += 1
        return k
    slam, loglam = math.sqrt(lam), math.log(lam)
    b = 0.931 + 2.53 * slam
    a = -0.059 + 0.02483 * b
    inv_alpha = 1.1239 + 1.1328 / (b - 3.4)
    vr = 0.9277 - 3.6224 / (b - 2)
    while True:
        u = rng.random() - 0.5
        v = rng.random()
        us = 0.5 - abs(u)
        k = math.floor((2 * a / us + b) * u + lam + 0.43)
        if us >= 0.07 and v <= vr:
            return k
        if k < 0 or (us < 0.013 and v > us):
            continue
        if (math.log(v) + math.log(inv_alpha) - math.log(a / (us * us) + b)
                <= -lam + k * loglam - math.lgamma(k + 1)):
            return k


def poisson_arrivals(trace: Trace, seed: int, dt: float = 1.0) -> list[tuple[int, ...]]:
    """Requests of each class arriving in each step: independent Poisson counts at the trace's
    rate (a Poisson process's counts over disjoint steps are exactly that), so the planner
    sees arrival noise and not a smooth curve."""
    rng = random.Random(seed + 1_000_003)  # not the stream that placed the bursts
    return [tuple(poisson(rng, r * dt) for r in trace.rates(k * dt))
            for k in range(int(trace.seconds / dt))]


# ------------------------------------------------------------------ the simulation


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.050


@dataclass
class Observed:
    """What a policy sees at a decision (what the operator scrapes)."""

    now: float
    prefill_ready: int
    decode_ready: int
    prefill_current: int  # ready + starting
    decode_current: int
    ttft: list[tuple[float, float]]  # (value, requests) finished in the interval
    tpot: list[tuple[float, float]]
    queued_prompt_tokens: float
    prompt_tokens_per_s: float  # arrived over the interval (computed + the queue's growth)
    prefill_in_flight: float  # requests
    kv_used_tokens: float
    running: float
    waiting: float


Policy = Callable[[Observed], tuple[int, int]]


@dataclass
class _Pool:
    ready: int
    starting: list[float] = field(default_factory=list)  # ready-at times
    draining: list[float] = field(default_factory=list)  # done-at times

    @property
    def current(self) -> int:
        return self.ready + len(self.starting)

    def step(self, now: float) -> None:
        up = [t for t in self.starting if t <= now]
        if up:
            self.ready += len(up)
            self.starting = [t for t in self.starting if t > now]
        self.draining = [t for t in self.draining if t > now]

    def resize(self, want: int, now: float, ready_s: float, drain_s: float) -> None:
        while self.current < want:
            self.starting.append(now + ready_s)
        while self.current > want and self.starting:
            self.starting.pop()  # the latest started goes first, before it serves
        while self.current > want and self.ready > 1:
            self.ready -= 1
            self.draining.append(now + drain_s)

    @property
    def billed(self) -> int:
        return self.ready + len(self.starting) + len(self.draining)


def _percentile(samples: list[tuple[float, float]], q: float) -> float | None:
    total = sum(w for _, w in samples)
    if total <= 0:
        return None
    acc = 0.0
    for v, w in sorted(samples):
        acc += w
        if acc >= q * total:
            return v
    return samples[-1][0]


@dataclass
class Result:
    policy: str
    requests: float
    attainment: float
    ttft_attainment: float
    tpot_attainment: float
    gpu_hours: float
    prefill_gpu_hours: float
    decode_gpu_hours: float
    max_prefill: int
    max_decode: int
    timeline: list[tuple[float, float, int, int]]  # (t, rps, prefill, decode) per minute
    missed_in_bursts: float = 0.0  # arrived in a burst or the BURST_AFTERMATH_S after it
    missed_by_hour: list[float] = field(default_factory=list)  # by arrival hour


def simulate(trace: Trace, fig: Figures, policy: Policy, start: tuple[int, int], slo: Slo,
             name: str, interval: float = 15.0, dt: float = 1.0,
             arrivals: Sequence[Sequence[float]] | None = None) -> Result:
    """`arrivals`: requests of each class arriving in each step (poisson_arrivals); None
    takes the trace's mean rates (a fluid without arrival noise)."""
    pre = _Pool(start[0])
    dec = _Pool(start[1])
    queue: deque[list[float]] = deque()  # [arrival, class, count, tokens left]
    queued_tokens = 0.0
    waiting: deque[list[float]] = deque()  # [first token time, class, count]
    running: list[list[float]] = []  # [first token time, class, count, tokens done]
    ttft_iv: list[tuple[float, float]] = []
    arrived_iv = 0.0
    tpot_iv: list[tuple[float, float]] = []
    total = ok = ttft_ok = tpot_ok = 0.0
    ttft_of: dict[int, tuple[float, float]] = {}  # cohort -> (TTFT, arrival)
    missed_burst = 0.0
    missed_hour = [0.0] * math.ceil(trace.seconds / 3600)
    gpu_s = 0.0
    gpu_p = 0.0
    timeline: list[tuple[float, float, int, int]] = []
    max_p = max_d = 0
    next_decision = interval
    last_step_s = fig.decode_step_s(1, CLASSES[0].prompt)
    cap_tps = fig.prefill_tokens_per_s
    service = [fig.prefill_own_s(c.prompt) for c in CLASSES]
    mean_service = sum(c.share * x for c, x in zip(CLASSES, service, strict=True))
    service_ratio = sum(c.share * x * x for c, x in zip(CLASSES, service, strict=True)) / sum(
        c.share * x for c, x in zip(CLASSES, service, strict=True))
    steps = int(trace.seconds / dt)
    cohort_id = 0
    k = -1
    while True:
        k += 1
        t = k * dt
        ended = k >= steps
        if ended and not (queue or waiting or running) or k >= steps + int(900 / dt):
            break  # after the trace: no arrivals, no decisions, no cost; what is in flight ends
        pre.step(t)
        dec.step(t)
        if ended:
            rates = [0.0] * len(CLASSES)
        elif arrivals is None:
            rates = trace.rates(t)
        else:
            rates = [n / dt for n in arrivals[k]]
        for ci, r in enumerate(rates):
            if r > 0:
                n = r * dt
                queue.append([t, ci, n, n * CLASSES[ci].prompt, cohort_id])
                queued_tokens += n * CLASSES[ci].prompt
                arrived_iv += n * CLASSES[ci].prompt
                cohort_id += 1
        if not ended and int(t) % 60 == 0 and abs(t - round(t)) < 1e-9:
            timeline.append((t, sum(rates), pre.current, dec.current))
        # Prefill: FIFO over the ready instances at full throughput; below saturation each
        # instance still queues its share of the arrivals (M/G/1, Pollaczek-Khinchine).
        budget = pre.ready * cap_tps * dt
        arriving = sum(r * c.prompt for r, c in zip(rates, CLASSES, strict=True)) * dt
        rho = min(0.99, arriving / budget) if budget > 0 else 0.99
        mg1_wait = rho / (2 * (1 - rho)) * service_ratio
        # In prefill or queued there below the backlog, by Little's law.
        prefill_busy = sum(rates) * (mean_service + mg1_wait)
        used = 0.0
        while queue and budget - used > 1e-9:
            head = queue[0]
            take = min(head[3], budget - used)
            head[3] -= take
            used += take
            queued_tokens -= take
            if head[3] <= 1e-9:
                queue.popleft()
                c = CLASSES[int(head[1])]
                done_at = t + dt * used / budget
                ttft = service[int(head[1])] + mg1_wait + max(
                    0.0, done_at - head[0] - dt)
                ttft_iv.append((ttft, head[2]))
                ttft_of[int(head[4])] = ttft, head[0]
                waiting.append([head[0] + ttft, head[1], head[2], head[4]])
        # Decode: admit FIFO while sequences and KV fit.
        seqs = sum(r[2] for r in running)
        kv = sum(r[2] * (CLASSES[int(r[1])].prompt + r[3]) for r in running)
        seq_cap = dec.ready * fig.decode_max_batch
        kv_cap = dec.ready * fig.kv_pool_tokens
        while waiting and waiting[0][0] <= t + dt:
            w = waiting[0]
            c = CLASSES[int(w[1])]
            need = c.prompt + c.output
            room = min(seq_cap - seqs, (kv_cap - kv) / need)
            if room <= 1e-9:
                break
            n = min(w[2], room)
            running.append([w[0], w[1], n, 0.0, w[3]])
            seqs += n
            kv += n * c.prompt
            w[2] -= n
            if w[2] <= 1e-9:
                waiting.popleft()
        # One dt of decode steps for everything running.
        serving = max(1, dec.ready + len(dec.draining))
        if running:
            ctx = kv / seqs if seqs > 0 else CLASSES[0].prompt
            step_s = fig.decode_step_s(seqs / serving, ctx)
            last_step_s = step_s
            advance = dt / step_s
            still: list[list[float]] = []
            for cohort in running:
                c = CLASSES[int(cohort[1])]
                left = c.output - 1 - cohort[3]  # the first token came from prefill
                if advance >= left:
                    end = t + left * step_s
                    tpot = max(step_s, (end - cohort[0]) / max(1, c.output - 1))
                    tpot_iv.append((tpot, cohort[2]))
                    ttft, came = ttft_of[int(cohort[4])]
                    total += cohort[2]
                    ttft_ok += cohort[2] * (ttft <= slo.ttft_s)
                    tpot_ok += cohort[2] * (tpot <= slo.tpot_s)
                    if ttft <= slo.ttft_s and tpot <= slo.tpot_s:
                        ok += cohort[2]
                    else:
                        missed_hour[min(int(came / 3600), len(missed_hour) - 1)] += cohort[2]
                        missed_burst += cohort[2] * trace.near_burst(came)
                else:
                    cohort[3] += advance
                    still.append(cohort)
            running = still
        if ended:
            continue
        gpu_s += (pre.billed + dec.billed) * fig.gpus_per_instance * dt
        gpu_p += pre.billed * fig.gpus_per_instance * dt
        max_p, max_d = max(max_p, pre.current), max(max_d, dec.current)
        if t + dt >= next_decision:
            now = t + dt
            waiting_n = sum(w[2] for w in waiting)
            obs = Observed(now, pre.ready, dec.ready, pre.current, dec.current, ttft_iv,
                           tpot_iv, queued_tokens, arrived_iv / interval,
                           sum(q[2] for q in queue) + prefill_busy, kv, seqs, waiting_n)
            want_p, want_d = policy(obs)
            drain_d = (sum(c.output * c.share for c in CLASSES)) * last_step_s
            pre.resize(want_p, now, fig.ready_s, 0.0)
            dec.resize(want_d, now, fig.ready_s, drain_d)
            ttft_iv, tpot_iv, arrived_iv = [], [], 0.0
            next_decision += interval
    # Requests still in flight after the run-off count as missed.
    for q in queue:
        total += q[2]
    for w in waiting:
        total += w[2]
    for cohort in running:
        total += cohort[2]
    return Result(name, total, ok / total if total else 1.0, ttft_ok / total if total else 1.0,
                  tpot_ok / total if total else 1.0, gpu_s / 3600.0, gpu_p / 3600.0,
                  (gpu_s - gpu_p) / 3600.0, max_p, max_d, timeline, missed_burst, missed_hour)


# ------------------------------------------------------------------ policies


def static(replicas: tuple[int, int]) -> Policy:
    return lambda _obs: replicas


def static_for_peak(trace: Trace, fig: Figures, utilization: float) -> tuple[int, int]:
    """Each role's instances for the trace's highest second (bursts included) at
    `utilization` of its capacity: prefill by prompt tokens per second, decode by the
    sequences running at the full-batch step time (and the KV they hold)."""
    peak_tokens = peak_seqs = peak_kv = 0.0
    for s in range(trace.seconds):
        rates = trace.rates(float(s))
        peak_tokens = max(peak_tokens, sum(r * c.prompt for r, c in zip(rates, CLASSES,
                                                                          strict=True)))
        step = fig.decode_step_s(fig.decode_max_batch, 4096)
        seqs = sum(r * c.output * step for r, c in zip(rates, CLASSES, strict=True))
        kv = sum(r * c.output * step * (c.prompt + c.output / 2)
                 for r, c in zip(rates, CLASSES, strict=True))
        peak_seqs, peak_kv = max(peak_seqs, seqs), max(peak_kv, kv)
    p = math.ceil(peak_tokens / (fig.prefill_tokens_per_s * utilization))
    d = math.ceil(max(peak_seqs / fig.decode_max_batch, peak_kv / fig.kv_pool_tokens)
                  / utilization)
    return max(1, p), max(1, d)


def planner_spec(max_replicas: int, slo: Slo, interval: int, stabilization: int = 300,
                 queued_per_replica: int | None = None,
                 prompt_tps_per_replica: int | None = None,
                 sequences_per_replica: int | None = None) -> AutoscalingSpec:
    """Targets below the SLO (p90 at 60 % of it) so the planner acts before requests miss;
    prefill sized on prompt tokens per second against a share of an instance's capacity."""
    return AutoscalingSpec(
        intervalSeconds=interval, scaleDownStabilizationSeconds=stabilization,
        prefill=PrefillAutoscaling(
            minReplicas=1, maxReplicas=max_replicas,
            ttft=LatencyTarget(percentile=90, seconds=0.6 * slo.ttft_s),
            queuedPromptTokensPerReplica=queued_per_replica,
            promptTokensPerSecondPerReplica=prompt_tps_per_replica),
        decode=DecodeAutoscaling(
            minReplicas=1, maxReplicas=max_replicas,
            tpot=LatencyTarget(percentile=90, seconds=0.6 * slo.tpot_s),
            kvCacheUtilization=0.7, sequencesPerReplica=sequences_per_replica))


def planner(spec: AutoscalingSpec, fig: Figures) -> Policy:
    """pdd's decision function, fed what the operator scrapes each interval."""
    history: dict[str, list[Sample]] = {"prefill": [], "decode": []}
    last: dict[str, float | None] = {"prefill": None, "decode": None}
    current = {"prefill": 0, "decode": 0}
    block = fig.kv_block_tokens

    def decide(o: Observed) -> tuple[int, int]:
        if not current["prefill"]:
            current.update(prefill=o.prefill_current, decode=o.decode_current)
        p90 = spec.prefill.ttft.percentile / 100 if spec.prefill and spec.prefill.ttft else 0.9
        d90 = spec.decode.tpot.percentile / 100 if spec.decode and spec.decode.tpot else 0.9
        history["prefill"].append(Sample(
            time=o.now, replicas=o.prefill_ready, latency=_percentile(o.ttft, p90),
            queued_prompt_tokens=o.queued_prompt_tokens,
            prompt_tokens_per_second=o.prompt_tokens_per_s,
            waiting_sequences=o.prefill_in_flight))
        history["decode"].append(Sample(
            time=o.now, replicas=o.decode_ready, latency=_percentile(o.tpot, d90),
            kv_blocks_used=o.kv_used_tokens / block,
            kv_blocks_total=o.decode_ready * fig.kv_pool_tokens / block,
            running_sequences=o.running, waiting_sequences=o.waiting))
        keep = int(spec.scaleDownStabilizationSeconds / spec.intervalSeconds) + 4
        for role in history:
            del history[role][:-keep]
        decisions = plan(spec, current, history, o.now, last)
        for role, d in decisions.items():
            if d.desired != current[role]:
                last[role] = o.now
                current[role] = d.desired
        return current["prefill"], current["decode"]

    return decide


def natural_targets(fig: Figures, share: float = 0.8) -> tuple[float, float]:
    """Request-count thresholds set to serve: what an instance holds in flight at `share` of
    its capacity (prefill: its requests/s at full chunks x a request's own prefill time, by
    Little's law; decode: that share of its batch)."""
    mean_prompt = sum(c.prompt * c.share for c in CLASSES)
    mean_own = sum(fig.prefill_own_s(c.prompt) * c.share for c in CLASSES)
    per_s = fig.prefill_tokens_per_s / mean_prompt
    return share * per_s * mean_own, share * fig.decode_max_batch


def requests_hpa(target_prefill: float, target_decode: float, max_replicas: int,
                 interval: float, window: float = 300.0) -> Policy:
    """HPA's rule on requests in flight per ready replica."""
    recs: dict[str, deque[tuple[float, int]]] = {"prefill": deque(), "decode": deque()}

    def one(role: str, now: float, current: int, ready: int, in_flight: float,
            target: float) -> int:
        # As HPA does for a scale-up, pods not ready yet count with nothing in flight: the
        # average is over every pod asked for, so a start-up does not ask again.
        ratio = (in_flight / max(current, 1)) / target
        want = current if abs(ratio - 1) <= 0.1 else math.ceil(max(current, 1) * ratio)
        want = max(1, min(max_replicas, want, max(current + 4, 2 * current)))
        r = recs[role]
        r.append((now, want))
        while r and r[0][0] < now - window:
            r.popleft()
        high = max(w for _, w in r)
        return want if want > current else min(current, high)

    def decide(o: Observed) -> tuple[int, int]:
        return (one("prefill", o.now, o.prefill_current, o.prefill_ready, o.prefill_in_flight,
                    target_prefill),
                one("decode", o.now, o.decode_current, o.decode_ready, o.running + o.waiting,
                    target_decode))

    return decide


# ------------------------------------------------------------------ the comparison

Pair = tuple[float, float]


@dataclass(frozen=True)
class Day:
    """One simulated day: the trace, its Poisson arrivals (None: the mean rates), the model
    with one start-up time, and the static count for the peak (the search's first guess)."""

    trace: Trace
    arrivals: list[tuple[int, ...]] | None
    fig: Figures
    slo: Slo
    interval: int
    peak: tuple[int, int]

    @property
    def start(self) -> tuple[int, int]:
        return max(1, self.peak[0] // 10), max(1, self.peak[1] // 10)

    @property
    def max_replicas(self) -> int:
        return max(self.peak) * 2

    def run(self, policy: Policy, start: tuple[int, int], name: str) -> Result:
        return simulate(self.trace, self.fig, policy, start, self.slo, name, self.interval,
                        arrivals=self.arrivals)


def per_role(r: Result) -> Pair:
    """What each role's setting moves: prefill's TTFT, decode's TPOT."""
    return r.ttft_attainment, r.tpot_attainment


def cheapest(run: Callable[[float], Result], role: int, good: float, bad: float,
             target: float, split: Callable[[float, float], float],
             close: Callable[[float, float], bool]) -> tuple[float, float]:
    """Bisect one role's setting between one assumed to reach its target (TTFT for role 0,
    prefill; TPOT for role 1, decode) and one that does not, to the cheapest that reaches it.
    Returns (cheapest reaching, next that misses). One role at a time: a starved prefill
    spares decode its load, so decode is searched with prefill already at its setting."""
    while not close(good, bad):
        x = split(good, bad)
        if per_role(run(x))[role] >= target:
            good = x
        else:
            bad = x
    return good, bad


def _row(r: Result) -> dict[str, float]:
    return {"attainment": r.attainment, "ttft_attainment": r.ttft_attainment,
            "tpot_attainment": r.tpot_attainment, "gpu_hours": r.gpu_hours}


def static_at_target(day: Day, target: Pair, log: Callable[[str], None]
                     ) -> tuple[tuple[int, int], tuple[int, int], list[dict[str, float]]]:
    """The fewest static instances per role whose TTFT (prefill) and TPOT (decode) attainment
    reach `target`: from the peak's count (doubled while short), bisected down. Returns the
    counts, the counts one step below (each missed its role's target), and every run."""
    tried: dict[tuple[int, int], Result] = {}

    def run(x: Pair) -> Result:
        n = (int(x[0]), int(x[1]))
        if n not in tried:
            tried[n] = day.run(static(n), n, "static")
            log(f"  static {n}: TTFT {tried[n].ttft_attainment:.5f} TPOT "
                f"{tried[n].tpot_attainment:.5f} (target {target[0]:.5f} {target[1]:.5f})")
        return tried[n]

    hi = day.peak
    for _ in range(4):
        short = [a < t for a, t in zip(per_role(run(hi)), target, strict=True)]
        if not any(short):
            break
        hi = (hi[0] * 2 if short[0] else hi[0], hi[1] * 2 if short[1] else hi[1])
    def halve(g: float, b: float) -> float:
        return float((int(g) + int(b)) // 2)

    def one_apart(g: float, b: float) -> bool:
        return abs(g - b) <= 1

    p, p_bad = cheapest(lambda v: run((v, hi[1])), 0, hi[0], 0, target[0], halve, one_apart)
    d, d_bad = cheapest(lambda v: run((p, v)), 1, hi[1], 0, target[1], halve, one_apart)
    return ((int(p), int(d)), (int(p_bad), int(d_bad)),
            [{"prefill": n[0], "decode": n[1], **_row(r)} for n, r in tried.items()])


STEP = 0.10  # the request-count rule's thresholds are searched to 10 %


def requests_at_target(day: Day, target: Pair, log: Callable[[str], None]
                       ) -> tuple[Pair, Pair, tuple[bool, bool], list[dict[str, float]]]:
    """The request-count rule's threshold per role, as a factor of natural_targets, set to the
    cheapest (highest) whose TTFT (prefill) and TPOT (decode) attainment reach `target`,
    bisected in log between 1/4 and 4 to STEP. Attainment is not monotonic in the threshold (the
    rule's doubling into a backlog), so this is the edge the bisection lands on, with a
    threshold at most STEP higher that misses. Returns the factors, those next ones, whether
    each role reached its target at all, and every run."""
    nat = natural_targets(day.fig)
    tried: dict[Pair, Result] = {}

    def run(f: Pair) -> Result:
        if f not in tried:
            tried[f] = day.run(requests_hpa(nat[0] * f[0], nat[1] * f[1], day.max_replicas,
                                            day.interval), day.start, "requests")
            log(f"  requests x{f[0]:.3f}/x{f[1]:.3f}: TTFT {tried[f].ttft_attainment:.5f} "
                f"TPOT {tried[f].tpot_attainment:.5f}, {tried[f].gpu_hours:.1f} GPU-h")
        return tried[f]

    lo, hi = 1 / 4, 4.0
    low = per_role(run((lo, lo)))

    def middle(g: float, b: float) -> float:
        return math.sqrt(g * b)

    def near(g: float, b: float) -> bool:
        return max(g, b) / min(g, b) <= 1.0 + STEP

    p, p_bad = cheapest(lambda v: run((v, lo)), 0, lo, hi, target[0], middle, near)
    d, d_bad = cheapest(lambda v: run((p, v)), 1, lo, hi, target[1], middle, near)
    reached = (low[0] >= target[0], low[1] >= target[1])
    return (p, d), (p_bad, d_bad), reached, [
        {"prefill_factor": f[0], "decode_factor": f[1], **_row(r)} for f, r in tried.items()]


def requests_at_cost(day: Day, factors: Pair, goal: float, first: Result,
                     log: Callable[[str], None]) -> tuple[float, Result]:
    """Both per-role thresholds scaled by one factor toward the rule's GPU-hours equal to
    `goal`. The cost is not monotonic in the factor (it falls as thresholds rise, then grows
    once the rule runs a backlog and doubles into it), so walk in steps of 10 % toward the goal
    until it is passed (then bisect twice) or the cost turns away: the closest is as near as the
    rule gets."""
    nat = natural_targets(day.fig)

    def run(g: float) -> Result:
        r = day.run(requests_hpa(nat[0] * factors[0] * g, nat[1] * factors[1] * g,
                                 day.max_replicas, day.interval), day.start, "requests")
        log(f"  requests at cost x{g:.3f}: {r.gpu_hours:.1f} GPU-h (goal {goal:.1f})")
        return r

    best = (1.0, first)
    step = 1.1 if first.gpu_hours > goal else 1 / 1.1
    a, cost_a = 1.0, first.gpu_hours
    for _ in range(4):
        if abs(cost_a - goal) / goal < 0.01:
            break
        b = a * step
        rb = run(b)
        if abs(rb.gpu_hours - goal) < abs(best[1].gpu_hours - goal):
            best = (b, rb)
        if (rb.gpu_hours - goal) * (cost_a - goal) <= 0:
            lo, hi = a, b
            for _ in range(2):
                g = math.sqrt(lo * hi)
                r = run(g)
                if abs(r.gpu_hours - goal) < abs(best[1].gpu_hours - goal):
                    best = (g, r)
                lo, hi = (g, hi) if (r.gpu_hours - goal) * (cost_a - goal) > 0 else (lo, g)
            break
        if abs(rb.gpu_hours - goal) >= abs(cost_a - goal):
            break
        a, cost_a = b, rb.gpu_hours
    return best


def one_day(trace: Trace, seed: int | None, fig: Figures, slo: Slo, interval: int,
            static_utilization: float, spec_args: dict[str, Any],
            log: Callable[[str], None]) -> dict[str, Any]:
    """Every policy on one day (seed None: the mean rates, no arrival noise): the planner; a
    static count per role brought down to the planner's attainment; the request-count rule
    tuned per role to it, then at the planner's GPU-hours."""
    arrivals = None if seed is None else poisson_arrivals(trace, seed)
    day = Day(trace, arrivals, fig, slo, interval, static_for_peak(trace, fig,
                                                                   static_utilization))
    spec = planner_spec(day.max_replicas, slo, interval, **spec_args)
    runs: dict[str, Result] = {}
    runs["planner"] = p = day.run(planner(spec, fig), day.start, "planner")
    log(f"seed {seed} ready {fig.ready_s:.0f} s: planner {p.attainment:.5f} (TTFT "
        f"{p.ttft_attainment:.5f}, TPOT {p.tpot_attainment:.5f}), {p.gpu_hours:.1f} GPU-h")
    target = per_role(p)
    counts, below, static_tried = static_at_target(day, target, log)
    runs["static"] = day.run(static(counts), counts, "static")
    runs[f"static (peak at {static_utilization:g})"] = day.run(static(day.peak), day.peak,
                                                               "static (peak)")
    factors, above, reached, req_tried = requests_at_target(day, target, log)
    nat = natural_targets(fig)
    runs["requests"] = req = day.run(requests_hpa(
        nat[0] * factors[0], nat[1] * factors[1], day.max_replicas, interval), day.start,
        "requests")
    g, runs["requests (equal GPU-hours)"] = requests_at_cost(day, factors, p.gpu_hours, req,
                                                             log)
    return {
        "seed": seed, "ready_s": fig.ready_s,
        "static_replicas": {"prefill": counts[0], "decode": counts[1]},
        "static_one_fewer": {"prefill": below[0], "decode": below[1]},
        "static_peak_replicas": {"prefill": day.peak[0], "decode": day.peak[1]},
        "requests_targets": {
            "prefill": nat[0] * factors[0], "decode": nat[1] * factors[1],
            "prefill_factor": factors[0], "decode_factor": factors[1],
            "prefill_reached": reached[0], "decode_reached": reached[1],
            "prefill_factor_missing": above[0], "decode_factor_missing": above[1]},
        "requests_equal_cost_targets": {"prefill": nat[0] * factors[0] * g,
                                        "decode": nat[1] * factors[1] * g},
        "planner_spec": spec.model_dump(),
        "policies": {k: {f: v for f, v in asdict(r).items() if f != "timeline"}
                     for k, r in runs.items()},
        "static_tried": static_tried, "requests_tried": req_tried,
        "timeline": {k: r.timeline for k, r in runs.items()},
    }


def pooled(days: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per policy over the seeds: attainment over all their requests, GPU-hours and misses a
    day on average, each seed's attainment."""
    out: dict[str, dict[str, Any]] = {}
    static_h = sum(d["policies"]["static"]["gpu_hours"] for d in days) / len(days)
    for name in days[0]["policies"]:
        rs = [d["policies"][name] for d in days]
        total = sum(r["requests"] for r in rs)

        def share(key: str, rs: list[dict[str, Any]] = rs, total: float = total) -> float:
            return sum(r["requests"] * r[key] for r in rs) / total

        hours = sum(r["gpu_hours"] for r in rs) / len(rs)
        out[name] = {
            "attainment": share("attainment"), "ttft_attainment": share("ttft_attainment"),
            "tpot_attainment": share("tpot_attainment"), "gpu_hours": hours,
            "gpu_hours_vs_static": hours / static_h,
            "missed_requests": sum(r["requests"] * (1 - r["attainment"]) for r in rs) / len(rs),
            "missed_in_bursts": sum(r["missed_in_bursts"] for r in rs) / len(rs),
            "max_prefill": max(r["max_prefill"] for r in rs),
            "max_decode": max(r["max_decode"] for r in rs),
            "attainment_by_seed": [r["attainment"] for r in rs]}
    return out


def _one_day_job(job: dict[str, Any]) -> dict[str, Any]:
    fig = replace(load_figures(), ready_s=job["ready_s"])
    trace = make_trace(**job["trace"])
    return one_day(trace, job["seed"], fig, Slo(**job["slo"]), job["interval"],
                   job["static_utilization"], job["spec_args"],
                   lambda m: print(m, file=sys.stderr, flush=True))


def _print_table(ready_s: float, seeds: list[int | None], pol: dict[str, dict[str, Any]]
                 ) -> None:
    print(f"\nstart-up {ready_s:.1f} s, seeds {seeds} (attainment over all their requests; "
          "GPU-hours and misses a day on average)")
    print(f"{'policy':30}{'attained':>10}{'TTFT ok':>9}{'TPOT ok':>9}{'GPU-h':>9}"
          f"{'vs static':>11}{'missed':>10}{'in bursts':>11}{'max P/D':>10}")
    for k, r in pol.items():
        print(f"{k:30}{r['attainment']:10.4%}{r['ttft_attainment']:9.4%}"
              f"{r['tpot_attainment']:9.4%}{r['gpu_hours']:9.1f}{r['gpu_hours_vs_static']:11.1%}"
              f"{r['missed_requests']:10.0f}{r['missed_in_bursts']:11.0f}"
              f"{r['max_prefill']:>6}/{r['max_decode']}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a 30-minute trace at a few replicas, one seed (tests)")
    ap.add_argument("--seconds", type=int, default=None, help="trace length (default a day)")
    ap.add_argument("--peak-rps", type=float, default=None,
                    help="requests/s at the day's peak (default 1500: hundreds of replicas)")
    ap.add_argument("--spikes", type=int, default=None, help="minute-long bursts (default 24)")
    ap.add_argument("--spike-factor", type=float, default=1.5,
                    help="a rate burst multiplies every class's rate by this")
    ap.add_argument("--long-factor", type=float, default=0.1,
                    help="a long-prompt burst adds long prompts at this share of the rate")
    ap.add_argument("--seeds", default=None,
                    help="comma-separated arrival seeds (default 1,2,3; quick 1); 'fluid': the "
                    "mean rates without arrival noise")
    ap.add_argument("--burst-seed", type=int, default=1, help="places the bursts")
    ap.add_argument("--ready-s", default=None,
                    help="comma-separated start-to-ready times, seconds (default: the measured "
                    "one and 600, a large multi-GPU instance)")
    ap.add_argument("--interval", type=int, default=15, help="decision interval, seconds")
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--tpot-slo", type=float, default=0.050)
    ap.add_argument("--static-utilization", type=float, default=0.8,
                    help="the peak sizing shown for reference (and the search's first guess)")
    ap.add_argument("--stabilization", type=int, default=300,
                    help="the planner's scaleDownStabilizationSeconds")
    ap.add_argument("--queued-per-replica", type=int, default=0,
                    help="the planner's prefill queuedPromptTokensPerReplica (0: off)")
    ap.add_argument("--prefill-utilization", type=float, default=0.6,
                    help="the planner's prefill promptTokensPerSecondPerReplica as this share "
                    "of an instance's measured prompt tokens/s (0: off)")
    ap.add_argument("--decode-utilization", type=float, default=0.7,
                    help="the planner's decode sequencesPerReplica as this share of the "
                    "largest measured batch (0: off)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="days simulated at once (processes)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    seconds = args.seconds or (1800 if args.quick else 86400)
    peak = args.peak_rps or (150.0 if args.quick else 1500.0)
    spikes = args.spikes if args.spikes is not None else (2 if args.quick else 24)
    seeds: list[int | None] = ([None] if args.seeds == "fluid" else
                               [int(x) for x in (args.seeds or ("1" if args.quick else "1,2,3"))
                                .split(",")])
    fig = load_figures()
    ready = ([float(x) for x in args.ready_s.split(",")] if args.ready_s
             else [fig.ready_s, 600.0])
    trace_args = {"seconds": seconds, "peak_rps": peak, "spikes": spikes,
                  "seed": args.burst_seed, "spike_factor": args.spike_factor,
                  "long_factor": args.long_factor}
    trace = make_trace(**trace_args)
    slo = Slo(args.ttft_slo, args.tpot_slo)
    print("per-instance model (measured):")
    for k, v in fig.sources.items():
        print(f"  {k}: {v}")
    print(f"  -> prefill {fig.prefill_tokens_per_s:,.0f} prompt tokens/s per instance at full "
          f"chunks; decode at most {fig.decode_max_batch} sequences, "
          f"{fig.kv_pool_tokens:,.0f} KV tokens; start-up {', '.join(f'{r:g}' for r in ready)} s")
    print(f"trace: {seconds} s, {trace.trough_rps:g} -> {trace.peak_rps:g} requests/s, "
          f"{len(trace.spikes)} bursts of 60 s, Poisson arrivals, seeds {seeds}; classes "
          + ", ".join(f"{c.name} {c.prompt}/{c.output} {c.share:.0%}" for c in CLASSES))
    print(f"SLO: TTFT <= {slo.ttft_s} s and TPOT <= {slo.tpot_s * 1000:.0f} ms per request")
    spec_args = {"stabilization": args.stabilization,
                 "queued_per_replica": args.queued_per_replica or None,
                 "prompt_tps_per_replica": int(args.prefill_utilization
                                               * fig.prefill_tokens_per_s) or None,
                 "sequences_per_replica": int(args.decode_utilization
                                              * fig.decode_max_batch) or None}
    jobs = [{"ready_s": r, "seed": s, "trace": trace_args, "slo": asdict(slo),
             "interval": args.interval, "static_utilization": args.static_utilization,
             "spec_args": spec_args} for r in ready for s in seeds]
    t0 = time.perf_counter()
    if args.jobs > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            days = list(pool.map(_one_day_job, jobs))
    else:
        days = [_one_day_job(j) for j in jobs]
    startups = []
    for r in ready:
        mine = [d for d in days if d["ready_s"] == r]
        pol = pooled(mine)
        _print_table(r, seeds, pol)
        p, req = pol["planner"], pol["requests"]
        print(f"planner: {p['attainment']:.2%} within both targets (target >= 99 %) on "
              f"{p['gpu_hours_vs_static']:.1%} of the static count at its attainment (target "
              f"<= 60 %); the request-count rule at its attainment "
              f"{req['gpu_hours_vs_static']:.1%}; at the planner's GPU-hours it misses "
              f"{pol['requests (equal GPU-hours)']['missed_requests']:.0f} against "
              f"{p['missed_requests']:.0f} a day")
        startups.append({"ready_s": r, "policies": pol, "days": [
            {k: v for k, v in d.items() if k != "timeline"} for d in mine],
            "timeline": mine[0]["timeline"]})
    print(f"({len(jobs)} days in {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    result = {"config": {"seconds": seconds, "peak_rps": peak, "trough_rps": trace.trough_rps,
                         "spikes": [asdict(s) for s in trace.spikes],
                         "burst_seed": args.burst_seed, "seeds": seeds,
                         "ready_s": ready, "interval_s": args.interval, "slo": asdict(slo),
                         "static_utilization": args.static_utilization,
                         "burst_aftermath_s": BURST_AFTERMATH_S,
                         "classes": [asdict(c) for c in CLASSES], "quick": args.quick},
              "figures": {**{k: v for k, v in asdict(fig).items()
                             if k not in ("decode_ms", "sources")},
                          "decode_ms": [[b, c, ms] for (b, c), ms in sorted(fig.decode_ms.items())],
                          "sources": fig.sources},
              "startups": startups}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
