"""The routing plan drawn as the vLLM DCP pull request draws it: prefill ranks over decode ranks.

People check a layout by looking at which decode rank sits under which prefill rank faster than
by reading a table, so `pdd plan -o diagram` and `kubectl pdd plan` print this picture. Pure and
deterministic: the same plan always gives the same characters, so a test can pin it.
"""

from __future__ import annotations

from pdd_api.plan import ChunkRead, RoutingPlan, SidePlan

INDENT = "  "
MIN_CELL = 6


def chunk_label(read: ChunkRead) -> str:
    if read.chunk_modulus == 1:
        return "all chunks"
    return f"g%{read.chunk_modulus}=={read.chunk_residue}"


def _side_note(role: str, side: SidePlan) -> str:
    tp, dcp = side.tensor_parallel_size, side.decode_context_parallel_size
    head = f"{role:<8} TP{tp}/DCP{dcp}"
    if dcp > 1:
        return f"{head} -- KV sharded into {dcp} slices, one per rank"
    return f"{head} -- KV replicated on every rank" if tp > 1 else f"{head} -- one rank"


def readers_by_prefill_rank(plan: RoutingPlan) -> dict[int, list[int]]:
    """Which decode ranks read from each prefill rank (empty: notified only)."""
    readers: dict[int, list[int]] = {p.rank: [] for p in plan.prefill_ranks}
    for d in plan.decode_ranks:
        for r in d.reads:
            if d.rank not in readers[r.prefill_rank]:
                readers[r.prefill_rank].append(d.rank)
    return readers


def _row(cells: list[str], widths: list[int]) -> str:
    return INDENT + "|" + "|".join(c.center(w) for c, w in zip(cells, widths, strict=True)) + "|"


def _border(widths: list[int], marks: list[bool]) -> str:
    parts = []
    for w, mark in zip(widths, marks, strict=True):
        parts.append("--+" + "-" * (w - 3) if mark else "-" * w)
    return INDENT + "+" + "+".join(parts) + "+"


def _arrows(widths: list[int], marks: list[bool], char: str) -> str:
    col = 0
    out = [" "] * (sum(widths) + len(widths) + 1)
    for w, mark in zip(widths, marks, strict=True):
        if mark:
            out[col + 3] = char
        col += w + 1
    return (INDENT + "".join(out)).rstrip()


def sides_title(plan: RoutingPlan) -> str:
    p, d = plan.prefill, plan.decode
    return (f"P TP{p.tensor_parallel_size}/DCP{p.decode_context_parallel_size} -> "
            f"D TP{d.tensor_parallel_size}/DCP{d.decode_context_parallel_size}")


def render_diagram(plan: RoutingPlan, title: str | None = None) -> str:
    """Draw `plan` under `title` (default: the two sides' TP/DCP)."""
    p, d = plan.prefill, plan.decode
    readers = readers_by_prefill_rank(plan)
    top = [f"P{r}" for r in sorted(readers)]
    bottom = [",".join(f"D{x}" for x in readers[r]) or "-" for r in sorted(readers)]
    widths = [max(MIN_CELL, len(a) + 4, len(b) + 4) for a, b in zip(top, bottom, strict=True)]
    read = [bool(readers[r]) for r in sorted(readers)]
    lines = [
        title or sides_title(plan),
        f"case {plan.case}, blockSize {plan.block_size}, chunk g = tokens "
        f"[g*{plan.block_size}, (g+1)*{plan.block_size})",
        "",
        INDENT + _side_note("Prefill", p),
        _border(widths, [False] * len(widths)),
        _row(top, widths),
        _border(widths, read),
        _arrows(widths, read, "|"),
        _arrows(widths, read, "v"),
        _border(widths, [False] * len(widths)),
        _row(bottom, widths),
        _border(widths, [False] * len(widths)),
        INDENT + _side_note("Decode", d),
        "",
    ]
    name_w = max(len(f"D{x.rank}") for x in plan.decode_ranks)
    for dr in plan.decode_ranks:
        sources = ", ".join(f"P{r.prefill_rank} [{chunk_label(r)}]" for r in dr.reads)
        line = f"{INDENT}{f'D{dr.rank}':<{name_w}} <- {sources}"
        extra = sorted(set(dr.notifies) - {r.prefill_rank for r in dr.reads})
        if extra:
            line += "; also notifies " + ",".join(f"P{x}" for x in extra)
        lines.append(line)
    unread = [r for r in sorted(readers) if not readers[r]]
    if unread:
        lines.append(f"{INDENT}'-': " + ",".join(f"P{x}" for x in unread)
                     + " hold the KV too but nobody reads them; they free on notification")
    return "\n".join(lines)
