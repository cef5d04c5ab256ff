"""KV hand-off over NIXL: one agent per rank, READs of exactly the chunks the plan assigns.

Cost model (measured, docs/architecture.md "Transfer"): per-request descriptor preparation
dominates, so every block range a request can need is prepared once per agent (and once per
remote agent), and a request picks entries by index. The prepared list holds, for each power of
two s up to a cap, one descriptor per starting block covering s consecutive blocks; a coalesced
run of n blocks then costs popcount(n) descriptors instead of n. The KV tensor is block-major,
so consecutive block ids are one contiguous byte range.

A chunk read only in part moves only its rows: the prompt's partial last chunk (its filled
tokens), and the first chunk when the decode holds its start already (a prefix-cache tail it
adopted). Such a block is read row range by row range (one descriptor per layer) through a small
unprepared transfer, so the bytes moved equal the plan's minimum exactly.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_MAX_LEVELS = 12  # runs of up to 2**11 blocks in one descriptor

# An agent still open at interpreter exit aborts the process from NIXL's destructor
# ("terminate called without an active exception"), so whatever is left gets closed first.
_OPEN_AGENTS: weakref.WeakSet[KVTransferAgent] = weakref.WeakSet()


@atexit.register
def _close_open_agents() -> None:
    for agent in list(_OPEN_AGENTS):
        agent.close()


class TransferError(RuntimeError):
    """A hand-off failed; the message names the peer."""


class PeerGone(TransferError):
    """The peer is not there any more: unreachable, or restarted (its KV went with it)."""


FAST_PROGRESS_S = 0.001
IDLE_PROGRESS_S = 0.02
LINGER_S = 0.05  # fast this long after the agent's own READs and notifications


class ProgressPace:
    """How often an agent's progress thread runs: every millisecond while a peer may need it
    (a claimed READ not yet notified done, this agent's own transfers just now), every
    ``idle_s`` otherwise.

    Each run takes the GIL from whatever Python the process is running: beside a prefill step
    that launches its kernels from Python, 1 ms progress cost 107-162 thread switches and
    ~2-4 ms of a 40-60 ms step on an H200 host (docs/serving.md, runs 14-15). A target needs to
    progress while its memory is read (UCX over TCP or shared-memory rendezvous moves data
    only when it does) and to answer a new connection; both follow a claim, which says a READ
    is coming. Without ``adaptive`` it is always fast (a rank that sees no claims)."""

    def __init__(self, adaptive: bool, fast_s: float = FAST_PROGRESS_S,
                 idle_s: float = IDLE_PROGRESS_S) -> None:
        self.adaptive = adaptive
        self.fast_s = fast_s
        self.idle_s = idle_s
        self._busy_until = 0.0
        # READs claimed and not yet notified done: key -> [how many, until when at most]. Each
        # decode rank claims before it reads; a rank that notifies another prefill rank leaves
        # its count here until the claim's pin runs out (fast longer, never too slow).
        self._expected: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def _idle(self, now: float) -> bool:
        return self.adaptive and self._busy_until <= now and not self._expected

    def kick(self, now: float, seconds: float = LINGER_S) -> bool:
        """Fast for ``seconds``; whether it was idle (the thread should be woken)."""
        with self._lock:
            idle = self._idle(now)
            self._busy_until = max(self._busy_until, now + seconds)
        return idle

    def expect(self, key: str, now: float, seconds: float) -> bool:
        """A READ of this agent's memory is coming (a claim, pinned for ``seconds``); whether
        it was idle."""
        with self._lock:
            idle = self._idle(now)
            entry = self._expected.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] = max(entry[1], now + seconds)
        return idle

    def settle(self, key: str | None) -> None:
        """One of its readers said it is done (a notification)."""
        if key is None:
            return
        with self._lock:
            entry = self._expected.get(key)
            if entry is not None:
                entry[0] -= 1
                if entry[0] <= 0:
                    del self._expected[key]

    def interval(self, now: float) -> float:
        if not self.adaptive:
            return self.fast_s
        with self._lock:
            for key in [k for k, (_, until) in self._expected.items() if until <= now]:
                del self._expected[key]
            busy = self._busy_until > now or bool(self._expected)
        return self.fast_s if busy else self.idle_s


@dataclass(frozen=True)
class RegionInfo:
    """Where a rank's KV cache lives and how it is laid out; published on the side channel."""

    addr: int
    num_blocks: int
    num_layers: int
    block_size: int
    row_bytes: int  # one token of one layer
    mem_type: str  # DRAM | VRAM
    device_id: int

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.block_size * self.row_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RegionInfo:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})

    @classmethod
    def of_tensor(cls, kv: Any) -> RegionInfo:
        """kv: [num_blocks, num_layers, block_size, latent], contiguous."""
        if not kv.is_contiguous() or kv.dim() != 4:
            raise ValueError(f"KV cache must be a contiguous 4-d tensor, got {tuple(kv.shape)}")
        nb, layers, bs, latent = kv.shape
        device_id = kv.get_device()
        return cls(
            addr=kv.data_ptr(),
            num_blocks=nb,
            num_layers=layers,
            block_size=bs,
            row_bytes=latent * kv.element_size(),
            mem_type="DRAM" if device_id < 0 else "VRAM",
            device_id=max(device_id, 0),
        )


