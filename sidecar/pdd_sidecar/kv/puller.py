"""A decode rank's KV pulls: reading a prompt's blocks from a prefill beside the running batch.

Each pull runs on one of a few threads, so one slow hand-off does not hold up the others and a
request waiting for its KV never stalls the forward passes. A pull checks the grant against the
local configuration, handshakes the prefill ranks it needs (once per peer instance, cached),
claims the blocks right before its READ, reads exactly the rows of the chunks the routing plan
gives this rank from the first token the decode's own prefix cache lacks (over NIXL, or as a
device copy from a peer on this host's CUDA devices: kv/transport.py picks the path per peer at
the handshake), and notifies the prefill ranks the plan names, even when it read nothing (the
prefill's lease counts them). Each result is queued for the owner, which collects them with
`take()`; `on_pulled` (set by the owner) is called from the pull thread after each one is
queued, so the owner can wake up instead of polling.

A result's error is a dict naming the HTTP status the decode answers with and the failure kind
(the owner passes it through unchanged): 409 incompatible, 410 grant_refused, 502 transfer (the
peer's connection is dropped, so the next pull handshakes again), 500 anything else; and its
``cause`` as `pdd_kv_handoff_failures_total` counts it (kv/errors.py): incompatible, grant_refused
or lease_expired (the grant ran out before the READ, or the prefill said its lease had), peer_gone
(the prefill unreachable or restarted), transport_error (the READ itself, anything else).
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdd_api.plan import RoutingPlan
from pdd_sidecar.env import InstanceSettings
from pdd_sidecar.kv.claims import CLAIM_MARGIN_S, ClaimRefused, claim
from pdd_sidecar.kv.compat import CompatError, CompatRecord
from pdd_sidecar.kv.device_copy import CopyPlan, DeviceCopier
from pdd_sidecar.kv.errors import (
    INCOMPATIBLE,
    LEASE_EXPIRED,
    PEER_GONE,
    TRANSPORT_ERROR,
)
from pdd_sidecar.kv.grants import GRANT_MARGIN_S
from pdd_sidecar.kv.handoff import TransferParams
from pdd_sidecar.kv.lease import notif_message
from pdd_sidecar.kv.side_channel import PeerInfo, handshake
from pdd_sidecar.kv.transfer import (
    KVTransferAgent,
    PeerGone,
    ReadSpec,
    ReadStats,
    TransferError,
    plan_read_specs,
)
from pdd_sidecar.kv.transport import (
    CUDA_IPC,
    NIXL,
    TransportRecord,
    TransportUnavailable,
    choose_transport,
    describe,
    open_peer_cache,
)

log = logging.getLogger(__name__)

PULL_THREADS = 32

# (decode sequence id, error or None, transfer stats)
Pulled = tuple[str, dict[str, Any] | None, dict[str, Any]]


@dataclass(frozen=True)
class _Reads:
    """One pull's reads by path: (peer, spec) over NIXL, and the planned device copies."""

    nixl: list[tuple[Any, ReadSpec]]
    copies: CopyPlan | None


@dataclass(frozen=True)
class PullJob:
    """One sequence's pull on one rank, as the step command carries it."""

    seq_id: str
    source: TransferParams
    blocks: list[int]  # this decode's block table for the sequence
    claim_url: str
    start_token: int = 0  # tokens before it are in this decode's prefix cache: not read

    @classmethod
    def from_command(cls, job: dict[str, Any]) -> PullJob:
        return cls(job["id"], job["source"], job["blocks"], job["claim_url"],
                   int(job.get("start_token", 0)))


