"""What one rank of an instance owns, and how it executes rank 0's step commands.

Rank 0 serves HTTP; ranks 1..tp-1 are forked children. Model collectives need every rank to run
the same batch in the same order, so rank 0's driver is the only source of work: it broadcasts a
step over a gloo control group, every rank executes it, and small per-rank results come back to
rank 0. Rank 0 alone allocates blocks and samples tokens; the commands carry block tables and the
tokens to feed, so nothing else has to agree.

Each rank owns its KV cache (on a GPU sized from memory at start, every rank agreeing:
engine/memory_probe.py), one NIXL agent with the cache registered, a side channel on
PDD_SIDE_CHANNEL_PORT + rank and, on a decode, a KVPuller (kv/puller.py): KV READs run on its
threads, beside the forward passes, so a request waiting for its KV never stalls the batch.

The ranks of one instance may span the pods of a LeaderWorkerSet group: they meet at the leader
pod, and at that rendezvous every rank learns every rank's side-channel endpoint and rank 0's
instance id, so the leader can tell decodes where each of its ranks is read from.
"""

from __future__ import annotations

import datetime
import logging
import os
import traceback
from typing import TYPE_CHECKING, Any

from pdd_api.plan import RoutingPlan
from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.env import InstanceSettings
from pdd_sidecar.kv.compat import CompatError, CompatRecord, cache_layout, plan_digest
from pdd_sidecar.kv.grants import load_key
from pdd_sidecar.kv.handoff import parse_endpoints
from pdd_sidecar.kv.lease import parse_notif
from pdd_sidecar.kv.puller import KVPuller, PullJob
from pdd_sidecar.kv.side_channel import SideChannelServer, publication
from pdd_sidecar.kv.transfer import KVTransferAgent, TransferError
from pdd_sidecar.kv.transport import local_record

if TYPE_CHECKING:
    from pdd_sidecar.engine.speculative.mtp_served import RankMTP

log = logging.getLogger(__name__)


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
        kv_cache_dtype=settings.kv_cache_dtype,
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


