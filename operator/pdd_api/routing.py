"""The rank-routing rule: which prefill rank each decode rank reads which KV chunks from.

A chunk g is tokens [g*blockSize, (g+1)*blockSize). Rank r of a side with dcp holds chunk g iff
dcp == 1 or g % dcp == r. Every decode rank must end with exactly the chunks it holds, each read
once, and every prefill rank must learn when it may free the request's blocks.
"""

from __future__ import annotations

from pdd_api.models import DEFAULT_KV_CACHE_DTYPE, KvCacheDtype, PDDeploymentSpec
from pdd_api.plan import (
    ChunkRead,
    DecodeRankPlan,
    PrefillRankPlan,
    RoutingCase,
    RoutingPlan,
    SidePlan,
)


def routing_case(prefill: SidePlan, decode: SidePlan) -> RoutingCase:
    p = "sharded" if prefill.sharded else "replicated"
    d = "sharded" if decode.sharded else "replicated"
    return f"{p}-to-{d}"  # type: ignore[return-value]


def reads_for(decode_rank: int, prefill: SidePlan, decode: SidePlan) -> list[ChunkRead]:
    """The routing rule of docs/architecture.md, in one place."""
    dcp_p, dcp_d = prefill.decode_context_parallel_size, decode.decode_context_parallel_size
    # Decode rank d holds chunks g % dcp_d == d (all chunks when dcp_d == 1).
    d_mod, d_res = (dcp_d, decode_rank) if dcp_d > 1 else (1, 0)
    if dcp_p == 1:
        # Every prefill rank holds everything: spread the readers evenly over prefill ranks.
        source = decode_rank * prefill.tensor_parallel_size // decode.tensor_parallel_size
        return [ChunkRead(prefill_rank=source, chunk_modulus=d_mod, chunk_residue=d_res)]
    if dcp_d <= dcp_p:
        # Each of my chunk classes mod dcp_p lives on exactly one prefill rank.
        return [
            ChunkRead(prefill_rank=p, chunk_modulus=dcp_p, chunk_residue=p)
            for p in range(dcp_p)
            if p % dcp_d == d_res % dcp_d
        ]
    # Finer sharding on decode: my class mod dcp_d is a subset of one prefill rank's class.
    return [ChunkRead(prefill_rank=decode_rank % dcp_p, chunk_modulus=dcp_d, chunk_residue=d_res)]


def plan_routing(prefill: SidePlan, decode: SidePlan, block_size: int,
                 kv_cache_dtype: KvCacheDtype = DEFAULT_KV_CACHE_DTYPE) -> RoutingPlan:
    """Compute the whole plan; callers must have validated the sides (see validation.py)."""
    decode_ranks: list[DecodeRankPlan] = []
    notified: dict[int, int] = {p: 0 for p in range(prefill.tensor_parallel_size)}
    for d in range(decode.tensor_parallel_size):
        reads = reads_for(d, prefill, decode)
        notifies = sorted({r.prefill_rank for r in reads})
        decode_ranks.append(DecodeRankPlan(rank=d, reads=reads, notifies=notifies))
        for p in notifies:
            notified[p] += 1
    # A prefill rank nobody reads from still holds blocks: some decode rank must release it.
    for p, count in notified.items():
        if count == 0:
            d = p * decode.tensor_parallel_size // prefill.tensor_parallel_size
            decode_ranks[d] = decode_ranks[d].model_copy(
                update={"notifies": sorted([*decode_ranks[d].notifies, p])}
            )
            notified[p] = 1
    prefill_ranks = [
        PrefillRankPlan(rank=p, expected_notifications=n) for p, n in sorted(notified.items())
    ]
    return RoutingPlan(
        case=routing_case(prefill, decode),
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        prefill=prefill,
        decode=decode,
        decode_ranks=decode_ranks,
        prefill_ranks=prefill_ranks,
    )


def plan_for_spec(spec: PDDeploymentSpec) -> RoutingPlan:
    """The plan of a validated spec: `pdd plan -o json` and the `<name>-routing` ConfigMap."""
    prefill, decode = (
        SidePlan(
            tensor_parallel_size=role.tensorParallelSize,
            decode_context_parallel_size=role.decodeContextParallelSize,
        )
        for role in (spec.prefill, spec.decode)
    )
    # The validators hold prefill's kvCacheDtype equal to decode's.
    return plan_routing(prefill, decode, spec.blockSize, spec.prefill.kvCacheDtype)


def chunks_read(plan: RoutingPlan, decode_rank: int, num_chunks: int) -> dict[int, int]:
    """Chunk -> prefill rank it is read from, for a request of num_chunks chunks."""
    out: dict[int, int] = {}
    for read in plan.reads_of(decode_rank):
        for g in range(read.chunk_residue, num_chunks, read.chunk_modulus):
            out[g] = read.prefill_rank
    return out