class KVPuller:
    """The pull threads of one decode rank, its cache of handshaken prefill peers and the
    queue of finished pulls."""

    def __init__(self, *, rank: int, who: str, settings: InstanceSettings, plan: RoutingPlan,
                 compat: CompatRecord, key: bytes, agent: KVTransferAgent,
                 transport: TransportRecord | None = None) -> None:
        self.rank = rank
        self.who = who
        self.settings = settings
        self.plan = plan
        self.compat = compat
        self.key = key
        self.agent = agent
        self.transport = transport  # this rank's record; None reads over NIXL only
        self.peer_instances: dict[str, str] = {}  # side-channel key -> instance id
        self.paths: dict[str, str] = {}  # side-channel key -> nixl | cuda_ipc
        self._peer_caches: dict[str, Any] = {}  # side-channel key -> its KV tensor (cuda_ipc)
        # The copies of peers read by cuda_ipc; made up front, so every pull thread can set
        # itself up for it before its first READ.
        self._copier = (DeviceCopier(agent.kv.device)
                        if transport is not None and transport.device_type == "cuda" else None)
        self.on_pulled: Callable[[], None] | None = None
        self._connect_lock = threading.Lock()
        self._jobs: queue.Queue[PullJob] = queue.Queue()
        self._pulled: list[Pulled] = []
        self._pulled_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self, threads: int = PULL_THREADS) -> None:
        for i in range(threads):
            t = threading.Thread(target=self._loop, name=f"kv-pull-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, job: PullJob) -> None:
        self._jobs.put(job)

    def take(self) -> list[Pulled]:
        """The results queued since the last call."""
        with self._pulled_lock:
            out, self._pulled = self._pulled, []
        return out

    # -- the pull threads

    def _loop(self) -> None:
        if self._copier is not None:
            try:
                self._copier.prepare_thread()
            except Exception as exc:  # a READ on this thread would then fail and say why
                log.warning("%s: a pull thread could not set up CUDA: %s", self.who, exc)
        while True:
            job = self._jobs.get()
            try:
                error, stats = self.pull(job)
            except Exception as exc:  # this thread serves every later pull: it must outlive one
                log.error("%s: pull failed: %s", self.who, traceback.format_exc())
                error, stats = {"error": f"{self.who}: hand-off failed: {exc}", "status": 500,
                                "kind": "transfer", "cause": TRANSPORT_ERROR}, {}
            with self._pulled_lock:
                self._pulled.append((job.seq_id, error, stats))
            wake = self.on_pulled
            if wake is not None:
                try:
                    wake()
                except Exception:
                    log.error("%s: on_pulled failed: %s", self.who, traceback.format_exc())

    def pull(self, job: PullJob) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        s = self.settings
        src = job.source
        stats = ReadStats()
        started = claimed = time.monotonic()
        try:
            if src.block_size != s.block_size:
                raise CompatError(f"{src.label}: block_size {src.block_size} != local "
                                  f"{s.block_size}")
            if src.plan_digest and src.plan_digest != self.compat.plan_digest:
                raise CompatError(f"{src.label}: plan digest {src.plan_digest} != local "
                                  f"{self.compat.plan_digest} (routing files differ)")
            if s.fault_pull_delay_s[1]:
                time.sleep(random.uniform(*s.fault_pull_delay_s))
            peers = self.connect(src.endpoints, src.instance_id, src.tp, src.dcp)
            # Claimed last, right before the READ: the prefill pins the blocks for the read's
            # whole time bound, or refuses if they were released or given to another request.
            if time.time() > float(src.expires_at) - GRANT_MARGIN_S:
                raise ClaimRefused(f"the grant of request {job.seq_id!r} expired before its KV "
                                   f"could be read; no READ was started", LEASE_EXPIRED)
            planned: list[_Reads] = []

            def plan() -> None:  # while the claim is away
                specs = plan_read_specs(self.plan.reads_of(self.rank), src.num_tokens,
                                        s.block_size, src.dcp, s.dcp, src.block_ids,
                                        job.blocks, job.start_token)
                planned.append(self._plan_reads(peers, specs))

            claim(job.claim_url, src.to_grant(self.key), s.transfer_timeout_s + CLAIM_MARGIN_S,
                  s.handshake_timeout_s, plan)
            claimed = time.monotonic()
            stats = self._read(planned[0])
        except CompatError as exc:
            return {"error": str(exc), "status": 409, "kind": "incompatible",
                    "cause": INCOMPATIBLE}, {}
        except ClaimRefused as exc:
            return {"error": f"{self.who}: {exc}", "status": 410, "kind": "grant_refused",
                    "cause": exc.cause}, {}
        except TransferError as exc:
            self.drop_instance(src.endpoints)
            return {"error": f"{self.who}: {exc}", "status": 502, "kind": "transfer",
                    "cause": PEER_GONE if isinstance(exc, PeerGone) else TRANSPORT_ERROR}, {}
        except Exception as exc:
            log.error("%s: hand-off failed: %s", self.who, traceback.format_exc())
            return {"error": f"{self.who}: hand-off failed: {exc}", "status": 500,
                    "kind": "transfer", "cause": TRANSPORT_ERROR}, {}
        for p in self.plan.decode_ranks[self.rank].notifies:
            try:
                # The prefill holds the blocks under the grant's id; a caller may name the
                # decode's request otherwise (its lease would keep them until it ran out).
                self.agent.notify(peers[p], notif_message(src.request_id))
            except TransferError as exc:
                log.warning("%s: %s (the prefill lease will free the blocks)", self.who, exc)
        return None, {"bytes": stats.bytes, "descriptors": stats.descriptors,
                      "seconds": stats.seconds, "transfers": stats.transfers,
                      "path": stats.path, "claim_seconds": claimed - started,
                      "device_seconds": stats.device_seconds}

    def _plan_reads(self, peers: dict[int, Any], specs: list[ReadSpec]) -> _Reads:
        """Each spec on its peer's path: NIXL READs, or device copies planned for cuda_ipc."""
        nixl: list[tuple[Any, ReadSpec]] = []
        copies: list[tuple[Any, ReadSpec]] = []
        for spec in specs:
            peer = peers[spec.prefill_rank]
            if self.paths.get(peer.key, NIXL) == CUDA_IPC:
                copies.append((self._peer_caches[peer.key], spec))
            else:
                nixl.append((peer, spec))
        if not copies:
            return _Reads(nixl, None)
        assert self._copier is not None
        return _Reads(nixl, self._copier.plan(self.agent.kv, copies, self.agent.region))

    def _read(self, reads: _Reads) -> ReadStats:
        s = self.settings
        stats = ReadStats(path=CUDA_IPC if reads.copies is not None and not reads.nixl else NIXL)
        if reads.nixl:
            stats = self.agent.read(reads.nixl, s.transfer_timeout_s,
                                    self._fault_gate if s.fault_read_gate else None)
        if reads.copies is not None:
            assert self._copier is not None
            stats.add(self._copier.run(reads.copies))
        return stats

    def _fault_gate(self) -> None:
        """Fault injection (PDD_FAULT_READ_GATE): a test kills the peer mid hand-off."""
        gate = self.settings.fault_read_gate
        with open(f"{gate}.reached.{self.rank}", "w"):
            pass
        deadline = time.monotonic() + self.settings.transfer_timeout_s
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)

    # -- peers

    def needed_prefill_ranks(self) -> list[int]:
        mine = self.plan.decode_ranks[self.rank]
        return sorted({r.prefill_rank for r in mine.reads} | set(mine.notifies))

    def connect(self, endpoints: list[tuple[str, int]], instance_id: str | None,
                tp: int, dcp: int) -> dict[int, Any]:
        """Handshake with the prefill ranks this rank reads from or notifies, each at the
        side channel of the pod that holds it; peers already known are reused."""
        with self._connect_lock:
            return self._connect_locked(endpoints, instance_id, tp, dcp)

    def _connect_locked(self, endpoints: list[tuple[str, int]], instance_id: str | None,
                        tp: int, dcp: int) -> dict[int, Any]:
        s = self.settings
        peers = {}
        if len(endpoints) != self.plan.prefill.tensor_parallel_size:
            raise CompatError(f"prefill instance {instance_id} lists {len(endpoints)} rank "
                              f"endpoints, the routing plan says tp "
                              f"{self.plan.prefill.tensor_parallel_size}")
        for p in self.needed_prefill_ranks():
            host, port = endpoints[p]
            key = f"{host}:{port}"
            known = self.peer_instances.get(key)
            if known is not None and (instance_id is None or known == instance_id):
                peers[p] = self.agent.peers[key]
                continue
            if known is not None:
                log.info("%s: %s restarted (%s -> %s); handshaking again", self.who, key,
                         known, instance_id)
                self._drop(key)
            info: PeerInfo = handshake(host, port, self.compat, self.who,
                                       s.handshake_timeout_s, self.key)
            if info.role != "prefill" or info.rank != p:
                raise CompatError(f"peer {key}: expected prefill rank {p}, "
                                  f"found {info.role} rank {info.rank}")
            want = (self.plan.prefill.tensor_parallel_size,
                    self.plan.prefill.decode_context_parallel_size)
            if (info.tp, info.dcp) != want or (tp, dcp) != want:
                raise CompatError(
                    f"peer {key}: prefill tp/dcp is {info.tp}/{info.dcp}, the routing plan says "
                    f"{want[0]}/{want[1]}"
                )
            if instance_id is not None and info.instance_id != instance_id:
                raise PeerGone(
                    f"peer {key}: instance {info.instance_id} is not the one that ran the "
                    f"prefill ({instance_id}); it restarted and the KV is gone"
                )
            path = self._choose(key, info)
            try:  # NIXL whatever the path: the prefill counts notifications that come over it
                peers[p] = self.agent.connect(key, info.metadata, info.region)
            except TransferError:
                raise
            except Exception as exc:
                raise TransferError(f"peer {key}: loading NIXL metadata failed: {exc}") from exc
            self.peer_instances[key] = info.instance_id
            self.paths[key] = path
        return peers

    def _choose(self, key: str, info: PeerInfo) -> str:
        """The path to read ``info``'s rank by; on cuda_ipc its cache is mapped here."""
        override = self.settings.kv_transport
        if self.transport is None:
            if override == CUDA_IPC:
                raise CompatError(f"peer {key}: PDD_KV_TRANSPORT=cuda_ipc, but this rank "
                                  f"publishes no transport record")
            return NIXL
        try:
            path = choose_transport(self.transport, info.transport, override)
        except TransportUnavailable as exc:
            raise TransportUnavailable(f"peer {key}: {exc}") from None
        if path == CUDA_IPC:
            assert info.transport is not None
            try:
                self._peer_caches[key] = open_peer_cache(info.transport, self.agent.kv.device)
            except Exception as exc:
                if override == CUDA_IPC:
                    raise CompatError(f"peer {key}: PDD_KV_TRANSPORT=cuda_ipc, but opening "
                                      f"its CUDA IPC handle failed: {exc}") from exc
                log.warning("%s: %s: CUDA IPC handle failed to open (%s); reading over NIXL",
                            self.who, key, exc)
                path = NIXL
        log.info("%s reads prefill rank %d at %s via %s (%s)", self.who, info.rank, key, path,
                 describe(path, self.transport, info.transport))
        return path

    def _drop(self, key: str) -> None:
        self.peer_instances.pop(key, None)
        self.paths.pop(key, None)
        self._peer_caches.pop(key, None)
        self.agent.disconnect(key)

    def drop_instance(self, endpoints: list[tuple[str, int]]) -> None:
        with self._connect_lock:
            for host, port in endpoints:
                self._drop(f"{host}:{port}")