# ---------------------------------------------------------------- pure descriptor arithmetic


@dataclass(frozen=True)
class Run:
    """n consecutive blocks from remote_start onto local_start."""

    remote_start: int
    local_start: int
    n: int


@dataclass(frozen=True)
class Rows:
    """Rows [lo, hi) of one block: a chunk read in part. A chunk's rows are its tokens'
    offsets in it, the same in the prefill's block and the decode's whatever either's DCP."""

    remote_block: int
    local_block: int
    lo: int
    hi: int

    @property
    def n(self) -> int:
        return self.hi - self.lo


@dataclass
class ReadSpec:
    """Everything one decode rank reads from one prefill rank for one request."""

    prefill_rank: int
    runs: list[Run] = field(default_factory=list)
    partials: list[Rows] = field(default_factory=list)  # at most the first and the last chunk
    chunks: list[int] = field(default_factory=list)

    @property
    def full_blocks(self) -> int:
        return sum(r.n for r in self.runs)

    @property
    def empty(self) -> bool:
        """Nothing to read from this prefill rank (the plan's chunks are all cached here)."""
        return not self.runs and not self.partials


def coalesce(pairs: Iterable[tuple[int, int]]) -> list[Run]:
    """(remote, local) block pairs in chunk order -> maximal runs consecutive on both sides."""
    runs: list[Run] = []
    for remote, local in pairs:
        if runs:
            last = runs[-1]
            if remote == last.remote_start + last.n and local == last.local_start + last.n:
                runs[-1] = Run(last.remote_start, last.local_start, last.n + 1)
                continue
        runs.append(Run(remote, local, 1))
    return runs


def pow2_pieces(n: int, max_levels: int) -> list[tuple[int, int]]:
    """Split n blocks into (offset, level) pieces of 2**level blocks, largest first."""
    pieces: list[tuple[int, int]] = []
    offset = 0
    top = max_levels - 1
    while n > 0:
        level = min(n.bit_length() - 1, top)
        pieces.append((offset, level))
        offset += 1 << level
        n -= 1 << level
    return pieces