class RankWorker:
    """Everything one rank owns, and the execution of one command on it."""

    def __init__(self, rank: int, settings: InstanceSettings, plan: RoutingPlan,
                 plan_text: str, instance_id: str) -> None:
        import torch

        from pdd_sidecar.engine.comm import SingleComm, TorchDistComm
        from pdd_sidecar.engine.host_tier import RankHostTier
        from pdd_sidecar.engine.memory_probe import oom_error, size_rank_pool
        from pdd_sidecar.engine.rank_engine import RankEngine, new_cache
        from pdd_sidecar.model.mtp import load_mtp_rank_model
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
        # On a GPU a start that runs out of memory says which setting to change, not where.
        dev = torch.device(device)
        free_at_start, total = torch.cuda.mem_get_info(dev) if cuda else (0, 0)
        stage = "loading the weights"
        try:
            self.model = load_rank_model(
                s.model_source, rank, s.tp, s.dtype, device, s.model_seed
            )
            # The MTP module's weights before the pool is sized from what is left
            stage = "loading the MTP module"
            mtp_weights = (load_mtp_rank_model(s.model_source, self.model, s.model_seed)
                           if s.cache_extra_layers else None)
            stage = "running the warm-up on a scratch cache to size the KV pool"
            self.pool = size_rank_pool(self.model, comm, s, dev, rank, self.lockstep.all_gather)
            stage = f"allocating the KV pool ({self.pool.blocks} blocks)"
            self.cache = new_cache(self.model, self.pool.blocks, s.block_size, device,
                                   s.kv_cache_dtype, extra_layers=s.cache_extra_layers)
        except torch.cuda.OutOfMemoryError as exc:
            raise oom_error(stage, dev, free_at_start, total, s) from exc
        if rank == 0:
            log.info("%s %d: %s", s.role, s.replica, self.pool.describe())
        # A decode runs no fresh prompts: nothing of its would overtake; a prefill that runs
        # the MTP module keeps every step's hidden states, in order (no overtaking either).
        self.engine = RankEngine(self.model, self.cache, comm, s.dcp,
                                 overtake=None if s.role == "prefill"
                                 and not s.cache_extra_layers else False,
                                 extra_layers=s.cache_extra_layers)
        # The MTP module beside the model (engine/speculative/mtp_served.py): a decode drafts
        # with it, its prefill fills its latents and the draft state.
        self.mtp: RankMTP | None = None
        if mtp_weights is not None:
            from pdd_sidecar.engine.speculative.mtp import MTPDrafter
            from pdd_sidecar.engine.speculative.mtp_served import RankMTP

            cfg = self.model.config
            self.mtp = RankMTP(MTPDrafter(*mtp_weights, self.cache, comm, s.dcp,
                                          cfg.num_hidden_layers, like=self.engine),
                               cfg.hidden_size)
        self.host_tier = RankHostTier.for_rank(self.cache, self.engine, s)
        self.compat = compat_record(
            s, plan_text, plan, self.cache.num_layers, self.cache.latent_dim
        )
        self.agent_name = f"{s.role}-{s.replica}-r{rank}-{instance_id}"
        # A prefill's rank 0 hears each claim before a READ of its memory, a decode reads and
        # is read by no one: both progress their agent fast only when that may matter. The
        # other prefill ranks hear no claims and keep progressing every millisecond.
        self.agent = KVTransferAgent(self.agent_name, self.cache.kv,
                                     adaptive_progress=s.role == "decode" or rank == 0,
                                     notif_key=parse_notif)
        self.key = load_key(s.grant_key_file)
        self.transport = local_record(self.cache.kv)
        self.side = SideChannelServer(
            s.bind_host,
            side_port,
            publication(
                role=s.role, rank=rank, tp=s.tp, dcp=s.dcp, instance_id=instance_id,
                agent_name=self.agent_name, metadata=self.agent.metadata(),
                region=self.agent.region, compat=self.compat, transport=self.transport,
            ),
            self.key,
        )
        self.who = f"{s.role} {s.replica} rank {rank}"
        self.logits: Any = None  # rank 0: the last step's logits, sampled by the driver
        self.puller = KVPuller(rank=rank, who=self.who, settings=s, plan=plan,
                               compat=self.compat, key=self.key, agent=self.agent,
                               transport=self.transport)
        if s.role == "decode":
            self.puller.start()

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
                if self.mtp is not None:
                    self.mtp.drafter.warm_up(cmd["blocks"], cmd["batch_sizes"])
                out = {}
            elif op == "mtp_draft":
                assert self.mtp is not None
                if cmd.get("copies"):  # a forked choice's own unit, before the module writes it
                    self.cache.copy_blocks(cmd["copies"])
                out = {"drafts": self.mtp.draft(cmd["seqs"])}
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
        tier = cmd.get("tier")
        if tier and self.host_tier is not None:
            self.host_tier.run(tier, before_reads=bool(cmd.get("pulls")))
        copies = cmd.get("copies")
        if copies:  # forked choices' own copy of a shared unit, before anything writes it
            self.cache.copy_blocks(copies)
        for job in cmd.get("pulls", ()):
            self.puller.submit(PullJob.from_command(job))
        out: dict[str, Any] = {}
        if self.host_tier is not None and (copied := self.host_tier.take_stats()):
            out["tier"] = copied
        chunks = [SeqChunk(tokens, start, blocks) for tokens, start, blocks in cmd["chunks"]]
        self.logits = None
        if chunks:
            self.logits = self.engine.step(chunks, want_logits=self.rank == 0,
                                           keep=cmd.get("keep", ()))
            if self.mtp is not None and "mtp_keep" in cmd:
                self.mtp.keep(self.engine.kept, cmd["mtp_keep"])
            if self.mtp is not None and cmd.get("mtp_prefill"):
                self.mtp.prefill(self.engine.kept, cmd["mtp_prefill"])
        if cmd.get("poll"):
            out["notified"] = [rid for m in self.agent.poll_notifs()
                               if (rid := parse_notif(m)) is not None]
        pulled = self.puller.take()
        if pulled:
            out["pulled"] = pulled
        return out

    def _handshake(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Readiness probe of one prefill instance: every rank handshakes its peers."""
        error = None
        try:
            tp = int(cmd["tp"])
            endpoints = cmd.get("rank_endpoints")
            if endpoints is None:
                endpoints = [[cmd["host"], int(cmd["side_channel_port"]) + p] for p in range(tp)]
            self.puller.connect(parse_endpoints(endpoints, tp), cmd.get("instance_id"), tp,
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