def bytes_per_decode_rank(plan: RoutingPlan, num_tokens: int, bytes_per_token: int) -> list[int]:
    """Bytes each decode rank receives for one request (last chunk may be partial)."""
    bs = plan.block_size
    num_chunks = -(-num_tokens // bs)
    out = []
    for d in range(plan.decode.tensor_parallel_size):
        tokens = sum(
            min(bs, num_tokens - g * bs) for g in chunks_read(plan, d, num_chunks)
        )
        out.append(tokens * bytes_per_token)
    return out


def load_plan(text: str | bytes) -> RoutingPlan:
    """Parse a routing file and refuse any plan that differs from the rule's own output.

    A sidecar that followed a hand-edited or stale plan could read a chunk twice or never, so
    it must not start on one.
    """
    plan = RoutingPlan.from_json(text)
    p, d = plan.prefill, plan.decode
    for side_name, side in (("prefill", p), ("decode", d)):
        if side.decode_context_parallel_size not in (1, side.tensor_parallel_size):
            raise ValueError(
                f"malformed routing plan: {side_name}.decodeContextParallelSize must be 1 or "
                f"{side.tensor_parallel_size}, got {side.decode_context_parallel_size}"
            )
    a, b = p.decode_context_parallel_size, d.decode_context_parallel_size
    if a % b and b % a:
        raise ValueError(
            f"malformed routing plan: decodeContextParallelSize {a} (prefill) and {b} (decode) "
            "do not divide one another"
        )
    try:
        check_plan_soundness(plan)
    except ValueError as exc:
        raise ValueError(f"unsound routing plan: {exc}") from None
    expected = plan_routing(p, d, plan.block_size, plan.kv_cache_dtype)
    if plan != expected:
        raise ValueError(
            "mismatched routing plan: it differs from the rule for "
            f"P TP{p.tensor_parallel_size}/DCP{a} -> D TP{d.tensor_parallel_size}/DCP{b}; "
            f"expected {expected.to_json()}"
        )
    return plan


def check_plan_soundness(plan: RoutingPlan) -> None:
    """Every decode rank reads each chunk it holds exactly once, from a prefill rank that holds
    it, and every prefill rank expects exactly the notifications sent to it; a plan failing any
    of these would lose or duplicate KV silently."""
    dcp_p = plan.prefill.decode_context_parallel_size
    dcp_d = plan.decode.decode_context_parallel_size
    tp_p = plan.prefill.tensor_parallel_size
    tp_d = plan.decode.tensor_parallel_size
    if [d.rank for d in plan.decode_ranks] != list(range(tp_d)):
        raise ValueError("decodeRanks must list ranks 0..decode.tensorParallelSize-1 in order")
    if [p.rank for p in plan.prefill_ranks] != list(range(tp_p)):
        raise ValueError("prefillRanks must list ranks 0..prefill.tensorParallelSize-1 in order")
    period = max(dcp_p, dcp_d) * 2
    notified = dict.fromkeys(range(tp_p), 0)
    for d in plan.decode_ranks:
        seen: dict[int, int] = {}
        for read in d.reads:
            if not 0 <= read.prefill_rank < tp_p:
                raise ValueError(
                    f"decode rank {d.rank} reads prefill rank {read.prefill_rank}, "
                    f"prefill has {tp_p} ranks"
                )
            for g in range(period):
                if read.covers(g):
                    if dcp_p > 1 and g % dcp_p != read.prefill_rank:
                        raise ValueError(
                            f"decode rank {d.rank} reads chunk {g} from prefill rank "
                            f"{read.prefill_rank}, which does not hold it"
                        )
                    seen[g] = seen.get(g, 0) + 1
        held = [g for g in range(period) if dcp_d == 1 or g % dcp_d == d.rank]
        if sorted(seen) != held or any(n != 1 for n in seen.values()):
            raise ValueError(
                f"decode rank {d.rank} must read each chunk it holds exactly once "
                f"(chunks mod {period}: holds {held}, plan reads {sorted(seen.items())})"
            )
        for p in set(d.notifies):
            if not 0 <= p < tp_p:
                raise ValueError(f"decode rank {d.rank} notifies unknown prefill rank {p}")
            notified[p] += 1
        if not {r.prefill_rank for r in d.reads} <= set(d.notifies):
            raise ValueError(f"decode rank {d.rank} must notify every prefill rank it reads")
    for pr in plan.prefill_ranks:
        if pr.expected_notifications != notified[pr.rank]:
            raise ValueError(
                f"prefill rank {pr.rank} expects {pr.expected_notifications} notifications, "
                f"decode ranks send {notified[pr.rank]}"
            )
