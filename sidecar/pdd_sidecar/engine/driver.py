"""Rank 0's driver thread: the serving loop of an instance.

Before it serves, the driver warms the instance up (``_warm_up``): every kind of step serving
will run, once, on every rank, so kernels are compiled and decode CUDA graphs captured before
``/readyz`` says ready and no first request pays for them.

Each turn drains the inbox (new sequences, cancellations, releases, probes), asks the scheduler
for the next step, runs it on every rank in lockstep, samples the next token of every sequence
that produced logits, and hands tokens and finished sequences back to the HTTP layer through
callbacks. A prefill's host does not wait for the device (engine/device_queue.py): it reads a
step's first tokens once the device is past them and meanwhile plans and enqueues further
steps, so a prompt that arrives during a long one's prefill is taken at once (and its step may
overtake the queued work, engine/overtaking.py); at most ``IN_ORDER_AHEAD`` in-order steps wait
on the device, so a cancelled long prompt stops within a chunk. A prefill also polls
transfer-done notifications and runs the leases of the blocks it holds for decodes. A decode's
claim on held blocks is answered at once from the HTTP thread (the lease table has its own
lock), never after the step that happens to be running.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdd_sidecar.engine import timing
from pdd_sidecar.engine.device_queue import DeviceMarks, Mark, to_device
from pdd_sidecar.engine.grammar_mask import advance, fill_bitmask
from pdd_sidecar.engine.graphed_hits import prefix_blocks, recompute_in_graph, scratch_blocks_needed
from pdd_sidecar.engine.launch_pacing import LaunchPacer
from pdd_sidecar.engine.overtaking import steps_since
from pdd_sidecar.engine.sampling import (
    Allowed,
    Logprob,
    LogprobRows,
    SamplingParams,
    TokenHistory,
    choice_seed,
    logprob_entries,
    logprob_table,
    needs_history,
    pick_rows,
    sample,
    sample_on_device,
    sample_with_logprobs,
)
from pdd_sidecar.engine.scheduler import (
    CHOICE_GRAMMARS,
    CHOICES,
    FIRST_FINISHES,
    FIRST_TOKENS,
    LOGPROBS,
    PENALTY_PROMPT,
    PROMPT_LOGPROBS,
    Allocator,
    DecodeEntry,
    NeverFits,
    PrefillChunk,
    QueueFull,
    Scheduler,
    Sequence,
    State,
    StepPlan,
    step_budget,
)
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.engine.speculative.config import SpeculativeConfig
from pdd_sidecar.engine.speculative.mtp_served import (
    DRAFT_HIDDEN,
    DRAFT_STATE,
    ServedMTPDrafts,
    draft_state_of,
    prefill_after,
)
from pdd_sidecar.engine.speculative.rows import grammar_drafts, row_histories
from pdd_sidecar.engine.speculative.speculator import SpecStats, Speculator, draft_room
from pdd_sidecar.engine.speculative.verify import accepted_tokens
from pdd_sidecar.engine.warmup_shape import warmup_shape
from pdd_sidecar.engine.worker import RankWorker, RequestError
from pdd_sidecar.gc_pauses import freeze_heap
from pdd_sidecar.kv.errors import LEASE_EXPIRED
from pdd_sidecar.kv.host_tier import HostTier
from pdd_sidecar.kv.lease import LeaseTable, Refusal
from pdd_sidecar.kv.prefix_cache import PrefixCache, chain_root
from pdd_sidecar.metrics import InstanceMetrics

log = logging.getLogger(__name__)

Future = concurrent.futures.Future

# An idle instance whose ranks span pods runs an empty command this often: a rank gone on another
# pod breaks it, and the leader exits (one pod watches its own rank processes instead).
HEARTBEAT_S = 1.0
# An idle instance's first step of prompts it runs itself (a prefill's, a decode's local ones)
# waits for the rest of a burst (gather_burst): until nothing came
# for BURST_QUIET_S, for at most BURST_MAX_S.
BURST_QUIET_S = 0.0015
BURST_MAX_S = 0.05

# In-order prefill steps enqueued but not yet done on the device, at most. One: a stream holds
# about a thousand pending launches and an eager step of a 27-layer model makes about 2,100, so
# a host that queues a second step behind the first blocks inside its launches, a wait the loop
# cannot leave; waiting for the first to finish it can (runs 29 and 30, docs/serving.md).
IN_ORDER_AHEAD = 1
PROMPT_LOGPROB_ROWS = 256  # positions whose logits a prompt's log-probabilities make at once

Inbox = queue.Queue[tuple[str, Any, "Future[Any] | None"]]


@dataclass
class _Sampled:
    """A prefill step's first tokens on their way to the host."""

    live: list[tuple[int, Sequence]]
    tokens: torch.Tensor  # on the host once ``mark`` is done
    mark: Mark
    logprobs: LogprobRows | None = None  # its values on the host once ``mark`` is done


def gather_burst(inbox: Inbox, handle: Callable[[str, Any, Future[Any] | None], None],
                 full: Callable[[], bool] = lambda: False, quiet_s: float = BURST_QUIET_S,
                 max_s: float = BURST_MAX_S) -> int:
    """Handle what keeps arriving until ``quiet_s`` passes with nothing new, ``max_s`` passed,
    or the first step is ``full`` (waiting longer would fill no more of it); the number handled.

    Requests of a burst reach an idle prefill one by one as its HTTP loop reads them. Stepping
    at the first would run most of the burst a step later, and the step's host work would
    share the GIL with the loop still reading the rest, slowing both (64 prompts of 32 tokens
    on one H200: 2-3 steps and a median 186 ms in the prefill instead of one 69 ms step).
    The router sends a burst on at ~0.4 ms a request. The driver sleeps through each quiet gap
    and then takes everything that came, instead of waking for each request: woken for each,
    it took the GIL from the loop reading the rest (up to a switch interval every time), the
    loop's reading fell behind, and a pause of ``quiet_s`` opened inside the burst (run 19:
    the first 7 of 64 requests stepped alone, 104 ms, while the other 57 waited). A lone
    request pays one ``quiet_s``; the last of a burst at most two.
    """
    deadline = time.monotonic() + max_s

    def take() -> int:
        got = 0
        while not full():
            try:
                item = inbox.get_nowait()
            except queue.Empty:
                break
            handle(*item)
            got += 1
        return got

    n = take()
    while not full() and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(quiet_s, left))
        got = take()
        if not got:
            break
        n += got
    return n


