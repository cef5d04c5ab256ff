"""One prefill or decode instance: `tp` rank processes moving in lockstep behind rank 0.

Rank 0 (this process) serves HTTP; ranks 1..tp-1 are forked children. Model collectives need every
rank to run the same request in the same order, so rank 0's driver thread is the only source of
work: it broadcasts a command over a gloo control group, every rank executes it, and per-rank
results are gathered back to rank 0. Block allocation is deterministic, so the ranks' block
tables agree without being sent around.

Each rank owns its KV cache, one NIXL agent with the cache registered, and a side channel on
PDD_SIDE_CHANNEL_PORT + rank. A dead rank takes the whole instance down (exit 1) so Kubernetes
restarts the pod rather than leaving a half-instance that hangs in collectives.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
import queue
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdd_api.plan import RoutingPlan
from pdd_sidecar.env import InstanceSettings
from pdd_sidecar.kv.compat import CompatError, CompatRecord, cache_layout, plan_digest
from pdd_sidecar.kv.lease import LeaseTable, notif_message, parse_notif
from pdd_sidecar.kv.side_channel import PeerInfo, SideChannelServer, handshake, publication
from pdd_sidecar.kv.transfer import KVTransferAgent, ReadStats, TransferError, plan_read_specs
from pdd_sidecar.metrics import InstanceMetrics

log = logging.getLogger(__name__)


class RequestError(RuntimeError):
    """A request failed on this instance; `status` is the HTTP code to answer with."""

    def __init__(self, message: str, status: int = 500, kind: str = "error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def compat_record(settings: InstanceSettings, plan_text: str, plan: RoutingPlan,
                  num_layers: int, latent_dim: int) -> CompatRecord:
    model = settings.model_name
    if settings.model_source == "builtin":
        model = f"{model}:builtin(seed={settings.model_seed})"
    return CompatRecord(
        model=model,
        dtype=settings.dtype,
        block_size=settings.block_size,
        cache_layout=cache_layout(num_layers, settings.block_size, latent_dim),
        plan_version=plan.version,
        plan_digest=plan_digest(plan_text),
    )


# ---------------------------------------------------------------- control plane between ranks


class Lockstep:
    """Rank 0 broadcasts a command, every rank runs it, results come back to rank 0."""

    def __init__(self, rank: int, tp: int) -> None:
        self.rank = rank
        self.tp = tp
        self.group: Any = None
        if tp > 1:
            import torch.distributed as dist

            self.dist = dist
            self.group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(days=365)
            )

    def receive(self) -> dict[str, Any]:
        box: list[Any] = [None]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def send(self, cmd: dict[str, Any]) -> None:
        if self.tp > 1:
            self.dist.broadcast_object_list([cmd], src=0, group=self.group)

    def gather(self, result: Any) -> list[Any]:
        if self.tp == 1:
            return [result]
        out: list[Any] | None = [None] * self.tp if self.rank == 0 else None
        self.dist.gather_object(result, out, dst=0, group=self.group)
        return out or []

    def all_gather(self, obj: Any) -> list[Any]:
        if self.tp == 1:
            return [obj]
        out: list[Any] = [None] * self.tp
        self.dist.all_gather_object(out, obj, group=self.group)
        return out


@dataclass
class _Source:
    """Where a decode reads from: the prefill instance's transfer parameters."""

    host: str
    side_channel_port: int
    instance_id: str
    tp: int
    dcp: int
    block_size: int
    block_ids: list[int]
    num_tokens: int
    plan_digest: str

    @classmethod
    def parse(cls, params: dict[str, Any]) -> _Source:
        try:
            return cls(
                host=str(params["host"]),
                side_channel_port=int(params["side_channel_port"]),
                instance_id=str(params["instance_id"]),
                tp=int(params["tp"]),
                dcp=int(params["dcp"]),
                block_size=int(params["block_size"]),
                block_ids=[int(b) for b in params["block_ids"]],
                num_tokens=int(params["num_tokens"]),
                plan_digest=str(params.get("plan_digest", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestError(f"malformed kv_transfer_params: {exc!r}", 400) from None

    @property
    def label(self) -> str:
        return f"prefill instance {self.host}:{self.side_channel_port}"


class RankWorker:
    """Everything one rank owns, and the execution of one command on it."""

    def __init__(self, rank: int, settings: InstanceSettings, plan: RoutingPlan,
                 plan_text: str, instance_id: str) -> None:
        import torch

        from pdd_sidecar.engine.comm import SingleComm, TorchDistComm
        from pdd_sidecar.engine.rank_engine import RankEngine, new_cache
        from pdd_sidecar.model.rank_model import load_rank_model

        self.torch = torch
        self.rank = rank
        self.settings = settings
        self.plan = plan
        self.instance_id = instance_id
        s = settings
        # Resolved here, after the fork: asking CUDA in the parent first would break the children.
        cuda = s.device == "cuda" or (
            s.device == "auto" and torch.cuda.is_available() and torch.cuda.device_count() >= s.tp
        )
        if not cuda:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // s.tp))
        device = f"cuda:{rank}" if cuda else "cpu"
        if cuda:
            torch.cuda.set_device(rank)
        if s.tp > 1:
            import torch.distributed as dist

            dist.init_process_group(
                "nccl" if cuda else "gloo",
                init_method=f"tcp://127.0.0.1:{s.dist_port}",
                rank=rank,
                world_size=s.tp,
                timeout=datetime.timedelta(minutes=10),
            )
            comm: Any = TorchDistComm()
        else:
            comm = SingleComm()
        self.lockstep = Lockstep(rank, s.tp)
        self.model = load_rank_model(
            s.model_source, rank, s.tp, s.dtype, device, s.model_seed
        )
        self.cache = new_cache(self.model, s.num_blocks, s.block_size, device)
        self.engine = RankEngine(self.model, self.cache, comm, s.dcp)
        self.compat = compat_record(
            s, plan_text, plan, self.cache.num_layers, self.cache.latent_dim
        )
        self.agent_name = f"{s.role}-{s.replica}-r{rank}-{instance_id}"
        self.agent = KVTransferAgent(self.agent_name, self.cache.kv)
        self.side = SideChannelServer(
            s.bind_host,
            s.side_channel_port + rank,
            publication(
                role=s.role, rank=rank, tp=s.tp, dcp=s.dcp, instance_id=instance_id,
                agent_name=self.agent_name, metadata=self.agent.metadata(),
                region=self.agent.region, compat=self.compat,
            ),
        )
        self.held: dict[str, list[int]] = {}
        self.peer_instances: dict[str, str] = {}  # side-channel key -> instance id
        self.who = f"{s.role} {s.replica} rank {rank}"

    # -- command dispatch

    def execute(self, cmd: dict[str, Any], on_token: Callable[[int], None] | None = None) -> Any:
        op = cmd["op"]
        try:
            if op == "prefill":
                out: dict[str, Any] = self._prefill(cmd)
            elif op == "decode":
                out = self._decode(cmd, on_token)
            elif op == "poll":
                out = self._poll(cmd)
            elif op == "handshake":
                out = self._handshake(cmd)
            elif op == "stats":
                out = {}
            elif op == "shutdown":
                out = {}
            else:
                out = {"error": f"unknown op {op!r}", "status": 400}
        except RequestError as exc:
            out = {"error": str(exc), "status": exc.status, "kind": exc.kind}
        except Exception as exc:  # a rank must answer the gather, or rank 0 hangs
            log.error("%s: %s failed: %s", self.who, op, traceback.format_exc())
            out = {"error": f"{self.who}: {type(exc).__name__}: {exc}", "status": 500}
        out["free"] = self.cache.num_free
        out["held"] = len(self.held)
        return out

    def run_as_leader(self, cmd: dict[str, Any],
                      on_token: Callable[[int], None] | None = None) -> list[Any]:
        self.lockstep.send(cmd)
        return self.lockstep.gather(self.execute(cmd, on_token))

    def follow(self) -> None:
        while True:
            cmd = self.lockstep.receive()
            self.lockstep.gather(self.execute(cmd))
            if cmd["op"] == "shutdown":
                return

    # -- prefill

    def _prefill(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from pdd_sidecar.engine.rank_engine import allocate_request
        from pdd_sidecar.kv.cache import KVCacheFullError

        rid, tokens = cmd["id"], cmd["tokens"]
        if rid in self.held:
            raise RequestError(f"request {rid} already holds blocks", 409)
        try:
            ids = allocate_request(self.cache, len(tokens), self.settings.dcp)
        except KVCacheFullError as exc:
            raise RequestError(str(exc), 503, "cache_full") from None
        try:
            logits = self.engine.prefill(tokens, ids)
        except Exception:
            self.cache.free(ids)
            raise
        self.held[rid] = ids
        return {"first_token": int(self.torch.argmax(logits)), "block_ids": ids}

    def _poll(self, cmd: dict[str, Any]) -> dict[str, Any]:
        for rid in cmd.get("free", []):
            ids = self.held.pop(rid, None)
            if ids is not None:
                self.cache.free(ids)
        notified = []
        for message in self.agent.poll_notifs():
            rid = parse_notif(message)
            if rid is not None:
                notified.append(rid)
        return {"notified": notified}

    # -- decode

    def _needed_prefill_ranks(self) -> list[int]:
        mine = self.plan.decode_ranks[self.rank]
        return sorted({r.prefill_rank for r in mine.reads} | set(mine.notifies))

    def _connect(self, host: str, base_port: int, instance_id: str | None,
                 tp: int, dcp: int) -> dict[int, Any]:
        """Handshake with the prefill ranks this rank reads from or notifies."""
        s = self.settings
        peers = {}
        for p in self._needed_prefill_ranks():
            key = f"{host}:{base_port + p}"
            known = self.peer_instances.get(key)
            if known is not None and (instance_id is None or known == instance_id):
                peers[p] = self.agent.peers[key]
                continue
            if known is not None:
                log.info("%s: %s restarted (%s -> %s); handshaking again", self.who, key,
                         known, instance_id)
                self._drop(key)
            info: PeerInfo = handshake(host, base_port + p, self.compat, self.who,
                                       s.handshake_timeout_s)
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
                raise TransferError(
                    f"peer {key}: instance {info.instance_id} is not the one that ran the "
                    f"prefill ({instance_id}); it restarted and the KV is gone"
                )
            try:
                peers[p] = self.agent.connect(key, info.metadata, info.region)
            except TransferError:
                raise
            except Exception as exc:
                raise TransferError(f"peer {key}: loading NIXL metadata failed: {exc}") from exc
            self.peer_instances[key] = info.instance_id
        return peers

    def _fault_gate(self) -> None:
        gate = self.settings.fault_read_gate
        with open(f"{gate}.reached.{self.rank}", "w"):
            pass
        deadline = time.monotonic() + self.settings.transfer_timeout_s
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _drop(self, key: str) -> None:
        self.peer_instances.pop(key, None)
        self.agent.disconnect(key)

    def _drop_instance(self, host: str, base_port: int) -> None:
        for p in range(self.plan.prefill.tensor_parallel_size):
            self._drop(f"{host}:{base_port + p}")

    def _handshake(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Readiness probe of one prefill instance: every rank handshakes its peers."""
        error = None
        try:
            self._connect(cmd["host"], int(cmd["side_channel_port"]), cmd.get("instance_id"),
                          int(cmd["tp"]), int(cmd["dcp"]))
        except CompatError as exc:
            error = {"error": str(exc), "status": 409, "kind": "incompatible"}
        except TransferError as exc:
            error = {"error": str(exc), "status": 502, "kind": "peer_unreachable"}
        errors = self.lockstep.all_gather(error)
        first = next((e for e in errors if e), None)
        return dict(first) if first else {}

    def _decode(self, cmd: dict[str, Any],
                on_token: Callable[[int], None] | None) -> dict[str, Any]:
        from pdd_sidecar.engine.rank_engine import allocate_request
        from pdd_sidecar.kv.cache import KVCacheFullError

        s = self.settings
        src = _Source.parse(cmd["source"])
        rid, max_new, first = cmd["id"], int(cmd["max_new"]), int(cmd["first_token"])
        try:
            ids = allocate_request(self.cache, src.num_tokens + max_new, s.dcp)
        except KVCacheFullError as exc:
            raise RequestError(str(exc), 503, "cache_full") from None
        try:
            return self._decode_into(rid, src, ids, first, max_new, on_token)
        finally:
            self.cache.free(ids)

    def _decode_into(self, rid: str, src: _Source, ids: list[int], first: int, max_new: int,
                     on_token: Callable[[int], None] | None) -> dict[str, Any]:
        s = self.settings
        error = None
        stats = ReadStats()
        peers: dict[int, Any] = {}
        try:
            if src.block_size != s.block_size:
                raise CompatError(f"{src.label}: block_size {src.block_size} != local "
                                  f"{s.block_size}")
            if src.plan_digest and src.plan_digest != self.compat.plan_digest:
                raise CompatError(f"{src.label}: plan digest {src.plan_digest} != local "
                                  f"{self.compat.plan_digest} (routing files differ)")
            peers = self._connect(src.host, src.side_channel_port, src.instance_id,
                                  src.tp, src.dcp)
            specs = plan_read_specs(self.plan.reads_of(self.rank), src.num_tokens,
                                    s.block_size, src.dcp, s.dcp, src.block_ids, ids)
            stats = self.agent.read(
                [(peers[spec.prefill_rank], spec) for spec in specs],
                s.transfer_timeout_s,
                self._fault_gate if s.fault_read_gate else None,
            )
        except CompatError as exc:
            error = {"error": str(exc), "status": 409, "kind": "incompatible"}
        except TransferError as exc:
            error = {"error": f"{self.who}: {exc}", "status": 502, "kind": "transfer"}
            self._drop_instance(src.host, src.side_channel_port)
        except Exception as exc:
            log.error("%s: hand-off failed: %s", self.who, traceback.format_exc())
            error = {"error": f"{self.who}: hand-off failed: {exc}", "status": 500,
                     "kind": "transfer"}
        # Every rank must agree before any of them enters the model's collectives.
        errors = self.lockstep.all_gather(error)
        failed = next((e for e in errors if e), None)
        if failed:
            return dict(failed)
        for p in self.plan.decode_ranks[self.rank].notifies:
            try:
                self.agent.notify(peers[p], notif_message(rid))
            except TransferError as exc:
                log.warning("%s: %s (the prefill lease will free the blocks)", self.who, exc)
        out = []
        tok, pos = first, src.num_tokens
        for _ in range(max_new):
            logits = self.engine.decode_step(tok, pos, ids)
            tok = int(self.torch.argmax(logits))
            out.append(tok)
            pos += 1
            if on_token is not None:
                on_token(tok)
        return {
            "tokens": out,
            "transfer": {"bytes": stats.bytes, "descriptors": stats.descriptors,
                         "seconds": stats.seconds, "transfers": stats.transfers},
        }


# ---------------------------------------------------------------- rank 0's driver


class InstanceDriver:
    """Rank 0's single worker thread: runs commands in order, polls notifications, leases."""

    def __init__(self, worker: RankWorker, metrics: InstanceMetrics) -> None:
        self.worker = worker
        self.settings = worker.settings
        self.metrics = metrics
        self.role = self.settings.role
        expected = {p.rank: p.expected_notifications for p in worker.plan.prefill_ranks}
        self.leases = LeaseTable(self.settings.lease_seconds, expected)
        self._free_next: list[str] = []
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="driver", daemon=True)
        self.last_results: list[Any] = []
        self.fatal: str | None = None

    def start(self) -> None:
        self._thread.start()

    def idle(self) -> bool:
        """Nothing queued or running, and no KV held for a decode."""
        return (self._queue.unfinished_tasks == 0 and len(self.leases) == 0
                and not self._free_next)

    def submit(self, cmd: dict[str, Any],
               on_token: Callable[[int], None] | None = None) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self.fatal:
            fut.set_exception(RequestError(self.fatal, 503))
        else:
            self._queue.put((cmd, on_token, fut))
        return fut

    def _run(self, cmd: dict[str, Any], on_token: Callable[[int], None] | None = None) -> list[Any]:
        results = self.worker.run_as_leader(cmd, on_token)
        self.last_results = results
        for rank, r in enumerate(results):
            self.metrics.blocks_free.labels(rank=str(rank)).set(r["free"])
        return results

    def _busy(self) -> bool:
        return self.role == "prefill" and (len(self.leases) > 0 or bool(self._free_next))

    def _loop(self) -> None:
        poll_s = max(self.settings.notif_poll_s, 0.001)
        last_poll = 0.0
        while True:
            try:
                item = self._queue.get(timeout=poll_s if self._busy() else 0.5)
            except queue.Empty:
                item = None
            try:
                if item is not None:
                    cmd, on_token, fut = item
                    try:
                        self._execute(cmd, on_token, fut)
                    finally:
                        self._queue.task_done()
                    if cmd["op"] == "shutdown":
                        return
                now = time.monotonic()
                if self._busy() and now - last_poll >= poll_s:
                    last_poll = now
                    self._poll()
            except Exception:
                # A failed collective means a rank is gone; the instance cannot go on.
                self.fatal = f"instance broken: {traceback.format_exc(limit=1)}"
                log.critical("%s", traceback.format_exc())
                os._exit(1)

    def _execute(self, cmd: dict[str, Any], on_token: Callable[[int], None] | None,
                 fut: concurrent.futures.Future[Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        if cmd["op"] == "release":  # bookkeeping of rank 0 only
            fut.set_result(self._release(cmd["id"]))
            return
        try:
            results = self._run(cmd, on_token)
            self._after(cmd, results)
            fut.set_result(results)
        except BaseException as exc:
            fut.set_exception(exc)
            raise

    def _after(self, cmd: dict[str, Any], results: list[Any]) -> None:
        if cmd["op"] != "prefill":
            return
        if any("error" in r for r in results):
            # Ranks that did allocate give their blocks back at the next poll.
            if any("block_ids" in r for r in results):
                self._free_next.append(cmd["id"])
            return
        self.leases.hold(cmd["id"], results[0]["block_ids"], time.monotonic())
        self.metrics.held_requests.set(len(self.leases))

    def _poll(self) -> None:
        free, self._free_next = self._free_next, []
        results = self._run({"op": "poll", "free": free})
        for rank, r in enumerate(results):
            for rid in r.get("notified", []):
                self.metrics.notifications.labels(rank=str(rank)).inc()
                if self.leases.notified(rid, rank) is not None:
                    self._free_next.append(rid)
        for held in self.leases.expire(time.monotonic()):
            self.metrics.lease_expiries.inc()
            self._free_next.append(held.request_id)
        self.metrics.held_requests.set(len(self.leases))

    def _release(self, request_id: str) -> bool:
        """The router gave up on a request: its blocks go at the next poll."""
        held = self.leases.release(request_id)
        if held is not None:
            self._free_next.append(request_id)
            self.metrics.held_requests.set(len(self.leases))
        return held is not None


def new_instance_id() -> str:
    return uuid.uuid4().hex[:12]
