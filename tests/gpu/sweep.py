#!/usr/bin/env python3
"""GPU data-plane sweep (issue 8): the CPU sweep's configurations on GPUs, through the real path.

For each configuration one prefill instance, one decode instance (rank r of either side on
``cuda:r``, NCCL for the TP/DCP collectives, NIXL over UCX with the KV cache registered as VRAM) and
a router are started as local processes; four prompts (shorter than one block to several blocks) are
completed with 16 greedy tokens each. PASS/FAIL is about the KV path alone: the tokens must equal
those of the same model run without the network in the same reduction order, and every decode rank
must receive exactly the plan's minimum bytes. Where both sides share a layout that run is a single
instance of it (no P/D split, the same ranks and collectives); where they differ, the prefill
layout's latents moved in memory into the decode layout's ranks and decoded there
(``engine/handoff_reference.py``), since a single instance of the decode layout computes the
prompt's latents in another order than the prefill did. Separately, each row is compared with the
single-GPU reference (tp1/dcp1, same dtype): matched tokens, first divergence, and the reference's
top-1 minus top-2 logit margin at that step (a small margin means the difference is rounding in
another reduction order, not the hand-off). Configurations that need more GPUs than the machine has
are listed as NOT RUN with the reason.

Not collected by pytest (``tests/gpu/conftest.py``); CI has no GPU. Run by hand:

    python tests/gpu/sweep.py --device cuda --dtype bfloat16,float32 --out /tmp/sweep

``--device cpu`` runs the same code path on CPUs (gloo, DRAM registration), for checking the
script without a GPU. Exit status 0 when every configuration that ran passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "tests" / "dataplane", ROOT / "sidecar", ROOT / "operator"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import runtime_fixtures as rf  # noqa: E402
from runtime_fixtures import LocalCluster, http  # noqa: E402
from test_sweep import (  # noqa: E402  (the CPU sweep's table, reused so the two stay alike)
    BLOCK,
    CONFIGS,
    MAX_TOKENS,
    PROMPT_LENGTHS,
    REFERENCE_SWEEP,
    _label,
    _prompt,
)

from pdd_api.plan import SidePlan  # noqa: E402
from pdd_api.routing import bytes_per_decode_rank, plan_routing  # noqa: E402

Config = tuple[tuple[int, int], tuple[int, int]]

# The configurations a two-GPU machine can run (both sides share the GPUs: rank r on cuda:r).
X2 = [((2, 1), (2, 1)), ((2, 1), (2, 2)), ((2, 2), (2, 1)), ((2, 2), (2, 2)),
      ((1, 1), (2, 1)), ((1, 1), (2, 2)), ((2, 1), (1, 1)), ((1, 1), (1, 1))]


@dataclass
class Row:
    config: str
    dtype: str
    status: str  # PASS | FAIL | ERROR | NOT RUN (against the decode layout's single instance)
    tokens: str = "-"  # matched / total against the decode layout's single instance
    divergence: str = "-"  # per prompt length: first step that differs, '-' when none
    bytes: str = "-"
    seconds: str = "-"
    reference: bool = False  # one of the seven reference configurations
    detail: str = ""
    tp1_tokens: str = "-"  # matched / total against the single-GPU tp1 reference
    tp1_divergence: str = "-"  # per prompt: first step that differs from tp1, '-' when none
    tp1_margin: str = "-"  # tp1's smallest top-1 minus top-2 logit gap at those first steps


@dataclass
class Reference:
    """Greedy tokens per prompt length of one single-instance run; logits only for tp1."""

    tokens: dict[int, list[int]]
    margins: dict[int, list[float]] | None = None  # per prompt: top1 - top2 per generated token


def parse_config(text: str) -> Config:
    """`2x1-2x2` = P TP2/DCP1 -> D TP2/DCP2."""
    try:
        p, d = text.split("-")
        tp_p, dcp_p = (int(v) for v in p.split("x"))
        tp_d, dcp_d = (int(v) for v in d.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad configuration {text!r}, want e.g. 2x1-2x2") from None
    return (tp_p, dcp_p), (tp_d, dcp_d)


def parse_configs(text: str) -> list[Config]:
    out: list[Config] = []
    for part in text.split(","):
        part = part.strip()
        if part == "all":
            out += CONFIGS
        elif part == "x2":
            out += X2
        elif part == "reference":
            out += REFERENCE_SWEEP
        elif part:
            out.append(parse_config(part))
    seen: set[Config] = set()
    return [c for c in out if not (c in seen or seen.add(c))]  # type: ignore[func-returns-value]


def gpus_needed(cfg: Config) -> int:
    return max(cfg[0][0], cfg[1][0])


def references(dtype: str, device: str) -> dict[int, list[int]]:
    """The single-device tp1 reference's tokens (see ``tp1_reference`` for its margins)."""
    return tp1_reference(dtype, device).tokens