def plan_read_specs(
    reads: Sequence[Any],
    num_tokens: int,
    block_size: int,
    prefill_dcp: int,
    decode_dcp: int,
    prefill_blocks: Sequence[int],
    decode_blocks: Sequence[int],
    start_token: int = 0,
) -> list[ReadSpec]:
    """Chunk g of the plan's reads: prefill block table[g // dcpP] -> decode table[g // dcpD].

    `reads` are the plan's ChunkRead entries for one decode rank (prefill_rank, chunk_modulus,
    chunk_residue); one ReadSpec per entry, in plan order, even when it covers no chunk.
    Tokens before `start_token` are left out: the decode has their KV already (its own prefix
    cache), so only the rest moves, from the middle of a chunk when it starts there.
    """
    if start_token < 0:
        raise ValueError(f"start_token must be >= 0, got {start_token}")
    num_chunks = -(-num_tokens // block_size)
    first_chunk = start_token // block_size
    specs = []
    for read in reads:
        spec = ReadSpec(prefill_rank=read.prefill_rank)
        pairs = []
        start = read.chunk_residue
        if first_chunk > start:
            start += -(-(first_chunk - start) // read.chunk_modulus) * read.chunk_modulus
        for g in range(start, num_chunks, read.chunk_modulus):
            lo = max(start_token - g * block_size, 0)
            hi = min(num_tokens - g * block_size, block_size)
            if lo >= hi:
                continue
            spec.chunks.append(g)
            remote = prefill_blocks[g // prefill_dcp]
            local = decode_blocks[g // decode_dcp]
            if hi - lo < block_size:
                spec.partials.append(Rows(remote, local, lo, hi))
            else:
                pairs.append((remote, local))
        spec.runs = coalesce(pairs)
        specs.append(spec)
    return specs


class PreppedBlocks:
    """Index arithmetic of a prepared list: level k, start block i -> descriptor index."""

    def __init__(self, num_blocks: int, max_levels: int = DEFAULT_MAX_LEVELS) -> None:
        self.num_blocks = num_blocks
        self.levels = max(1, min(max_levels, num_blocks.bit_length()))
        self.offsets = [0]
        for k in range(self.levels):
            self.offsets.append(self.offsets[-1] + num_blocks - (1 << k) + 1)

    def __len__(self) -> int:
        return self.offsets[-1]

    def index(self, level: int, start: int) -> int:
        return self.offsets[level] + start

    def descriptors(self, region: RegionInfo) -> np.ndarray:
        """Nx3 (addr, len, device) rows in index order."""
        bpb = region.bytes_per_block
        rows = []
        for k in range(self.levels):
            count = self.num_blocks - (1 << k) + 1
            block = np.empty((count, 3), dtype=np.uint64)
            block[:, 0] = region.addr + np.arange(count, dtype=np.uint64) * np.uint64(bpb)
            block[:, 1] = bpb << k
            block[:, 2] = region.device_id
            rows.append(block)
        return np.concatenate(rows)

    def indices(self, runs: Sequence[Run]) -> tuple[list[int], list[int]]:
        local: list[int] = []
        remote: list[int] = []
        for run in runs:
            for offset, level in pow2_pieces(run.n, self.levels):
                local.append(self.index(level, run.local_start + offset))
                remote.append(self.index(level, run.remote_start + offset))
        return local, remote


def row_descriptors(region: RegionInfo, block: int, lo: int,
                    hi: int) -> list[tuple[int, int, int]]:
    """Rows [lo, hi) of one block: one descriptor per layer, since each layer's rows are
    contiguous only within that layer's slab of the block."""
    base = region.addr + block * region.bytes_per_block + lo * region.row_bytes
    layer_bytes = region.block_size * region.row_bytes
    return [
        (base + layer * layer_bytes, (hi - lo) * region.row_bytes, region.device_id)
        for layer in range(region.num_layers)
    ]


def spec_bytes(spec: ReadSpec, region: RegionInfo) -> int:
    rows = sum(p.n for p in spec.partials) * region.row_bytes * region.num_layers
    return spec.full_blocks * region.bytes_per_block + rows


# ---------------------------------------------------------------- NIXL


@dataclass
class RemotePeer:
    key: str  # host:port of its side channel
    agent_name: str
    region: RegionInfo
    prepped: Any  # nixl_prepped_dlist_handle


@dataclass
class ReadStats:
    bytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    transfers: int = 0
    path: str = "nixl"  # nixl | cuda_ipc (kv/device_copy.py); both, joined by "+"
    # cuda_ipc: the copies' own time on the device (CUDA events), beside the wall time above,
    # which also holds the host's share (launches, the wait, the thread getting the GIL back)
    device_seconds: float = 0.0

    def add(self, other: ReadStats) -> None:
        self.bytes += other.bytes
        self.descriptors += other.descriptors
        self.seconds += other.seconds
        self.device_seconds += other.device_seconds
        self.transfers += other.transfers
        self.path = join_paths([self.path, other.path])


def join_paths(paths: Iterable[str]) -> str:
    """The paths some reads took, as one label: "nixl", "cuda_ipc" or "cuda_ipc+nixl"."""
    return "+".join(sorted({p for p in paths if p})) or "nixl"


@dataclass
class _Posted:
    peer: RemotePeer
    handles: list[Any]
    stats: ReadStats


class KVTransferAgent:
    """One rank's NIXL agent with its KV cache registered and prepared once."""

    def __init__(
        self,
        name: str,
        kv: Any,
        backends: Sequence[str] = ("UCX",),
        max_levels: int = DEFAULT_MAX_LEVELS,
        adaptive_progress: bool = False,
        notif_key: Callable[[bytes], str | None] | None = None,
    ) -> None:
        """The agent must progress even while its rank waits for work: UCX connection set-up,
        notifications and, on some transports, a peer's READ need the target side to answer.
        NIXL's own progress thread polls without pause (a whole core per agent), so a thread
        of ours progresses the agent, at the pace ``ProgressPace`` sets, with the agent in
        strict thread-safe mode. ``notif_key`` names the READ a notification settles."""
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.name = name
        self.kv = kv
        self.region = RegionInfo.of_tensor(kv)
        self.agent = nixl_agent(
            name,
            nixl_agent_config(
                enable_prog_thread=False,
                backends=list(backends),
                sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            ),
        )
        self._notifs: list[bytes] = []
        self._notif_lock = threading.Lock()
        self._closed = threading.Event()
        self._wake = threading.Event()
        self.pace = ProgressPace(adaptive_progress)
        self._notif_key = notif_key
        self._progress = threading.Thread(
            target=self._progress_loop, name=f"nixl-progress-{name}", daemon=True
        )
        self._reg = self.agent.register_memory(kv)
        self.layout = PreppedBlocks(self.region.num_blocks, max_levels)
        self._local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self.layout.descriptors(self.region), mem_type=self.region.mem_type
        )
        self.peers: dict[str, RemotePeer] = {}
        self._remote_layouts: dict[str, PreppedBlocks] = {}
        self._progress.start()
        _OPEN_AGENTS.add(self)
        log.info("agent %s: progress every %.0f ms%s", name, self.pace.fast_s * 1e3,
                 f", every {self.pace.idle_s * 1e3:.0f} ms while no READ of it is claimed"
                 if adaptive_progress else "")

    def _progress_loop(self) -> None:
        while True:
            self._wake.wait(self.pace.interval(time.monotonic()))
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                new = self.agent.get_new_notifs()
            except Exception as exc:
                log.debug("agent %s progress: %s", self.name, exc)
                continue
            if new:
                messages = [m for ms in new.values() for m in ms]
                self._settle(messages)
                with self._notif_lock:
                    self._notifs.extend(messages)

    def _settle(self, messages: Iterable[bytes]) -> None:
        if self._notif_key is not None:
            for m in messages:
                self.pace.settle(self._notif_key(m))

    def expect_read(self, key: str, seconds: float) -> None:
        """A peer claimed a READ of this agent's memory: progress fast until it notifies."""
        # Waking the thread costs the caller a notify; one already fast needs none.
        if self.pace.expect(key, time.monotonic(), seconds):
            self._wake.set()

    def _kick(self) -> None:
        if self.pace.kick(time.monotonic()):
            self._wake.set()

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    # -- peers

    def connect(self, key: str, metadata: bytes, region: RegionInfo) -> RemotePeer:
        """Load a remote agent and prepare its block list once; reused until it changes."""
        known = self.peers.get(key)
        if known is not None:
            return known
        if (region.num_layers, region.block_size, region.row_bytes) != (
            self.region.num_layers,
            self.region.block_size,
            self.region.row_bytes,
        ):
            raise TransferError(
                f"peer {key}: block layout (layers={region.num_layers}, "
                f"block={region.block_size}, row={region.row_bytes}B) != local "
                f"(layers={self.region.num_layers}, block={self.region.block_size}, "
                f"row={self.region.row_bytes}B)"
            )
        self._kick()  # UCX sets the connection up with the peer's answers
        name = self.agent.add_remote_agent(metadata)
        agent_name = name.decode() if isinstance(name, bytes) else str(name)
        layout = PreppedBlocks(region.num_blocks, self.layout.levels)
        try:
            prepped = self.agent.prep_xfer_dlist(
                agent_name, layout.descriptors(region), mem_type=region.mem_type
            )
        except Exception:
            self._forget_agent(agent_name)
            raise
        peer = RemotePeer(key=key, agent_name=agent_name, region=region, prepped=prepped)
        self.peers[key] = peer
        self._remote_layouts[key] = layout
        return peer

    def disconnect(self, key: str) -> None:
        """Drop a peer (dead or restarted); the next request handshakes again."""
        peer = self.peers.pop(key, None)
        self._remote_layouts.pop(key, None)
        if peer is None:
            return
        try:
            self.agent.release_dlist_handle(peer.prepped)
        except Exception as exc:  # a dead peer's list may refuse release
            log.debug("release of %s's prepared list failed: %s", key, exc)
        self._forget_agent(peer.agent_name)

    def _forget_agent(self, agent_name: str) -> None:
        try:
            self.agent.remove_remote_agent(agent_name)
        except Exception as exc:
            log.debug("remove_remote_agent(%s) failed: %s", agent_name, exc)

    # -- reads

    def _post(self, peer: RemotePeer, spec: ReadSpec) -> _Posted:
        layout = self._remote_layouts[peer.key]
        stats = ReadStats(bytes=spec_bytes(spec, self.region))
        handles: list[Any] = []
        posted = _Posted(peer, handles, stats)
        try:
            if spec.runs:
                local_idx, _ = self.layout.indices(spec.runs)
                _, remote_idx = layout.indices(spec.runs)
                handle = self.agent.make_prepped_xfer(
                    "READ", self._local, local_idx, peer.prepped, remote_idx
                )
                handles.append(handle)
                stats.descriptors += len(local_idx)
            if spec.partials:
                local = self.agent.get_xfer_descs(
                    [d for p in spec.partials
                     for d in row_descriptors(self.region, p.local_block, p.lo, p.hi)],
                    self.region.mem_type,
                )
                remote = self.agent.get_xfer_descs(
                    [d for p in spec.partials
                     for d in row_descriptors(peer.region, p.remote_block, p.lo, p.hi)],
                    peer.region.mem_type,
                )
                handles.append(self.agent.initialize_xfer("READ", local, remote, peer.agent_name))
                stats.descriptors += self.region.num_layers * len(spec.partials)
            for handle in handles:
                if self.agent.transfer(handle) == "ERR":
                    raise TransferError(f"peer {peer.key}: NIXL READ failed to post")
                stats.transfers += 1
        except TransferError:
            self._release(posted)
            raise
        except Exception as exc:
            self._release(posted)
            raise TransferError(f"peer {peer.key}: NIXL READ failed: {exc}") from exc
        return posted

    def _release(self, posted: _Posted) -> None:
        for handle in posted.handles:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as exc:
                log.debug("release of a transfer from %s failed: %s", posted.peer.key, exc)
        posted.handles.clear()

    def _wait(self, posted: _Posted, deadline: float) -> None:
        # Spin first (a GPU hand-off takes about a millisecond), then yield the CPU.
        spin_until = time.monotonic() + 0.005
        pending = list(posted.handles)
        while pending:
            still = []
            for handle in pending:
                try:
                    state = self.agent.check_xfer_state(handle)
                except Exception as exc:
                    raise TransferError(f"peer {posted.peer.key}: NIXL READ failed: {exc}") from exc
                if state == "ERR":
                    raise TransferError(f"peer {posted.peer.key}: NIXL READ reported an error")
                if state == "PROC":
                    still.append(handle)
            pending = still
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TransferError(
                    f"peer {posted.peer.key}: NIXL READ did not complete within the transfer "
                    f"timeout"
                )
            if time.monotonic() > spin_until:
                time.sleep(0.0001)

    def read(
        self,
        work: Sequence[tuple[RemotePeer, ReadSpec]],
        timeout_s: float,
        between: Callable[[], None] | None = None,
    ) -> ReadStats:
        """Post every peer's READ, then wait for all; raise TransferError naming the peer."""
        start = time.monotonic()
        deadline = start + timeout_s
        posted: list[_Posted] = []
        total = ReadStats()
        try:
            for peer, spec in work:
                if spec.empty:
                    continue
                if posted and between is not None:
                    # Fault injection: a test kills the peer in the middle of a hand-off.
                    self._wait(posted[-1], deadline)
                    between()
                posted.append(self._post(peer, spec))
            for p in posted:
                self._wait(p, deadline)
                total.add(p.stats)
        finally:
            for p in posted:
                self._release(p)
            if posted:
                self._kick()
        total.seconds = time.monotonic() - start
        return total

    # -- notifications

    def notify(self, peer: RemotePeer, message: bytes) -> None:
        try:
            self.agent.send_notif(peer.agent_name, message)
        except Exception as exc:
            raise TransferError(f"peer {peer.key}: notification failed: {exc}") from exc
        self._kick()  # a send UCX could not finish at once completes as the agent progresses

    def poll_notifs(self) -> list[bytes]:
        new = self.agent.get_new_notifs()
        with self._notif_lock:
            out, self._notifs = self._notifs, []
        fresh = [m for messages in new.values() for m in messages]
        self._settle(fresh)
        return out + fresh

    def close(self) -> None:
        if self._closed.is_set():
            return
        _OPEN_AGENTS.discard(self)
        self._closed.set()
        self._wake.set()
        self._progress.join(timeout=1)
        for key in list(self.peers):
            self.disconnect(key)
        try:
            self.agent.release_dlist_handle(self._local)
            self.agent.deregister_memory(self._reg)
        except Exception as exc:
            log.debug("agent %s teardown: %s", self.name, exc)
