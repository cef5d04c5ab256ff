"""One rank's side of the host KV tier: its pool (kv/host_pool.py) and the step command's
copies run on it, ordered against this rank's compute streams.

Rank 0's driver decides every copy (kv/host_tier.py) and sends it with the step; each rank
runs it on its own cache and pool before the step's forward pass and pulls: an evicted block
is copied out before anything that command carries writes it, and a loaded block is in place
before the step that reads it (on CUDA the compute streams wait for the copies on the device;
a KV READ, which no stream orders, waits for them on the host). The copies themselves wait for
no compute (kv/host_pool.py says why that is safe), so a load overlaps the step queued before.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pdd_sidecar.engine.rank_engine import RankEngine
from pdd_sidecar.env import PDD_HOST_KV_CACHE_GIB, InstanceSettings
from pdd_sidecar.kv.cache import PagedKVCache
from pdd_sidecar.kv.host_pool import HostKVPool
from pdd_sidecar.kv.host_tier import host_slots

log = logging.getLogger(__name__)


def tier_slots(settings: InstanceSettings, bytes_per_block: int) -> int:
    """Host slots per rank the settings ask for: 0 when the tier is off (no GiB, or no prefix
    cache for it to sit under); a size that holds no block is a configuration error."""
    gib = settings.host_kv_cache_gib
    if gib <= 0:
        return 0
    n = host_slots(gib, bytes_per_block)
    if n == 0:
        raise ValueError(f"{PDD_HOST_KV_CACHE_GIB}={gib} holds no KV block ({bytes_per_block} "
                         "bytes per rank); set 0 (off) or more")
    if not settings.prefix_cache:
        log.warning("%s=%s is ignored: the prefix cache is off (PDD_PREFIX_CACHE=0), and the "
                    "host tier keeps what it evicts", PDD_HOST_KV_CACHE_GIB, gib)
        return 0
    return n


def describe_tier(slots: int, bytes_per_block: int, tp: int, dcp: int) -> str:
    """The tier's host memory as the log states it at start. With dcp = 1 the ranks' pools hold
    the same blocks, each pinned by its own process (docs/host-kv-tier.md says why they are not
    shared): the instance pays tp times the memory for one pool's capacity, said plainly."""
    gib = slots * bytes_per_block / (1 << 30)
    out = f"host KV tier: {slots} blocks of {bytes_per_block} bytes per rank ({gib:.2f} GiB)"
    if dcp == 1 and tp > 1:
        out += (f"; the {tp} ranks hold the same blocks (dcp=1): {tp * gib:.2f} GiB of host "
                f"memory for {gib:.2f} GiB of capacity")
    return out


class RankHostTier:
    def __init__(self, pool: HostKVPool, engine: RankEngine) -> None:
        self.pool = pool
        self.engine = engine

    @classmethod
    def for_rank(cls, cache: PagedKVCache, engine: RankEngine,
                 settings: InstanceSettings) -> RankHostTier | None:
        n = tier_slots(settings, cache.bytes_per_block)
        if n == 0:
            return None
        log.info("%s%s", describe_tier(n, cache.bytes_per_block, settings.tp, settings.dcp),
                 ", pinned" if cache.device.type == "cuda" else "")
        return cls(HostKVPool(cache, n), engine)

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    def _streams(self) -> list[Any]:
        """The compute streams that wait for the copies: the current one, and a prefill's
        overtaking stream (its steps read loaded blocks and write fresh ones, possibly just
        evicted and still being copied out)."""
        dev = self.pool.cache.device
        if dev.type != "cuda":
            return []
        streams = [torch.cuda.current_stream(dev)]
        if self.engine.overtaking is not None:
            streams.append(self.engine.overtaking.stream)
        return streams

    def run(self, tier: dict[str, Any], before_reads: bool) -> None:
        """The command's offloads, then its loads; with ``before_reads`` (the command starts
        KV READs into blocks it may also copy into or out of) the host waits for them."""
        offloads, loads = tier.get("offloads", ()), tier.get("loads", ())
        if not offloads and not loads:
            return
        self.pool.run(offloads, loads, self._streams())
        if before_reads:
            self.pool.wait()

    def take_stats(self) -> dict[str, dict[str, float]]:
        return self.pool.take_stats()
