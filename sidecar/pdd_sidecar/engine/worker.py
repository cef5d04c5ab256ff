"""What one rank of an instance owns, and how it executes rank 0's step commands.

Rank 0 serves HTTP; ranks 1..tp-1 are forked children. Model collectives need every rank to run
the same batch in the same order, so rank 0's driver is the only source of work: it broadcasts a
step over a gloo control group, every rank executes it, and small per-rank results come back to
rank 0. Rank 0 alone allocates blocks and samples tokens; the commands carry block tables and the
tokens to feed, so nothing else has to agree.

Each rank owns its KV cache, one NIXL agent with the cache registered, a side channel on
PDD_SIDE_CHANNEL_PORT + rank and, on a decode, a pull thread: KV READs run there, beside the
forward passes, so a request waiting for its KV never stalls the running batch.

The ranks of one instance may span the pods of a LeaderWorkerSet group: they meet at the leader
pod, and at that rendezvous every rank learns every rank's side-channel endpoint and rank 0's
instance id, so the leader can tell decodes where each of its ranks is read from.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import random
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from pdd_api.plan import RoutingPlan
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.env import InstanceSettings
from pdd_sidecar.kv.claims import CLAIM_MARGIN_S, ClaimRefused, claim
from pdd_sidecar.kv.compat import CompatError, CompatRecord, cache_layout, plan_digest
from pdd_sidecar.kv.grants import GRANT_MARGIN_S, load_key
from pdd_sidecar.kv.lease import notif_message, parse_notif
from pdd_sidecar.kv.side_channel import PeerInfo, SideChannelServer, handshake, publication
from pdd_sidecar.kv.transfer import KVTransferAgent, ReadStats, TransferError, plan_read_specs

log = logging.getLogger(__name__)

PULL_THREADS = 8


class RequestError(RuntimeError):
    """A request failed on this instance; `status` is the HTTP code to answer with."""

    def __init__(self, message: str, status: int = 500, kind: str = "error",
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.retry_after = retry_after

    def to_dict(self) -> dict[str, Any]:
        return {"error": str(self), "status": self.status, "kind": self.kind}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestError:
        return cls(str(d.get("error")), int(d.get("status", 500)), str(d.get("kind", "error")))


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


class Lockstep:
    """Rank 0 broadcasts a command, every rank runs it, results come back to rank 0."""

    def __init__(self, rank: int, tp: int) -> None:
        self.rank = rank
        self.tp = tp
        self.group: Any = None
        if tp > 1:
            import torch.distributed as dist

            self.dist = dist
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))

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
class Source:
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
    rank_endpoints: list[tuple[str, int]] | None = None  # an instance spanning pods names each

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        """The side channel of each prefill rank."""
        if self.rank_endpoints is not None:
            return self.rank_endpoints
        return [(self.host, self.side_channel_port + p) for p in range(self.tp)]

    @classmethod
    def parse(cls, params: Any) -> Source:
        if not isinstance(params, dict):
            raise RequestError("kv_transfer_params: must be an object", 400, "invalid_request")
        try:
            src = cls(
                host=str(params["host"]),
                side_channel_port=_int(params["side_channel_port"]),
                instance_id=str(params["instance_id"]),
                tp=_int(params["tp"]),
                dcp=_int(params["dcp"]),
                block_size=_int(params["block_size"]),
                block_ids=[_int(b) for b in params["block_ids"]],
                num_tokens=_int(params["num_tokens"]),
                plan_digest=str(params.get("plan_digest", "")),
            )
            if params.get("rank_endpoints") is not None:
                src.rank_endpoints = parse_endpoints(params["rank_endpoints"], src.tp)
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestError(f"kv_transfer_params: malformed: {exc!r}", 400,
                               "invalid_request") from None
        if (src.num_tokens < 1 or not 0 < src.side_channel_port < 65536 or src.tp < 1
                or src.dcp < 1 or src.block_size < 1):
            raise RequestError("kv_transfer_params: num_tokens, tp, dcp, block_size and "
                               "side_channel_port must be positive", 400, "invalid_request")
        epoch = params.get("epoch")
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise RequestError(f"kv_transfer_params: epoch must be an integer, got "
                               f"{type(epoch).__name__}", 400, "invalid_request")
        # Even a grant that verifies is checked for shape: the plan indexes these ids.
        chunks = -(-src.num_tokens // src.block_size)
        per_rank = -(-chunks // src.dcp)
        if len(src.block_ids) < per_rank or any(b < 0 for b in src.block_ids):
            raise RequestError(f"kv_transfer_params: {src.num_tokens} tokens in blocks of "
                               f"{src.block_size} over dcp {src.dcp} need {per_rank} block ids "
                               f">= 0 per rank, got {len(src.block_ids)}", 400,
                               "invalid_request")
        return src

    @property
    def label(self) -> str:
        return f"prefill instance {self.host}:{self.side_channel_port}"


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def parse_endpoints(value: Any, tp: int) -> list[tuple[str, int]]:
    """``[[host, port], ...]``, one per rank, as a prefill's info and grants list them."""
    if not isinstance(value, list) or len(value) != tp:
        raise ValueError(f"rank_endpoints: must list {tp} [host, port] pairs, got {value!r}")
    out = []
    for item in value:
        if (not isinstance(item, list | tuple) or len(item) != 2 or not isinstance(item[0], str)
                or not item[0] or not 0 < _int(item[1]) < 65536):
            raise ValueError(f"rank_endpoints: {item!r} is no [host, port] pair")
        out.append((item[0], int(item[1])))
    return out


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
        s = settings
        local = rank - s.local_ranks.start  # this rank's GPU in its pod
        # Resolved here, after the fork: asking CUDA in the parent first would break the children.
        cuda = s.device == "cuda" or (
            s.device == "auto" and torch.cuda.is_available()
            and torch.cuda.device_count() >= s.ranks_per_pod
        )
        if not cuda:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // s.ranks_per_pod))
        device = f"cuda:{local}" if cuda else "cpu"
        if cuda:
            torch.cuda.set_device(local)
        if s.tp > 1:
            import torch.distributed as dist

            dist.init_process_group(
                "nccl" if cuda else "gloo",
                init_method=f"tcp://{s.rendezvous_host}:{s.dist_port}",
                rank=rank,
                world_size=s.tp,
                timeout=datetime.timedelta(minutes=10),
            )
            comm: Any = TorchDistComm()
        else:
            comm = SingleComm()
        self.lockstep = Lockstep(rank, s.tp)
        # Rank 0's id names the instance on every pod; each rank's side channel is where its pod
        # is reached (the leader lists them for decodes). Ports follow the global rank, as in
        # one pod, so every pod of a group declares the same ports.
        side_port = s.side_channel_port + rank
        met = self.lockstep.all_gather((instance_id, s.pod_ip, side_port))
        instance_id = str(met[0][0])
        self.instance_id = instance_id
        self.endpoints: list[tuple[str, int]] = [(str(h), int(p)) for _, h, p in met]
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
        self.key = load_key(s.grant_key_file)
        self.side = SideChannelServer(
            s.bind_host,
            side_port,
            publication(
                role=s.role, rank=rank, tp=s.tp, dcp=s.dcp, instance_id=instance_id,
                agent_name=self.agent_name, metadata=self.agent.metadata(),
                region=self.agent.region, compat=self.compat,
            ),
            self.key,
        )
        self.peer_instances: dict[str, str] = {}  # side-channel key -> instance id
        self.who = f"{s.role} {s.replica} rank {rank}"
        self.logits: Any = None  # rank 0: the last step's logits, sampled by the driver
        self._connect_lock = threading.Lock()
        self._pulls: queue.Queue[dict[str, Any]] = queue.Queue()
        self._pulled: list[tuple[str, dict[str, Any] | None, dict[str, Any]]] = []
        self._pulled_lock = threading.Lock()
        if s.role == "decode":  # a few, so one slow hand-off does not hold up the others
            for i in range(PULL_THREADS):
                threading.Thread(target=self._pull_loop, name=f"kv-pull-{i}",
                                 daemon=True).start()

    # -- command dispatch

    def execute(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        try:
            if op == "step":
                out: dict[str, Any] = self._step(cmd)
            elif op == "handshake":
                out = self._handshake(cmd)
            elif op == "warmup":
                self.engine.warm_up(cmd["blocks"], cmd["prompt_tokens"], cmd["chunk_tokens"],
                                    cmd["batch_sizes"], want_logits=self.rank == 0)
                out = {}
            elif op in ("stats", "shutdown"):
                out = {}
            else:
                out = {"error": f"unknown op {op!r}", "status": 400}
        except RequestError as exc:
            out = exc.to_dict()
        except Exception as exc:  # a rank must answer the gather, or rank 0 hangs
            log.error("%s: %s failed: %s", self.who, op, traceback.format_exc())
            out = {"error": f"{self.who}: {type(exc).__name__}: {exc}", "status": 500}
        return out

    def run_as_leader(self, cmd: dict[str, Any]) -> list[Any]:
        self.lockstep.send(cmd)
        return self.lockstep.gather(self.execute(cmd))

    def follow(self) -> None:
        while True:
            cmd = self.lockstep.receive()
            self.lockstep.gather(self.execute(cmd))
            if cmd["op"] == "shutdown":
                return

    # -- the step

    def _step(self, cmd: dict[str, Any]) -> dict[str, Any]:
        for job in cmd.get("pulls", ()):
            self._pulls.put(job)
        out: dict[str, Any] = {}
        chunks = [SeqChunk(tokens, start, blocks) for tokens, start, blocks in cmd["chunks"]]
        self.logits = None
        if chunks:
            self.logits = self.engine.step(chunks, want_logits=self.rank == 0)
        if cmd.get("poll"):
            out["notified"] = [rid for m in self.agent.poll_notifs()
                               if (rid := parse_notif(m)) is not None]
        with self._pulled_lock:
            if self._pulled:
                out["pulled"], self._pulled = self._pulled, []
        return out

    # -- decode: pulling KV from a prefill, beside the running batch

    def _pull_loop(self) -> None:
        while True:
            job = self._pulls.get()
            try:
                error, stats = self._pull(job)
            except Exception as exc:  # this thread serves every later pull: it must outlive one
                log.error("%s: pull failed: %s", self.who, traceback.format_exc())
                error, stats = {"error": f"{self.who}: hand-off failed: {exc}", "status": 500,
                                "kind": "transfer"}, {}
            with self._pulled_lock:
                self._pulled.append((job["id"], error, stats))

    def _pull(self, job: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        s = self.settings
        src = Source.parse(job["source"])
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
            peers = self._connect(src.endpoints, src.instance_id, src.tp, src.dcp)
            # Claimed last, right before the READ: the prefill pins the blocks for the read's
            # whole time bound, or refuses if they were released or given to another request.
            expires = float(job["source"]["expires_at"])
            if time.time() > expires - GRANT_MARGIN_S:
                raise ClaimRefused(f"the grant of request {job['id']!r} expired before its KV "
                                   f"could be read; no READ was started")
            claim(job["claim_url"], job["source"], s.transfer_timeout_s + CLAIM_MARGIN_S,
                  s.handshake_timeout_s)
            claimed = time.monotonic()
            specs = plan_read_specs(self.plan.reads_of(self.rank), src.num_tokens,
                                    s.block_size, src.dcp, s.dcp, src.block_ids, job["blocks"])
            stats = self.agent.read(
                [(peers[spec.prefill_rank], spec) for spec in specs],
                s.transfer_timeout_s,
                self._fault_gate if s.fault_read_gate else None,
            )
        except CompatError as exc:
            return {"error": str(exc), "status": 409, "kind": "incompatible"}, {}
        except ClaimRefused as exc:
            return {"error": f"{self.who}: {exc}", "status": 410, "kind": "grant_refused"}, {}
        except TransferError as exc:
            self._drop_instance(src.endpoints)
            return {"error": f"{self.who}: {exc}", "status": 502, "kind": "transfer"}, {}
        except Exception as exc:
            log.error("%s: hand-off failed: %s", self.who, traceback.format_exc())
            return {"error": f"{self.who}: hand-off failed: {exc}", "status": 500,
                    "kind": "transfer"}, {}
        for p in self.plan.decode_ranks[self.rank].notifies:
            try:
                # The prefill holds the blocks under the grant's id; a caller may name the
                # decode's request otherwise (its lease would keep them until it ran out).
                self.agent.notify(peers[p], notif_message(str(job["source"]["request_id"])))
            except TransferError as exc:
                log.warning("%s: %s (the prefill lease will free the blocks)", self.who, exc)
        return None, {"bytes": stats.bytes, "descriptors": stats.descriptors,
                      "seconds": stats.seconds, "transfers": stats.transfers,
                      "claim_seconds": claimed - started}

    def _needed_prefill_ranks(self) -> list[int]:
        mine = self.plan.decode_ranks[self.rank]
        return sorted({r.prefill_rank for r in mine.reads} | set(mine.notifies))

    def _connect(self, endpoints: list[tuple[str, int]], instance_id: str | None,
                 tp: int, dcp: int) -> dict[int, Any]:
        with self._connect_lock:
            return self._connect_locked(endpoints, instance_id, tp, dcp)

    def _connect_locked(self, endpoints: list[tuple[str, int]], instance_id: str | None,
                        tp: int, dcp: int) -> dict[int, Any]:
        """Handshake with the prefill ranks this rank reads from or notifies, each at the
        side channel of the pod that holds it."""
        s = self.settings
        peers = {}
        if len(endpoints) != self.plan.prefill.tensor_parallel_size:
            raise CompatError(f"prefill instance {instance_id} lists {len(endpoints)} rank "
                              f"endpoints, the routing plan says tp "
                              f"{self.plan.prefill.tensor_parallel_size}")
        for p in self._needed_prefill_ranks():
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

    def _drop_instance(self, endpoints: list[tuple[str, int]]) -> None:
        with self._connect_lock:
            for host, port in endpoints:
                self._drop(f"{host}:{port}")

    def _handshake(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Readiness probe of one prefill instance: every rank handshakes its peers."""
        error = None
        try:
            tp = int(cmd["tp"])
            endpoints = cmd.get("rank_endpoints")
            if endpoints is None:
                endpoints = [[cmd["host"], int(cmd["side_channel_port"]) + p] for p in range(tp)]
            self._connect(parse_endpoints(endpoints, tp), cmd.get("instance_id"), tp,
                          int(cmd["dcp"]))
        except (KeyError, TypeError, ValueError) as exc:  # every rank must reach the gather
            error = {"error": f"prefill info: malformed: {exc!r}", "status": 502,
                     "kind": "peer_unreachable"}
        except CompatError as exc:
            error = {"error": str(exc), "status": 409, "kind": "incompatible"}
        except TransferError as exc:
            error = {"error": str(exc), "status": 502, "kind": "peer_unreachable"}
        errors = self.lockstep.all_gather(error)
        first = next((e for e in errors if e), None)
        return dict(first) if first else {}