class InstanceDriver:
    """``speculative``: a decode drafts and verifies tokens per step (engine/speculative/);
    None: plain decoding."""

    def __init__(self, worker: RankWorker, metrics: InstanceMetrics,
                 speculative: SpeculativeConfig | None = None) -> None:
        s = worker.settings
        self.worker = worker
        self.settings = s
        self.metrics = metrics
        self.role = s.role
        self.cache = worker.cache
        # A prefill shares prompts' computed units; a decode keeps finished conversations'
        # units, so a follow-up turn pulls only what it lacks.
        self.prefix_cache = (PrefixCache(worker.cache, s.block_size * s.dcp,
                                         chain_root({**worker.compat.to_dict(), "tp": s.tp,
                                                     "dcp": s.dcp}))
                             if s.prefix_cache else None)
        # Under the prefix cache, the units it evicts go to host memory (kv/host_tier.py).
        self.host_tier = (HostTier(worker.host_tier.num_slots, s.block_size * s.dcp)
                          if worker.host_tier is not None and self.prefix_cache else None)
        if self.prefix_cache is not None and self.host_tier is not None:
            self.prefix_cache.on_evict = self.host_tier.spill
        self._host_seen = 0
        # Every block comes through here; with the cache, "free" drops a reference. Blocks go
        # back through the scheduler's fence (engine/free_fence.py): a block a queued step still
        # references is held until that step ran.
        self.allocator: Allocator = self.prefix_cache or worker.cache
        self._prefix_seen = (0, 0)
        self._scratch: list[int] = []  # where recomputed prefixes are written (graphed_hits.py)
        self._computed_seen = 0  # the scheduler's computed prompt tokens, counted so far
        self._overtaking_seen = (0, 0)  # (steps, waited) of rank 0's engine, counted so far
        budget = step_budget(worker.cache.device.type, s.max_step_tokens, s.chunk_tokens,
                             s.long_chunk_tokens)
        self.scheduler = Scheduler(
            s.role, worker.cache, s.block_size, s.dcp, s.tp,
            max_running=s.max_num_seqs, max_waiting=s.max_waiting,
            step_tokens=budget.step, chunk_tokens=budget.chunk, prefix_cache=self.prefix_cache,
            long_chunk_tokens=budget.long_chunk, host_tier=self.host_tier,
        )
        expected = {p.rank: p.expected_notifications for p in worker.plan.prefill_ranks}
        self.leases = LeaseTable(s.lease_seconds, expected)
        # Claims come from HTTP threads; everything else on the table from the driver thread.
        self._lease_lock = threading.Lock()
        self.warm = False
        self.warmup_seconds: float | None = None
        # A finished pull wakes the loop at once instead of at its next poll (rank 0's pulls;
        # other ranks' results still come back with the next step, polled while any pull runs).
        worker.puller.on_pulled = self.wake
        self._inbox: Inbox = queue.Queue()
        self._marks = DeviceMarks(worker.cache.device, self.wake, s.fault_device_lag_s)
        self._sampled: list[_Sampled] = []  # prefill: oldest first
        self._in_order: deque[Mark] = deque()  # prefill: in-order steps not seen done
        # Sequences of the steps being launched (an in-order one, paced, and what overtakes it)
        # and what arrived meanwhile that must wait for the launch's end (_between_slices).
        self._launching: frozenset[str] = frozenset()
        self._deferred: deque[tuple[str, Any, Future[Any] | None]] = deque()
        self.pacer: LaunchPacer | None = None
        self._thread = threading.Thread(target=self._loop, name="driver", daemon=True)
        self._last_poll = 0.0
        self._last_collective = time.monotonic()
        self._heartbeat_s = HEARTBEAT_S if s.spans_pods else 0.0
        self._epochs = itertools.count(1)
        self.fatal: str | None = None
        engine = worker.engine
        # MTP drafts come from the module every rank runs (engine/speculative/mtp_served.py)
        self.mtp = (ServedMTPDrafts(worker.run_as_leader)
                    if worker.mtp is not None and s.role == "decode" else None)
        self.speculator = (Speculator(speculative, max_rows=(
            engine.buckets[-1] if engine.decode_mode != "eager" else None), batch=self.mtp)
            if speculative is not None and s.role == "decode" else None)
        self._spec_seen = SpecStats(
            accepted_per_pos=[0] * (speculative.tokens if speculative else 0))
        self._drafted_for: dict[str, Sequence] = {}  # the sequence each id last drafted for
        self._pool_gauges()
        if self.host_tier is not None:
            metrics.host_kv_blocks_total.set(self.host_tier.num_slots)
        self._update_gauges()

    # -- called from the HTTP threads

    def start(self) -> None:
        self._thread.start()

    def idle(self) -> bool:
        """Nothing queued or running, and no KV held for a decode."""
        return self._inbox.empty() and not self.scheduler.busy and len(self.leases) == 0

    def submit(self, seq: Sequence) -> Future[Sequence]:
        """Resolves with the finished sequence (error set on failure); raises RequestError at
        once for a full queue or a request that can never fit."""
        return self._post("submit", seq)

    def cancel(self, seq_id: str) -> None:
        self._inbox.put(("cancel", seq_id, None))

    def end_choice(self, seq_id: str, choice: int) -> None:
        """One choice of a request of several ends, between two steps (Scheduler.end_choice)."""
        self._inbox.put(("end_choice", (seq_id, choice), None))

    def release(self, request_id: str) -> Future[bool]:
        """A held request is released at once (its blocks go back at the driver's next turn);
        one still running is cancelled by the driver, between two steps."""
        with self._lease_lock:
            held_now = request_id in self.leases
            held = self.leases.release(request_id, time.monotonic()) if held_now else None
        if not held_now:
            return self._post("release", request_id)
        if held is not None:  # else pinned by a READ: freed when its pin runs out
            self._inbox.put(("free", held.blocks, None))
        fut: Future[bool] = concurrent.futures.Future()
        fut.set_result(True)
        return fut

    def claim(self, request_id: str, epoch: int, hold_s: float) -> Refusal | None:
        """A decode is about to READ a held request: pin it, or say why it cannot be read.
        Answered on the caller's thread: a READ waits for no forward step."""
        if self.fatal:
            raise RequestError(self.fatal, 503, "broken")
        with self._lease_lock:
            refused = self.leases.claim(request_id, epoch, time.monotonic(), hold_s)
        if refused is None:
            self.worker.agent.expect_read(request_id, hold_s)
        elif refused.cause != LEASE_EXPIRED:  # an expired holding counts once, as it goes
            self.metrics.handoff_failures.labels(role=self.role, cause=refused.cause).inc()
        return refused

    def wake(self) -> None:
        """Something the loop waits for happened off its thread (a KV pull finished, the
        device passed a mark)."""
        self._inbox.put(("wake", None, None))

    def call(self, cmd: dict[str, Any]) -> Future[list[Any]]:
        """A command every rank runs between two steps (handshakes, stats)."""
        return self._post("call", cmd)

    def _post(self, kind: str, payload: Any) -> Future[Any]:
        fut: Future[Any] = concurrent.futures.Future()
        if self.fatal:
            fut.set_exception(RequestError(self.fatal, 503, "broken"))
        else:
            self._inbox.put((kind, payload, fut))
        return fut

    # -- the loop

    def _loop(self) -> None:
        try:
            self._warm_up()
            self._reserve_scratch()
            self._overtaking_seen = self._overtaking_counts()  # warm-up steps are not served
            self._start_pacing()
            held = False
            while True:
                self._collect()
                self.scheduler.fence.settle()
                idle = not self._has_work()
                self._drain(block=idle or held)
                if idle and self.scheduler.prompts_waiting():
                    gather_burst(self._inbox, self._handle, self.scheduler.first_step_full)
                plan = self.scheduler.plan()
                timing.mark_planned(plan, time.monotonic())
                held = self._device_behind(plan)
                if held:  # planned again once the device is further on or something arrives
                    self.scheduler.hold()
                    plan.prefill = []
                poll = self._poll_due()
                if plan.has_forward or plan.pulls or self.scheduler.pulling or poll:
                    self._run_step(plan, poll)
                self._expire_leases()
                self._update_gauges()
                if (self._heartbeat_s
                        and time.monotonic() - self._last_collective >= self._heartbeat_s):
                    self.worker.run_as_leader({"op": "stats"})
                    self._last_collective = time.monotonic()
        except SystemExit:
            return
        except Exception:
            # A failed collective means a rank is gone; the instance cannot go on.
            self.fatal = f"instance broken: {traceback.format_exc(limit=1)}"
            log.critical("%s", traceback.format_exc())
            os._exit(1)

    def _warm_up(self) -> None:
        """Run each kind of step serving will run, on every rank, before the instance is ready:
        a prefill a chunk-sized prompt and a continuing chunk of it, a decode every CUDA-graph
        bucket up to its running limit. Scratch blocks, freed after; nothing is sampled."""
        start = time.monotonic()
        sch = self.scheduler
        engine = self.worker.engine
        rows = sch.max_running
        if self.speculator is not None:  # a verify step runs k + 1 rows per sequence
            cfg = self.speculator.cfg
            rows = max(rows, min(rows, cfg.max_batch) * (cfg.tokens + 1))
        shape = warmup_shape(self.role, self.cache.num_blocks, sch.block_size, sch.dcp,
                             sch.chunk_tokens, rows, engine.buckets,
                             engine.decode_mode == "eager")
        prompt, batches, need = shape.prompt_tokens, shape.batch_sizes, shape.blocks
        blocks = self.allocator.allocate(need)
        try:
            results = self.worker.run_as_leader({
                "op": "warmup", "blocks": blocks, "prompt_tokens": prompt,
                "chunk_tokens": sch.chunk_tokens, "batch_sizes": batches})
        finally:  # RankEngine.warm_up synchronizes the device before it returns
            sch.fence.free(blocks)
        self._last_collective = time.monotonic()
        failed = next((r for r in results if r.get("error")), None)
        if failed:
            raise RuntimeError(f"warm-up failed: {failed['error']}")
        # Everything alive now (model, kernels, graphs) lives as long as the process: out of the
        # collector's sight, a full collection during serving no longer walks it (a pause of
        # tens of ms on a request's path otherwise; vLLM freezes after graph capture too).
        freeze_heap()
        self.warmup_seconds = time.monotonic() - start
        self.metrics.warmup_seconds.set(self.warmup_seconds)
        self.warm = True
        log.info("%s warm in %.2fs (prompt %d tokens in chunks of %d, decode batches %s)",
                 self.role, self.warmup_seconds, prompt, sch.chunk_tokens, batches or "none")

    def _start_pacing(self) -> None:
        """A prefill whose steps may overtake launches its long in-order steps in slices; a
        CPU prefill under ``PDD_FAULT_PACED_LAUNCH`` (tests) every one of them."""
        engine = self.worker.engine
        if self.role != "prefill":
            return
        if engine.overtaking is not None:
            self.pacer = LaunchPacer(self._marks.mark, self._between_slices)
        elif self.settings.fault_paced_launch:
            self.pacer = LaunchPacer(self._marks.mark, self._between_slices, min_tokens=1)
        engine.pacer = self.pacer

    def _has_work(self) -> bool:
        return self.scheduler.runnable

    def _device_behind(self, plan: StepPlan) -> bool:
        """An in-order prefill step would queue behind ``IN_ORDER_AHEAD`` others still on the
        device; a step that overtakes them runs anyway."""
        if not plan.prefill:
            return False
        while self._in_order and self._in_order[0].done():
            self._in_order.popleft()
        if len(self._in_order) < IN_ORDER_AHEAD:
            return False
        return bool(_keeps(plan)) or not self.worker.engine.overtakes(self._seq_chunks(plan))

    def _seq_chunks(self, plan: StepPlan) -> list[SeqChunk]:
        """The step's prompt chunks as the ranks run them: prefix-cache hits recomputed in a
        prefill graph where that is the faster step (engine/graphed_hits.py)."""
        chunks = [SeqChunk(c.tokens, c.start, c.seq.blocks) for c in plan.prefill]
        if not self._scratch or not chunks or _keeps(plan) or self.worker.mtp is not None:
            return chunks
        engine = self.worker.engine
        unit = self.scheduler.block_size * self.scheduler.dcp
        order = engine.overtaking.order if engine.overtaking is not None else None
        if order is not None and order.must_wait(prefix_blocks(chunks, unit)):
            # Still being written in order: a step that overtook it would hand off its prompt
            # before the prefix's KV is there. The continuing chunk reads it in order instead.
            return chunks
        graphed = recompute_in_graph(chunks, [c.seq.prompt for c in plan.prefill], unit,
                                     self._scratch, engine.runs_padded)
        return chunks if graphed is None else graphed

    def _reserve_scratch(self) -> None:
        """A prefill whose fresh prompts run in graphs keeps the blocks recomputed prefixes are
        written to, for good (a few dozen: the largest bucket's tokens in whole units, at most
        a quarter of the pool)."""
        buckets = self.worker.engine.prefill_buckets
        if self.role != "prefill" or not buckets or self.prefix_cache is None:
            return
        n = min(scratch_blocks_needed(buckets[-1], self.scheduler.block_size * self.scheduler.dcp),
                self.allocator.num_free // 4)  # a small pool recomputes shorter prefixes only
        if n > 0:
            self._scratch = self.allocator.allocate(n)
            self.scheduler.reserved_blocks = n
            self.worker.pool = dataclasses.replace(self.worker.pool, reserved=n)
            self._pool_gauges()

    def _pool_gauges(self) -> None:
        """The pool as sized at start (engine/memory_probe.py), less what the driver keeps."""
        m, pool = self.metrics, self.worker.pool
        for rank in range(self.settings.tp):
            m.blocks_total.labels(rank=str(rank)).set(pool.blocks)
            m.pool_bytes.labels(rank=str(rank)).set(pool.bytes)
        m.pool_tokens.set(pool.tokens)
        m.pool_longest.set(pool.longest)

    def _poll_due(self) -> bool:
        if self.role != "prefill" or len(self.leases) == 0:
            return False
        return time.monotonic() - self._last_poll >= self.settings.notif_poll_s

    def _drain(self, block: bool) -> None:
        while self._deferred:
            self._handle(*self._deferred.popleft())
            block = False
        timeout = None
        # One rank: its finished pulls wake the loop (``wake``). Several: the others' results
        # arrive only with a step, so the loop polls while a pull runs.
        polled_pulls = self.scheduler.pulling and self.settings.tp > 1
        if polled_pulls or len(self.leases):
            timeout = max(self.settings.notif_poll_s, 0.001)
        elif block:
            timeout = 0.5
        for item in self._received(block, timeout):
            self._handle(*item)

    def _received(self, wait: bool, timeout: float | None
                  ) -> list[tuple[str, Any, Future[Any] | None]]:
        """What is in the inbox; with ``wait``, the first item waited for up to ``timeout``."""
        items = []
        try:
            if wait:
                items.append(self._inbox.get(timeout=timeout))
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return items

    def _handle(self, kind: str, payload: Any, fut: Future[Any] | None) -> None:
        if kind == "cancel":
            self.scheduler.cancel(payload)
            return
        if kind == "end_choice":
            self.scheduler.end_choice(*payload)
            return
        if kind == "free":
            self.scheduler.fence.free(payload)
            return
        if kind == "wake":
            return
        assert fut is not None
        if not fut.set_running_or_notify_cancel():
            return
        if kind == "submit":
            seq: Sequence = payload
            seq.on_done = lambda s, f=fut: f.set_result(s)  # type: ignore[misc]
            if seq.id in self.leases:  # a second hold of one id would stop this loop
                fut.set_exception(RequestError(
                    f"request_id {seq.id!r} still holds KV blocks on this instance (its grant "
                    "is outstanding)", 409, "conflict"))
                return
            try:
                self.scheduler.submit(seq)
                seq.extra[timing.HANDLED] = time.monotonic()
            except QueueFull as exc:
                fut.set_exception(RequestError(str(exc), 429, "overloaded", retry_after=1.0))
            except NeverFits as exc:
                fut.set_exception(RequestError(str(exc), 400, "invalid_request"))
            except ValueError as exc:
                fut.set_exception(RequestError(str(exc), 409, "conflict"))
        elif kind == "release":
            fut.set_result(self._release(payload))
        elif kind == "call":
            if payload.get("op") == "shutdown":
                fut.set_result(self.worker.run_as_leader(payload))
                raise SystemExit
            fut.set_result(self.worker.run_as_leader(payload))

    def _between_slices(self, oldest: Mark) -> None:
        """Rank 0's engine waits for the device before launching the next slice of an
        in-order step (engine/launch_pacing.py). Until something happens (``oldest`` passed,
        a request came), then: tokens on the host go out, new prompts are admitted, and a step
        of fresh ones that overtakes the step being launched runs now. Everything else waits
        for the launch's end: a cancel or a command would change blocks or ranks under it."""
        for item in self._received(not oldest.done(), 0.5):
            if item[0] in ("submit", "wake"):
                self._handle(*item)
            else:
                self._deferred.append(item)
        self._collect()
        plan = self.scheduler.plan_fresh(self._launching)
        timing.mark_planned(plan, time.monotonic())
        if (plan.prefill and not _keeps(plan)
                and self.worker.engine.overtakes(self._seq_chunks(plan))):
            self._run_step(plan, poll=False)

    def _draft(self, decode: list[DecodeEntry]) -> None:
        """Each decode sequence's drafts for this step (engine/speculative/speculator.py), cut
        where its grammar refuses one (engine/speculative/rows.py)."""
        spec = self.speculator
        assert spec is not None
        # a request id a new sequence reuses starts afresh (its text's index, the module's state)
        spec.retain(d.seq.id for d in decode if self._drafted_for.get(d.seq.id, d.seq) is d.seq)
        self._drafted_for = {d.seq.id: d.seq for d in decode}
        self._mtp_begin(decode)
        items = [(d.seq.id, _text(d.seq), draft_room(d.seq.max_tokens, len(d.seq.output)))
                 for d in decode]
        for d, drafts in zip(decode, spec.plan(items), strict=True):
            if drafts and d.seq.grammar is not None:
                drafts, d.states = grammar_drafts(d.seq.grammar, drafts)
            d.drafts = drafts

    def _mtp_begin(self, decode: list[DecodeEntry]) -> None:
        """The MTP drafter learns each sequence's table, and a new one pulled from a prefill
        its draft state (counted when the prefill sent none)."""
        if self.mtp is None:
            return
        for d in decode:
            seq = d.seq
            src = seq.source
            if self.mtp.begin(seq.id, seq.blocks, seq.context, seq.first_token,
                              getattr(src, "draft_state", None), src is not None):
                self.metrics.spec_draft_state_missing.inc()

    def _run_step(self, plan: StepPlan, poll: bool) -> None:
        timing.mark_step_start(plan, time.monotonic())
        # the unit a forked choice's prompt ends in: its own copy (scheduler.py), made before
        # the module's command when one runs (it writes there), else in the step's
        copies = self.scheduler.take_copies()
        if self.mtp is not None:
            self.mtp.carry(copies)
        # A step that also prefills a prompt here (scheduler.py: Local prefill) drafts and
        # verifies as a decode-only one: its prompt rows come first and are sampled apart.
        if self.speculator is not None and plan.decode:
            self._draft(plan.decode)
        if self.mtp is not None:
            copies = self.mtp.uncarried()
        chunks = self._seq_chunks(plan)
        recomputed = sum(len(c.tokens) - len(p.tokens) for c, p in zip(chunks, plan.prefill,
                                                                       strict=True))
        if recomputed:
            self.metrics.prefix_recomputed.inc(recomputed)
        cmd: dict[str, Any] = {
            "op": "step",
            "chunks": [(list(c.tokens), c.start, list(c.block_ids)) for c in chunks]
            + [([t], d.position + j, d.seq.blocks) for d in plan.decode
               for j, t in enumerate([d.token, *d.drafts])],
            "pulls": [{"id": s.id, "source": s.extra["source"], "blocks": s.blocks,
                       "claim_url": s.extra["claim_url"],
                       "start_token": self.scheduler.start_token(s)} for s in plan.pulls],
            "poll": poll,
        }
        keep = _keeps(plan)
        if self.worker.mtp is not None:
            keep = self._mtp_command(plan, cmd, keep)
        if keep:
            cmd["keep"] = keep
        if copies:
            cmd["copies"] = copies
        if self.host_tier is not None and self.host_tier.pending():
            cmd["tier"] = self.host_tier.take().to_command()
        if poll:
            self._last_poll = time.monotonic()
        if self.settings.fault_step_delay_s and cmd["chunks"]:
            time.sleep(self.settings.fault_step_delay_s)
        started = time.monotonic()
        outer = self._launching
        self._launching = outer | {c.seq.id for c in plan.prefill}
        try:
            results = self.worker.run_as_leader(cmd)
        finally:
            self._launching = outer
        self._last_collective = time.monotonic()
        for c in plan.prefill:
            c.seq.extra[timing.LAUNCHED] = self._last_collective
        failed = next((r for r in results if r.get("error")), None)
        if cmd["chunks"]:
            # What rank 0's engine did with the step, not a second guess at it beforehand.
            overtook = self.worker.engine.logits_stream is not None
            if self.role == "prefill":
                # On the default stream, which waits for an overtaking step: past it once
                # this step and everything queued before it ran.
                mark = self._marks.mark()
                if not overtook:
                    self._in_order.append(mark)
                self.scheduler.fence.queued(
                    {b for _, _, blocks in cmd["chunks"] for b in blocks}, mark)
            self.metrics.step_enqueue_seconds.labels(
                order="overtaking" if overtook else "in_order").observe(
                self._last_collective - started)
            self.metrics.batch_size.observe(len(cmd["chunks"]))
        for rank, r in enumerate(results):
            for kind, copied in r.get("tier", {}).items():
                self.metrics.host_kv_copied(kind, rank, copied)
            for rid, error, stats in r.get("pulled", ()):
                seq = self.scheduler.pulling.get(rid)
                if seq is not None:
                    seq.extra.setdefault("transfer", {})[rank] = stats
                self.scheduler.on_pulled(rid, rank, error)
                if seq is not None and seq.state is State.FINISHED and seq.error:
                    self.metrics.transfer_failures.labels(reason=seq.error.get("kind")).inc()
                    cause = seq.error.get("cause")
                    if cause is not None:
                        self.metrics.handoff_failures.labels(role=self.role, cause=cause).inc()
            for rid in r.get("notified", ()):
                self.metrics.notifications.labels(rank=str(rank)).inc()
                with self._lease_lock:
                    held = self.leases.notified(rid, rank)
                if held is not None:
                    self.scheduler.fence.free(held.blocks)
        seqs = [c.seq for c in plan.prefill] + [d.seq for d in plan.decode]
        emitted = [len(d.seq.output) for d in plan.decode]
        if not failed:
            try:
                self._sample(plan)
                if self.mtp is not None:  # the positions whose next token is now known
                    for d, before in zip(plan.decode, emitted, strict=True):
                        self.mtp.verified(d.seq.id, d.position, d.seq.output[before:])
                    for c in plan.prefill:  # a prompt prefilled here: its last position
                        if c.last and c.seq.output:
                            self.mtp.verified(c.seq.id, len(c.seq.prompt) - 1,
                                              c.seq.output[:1])
            except Exception as exc:  # rank 0 alone: fail this step's sequences, not the loop
                log.error("sampling failed: %s", traceback.format_exc())
                failed = {"error": f"sampling failed: {type(exc).__name__}: {exc}",
                          "status": 500, "kind": "internal_error"}
        if failed:
            for seq in seqs:
                seq.error = failed
                self.scheduler.cancel(seq.id)

    def _mtp_command(self, plan: StepPlan, cmd: dict[str, Any], keep: list[int]) -> list[int]:
        """What the step's ranks do for the MTP module (engine/speculative/mtp_served.py): the
        step's prompt chunks keep their hidden states and the module runs over their positions
        whose next token the prompt has; a decode keeps its rows' hidden states (and those of
        the last position of a prompt it prefilled). The step's kept chunks."""
        rows = len(plan.prefill)
        if plan.prefill:
            cmd["mtp_prefill"] = [(i, c.start, prefill_after(c.seq.prompt, c.start,
                                                             len(c.tokens)), list(c.seq.blocks))
                                  for i, c in enumerate(plan.prefill)]
        if self.role != "decode":
            return sorted({*keep, *range(rows)})
        # A prompt prefilled here (scheduler.py: Local prefill) keeps its last position's
        # hidden state for the module's run there once the first token is known.
        mtp_keep = [(c.seq.id, i, 1) for i, c in enumerate(plan.prefill) if c.last]
        for d in plan.decode:
            mtp_keep.append((d.seq.id, rows, d.rows))
            rows += d.rows
        cmd["mtp_keep"] = mtp_keep
        return sorted({*keep, *range(rows)})

    def _sample(self, plan: StepPlan) -> None:
        logits = self.worker.logits
        rows: list[tuple[int, Sequence]] = []
        for i, c in enumerate(plan.prefill):
            self.scheduler.on_chunk_done(c)
            if c.last and self.worker.mtp is not None and self.role == "prefill":
                # the draft state (mtp_served.py), read on the host once the token is
                c.seq.extra[DRAFT_HIDDEN] = self.worker.engine.kept[i][-1].clone()
            if c.seq.prompt_logprobs is not None and c.seq.state is State.RUNNING:
                self._prompt_logprobs(c, self.worker.engine.kept[i])
            if c.last:
                rows.append((i, c.seq))
        base = len(plan.prefill)
        if any(d.drafts for d in plan.decode):
            self._sample_rows(rows, logits)  # the prompts prefilled here, then the verify rows
            self._sample_verify(plan.decode, base, logits)
            return
        self._sample_rows(rows + [(base + i, d.seq) for i, d in enumerate(plan.decode)], logits)

    def _sample_rows(self, rows: list[tuple[int, Sequence]], logits: Any) -> None:
        """One token for each of ``rows`` (logits row, sequence) still running: a prompt's
        first or a decode row's next."""
        live = [(i, s) for i, s in rows if s.state is State.RUNNING]
        if not live or logits is None:
            return
        if self.role == "prefill" and any(CHOICES in s.extra for _, s in live):
            live, params = choice_rows(live)
        else:
            params = [s.sampling for _, s in live]
        indices = [len(s.output) + (0 if s.source is None else 1) for _, s in live]
        histories = ([_history(s) if s.sampling.adjusts else None for _, s in live]
                     if needs_history(params) else None)
        allowed = _allowed(live, logits.device.type == "cuda", self.metrics)
        tops = [s.logprobs for _, s in live]
        asks = any(k is not None for k in tops)
        # On the logits' own stream: an overtaking step's rows picked on the default stream
        # would wait for the work it overtook (runs 29 and 30 did, through a synchronizing
        # list index).
        with self.worker.engine.logits_context():
            logits = pick_rows(logits, [i for i, _ in live])
            if self.role == "decode" and not asks:  # its next step needs these tokens
                self._deliver(live, sample(logits, params, indices, histories, allowed))
                return
            lp: LogprobRows | None = None
            if asks:
                on_device, lp = sample_with_logprobs(logits, params, indices, tops, histories,
                                                      allowed)
            else:
                on_device = sample_on_device(logits, params, indices, histories, allowed)
            if self.role == "decode":  # both on the host after one wait, as sample's
                assert lp is not None
                host, values = on_device.to("cpu", non_blocking=True), lp.values.to(
                    "cpu", non_blocking=True)
                if on_device.is_cuda:
                    torch.cuda.current_stream(on_device.device).synchronize()
                self._attach(live, lp, values.tolist())
                self._deliver(live, [int(t) for t in host.tolist()])
                return
            if lp is not None:
                lp = lp._replace(values=lp.values.to("cpu", non_blocking=True))
            self._sampled.append(_Sampled(live, on_device.to("cpu", non_blocking=True),
                                          self._marks.mark(), lp))

    def _sample_verify(self, decode: list[DecodeEntry], base: int, logits: Any) -> None:
        """A decode step that verified drafts: every row drawn as plain decoding draws it
        there (engine/speculative/rows.py), the drafts kept while they equal the draws, and
        the kept tokens delivered one by one, so a stop, the grammar's end or ``max_tokens``
        ends the sequence where plain decoding would and the tokens after it are dropped."""
        if logits is None:
            return
        rows: list[int] = []
        params: list[SamplingParams] = []
        indices: list[int] = []
        spans: list[tuple[DecodeEntry, int]] = []
        r = base
        for d in decode:
            seq = d.seq
            if seq.state is State.RUNNING:
                spans.append((d, len(rows)))
                first = len(seq.output) + (0 if seq.source is None else 1)
                rows.extend(range(r, r + d.rows))
                params.extend([seq.sampling] * d.rows)
                indices.extend(range(first, first + d.rows))
            r += d.rows
        if not spans:
            return
        histories: list[TokenHistory | None] | None = None
        if needs_history(params):
            histories = []
            for d, _ in spans:
                h = _history(d.seq) if d.seq.sampling.adjusts else None
                histories.extend(row_histories(h, d.drafts))
        masked: list[int] = []
        states: list[Any] = []
        for d, first in spans:
            if d.seq.grammar is not None:
                masked.extend(range(first, first + d.rows))
                states.extend(d.states or [d.seq.grammar])
        allowed = None
        if masked:
            start = time.perf_counter()
            allowed = Allowed(masked, fill_bitmask(states, logits.device.type == "cuda"))
            self.metrics.structured_mask_seconds.observe(time.perf_counter() - start)
        tops = [d.seq.logprobs for d, _ in spans for _ in range(d.rows)]
        entries: dict[int, Logprob] = {}
        with self.worker.engine.logits_context():
            picked = pick_rows(logits, rows)
            if any(k is not None for k in tops):
                on_device, lp = sample_with_logprobs(picked, params, indices, tops, histories,
                                                     allowed)
                assert lp is not None
                entries = dict(zip(lp.rows, logprob_entries(lp.values.tolist(), lp.tops),
                                   strict=True))
            else:
                on_device = sample_on_device(picked, params, indices, histories, allowed)
            draws = [int(t) for t in on_device.tolist()]
        timing.mark_sampled((d.seq for d, _ in spans), time.monotonic())
        spec = self.speculator
        for d, first in spans:
            seq = d.seq
            kept = accepted_tokens(d.drafts, draws[first:first + d.rows])
            emitted = 0
            for j, tok in enumerate(kept):
                if seq.state is not State.RUNNING:  # a stop or max_tokens ended it before
                    break
                if first + j in entries:
                    seq.extra.setdefault(LOGPROBS, []).append(entries[first + j])
                complete = seq.grammar is not None and advance(seq.grammar.matcher, tok)
                self.metrics.tokens.labels(kind="generated").inc()
                self.scheduler.on_token(seq, tok, complete)
                emitted += 1
            if spec is not None:  # the drafts it emitted: none past a token that ended it
                accepted = max(0, min(len(kept), emitted) - 1)
                spec.record(seq.id, len(d.drafts), accepted)
                timing.count_speculation(seq.extra, len(d.drafts), accepted)

    def _collect(self) -> None:
        """The prefill's first tokens that reached the host: out, each sequence at once."""
        waiting: list[_Sampled] = []
        for s in self._sampled:
            if s.mark.done():
                if s.logprobs is not None:
                    self._attach(s.live, s.logprobs, s.logprobs.values.tolist())
                self._deliver(s.live, [int(t) for t in s.tokens.tolist()])
            else:
                waiting.append(s)
        self._sampled = waiting

    @staticmethod
    def _attach(live: list[tuple[int, Sequence]], lp: LogprobRows,
                values: list[list[float]]) -> None:
        """Each asking sequence's entry for the token about to be delivered to it."""
        for b, entry in zip(lp.rows, logprob_entries(values, lp.tops), strict=True):
            live[b][1].extra.setdefault(LOGPROBS, []).append(entry)

    def _prompt_logprobs(self, chunk: PrefillChunk, hidden: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens this chunk's positions predict (its last
        position, when the prompt ends there, predicts the first generated token instead):
        logits made a slice of positions at a time, so a long chunk never holds ``[T, V]``.
        Read on the host at once (a sync, for the prompts that asked only)."""
        seq = chunk.seq
        prompt = seq.prompt
        out: list[Logprob] = seq.extra.setdefault(PROMPT_LOGPROBS, [])
        n = min(len(chunk.tokens), len(prompt) - 1 - chunk.start)
        k = int(seq.prompt_logprobs or 0)
        engine = self.worker.engine
        for a in range(0, n, PROMPT_LOGPROB_ROWS):
            b = min(n, a + PROMPT_LOGPROB_ROWS)
            lsm = engine.logits(hidden[a:b]).log_softmax(-1)
            targets = to_device(prompt[chunk.start + a + 1:chunk.start + b + 1], torch.long,
                                lsm.device)
            out.extend(logprob_entries(logprob_table(lsm, targets, k).tolist(), [k] * (b - a)))

    def _deliver(self, live: list[tuple[int, Sequence]], tokens: list[int]) -> None:
        timing.mark_sampled((s for _, s in live), time.monotonic())
        if self.role == "prefill":
            # A request with several choices has a row per choice, in order (choice_rows).
            chosen: dict[str, tuple[Sequence, list[int]]] = {}
            for (_, seq), tok in zip(live, tokens, strict=True):
                chosen.setdefault(seq.id, (seq, []))[1].append(tok)
            for seq, toks in chosen.values():
                if seq.state is State.RUNNING:  # else cancelled while its token was on the way
                    grammars = seq.extra.pop(CHOICE_GRAMMARS, None) or [seq.grammar] * len(toks)
                    self._prefilled(seq, toks, [g is not None and advance(g.matcher, t)
                                                for g, t in zip(grammars, toks, strict=True)])
            return
        for (_, seq), tok in zip(live, tokens, strict=True):
            if seq.state is not State.RUNNING:  # cancelled while its token was on the way
                continue
            complete = seq.grammar is not None and advance(seq.grammar.matcher, tok)
            if seq.source is None and not seq.output:  # a prompt prefilled here is done
                self.metrics.tokens.labels(kind="prompt").inc(len(seq.prompt))
            self.metrics.tokens.labels(kind="generated").inc()
            self.scheduler.on_token(seq, tok, complete)

    def _prefilled(self, seq: Sequence, tokens: list[int], completes: list[bool]) -> None:
        """The prompt's first token of each choice is chosen (``completes``: which ended its
        grammar): the KV is held for a decode unless every choice already ended."""
        seq.output.append(tokens[0])
        hidden = seq.extra.pop(DRAFT_HIDDEN, None)
        if hidden is not None:
            seq.extra[DRAFT_STATE] = draft_state_of(hidden, len(seq.prompt))
        ended = [t in seq.stop_ids or c for t, c in zip(tokens, completes, strict=True)]
        if len(tokens) > 1:
            seq.extra[FIRST_TOKENS] = tokens
            seq.extra[FIRST_FINISHES] = ["stop" if e else None for e in ended]
        self.metrics.tokens.labels(kind="prompt").inc(len(seq.prompt))
        if all(ended):
            seq.finish_reason = "stop"
        elif seq.max_tokens <= 1:
            seq.finish_reason = "length"
        keep = seq.finish_reason is None
        if keep:
            with self._lease_lock:
                held = self.leases.hold(seq.id, seq.blocks, time.monotonic(),
                                        next(self._epochs))
            seq.extra["epoch"] = held.epoch
            seq.extra["expires_at"] = time.time() + self.settings.lease_seconds
        self.scheduler.finish_prefill(seq, keep_blocks=keep)

    def _expire_leases(self) -> None:
        if not len(self.leases):
            return
        with self._lease_lock:
            expired = self.leases.expire(time.monotonic())
        for held in expired:
            self.metrics.lease_expiries.inc()
            self.metrics.handoff_failures.labels(
                role=self.role, cause=self.leases.expiry_cause(held)).inc()
            self.scheduler.fence.free(held.blocks)

    def _release(self, request_id: str) -> bool:
        """The router gave up on a request: its blocks go now."""
        with self._lease_lock:
            if request_id in self.leases:
                held = self.leases.release(request_id, time.monotonic())
                if held is not None:
                    self.scheduler.fence.free(held.blocks)
                return True
        self.scheduler.cancel(request_id)
        return False

    def _spec_metrics(self) -> None:
        """The speculator's counts since the last update, onto the metrics."""
        assert self.speculator is not None
        st, seen, m = self.speculator.stats, self._spec_seen, self.metrics
        m.spec_drafts.inc(st.drafts - seen.drafts)
        m.spec_draft_tokens.inc(st.draft_tokens - seen.draft_tokens)
        m.spec_accepted_tokens.inc(st.accepted_tokens - seen.accepted_tokens)
        for pos, (now, was) in enumerate(zip(st.accepted_per_pos, seen.accepted_per_pos,
                                             strict=True)):
            if now != was:
                m.spec_accepted_per_pos.labels(position=str(pos)).inc(now - was)
        for reason, n in st.skipped.items():
            if n != seen.skipped.get(reason, 0):
                m.spec_skipped.labels(reason=reason).inc(n - seen.skipped.get(reason, 0))
        self._spec_seen = st.copy()

    def _overtaking_counts(self) -> tuple[int, int]:
        ot = self.worker.engine.overtaking
        return (0, 0) if ot is None else (ot.steps, ot.waited)

    def _update_gauges(self) -> None:
        m, sch = self.metrics, self.scheduler
        m.gc_pauses.flush()
        now = self._overtaking_counts()
        if now != self._overtaking_seen:
            for waited, n in steps_since(self._overtaking_seen, now).items():
                m.overtaking_steps.labels(waited=waited).inc(n)
            self._overtaking_seen = now
        free = self.allocator.num_free
        for rank in range(self.settings.tp):
            m.blocks_free.labels(rank=str(rank)).set(free)
        m.running.set(len(sch.running) + len(sch.pulling))
        m.waiting.set(len(sch.waiting))
        m.queued_prompt_tokens.set(sum(
            max(0, len(s.prompt) - s.computed)
            for s in (*sch.waiting, *sch.running.values()) if s.source is None))
        m.held_requests.set(len(self.leases))
        if self.speculator is not None:
            self._spec_metrics()
        m.prefill_computed_tokens.inc(sch.computed_tokens - self._computed_seen)
        self._computed_seen = sch.computed_tokens
        pc = self.prefix_cache
        if pc is not None:
            queried, hit = self._prefix_seen
            m.prefix_queries.inc(pc.queried_tokens - queried)
            m.prefix_hits.inc(pc.hit_tokens - hit)
            self._prefix_seen = (pc.queried_tokens, pc.hit_tokens)
            m.prefix_cached_blocks.set(pc.cached_blocks)
        tier = self.host_tier
        if tier is not None:
            m.prefix_hits.inc(tier.hit_tokens - self._host_seen)
            m.host_kv_hits.inc(tier.hit_tokens - self._host_seen)
            self._host_seen = tier.hit_tokens
            m.host_kv_blocks.set(tier.used_slots)


