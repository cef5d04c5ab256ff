"""Draw the benchmarks' JSON as PNG plots for docs/ (next to the tables they show).

    python bench/plot.py serving docs/serving_cpu.json docs/serving_cpu.png
    python bench/plot.py engine docs/gpu_engine_h200.json docs/gpu_engine_h200.png
    python bench/plot.py serve_path docs/serve_path_cpu.json docs/serve_path_cpu.png
    python bench/plot.py prefix_cache docs/prefix_cache_h200.json docs/prefix_cache_h200.png
    python bench/plot.py autoscale docs/autoscale_sim.json docs/autoscale_sim.png
    python bench/plot.py kv_tiers docs/kv_tiers_h200_b_c.json docs/kv_tiers_h200_b_c.png

Inputs are what `bench/serving.py --json`, `bench/engine.py --json`,
`bench/serve_path.py --json` and `bench/prefix_cache.py --json` write. Tables show exact
figures; the plots show the shape (where dcp = N's admitted batch pays, how far a step is from
its roofline) at a glance. Needs matplotlib (`pip install -e .[bench]`). The `*_series`
functions are pure and shared with the tests that keep the JSON and the tables in step.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Series = dict[str, list[tuple[float, float]]]


def _pyplot() -> Any:
    """matplotlib's pyplot on a backend that needs no display (imported here: only drawing
    needs it, not the series the tests read)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, out: Path) -> None:
    # No Software/date metadata: the same JSON gives the same file.
    fig.savefig(out, dpi=100, metadata={"Software": None})
    plt.close(fig)


def serving_series(data: dict[str, Any]) -> dict[str, Series]:
    """Per metric, per decode layout: (concurrency, value) points in concurrency order."""
    out: dict[str, Series] = {}
    metrics = {"output tokens/s": "tokens_per_s", "TPOT p50 (ms)": "tpot_p50_ms",
               "TTFT p50 (ms)": "ttft_p50_ms", "admitted sequences": "max_running"}
    for title, key in metrics.items():
        series: Series = {}
        for lv in sorted(data["levels"], key=lambda r: (r["decode_dcp"], r["concurrency"])):
            series.setdefault(f"decode dcp {lv['decode_dcp']}", []).append(
                (float(lv["concurrency"]), float(lv[key])))
        out[title] = series
    return out


def engine_series(data: dict[str, Any]) -> dict[str, Series]:
    """Decode step time (CUDA graph vs roofline) and tokens/s per batch over context; paged
    attention GB/s over context; MoE time over tokens. Skipped layouts (KV over budget) drop."""
    decode = [d for d in data["decode"] if "graph_ms" in d]
    out: dict[str, Series] = {"decode step (ms)": {}, "decode tokens/s": {}}
    for d in sorted(decode, key=lambda r: (r["batch"], r["context"])):
        step = out["decode step (ms)"]
        step.setdefault(f"batch {d['batch']} graph", []).append((d["context"], d["graph_ms"]))
        step.setdefault(f"batch {d['batch']} roofline", []).append(
            (d["context"], d["roofline_ms"]))
        out["decode tokens/s"].setdefault(f"batch {d['batch']}", []).append(
            (d["context"], d["tokens_per_s"]))
    att: Series = {}
    for a in sorted(data.get("attention", []), key=lambda r: (r["batch"], r["context"])):
        att.setdefault(f"batch {a['batch']}", []).append((a["context"], a["GBps"]))
    out["paged MLA attention (GB/s)"] = att
    moe: Series = {"grouped_mm": [], "per-expert GEMV": []}
    for m in sorted(data.get("moe", []), key=lambda r: r["tokens"]):
        moe["grouped_mm"].append((m["tokens"], m["grouped_mm_us"]))
        moe["per-expert GEMV"].append((m["tokens"], m["gemv_us"]))
    out["MoE layer (µs)"] = moe
    return out


SERVE_PATH_STAGES = ("router_to_prefill", "prefill_queue", "prefill_compute",
                     "prefill_to_router", "to_client", "grant_to_decode", "decode_queue",
                     "claim", "read", "join", "first_step", "decode_to_client")


def serve_path_series(data: dict[str, Any]) -> tuple[list[str], dict[str, list[float]],
                                                      dict[str, list[float]]]:
    """Level labels; per stage (to the first token, then the hand-off to the decode's first),
    its median (ms) at each level (0 where the stage did not happen); and the measured TTFT
    p50 and the decode's first token p50 beside the engine bound (ms; NaN where a level is
    judged otherwise or has no second token)."""
    levels = data["levels"]
    labels = [lv["level"] for lv in levels]
    stages = {k: [float(lv["timing_p50_ms"].get(k, 0.0)) for lv in levels]
              for k in SERVE_PATH_STAGES}
    nan = float("nan")
    ttft = {"TTFT p50": [float(lv["ttft_p50_ms"]) for lv in levels],
            "2nd token p50": [float(lv.get("second_p50_ms", nan)) for lv in levels],
            "engine bound": [float(lv["bounds"].get("ttft_bound_ms", nan)) for lv in levels]}
    return labels, stages, ttft


