"""Loading PDD_ROUTING_FILE and refusing any plan this instance cannot follow exactly.

Schema checks come from pdd_api; on top, the plan must describe this instance (role, tp, dcp,
block size) and must be sound: every decode rank reads each chunk it holds exactly once, from a
prefill rank that holds it, and every prefill rank's expectedNotifications equals the number of
decode ranks that notify it. A plan that fails any of these would lose or duplicate KV silently.
"""

from __future__ import annotations

from pathlib import Path

from pdd_api.plan import RoutingPlan
from pdd_sidecar.env import (
    PDD_BLOCK_SIZE,
    PDD_DCP_SIZE,
    PDD_ROUTING_FILE,
    PDD_TP_SIZE,
    ConfigError,
)


def check_plan_soundness(plan: RoutingPlan) -> None:
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


def load_routing_file(
    path: str, role: str, tp: int, dcp: int, block_size: int
) -> tuple[RoutingPlan, str]:
    """The plan and its text, or ConfigError naming the file and the problem."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{PDD_ROUTING_FILE} {path}: cannot read: {exc.strerror}") from None
    try:
        plan = RoutingPlan.from_json(text)
        check_plan_soundness(plan)
    except ValueError as exc:
        raise ConfigError(f"{PDD_ROUTING_FILE} {path}: {exc}") from None
    side = plan.prefill if role == "prefill" else plan.decode
    problems = []
    if side.tensor_parallel_size != tp:
        problems.append(f"{role}.tensorParallelSize is {side.tensor_parallel_size}, "
                        f"{PDD_TP_SIZE} is {tp}")
    if side.decode_context_parallel_size != dcp:
        problems.append(f"{role}.decodeContextParallelSize is "
                        f"{side.decode_context_parallel_size}, {PDD_DCP_SIZE} is {dcp}")
    if plan.block_size != block_size:
        problems.append(f"blockSize is {plan.block_size}, {PDD_BLOCK_SIZE} is {block_size}")
    if problems:
        raise ConfigError(
            f"{PDD_ROUTING_FILE} {path} does not describe this instance: " + "; ".join(problems)
        )
    return plan, text