def tp1_reference(dtype: str, device: str) -> Reference:
    import torch

    from pdd_sidecar.engine.generate import generate_result

    tokens: dict[int, list[int]] = {}
    margins: dict[int, list[float]] = {}
    for n in PROMPT_LENGTHS:
        res = generate_result("builtin", _prompt(n), MAX_TOKENS, block_size=BLOCK, dtype=dtype,
                              device=device, keep_logits=True)
        assert res.prompt_logits is not None
        rows = [res.prompt_logits[-1], *res.step_logits]
        tokens[n] = res.token_ids
        margins[n] = [float(t[0] - t[1]) for t in (torch.topk(r.float(), 2).values
                                                    for r in rows)]
    return Reference(tokens, margins)


def layout_reference(tp: int, dcp: int, dtype: str, device: str) -> Reference:
    """One instance of this layout, its ranks as processes over NCCL (gloo on the CPU) like a
    serving instance's, prefill and decode in the same instance."""
    from pdd_sidecar.engine.generate import generate

    launcher = "procs" if tp > 1 else "inproc"
    return Reference({n: generate("builtin", _prompt(n), MAX_TOKENS, tp=tp, dcp=dcp,
                                  block_size=BLOCK, dtype=dtype, device=device, launcher=launcher)
                      for n in PROMPT_LENGTHS})


def handoff_reference(cfg: Config, dtype: str, device: str) -> Reference:
    """Where the two sides' layouts differ: the prefill layout's latents decoded in the decode
    layout without the network (engine/handoff_reference.py), the only run that rounds as the
    P/D pair does."""
    from pdd_sidecar.engine.handoff_reference import handoff_generate

    tokens = handoff_generate("builtin", [_prompt(n) for n in PROMPT_LENGTHS], MAX_TOKENS,
                              cfg[0], cfg[1], dtype=dtype, block_size=BLOCK, device=device,
                              launcher="procs")
    return Reference(dict(zip(PROMPT_LENGTHS, tokens, strict=True)))


