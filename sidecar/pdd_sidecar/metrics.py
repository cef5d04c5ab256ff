"""Prometheus metrics of one instance or router, on a private registry.

A private registry per process object keeps several instances in one test process (or a router
and an instance) from colliding on the global default registry. A router of several worker
processes (serve/router/router_workers.py) runs them in prometheus_client's multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``, set for the workers before they start): whichever worker answers
``/metrics`` reports the sums over all of them.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from pdd_sidecar import tracing
from pdd_sidecar.gc_pauses import BUCKETS as _GC_BUCKETS
from pdd_sidecar.gc_pauses import PauseTimer
from pdd_sidecar.kv.errors import HANDOFF_FAILURE_CAUSES

MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own name for it

__all__ = ["CONTENT_TYPE_LATEST", "OPENMETRICS_TYPE", "InstanceMetrics", "RouterMetrics",
           "wants_openmetrics"]


def wants_openmetrics(accept: str) -> bool:
    """Whether a scraper's Accept header asks for OpenMetrics (which carries exemplars)."""
    return "application/openmetrics-text" in accept

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class InstanceMetrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.role = role
        self.requests = Counter(
            "pdd_requests", "Instance API requests", ["role", "endpoint", "outcome"], registry=r
        )
        self.request_seconds = Histogram(
            "pdd_request_seconds", "Instance API latency", ["role", "endpoint"],
            buckets=_SECONDS, registry=r,
        )
        self.transfer_bytes = Counter(
            "pdd_kv_transfer_bytes", "KV bytes read (over NIXL or CUDA IPC)", ["rank"], registry=r
        )
        self.transfer_paths = Counter(
            "pdd_kv_transfer_path", "Per-rank KV hand-offs by the path they took (nixl, "
            "cuda_ipc)", ["path"], registry=r
        )
        self.transfer_descriptors = Counter(
            "pdd_kv_transfer_descriptors", "NIXL descriptors posted", ["rank"], registry=r
        )
        self.transfer_seconds = Histogram(
            "pdd_kv_transfer_seconds", "Per-rank KV hand-off time (post to completion)", ["rank"],
            buckets=_SECONDS, registry=r,
        )
        self.transfer_device_seconds = Counter(
            "pdd_kv_transfer_device_seconds",
            "Device time of KV hand-offs copied on the device (cuda_ipc), by CUDA events",
            ["rank"], registry=r,
        )
        self.transfer_failures = Counter(
            "pdd_kv_transfer_failures", "Hand-offs that failed", ["reason"], registry=r
        )
        # By cause (kv/errors.py), each side counting what it saw: a decode its failed pulls
        # (per request), a prefill its refused claims and the holdings its lease freed unread.
        self.handoff_failures = Counter(
            "pdd_kv_handoff_failures", "KV hand-offs that failed, by cause: transport_error, "
            "peer_gone, lease_expired, grant_refused, incompatible", ["role", "cause"],
            registry=r,
        )
        for cause in HANDOFF_FAILURE_CAUSES:  # every series from the start: rates need a zero
            self.handoff_failures.labels(role=role, cause=cause)
        self.lease_expiries = Counter(
            "pdd_lease_expiries", "Prefill requests whose blocks were freed by the lease",
            registry=r,
        )
        self.notifications = Counter(
            "pdd_notifications", "Transfer-done notifications received", ["rank"], registry=r
        )
        self.held_requests = Gauge(
            "pdd_held_requests", "Prefill requests holding blocks for a decode", registry=r
        )
        self.blocks_free = Gauge("pdd_kv_blocks_free", "Free KV blocks", ["rank"], registry=r)
        self.blocks_total = Gauge("pdd_kv_blocks_total", "KV blocks", ["rank"], registry=r)
        # The pool as sized at start (kv/pool_sizing.py): from memory on a GPU unless set.
        self.pool_bytes = Gauge("pdd_kv_pool_bytes", "Device bytes of the KV pool", ["rank"],
                                registry=r)
        self.pool_tokens = Gauge(
            "pdd_kv_pool_tokens", "Tokens of KV the instance holds: blocks x block size x DCP",
            registry=r)
        self.pool_longest = Gauge(
            "pdd_kv_pool_longest_sequence_tokens", "The longest sequence the instance can "
            "hold: its KV tokens but the blocks it keeps for itself, at most the model's "
            "maximum length", registry=r)
        self.running = Gauge(
            "pdd_running_sequences", "Sequences admitted (running or pulling their KV)",
            registry=r,
        )
        self.waiting = Gauge(
            "pdd_waiting_sequences", "Sequences queued for KV blocks or a running slot",
            registry=r,
        )
        self.queued_prompt_tokens = Gauge(
            "pdd_queued_prompt_tokens", "Prompt tokens admitted or waiting but not yet run "
            "through the model (the prefill work queued; the autoscaler reads it)", registry=r,
        )
        self.batch_size = Histogram(
            "pdd_batch_size", "Sequences per engine step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r,
        )
        self.structured_mask_seconds = Histogram(
            "pdd_structured_mask_seconds",
            "Host time filling a step's structured-output token mask (llguidance, the rows "
            "under a grammar only; steps without one do not count)",
            buckets=(0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
            registry=r,
        )
        self.step_enqueue_seconds = Histogram(
            "pdd_step_enqueue_seconds",
            "Host time a forward step takes to enqueue (on a GPU its launches, which wait for "
            "the device once a stream holds about a thousand); order: in_order or overtaking",
            ["order"], buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
            registry=r,
        )
        self.tokens = Counter("pdd_tokens", "Tokens processed", ["kind"], registry=r)
        self.prefix_queries = Counter(
            "pdd_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            "pdd_prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache",
            registry=r,
        )
        self.prefix_recomputed = Counter(
            "pdd_prefix_cache_recomputed",
            "Prompt tokens found in the prefix cache and computed again in a prefill graph, "
            "where that step is faster than the rest of the prompt run eagerly "
            "(engine/graphed_hits.py)", registry=r,
        )
        self.prefill_computed_tokens = Counter(
            "pdd_prefill_computed_tokens", "Prompt tokens a prefill ran through the model (not "
            "taken from its prefix cache, warm-up not counted)", registry=r,
        )
        self.prefix_cached_blocks = Gauge(
            "pdd_prefix_cache_blocks", "KV blocks (table entries) held by the prefix cache",
            registry=r,
        )
        self.host_kv_hits = Counter(
            "pdd_host_kv_hits", "Prompt tokens whose KV was loaded from the host tier (part of "
            "pdd_prefix_cache_hits)", registry=r,
        )
        self.host_kv_blocks = Gauge(
            "pdd_host_kv_blocks", "Host KV blocks (slots, per rank) holding evicted units",
            registry=r,
        )
        self.host_kv_blocks_total = Gauge(
            "pdd_host_kv_blocks_total", "Host KV blocks (slots, per rank) of the tier",
            registry=r,
        )
        # One name per kind (not a label): the bench and dashboards read a rate as bytes over
        # seconds of the same name's samples.
        self.host_kv_bytes = {kind: Counter(
            f"pdd_host_kv_{kind}_bytes", f"Bytes the host tier copied ({what})", ["rank"],
            registry=r) for kind, what in (("load", "host to device"), ("offload",
                                                                        "device to host"))}
        self.host_kv_seconds = {kind: Counter(
            f"pdd_host_kv_{kind}_seconds", f"Time of the host tier's copies ({what}; on CUDA "
            "by events on its stream)", ["rank"], registry=r)
            for kind, what in (("load", "host to device"), ("offload", "device to host"))}
        self.host_kv_copies = {kind: Counter(
            f"pdd_host_kv_{kind}_copies", f"Copies the host tier issued ({what}; one per run of "
            "slots and blocks consecutive on both sides)", ["rank"], registry=r)
            for kind, what in (("load", "host to device"), ("offload", "device to host"))}
        self.warmup_seconds = Gauge(
            "pdd_warmup_seconds", "Warm-up before ready: compilation, CUDA graphs", registry=r
        )
        self.gc_pause_seconds = Histogram(
            "pdd_gc_pause_seconds", "Garbage-collector pauses of the instance's leader process "
            "(every thread waits), by generation", ["generation"], buckets=_GC_BUCKETS,
            registry=r,
        )
        self.gc_pauses = PauseTimer(self.gc_pause_seconds)  # installed by the process's main
        self.overtaking_steps = Counter(
            "pdd_overtaking_steps",
            "Prefill steps run ahead of device work queued before them (a high-priority CUDA "
            "stream); waited: held back for queued work that may write one of their blocks",
            ["waited"], registry=r,
        )
        # Speculative decoding (a decode that drafts, engine/speculative/), in vLLM's terms:
        # acceptance = accepted / draft tokens, mean accepted length = 1 + accepted / drafts.
        self.spec_drafts = Counter(
            "pdd_spec_decode_num_drafts", "Verify steps of a sequence that drafted tokens",
            registry=r)
        self.spec_draft_tokens = Counter(
            "pdd_spec_decode_num_draft_tokens", "Tokens drafted", registry=r)
        self.spec_accepted_tokens = Counter(
            "pdd_spec_decode_num_accepted_tokens", "Drafted tokens kept (equal to the target's "
            "own draw)", registry=r)
        self.spec_accepted_per_pos = Counter(
            "pdd_spec_decode_num_accepted_tokens_per_pos", "Drafted tokens kept, by position "
            "in the draft (0: the first)", ["position"], registry=r)
        self.spec_skipped = Counter(
            "pdd_spec_decode_skipped", "Sequence-steps that drafted nothing, by reason: batch "
            "(more running than the threshold), acceptance (recently too low), no_match (no "
            "earlier occurrence of the text's ending), room (max_tokens reached next), prefill "
            "(a step that also prefilled a prompt on this decode verifies nothing)",
            ["reason"], registry=r)
        self.spec_draft_state_missing = Counter(
            "pdd_spec_decode_draft_state_missing", "Sequences pulled from a prefill that sent "
            "no MTP draft state: their first step drafted nothing (engine/speculative/"
            "mtp_served.py)", registry=r)
        self.trace_plans_dropped = Counter(
            "pdd_trace_plans_dropped", "Requests' span plans dropped because the exporting "
            "child was too far behind (their spans are missing from the traces)", registry=r)
        tracing.on_dropped(self.trace_plans_dropped.inc)

    def host_kv_copied(self, kind: str, rank: int, copied: dict[str, float]) -> None:
        """One rank's finished host-tier copies of ``kind`` (bytes, seconds)."""
        self.host_kv_bytes[kind].labels(rank=str(rank)).inc(copied.get("bytes", 0))
        self.host_kv_seconds[kind].labels(rank=str(rank)).inc(copied.get("seconds", 0.0))
        self.host_kv_copies[kind].labels(rank=str(rank)).inc(copied.get("copies", 0))

    def expose(self) -> bytes:
        self.gc_pauses.flush()
        return generate_latest(self.registry)


class RouterMetrics:
    def __init__(self) -> None:
        # As prometheus_client itself decides, once: a worker's env is set before it starts.
        self.multiprocess = bool(os.environ.get(MULTIPROC_DIR))
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdd_router_requests", "Completions requests", ["outcome"], registry=r
        )
        # Where each routed request's prompt was prefilled (serve/router/prefill_path.py):
        # remote_prefill, local_prefill (a short uncached part, on its decode) or fallback (no
        # prefill was ready). Counted apart from pdd_router_requests so that its series keep
        # their labels.
        self.paths = Counter(
            "pdd_router_request_paths", "Routed requests by where their prompt was prefilled",
            ["path"], registry=r,
        )
        self.request_seconds = Histogram(
            "pdd_router_request_seconds", "Completions latency", buckets=_SECONDS, registry=r
        )
        self.ttft_seconds = Histogram(
            "pdd_router_ttft_seconds", "Time to the first token of a completion",
            buckets=_SECONDS, registry=r,
        )
        self.tpot_seconds = Histogram(
            "pdd_router_tpot_seconds", "Time per output token after the first (per request)",
            buckets=_SECONDS, registry=r,
        )
        self.gc_pause_seconds = Histogram(
            "pdd_router_gc_pause_seconds", "Garbage-collector pauses of the router (its loop "
            "waits), by generation", ["generation"], buckets=_GC_BUCKETS, registry=r,
        )
        self.gc_pauses = PauseTimer(self.gc_pause_seconds)  # installed by the app's lifecycle
        # Across workers: what the latest probe of any of them said, the longest warm-up.
        self.healthy = Gauge(
            "pdd_router_replica_healthy", "1 if the replica answered /readyz",
            ["role", "replica"], registry=r, multiprocess_mode="mostrecent",
        )
        # The decision's threshold (spec.router.localPrefillTokens), beside the paths it splits.
        self.local_prefill_tokens = Gauge(
            "pdd_router_local_prefill_tokens", "Uncached prompt tokens up to which a request "
            "is prefilled on its decode (0: always through a prefill)",
            registry=r, multiprocess_mode="max",
        )
        self.warmup_seconds = Gauge(
            "pdd_router_warmup_seconds", "The warm round trip (prefill -> decode) before ready",
            registry=r, multiprocess_mode="max",
        )
        self.trace_plans_dropped = Counter(
            "pdd_router_trace_plans_dropped", "Routing decisions' span plans dropped because "
            "the exporting child was too far behind (missing from the traces)", registry=r)
        tracing.on_dropped(self.trace_plans_dropped.inc)

    def expose(self, openmetrics: bool = False) -> bytes:
        """The text format, or OpenMetrics (with the TTFT's exemplars: the trace ids of sampled
        requests, which a dashboard links to their traces; one process only, prometheus_client
        keeps none in multiprocess mode)."""
        self.gc_pauses.flush()
        generate = generate_openmetrics if openmetrics else generate_latest
        if not self.multiprocess:
            return generate(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged)
        return generate(merged)