def plot_serve_path(data: dict[str, Any], out: Path) -> None:
    plt = _pyplot()

    cfg = data.get("config", {})
    labels, stages, ttft = serve_path_series(data)
    xs = list(range(len(labels)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    bottom = [0.0] * len(labels)
    colors = plt.get_cmap("tab20")
    for i, (name, values) in enumerate(stages.items()):
        ax1.bar(xs, values, bottom=bottom, label=name, color=colors(i))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax1.set_title("median of each stage to the decode's first token (ms)")
    ax2.bar([x - 0.27 for x in xs], ttft["TTFT p50"], width=0.27, label="TTFT p50, served")
    ax2.bar(xs, ttft["2nd token p50"], width=0.27, label="decode's first token p50, served")
    ax2.bar([x + 0.27 for x in xs], ttft["engine bound"], width=0.27,
            label="prefill + decode step, engine (same run)")
    ax2.set_title("first tokens against the engine's bound (ms)")
    for ax in (ax1, ax2):
        ax.set_xticks(xs, labels, rotation=30, fontsize=8)
        ax.set_xlabel("concurrency:prompt:max_tokens")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"bench/serve_path.py: P tp1 -> D tp1, {Path(str(cfg.get('model', '?'))).name}"
                 f" on {cfg.get('device', '?')} {cfg.get('dtype', '')}")
    fig.tight_layout()
    _save(plt, fig, out)


def prefix_cache_series(data: dict[str, Any]) -> dict[str, Series]:
    """Per workload and metric (TTFT p50 in ms, KV MB READ per request), per cache setting:
    (phase, value) points in phase order."""
    out: dict[str, Series] = {}
    for ph in data["phases"]:
        setting = "cache on" if ph["cache"] else "cache off"
        done = max(1, ph["requests"] - ph["errors"])
        for metric, value in (("TTFT p50 (ms)", ph["ttft_p50_ms"]),
                              ("KV MB READ per request", ph["kv_bytes_read"] / done / 1e6)):
            out.setdefault(f"{ph['workload']}: {metric}", {}).setdefault(setting, []).append(
                (float(ph["phase"]), float(value)))
    return out


def plot_prefix_cache(data: dict[str, Any], out: Path) -> None:
    cfg = data.get("config", {})
    title = (f"bench/prefix_cache.py: {Path(str(cfg.get('model', '?'))).name} on "
             f"{cfg.get('device', '?')}, cache off against on")
    panels = prefix_cache_series(data)
    xlabels = {k: ("round" if k.startswith("shared") else "turn") for k in panels}
    _draw(panels, title, xlabels, out, log_x=False)


def _draw(panels: dict[str, Series], title: str, xlabels: dict[str, str], out: Path,
          hlines: dict[str, tuple[float, str]] | None = None, log_x: bool = True) -> None:
    plt = _pyplot()

    n = len(panels)
    cols = 2 if n > 2 else n
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, (name, series) in zip(axes.flat, panels.items(), strict=False):
        palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        colors: dict[str, str] = {}
        for label, points in series.items():
            xs, ys = zip(*points, strict=True) if points else ((), ())
            # A measured line and its roofline share a colour; the roofline is dashed.
            group = label.removesuffix(" roofline").removesuffix(" graph")
            color = colors.setdefault(group, palette[len(colors) % len(palette)])
            style = "--" if label.endswith("roofline") else "-"
            ax.plot(xs, ys, style, color=color, marker="o", markersize=4, label=label)
        if hlines and name in hlines:
            value, text = hlines[name]
            ax.axhline(value, color="grey", linestyle=":", label=text)
        ax.set_title(name)
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabels.get(name, ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    _save(plt, fig, out)


def autoscale_series(data: dict[str, Any]) -> dict[str, Series]:
    """Per start-up and policy, instances over the first seed's day (prefill + decode, hours);
    and that day's request rate."""
    out: dict[str, Series] = {"instances (prefill + decode)": {}, "requests/s": {}}
    for su in data["startups"]:
        for policy, points in su["timeline"].items():
            out["instances (prefill + decode)"][f"{policy}, {su['ready_s']:.0f} s"] = [
                (t / 3600, float(p + d)) for t, _rps, p, d in points]
    first = next(iter(data["startups"][0]["timeline"].values()))
    out["requests/s"]["trace"] = [(t / 3600, float(rps)) for t, rps, _p, _d in first]
    return out


def plot_autoscale(data: dict[str, Any], out: Path) -> None:
    plt = _pyplot()

    series = autoscale_series(data)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors: dict[str, str] = {}
    for name, pts in series["instances (prefill + decode)"].items():
        policy = name.rsplit(", ", 1)[0]
        if policy.startswith(("static (peak", "requests (equal")):
            continue  # kept in the JSON; the left panel shows the policies at one attainment
        color = colors.setdefault(policy, f"C{len(colors)}")
        ax1.plot([x for x, _ in pts], [y for _, y in pts], label=name, linewidth=1, color=color,
                 linestyle="-" if name.endswith(f"{data['startups'][0]['ready_s']:.0f} s")
                 else ":")
    ax1b = ax1.twinx()
    rate = series["requests/s"]["trace"]
    ax1b.plot([x for x, _ in rate], [y for _, y in rate], color="grey", alpha=0.4,
              linewidth=0.8, label="requests/s")
    ax1b.set_ylabel("requests/s (grey)")
    ax1.set_xlabel("hour")
    ax1.set_ylabel("instances")
    ax1.set_title("instances over the first seed's day")
    ax1.legend(fontsize=7, loc="upper left")
    for su, marker in zip(data["startups"], "os^v", strict=False):
        pol = su["policies"]
        xs = [pol[n]["gpu_hours"] for n in pol]
        ys = [100 * (1 - pol[n]["attainment"]) for n in pol]
        ax2.scatter(xs, ys, marker=marker, label=f"start-up {su['ready_s']:.0f} s")
        for n, x, y in zip(pol, xs, ys, strict=True):
            ax2.annotate(n, (x, y), fontsize=7)
    ax2.set_yscale("symlog", linthresh=0.1)
    ax2.set_xlabel("GPU-hours a day (mean over seeds)")
    ax2.set_ylabel("% of requests missing TTFT or TPOT target")
    ax2.set_title("cost and misses")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    _save(plt, fig, out)


def kv_tiers_bars(data: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per metric (out tokens/s, TTFT p50 in ms), per load in run order, per stack: the value
    (a load one stack did not run is absent from that stack)."""
    out: dict[str, dict[str, dict[str, float]]] = {"output tokens/s": {}, "TTFT p50 (ms)": {}}
    for ld in data["loads"]:
        out["output tokens/s"].setdefault(ld["load"], {})[ld["stack"]] = float(ld["tok_s"])
        out["TTFT p50 (ms)"].setdefault(ld["load"], {})[ld["stack"]] = float(ld["ttft_p50_ms"])
    return out


def plot_kv_tiers(data: dict[str, Any], out: Path) -> None:
    plt = _pyplot()

    cfg = data.get("config", {})
    bars = kv_tiers_bars(data)
    stacks = list(dict.fromkeys(ld["stack"] for ld in data["loads"]))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(stacks)
    for ax, (metric, loads) in zip(axes, bars.items(), strict=True):
        labels = list(loads)
        for i, stack in enumerate(stacks):
            xs = [j + (i - (len(stacks) - 1) / 2) * width for j, ld in enumerate(labels)
                  if stack in loads[ld]]
            ax.bar(xs, [loads[ld][stack] for ld in labels if stack in loads[ld]], width=width,
                   label=stack)
        ax.set_yscale("log")
        ax.set_title(metric + " (log scale)")
        ax.set_xticks(range(len(labels)), labels, rotation=25, ha="right", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"bench/kv_tiers.py parts {cfg.get('parts', '?')}: P tp1 + D tp1 on one GPU, "
                 f"{Path(str(cfg.get('model', '?'))).name} on {cfg.get('device', '?')} "
                 f"{cfg.get('dtype', '')}")
    fig.tight_layout()
    _save(plt, fig, out)


def plot_serving(data: dict[str, Any], out: Path) -> None:
    cfg = data.get("config", {})
    title = (f"bench/serving.py: P tp{cfg.get('prefill_tp', '?')}/dcp{cfg.get('prefill_dcp', '?')}"
             f" -> D tp{cfg.get('decode_tp', '?')}, {Path(str(cfg.get('model', '?'))).name} on "
             f"{cfg.get('device', '?')}, prompt {cfg.get('prompt_tokens', '?')} + "
             f"{cfg.get('max_tokens', '?')} tokens, same KV blocks per rank")
    panels = serving_series(data)
    _draw(panels, title, dict.fromkeys(panels, "concurrent streams"), out)


def plot_engine(data: dict[str, Any], out: Path) -> None:
    ceilings = data.get("ceilings", {})
    title = (f"bench/engine.py: {data.get('config', '?')} on {data.get('device', '?')} "
             f"(torch {data.get('torch', '?')}, Triton {data.get('triton', '?')})")
    panels = engine_series(data)
    xlabels = {"decode step (ms)": "context (tokens)", "decode tokens/s": "context (tokens)",
               "paged MLA attention (GB/s)": "context (tokens)",
               "MoE layer (µs)": "tokens in the batch"}
    hlines = {}
    if "hbm_read_Bps" in ceilings:
        hlines["paged MLA attention (GB/s)"] = (ceilings["hbm_read_Bps"] / 1e9,
                                                "HBM read, same run")
    _draw(panels, title, xlabels, out, hlines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["serving", "engine", "serve_path", "prefix_cache",
                                     "autoscale", "kv_tiers"])
    ap.add_argument("json", type=Path)
    ap.add_argument("png", type=Path)
    args = ap.parse_args(argv)
    data = json.loads(args.json.read_text())
    {"serving": plot_serving, "engine": plot_engine,
     "serve_path": plot_serve_path, "prefix_cache": plot_prefix_cache,
     "autoscale": plot_autoscale, "kv_tiers": plot_kv_tiers}[args.kind](data, args.png)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