def first_divergence(got: list[int], want: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def run_config(cfg: Config, dtype: str, device: str, refs: dict[int, list[int]],
               workdir: Path, ready_timeout: float, tp1: Reference | None = None) -> Row:
    """``refs``: the tokens the row must produce (its decode layout's single instance);
    ``tp1``: the single-GPU reference it is measured against, apart from PASS/FAIL."""
    import torch

    from pdd_sidecar.model.config import builtin_config

    (tp_p, dcp_p), (tp_d, dcp_d) = cfg
    row = Row(_label(cfg), dtype, "ERROR", reference=cfg in REFERENCE_SWEEP)
    start = time.monotonic()
    plan = plan_routing(SidePlan(tensor_parallel_size=tp_p, decode_context_parallel_size=dcp_p),
                        SidePlan(tensor_parallel_size=tp_d, decode_context_parallel_size=dcp_d),
                        BLOCK)
    model = builtin_config()
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    bytes_per_token = model.num_hidden_layers * model.latent_dim * elem
    workdir.mkdir(parents=True)
    cluster = LocalCluster(workdir)
    try:
        routing = cluster.plan_file(plan.to_json())
        extra = {"PDD_DEVICE": device, "PDD_DTYPE": dtype, "PDD_TRANSFER_TIMEOUT_S": "60",
                 "PDD_HANDSHAKE_TIMEOUT_S": "20", "PDD_LEASE_SECONDS": "180"}
        prefill = cluster.instance("prefill", tp_p, dcp_p, routing, BLOCK, **extra)
        decode = cluster.instance("decode", tp_d, dcp_d, routing, BLOCK,
                                  PDD_PREFILL_URLS=prefill.url, **extra)
        router = cluster.router([prefill], [decode])
        for p in (prefill, decode, router):
            p.wait_ready(timeout=ready_timeout)
        matched = moved = minimum = tp1_matched = 0
        div: list[str] = []
        tp1_div: list[str] = []
        tp1_gaps: list[float] = []
        problems: list[str] = []
        for n in PROMPT_LENGTHS:
            status, body = http("POST", f"{router.url}/v1/completions",
                                {"prompt": _prompt(n), "max_tokens": MAX_TOKENS,
                                 "temperature": 0}, timeout=120)
            if status != 200:
                problems.append(f"prompt {n}: HTTP {status}: {body}")
                div.append("err")
                tp1_div.append("err")
                continue
            got = body["choices"][0]["token_ids"]
            want = refs[n]
            matched += sum(a == b for a, b in zip(got, want, strict=False))
            step = first_divergence(got, want)
            div.append("-" if step is None else str(step))
            if step is not None:
                problems.append(f"prompt {n}: tokens {got} != reference {want}")
            if tp1 is not None:
                tp1_matched += sum(a == b for a, b in zip(got, tp1.tokens[n], strict=False))
                at = first_divergence(got, tp1.tokens[n])
                tp1_div.append("-" if at is None else str(at))
                if at is not None and tp1.margins is not None and at < len(tp1.margins[n]):
                    tp1_gaps.append(tp1.margins[n][at])
            per_rank = [r["bytes"] for r in body["pdd"]["transfer"]["ranks"]]
            need = bytes_per_decode_rank(plan, n, bytes_per_token)
            moved += sum(per_rank)
            minimum += sum(need)
            if per_rank != need:
                problems.append(f"prompt {n}: bytes per decode rank {per_rank} != minimum {need}")
        # Cross-check the decode instance's own counter against the responses.
        status, text = http("GET", f"{decode.url}/metrics")
        counted = _metric_sum(text if isinstance(text, str) else "",
                              "pdd_kv_transfer_bytes_total")
        if counted is not None and int(counted) != moved:
            problems.append(f"/metrics transfer bytes {counted} != responses' {moved}")
        status, stats = http("GET", f"{prefill.url}/v1/stats")
        if status != 200 or stats["leases"]["expired_total"] != 0:
            problems.append(f"prefill freed by lease, not notification: {stats}")
        row.tokens = f"{matched}/{len(PROMPT_LENGTHS) * MAX_TOKENS}"
        row.divergence = " ".join(div)
        if tp1 is not None:
            row.tp1_tokens = f"{tp1_matched}/{len(PROMPT_LENGTHS) * MAX_TOKENS}"
            row.tp1_divergence = " ".join(tp1_div)
            row.tp1_margin = f"{min(tp1_gaps):.4f}" if tp1_gaps else "-"
        row.bytes = f"{moved}/{minimum}"
        row.status = "PASS" if not problems else "FAIL"
        row.detail = "\n".join(problems)
    except Exception as exc:  # one configuration's failure must not stop the sweep
        row.detail = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        cluster.close()
        row.seconds = f"{time.monotonic() - start:.1f}"
    return row


def _metric_sum(text: str, name: str) -> float | None:
    """Sum of every sample of metric `name` in a Prometheus text exposition."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or line.split("{")[0].split(" ")[0] != name:
            continue
        total += float(line.rsplit(" ", 1)[1])
        found = True
    return total if found else None


HEADER = ("Configuration", "dtype", "Status", "Tokens matched", "First divergence",
          "Bytes moved / minimum", "s", "vs tp1", "tp1 divergence", "tp1 margin")


def table(rows: list[Row]) -> str:
    cells = [HEADER] + [(r.config + (" *" if r.reference else ""), r.dtype, r.status, r.tokens,
                         r.divergence, r.bytes, r.seconds, r.tp1_tokens, r.tp1_divergence,
                         r.tp1_margin) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in cells)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", default="bfloat16",
                    help="comma list of float32|bfloat16; each runs the whole sweep")
    ap.add_argument("--configs", default="all",
                    help="comma list: all | x2 | reference | PxQ-RxS (P TPp/DCPq -> D TPr/DCPs)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs available (default: torch.cuda.device_count(); none on cpu)")
    ap.add_argument("--jobs", type=int, default=1, help="configurations run at once")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no configuration after this many seconds (listed as NOT RUN)")
    ap.add_argument("--ready-timeout-s", type=float, default=120)
    ap.add_argument("--max-errors", type=int, default=2,
                    help="after this many configurations in ERROR, skip the rest (NOT RUN)")
    ap.add_argument("--out", type=Path, default=None, help="write sweep.txt and sweep.json here")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    import torch

    dtypes = [d.strip() for d in a.dtype.split(",") if d.strip()]
    configs = parse_configs(a.configs)
    if a.device == "cuda":
        gpus = a.gpus if a.gpus is not None else torch.cuda.device_count()
        where = (f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else "no GPU")
    else:
        gpus, where = 1 << 30, "CPU (gloo, DRAM registration)"
    print(f"GPU sweep on {where}; torch {torch.__version__}; configurations {len(configs)}; "
          f"dtypes {','.join(dtypes)}", flush=True)

    # The single-device reference per dtype, and how it compares with the CPU float32 one.
    tp1 = {d: tp1_reference(d, a.device) for d in dtypes}
    cpu_ref = references("float32", "cpu")
    notes = []
    for d in dtypes:
        same = sum(x == y for n in PROMPT_LENGTHS for x, y in zip(tp1[d].tokens[n], cpu_ref[n],
                                                                 strict=False))
        notes.append(f"reference {a.device} tp1 {d} vs CPU float32 tp1: {same}/"
                     f"{len(PROMPT_LENGTHS) * MAX_TOKENS} tokens equal")
    for line in notes:
        print(line, flush=True)
    # PASS/FAIL yardsticks: a single instance where both sides share a layout, else the
    # in-memory hand-off between the two layouts.
    yardsticks: dict[tuple[Config, str], Reference] = {}
    singles: dict[tuple[int, int, str], Reference] = {}
    for d in dtypes:
        for cfg in configs:
            if gpus_needed(cfg) > gpus:
                continue
            tl = time.monotonic()
            if cfg[0] != cfg[1]:
                ref = handoff_reference(cfg, d, a.device)
                what = f"hand-off {_label(cfg)} {d}"
            else:
                key = (cfg[1][0], cfg[1][1], d)
                if key not in singles:
                    singles[key] = (tp1[d] if key[:2] == (1, 1)
                                    else layout_reference(key[0], key[1], d, a.device))
                ref = singles[key]
                what = f"single instance tp{key[0]}/dcp{key[1]} {d}"
            yardsticks[(cfg, d)] = ref
            same = sum(x == y for n in PROMPT_LENGTHS
                       for x, y in zip(ref.tokens[n], tp1[d].tokens[n], strict=False))
            line = (f"{what}: {same}/{len(PROMPT_LENGTHS) * MAX_TOKENS} tokens equal to tp1 "
                    f"({time.monotonic() - tl:.0f}s)")
            notes.append(line)
            print(line, flush=True)

    rf._context()  # start the forkserver once, before any worker thread uses it
    rows: dict[tuple[Config, str], Row] = {}
    todo = []
    for d in dtypes:
        for cfg in configs:
            if gpus_needed(cfg) > gpus:
                rows[(cfg, d)] = Row(_label(cfg), d, "NOT RUN", reference=cfg in REFERENCE_SWEEP,
                                     detail=f"needs {gpus_needed(cfg)} GPUs, machine has {gpus}")
            else:
                todo.append((cfg, d))

    workroot = Path(tempfile.mkdtemp(prefix="pdd-gpu-sweep-"))
    errors = [0]  # configurations that ended in ERROR after their retry

    def one(item: tuple[Config, str]) -> Row:
        cfg, d = item
        if a.budget_s is not None and time.monotonic() - t0 > a.budget_s:
            return Row(_label(cfg), d, "NOT RUN", reference=cfg in REFERENCE_SWEEP,
                       detail=f"time budget {a.budget_s:.0f}s spent")
        if errors[0] >= a.max_errors:
            return Row(_label(cfg), d, "NOT RUN", reference=cfg in REFERENCE_SWEEP,
                       detail=f"skipped after {errors[0]} configurations ended in ERROR")
        name = f"{cfg[0][0]}x{cfg[0][1]}-{cfg[1][0]}x{cfg[1][1]}-{d}"
        want = yardsticks[(cfg, d)].tokens
        row = run_config(cfg, d, a.device, want, workroot / name, a.ready_timeout_s, tp1[d])
        if row.status == "ERROR":  # a start-up race (a port taken meanwhile): one more try
            print(f"{row.config} {d}: ERROR, trying once more: {row.detail}", flush=True)
            first = row.detail.strip().splitlines()[0]
            row = run_config(cfg, d, a.device, want, workroot / f"{name}-2",
                             a.ready_timeout_s, tp1[d])
            row.detail = (row.detail + "\n" if row.detail else "") + f"(retried after: {first})"
            if row.status == "ERROR":
                errors[0] += 1
        print(f"[{time.monotonic() - t0:6.1f}s] {row.config} {d}: {row.status} "
              f"tokens {row.tokens} bytes {row.bytes} ({row.seconds}s)", flush=True)
        if row.detail:
            print("    " + row.detail.replace("\n", "\n    "), flush=True)
        return row

    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        for item, row in zip(todo, pool.map(one, todo), strict=True):
            rows[item] = row
    ordered = [rows[(cfg, d)] for d in dtypes for cfg in configs]

    title = (f"GPU data-plane sweep ({where}; router -> prefill -> NIXL/UCX "
             f"{'VRAM' if a.device == 'cuda' else 'DRAM'} -> decode; blockSize {BLOCK}, "
             f"{len(PROMPT_LENGTHS)} prompts of {','.join(map(str, PROMPT_LENGTHS))} tokens x "
             f"{MAX_TOKENS} greedy tokens; * = reference configuration; Status and Tokens "
             f"matched: against the same model without the network, a single instance where both "
             f"sides share a layout, else the prefill layout's latents decoded in the decode "
             f"layout in memory; vs tp1: against the "
             f"single-GPU reference, with its top1-top2 logit margin at the first differing "
             f"step)")
    text = "\n".join([title, *notes, table(ordered)])
    not_run = [r for r in ordered if r.status == "NOT RUN"]
    if not_run:
        text += "\nNot run:\n" + "\n".join(f"  {r.config} {r.dtype}: {r.detail}" for r in not_run)
    print("\n" + text, flush=True)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "sweep.txt").write_text(text + "\n")
        (a.out / "sweep.json").write_text(json.dumps(
            {"where": where, "notes": notes, "rows": [asdict(r) for r in ordered]}, indent=1))
    print(f"total {time.monotonic() - t0:.1f}s", flush=True)
    ran = [r for r in ordered if r.status != "NOT RUN"]
    return 0 if ran and all(r.status == "PASS" for r in ran) else 1


if __name__ == "__main__":
    raise SystemExit(main())
