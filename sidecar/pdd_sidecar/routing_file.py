"""Loading PDD_ROUTING_FILE and refusing any plan this instance cannot follow exactly.

Schema and soundness checks come from pdd_api.routing.load_plan; on top, the plan must describe
this instance (role, tp, dcp, block size).
"""

from __future__ import annotations

from pathlib import Path

from pdd_api.plan import RoutingPlan
from pdd_api.routing import load_plan
from pdd_sidecar.env import (
    PDD_BLOCK_SIZE,
    PDD_DCP_SIZE,
    PDD_ROUTING_FILE,
    PDD_TP_SIZE,
    ConfigError,
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
        plan = load_plan(text)
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