def _text(seq: Sequence) -> tuple[list[int], ...]:
    """A decode sequence's text so far, in parts (prompt, first token, output): what its
    drafts continue. The prompt's ids are there when the request sent them."""
    prompt = seq.prompt or seq.extra.get(PENALTY_PROMPT) or []
    first = [] if seq.first_token is None else [seq.first_token]
    return prompt, first, seq.output


def _allowed(live: list[tuple[int, Sequence]], pin: bool,
             metrics: InstanceMetrics) -> Allowed | None:
    """Structured output's mask for the rows under a grammar (None: no row has one, nothing
    is done). Host work, per step, for those rows only (engine/grammar_mask.py), while the
    device still runs the step's forward."""
    grammars = _row_grammars(live)
    rows = [r for r, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    start = time.perf_counter()
    mask = fill_bitmask([grammars[r] for r in rows], pin)
    metrics.structured_mask_seconds.observe(time.perf_counter() - start)
    return Allowed(rows, mask)


def _keeps(plan: StepPlan) -> list[int]:
    """The step's prompt chunks whose every position's hidden state is kept (their prompt
    log-probabilities); such a step runs in order, eagerly (RankEngine.step)."""
    return [i for i, c in enumerate(plan.prefill) if c.seq.prompt_logprobs is not None]


def _row_grammars(live: list[tuple[int, Sequence]]) -> list[Any]:
    """Each row's grammar: its sequence's, or, for a prefill's rows of several choices
    (``choice_rows``), each choice's own matcher."""
    out: list[Any] = []
    seen: dict[str, int] = {}
    for _, s in live:
        per_choice = s.extra.get(CHOICE_GRAMMARS)
        if per_choice is None:
            out.append(s.grammar)
            continue
        j = seen[s.id] = seen.get(s.id, -1) + 1
        out.append(per_choice[j])
    return out


def choice_rows(live: list[tuple[int, Sequence]]
                ) -> tuple[list[tuple[int, Sequence]], list[SamplingParams]]:
    """A prefill's logits rows, one per choice of each request (``seq.extra[CHOICES]``), all
    reading its prompt's last position, each with its choice's seed (``choice_seed``) and,
    under a grammar, its own copy of the matcher (each choice's first token advances its
    own)."""
    rows: list[tuple[int, Sequence]] = []
    params: list[SamplingParams] = []
    for i, seq in live:
        p = seq.sampling
        n = int(seq.extra.get(CHOICES, 1))
        if seq.grammar is not None and n > 1:
            g = seq.grammar
            seq.extra[CHOICE_GRAMMARS] = [g, *(g._replace(matcher=g.matcher.deep_copy())
                                              for _ in range(n - 1))]
        for j in range(n):
            rows.append((i, seq))
            params.append(p if j == 0 else dataclasses.replace(p, seed=choice_seed(p.seed, j)))
    return rows, params


def _history(seq: Sequence) -> TokenHistory:
    """What ``seq``'s sampling controls look at. A decode generated its first token on the
    prefill; its prompt is the one the request named (kept for repetition_penalty when the
    prefix cache is off and ``seq.prompt`` is empty)."""
    generated = seq.output if seq.first_token is None else [seq.first_token, *seq.output]
    return TokenHistory(seq.extra.get(PENALTY_PROMPT, seq.prompt), generated, seq.stop_ids,
                        seq.extra)


class _LoopDelivery:
    """Calls from the driver thread queued for one asyncio loop and run there in batches: a
    step that produces a token for each of 200 sequences wakes the loop once, not 200 times."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[Callable[..., None], tuple[Any, ...]]] = []

    def put(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        with self.lock:
            self.pending.append((fn, args))
            first = len(self.pending) == 1
        if first:
            self.loop.call_soon_threadsafe(self.flush)

    def flush(self) -> None:
        with self.lock:
            items, self.pending = self.pending, []
        for fn, args in items:
            fn(*args)


_DELIVERY: weakref.WeakKeyDictionary[Any, _LoopDelivery] = weakref.WeakKeyDictionary()
_DELIVERY_LOCK = threading.Lock()


def on_loop(loop: Any, fn: Callable[..., None]) -> Callable[..., None]:
    """A callback for the driver thread that runs ``fn`` on an asyncio loop instead."""
    with _DELIVERY_LOCK:
        delivery = _DELIVERY.get(loop)
        if delivery is None:
            delivery = _DELIVERY[loop] = _LoopDelivery(loop)

    def call(*args: Any) -> None:
        delivery.put(fn, args)

    return call
