"""The plots in docs/ draw the JSON beside them, and that JSON holds the figures of the tables
next to the plots (a table edited without its JSON, or the reverse, fails here)."""

from __future__ import annotations

import importlib.util
import json
import re
from types import ModuleType
from typing import Any

import pytest

from .conftest import ROOT

DOCS = ROOT / "docs"


def plot_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_plot", ROOT / "bench" / "plot.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load(name: str) -> Any:
    return json.loads((DOCS / name).read_text())


def serving_tables() -> dict[str, list[list[str]]]:
    """The rows of each bench/serving.py output block in docs/serving.md, by its first line."""
    tables: dict[str, list[list[str]]] = {}
    for block in (DOCS / "serving.md").read_text().split("```")[1::2]:
        lines = block.strip("\n").splitlines()
        if not lines or not lines[0].startswith("serving: "):
            continue
        tables[lines[0]] = [ln.split() for ln in lines[2:] if len(ln.split()) == 12
                            and all(re.fullmatch(r"[\d.]+", f) for f in ln.split())]
    return tables


@pytest.mark.parametrize("name", ["serving_cpu.json", "serving_h200.json",
                                  "serving_h200_graphs.json"])
def test_serving_json_holds_its_table(name: str) -> None:
    data = load(name)
    cfg = data["config"]
    heading = (f"serving: P tp{cfg['prefill_tp']}/dcp{cfg['prefill_dcp']} -> "
               f"D tp{cfg['decode_tp']}/dcp{{1,{cfg['decode_tp']}}}, model {cfg['model']}, "
               f"{cfg['device']}, prompt {cfg['prompt_tokens']} + {cfg['max_tokens']} tokens")
    (rows,) = [t for first, t in serving_tables().items() if first.startswith(heading)]
    levels = data["levels"]
    assert len(rows) == len(levels) >= 4
    for fields, lv in zip(rows, levels, strict=True):
        assert fields == [
            str(lv["decode_dcp"]), str(lv["concurrency"]), str(lv["requests"]),
            str(lv["errors"]), f"{lv['tokens_per_s']:.1f}", f"{lv['ttft_p50_ms']:.1f}",
            f"{lv['tpot_p50_ms']:.2f}", f"{lv['tpot_p90_ms']:.2f}", str(lv["max_running"]),
            str(lv["max_waiting"]), str(lv["min_blocks_free"]), f"{lv['mean_batch']:.2f}"]


def close(shown: str, value: float, digits: int) -> bool:
    """`shown` is `value` to within one unit of its last digit (the tables were rounded twice,
    e.g. 37.8497 shown as 37.9)."""
    return abs(float(shown) - value) <= 10**-digits + 1e-9


def test_engine_json_holds_the_decode_table() -> None:
    decode = {(d["batch"], d["context"]): d for d in load("gpu_engine_h200.json")["decode"]}
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| "
                      r"(\d+)% \| (\d+) \|$", (DOCS / "gpu.md").read_text(), re.M)
    measured = {k: d for k, d in decode.items() if "graph_ms" in d}
    assert len(rows) == len(measured) >= 8
    for b, c, eager, graph, engine, roof, of_roof, tps in rows:
        d = measured[(int(b), int(c))]
        assert close(eager, d["eager_ms"], 1) and close(graph, d["graph_ms"], 2)
        assert close(engine, d["engine_graph_ms"], 2) and close(roof, d["roofline_ms"], 2)
        assert int(of_roof) == round(100 * d["engine_of_roofline"])
        assert int(tps) == round(d["batch"] * 1000 / d["engine_graph_ms"])


def test_series_are_the_json_points() -> None:
    plot = plot_module()
    data = load("serving_cpu.json")
    series = plot.serving_series(data)
    for lv in data["levels"]:
        line = series["output tokens/s"][f"decode dcp {lv['decode_dcp']}"]
        assert (lv["concurrency"], lv["tokens_per_s"]) in line
        assert (lv["concurrency"], lv["max_running"]) in series["admitted sequences"][
            f"decode dcp {lv['decode_dcp']}"]
    engine = load("gpu_engine_h200.json")
    es = plot.engine_series(engine)
    points = sum(len(v) for v in es["decode tokens/s"].values())
    assert points == sum(1 for d in engine["decode"] if "graph_ms" in d)
    for d in engine["decode"]:
        if "graph_ms" in d:
            graph = es["decode step (ms)"][f"batch {d['batch']} graph"]
            assert (d["context"], d["graph_ms"]) in graph
    assert len(es["MoE layer (µs)"]["grouped_mm"]) == len(engine["moe"])


def test_serve_path_series_are_the_json_points() -> None:
    from pdd_sidecar.engine.timing import STAGES

    plot = plot_module()
    assert plot.SERVE_PATH_STAGES == STAGES  # plot.py imports no sidecar code: same names
    data = load("serve_path_cpu.json")
    labels, stages, ttft = plot.serve_path_series(data)
    assert labels == [lv["level"] for lv in data["levels"]] and len(labels) >= 3
    for i, lv in enumerate(data["levels"]):
        assert {k: v[i] for k, v in stages.items()} == {
            k: v for k, v in lv["timing_p50_ms"].items() if k not in ("ttft", "second_token")}
        assert ttft["TTFT p50"][i] == lv["ttft_p50_ms"]
        assert ttft["engine bound"][i] == lv["bounds"]["ttft_bound_ms"]


@pytest.mark.parametrize("name,device", [("serve_path_cpu.json", "cpu"),
                                         ("serve_path_h200.json", "cuda")])
def test_serve_path_json_holds_its_table(name: str, device: str) -> None:
    """The level rows of the bench/serve_path.py output in docs/serving.md are the JSON's (the
    first run printed for the device: the current one; older runs follow it)."""
    data = load(name)
    assert data["config"]["device"] == device
    block = next(b for b in (DOCS / "serving.md").read_text().split("```")[1::2]
                 if b.lstrip().startswith("serve_path: ")
                 and f", {device} " in b.lstrip().splitlines()[0])
    shown = {f[0]: f for ln in block.splitlines()
             if (f := ln.split()) and f[0] in {lv["level"] for lv in data["levels"]}
             and len(f) > 10 and f[1].isdigit()}
    assert len(shown) == len(data["levels"])
    for lv in data["levels"]:
        f = shown[lv["level"]]
        assert f[1:4] == [str(lv["requests"]), str(lv["errors"]), f"{lv['wall_s']:.2f}"]
        assert f[5:7] == [f"{lv['ttft_p50_ms']:.1f}", f"{lv['ttft_p99_ms']:.1f}"]


def test_prefix_cache_json_holds_its_table_and_plot() -> None:
    """The H200 prefix-cache rows in docs/serving.md and the plot's points are the JSON's."""
    plot = plot_module()
    data = load("prefix_cache_h200.json")
    series = plot.prefix_cache_series(data)
    for ph in data["phases"]:
        setting = "cache on" if ph["cache"] else "cache off"
        ttft = series[f"{ph['workload']}: TTFT p50 (ms)"][setting]
        assert (float(ph["phase"]), ph["ttft_p50_ms"]) in ttft
    text = (DOCS / "serving.md").read_text()
    section = text[text.index("[prefix_cache_h200.json](prefix_cache_h200.json)"):]
    block = section.split("```")[1]
    rows = {(f[0], f[1]): f for ln in block.splitlines()
            if (f := ln.split()) and f[0] in ("shared", "chat") and len(f) == 11}
    on = {(p["workload"], str(p["phase"])): p for p in data["phases"] if p["cache"]}
    off = {(p["workload"], str(p["phase"])): p for p in data["phases"] if not p["cache"]}
    assert set(rows) == set(on) == set(off)
    for key, f in rows.items():
        assert f[7] == f"{off[key]['ttft_p50_ms']:.1f}/{on[key]['ttft_p50_ms']:.1f}"


def test_autoscale_sim_json_holds_its_table_and_plot() -> None:
    """docs/autoscaling.md's simulation table and the plot's points are the JSON's."""
    plot = plot_module()
    data = load("autoscale_sim.json")
    series = plot.autoscale_series(data)
    text = (DOCS / "autoscaling.md").read_text()
    section = text[text.index("[autoscale_sim.json](autoscale_sim.json)"):]
    rows = {(f[1].strip(), f[2].strip()): f for ln in section.splitlines()
            if ln.startswith("| ") and len(f := ln.split("|")) > 8}
    for su in data["startups"]:
        for policy, points in su["timeline"].items():
            drawn = series["instances (prefill + decode)"][f"{policy}, {su['ready_s']:.0f} s"]
            assert [(t / 3600, float(p + d)) for t, _r, p, d in points] == drawn
        for policy, r in su["policies"].items():
            row = rows[(f"{su['ready_s']:.1f} s", policy)]
            assert row[3].strip() == f"{100 * r['attainment']:.2f} %"
            assert row[6].strip() == f"{r['gpu_hours']:.0f}"
            assert row[7].strip() == f"{100 * r['gpu_hours_vs_static']:.1f} %"
            assert row[8].strip() == f"{r['missed_requests']:,.0f}"


def test_kv_tiers_json_holds_its_table_and_plot() -> None:
    """docs/kv-memory.md's H200 table and the plots' bars are the two JSON files' loads."""
    plot = plot_module()
    text = (DOCS / "kv-memory.md").read_text()
    rows = {f[2].strip(): f for ln in text.splitlines()
            if ln.startswith("| (") and len(f := ln.split("|")) == 8}
    a_d, b_c = load("kv_tiers_h200_a_d.json"), load("kv_tiers_h200_b_c.json")
    for data in (a_d, b_c):
        bars = plot.kv_tiers_bars(data)
        for ld in data["loads"]:
            assert bars["TTFT p50 (ms)"][ld["load"]][ld["stack"]] == ld["ttft_p50_ms"]
            assert bars["output tokens/s"][ld["load"]][ld["stack"]] == ld["tok_s"]
    loads = {(ld["stack"], ld["load"]): ld for ld in a_d["loads"] + b_c["loads"]}
    for load_name in ("burst 64x(1024,128)", "burst 256x(1024,128)",
                      "closed loop 256, 64 in flight"):
        shown = load_name.removeprefix("burst ").replace("x(1024,", " x (1k, ")
        row = rows[shown]
        d, e = loads[("defaults", load_name)], loads[("explicit1", load_name)]
        assert f"{d['tok_s']:,.0f} tok/s" in row[3] and f"{e['tok_s']:,.0f} tok/s" in row[4]
    revisit_off = loads[("small pool", "32 revisits")]["ttft_p50_ms"]
    revisit_on = loads[("small pool + host tier", "32 revisits")]["ttft_p50_ms"]
    (b_row,) = [f for k, f in rows.items() if k.startswith("32 revisits")]
    assert f"{revisit_off / revisit_on:.2f}x lower" in b_row[5]
    off = loads[("small pool", "no reuse")]["tok_s"]
    on = loads[("small pool + host tier", "no reuse")]["tok_s"]
    assert rows["no reuse, closed loop in the small pool"][5].strip() == f"{on / off:.3f}"


@pytest.mark.parametrize(("png", "doc"), [("serving_cpu.png", "serving.md"),
                                          ("serve_path_cpu.png", "serving.md"),
                                          ("serve_path_h200.png", "serving.md"),
                                          ("prefix_cache_h200.png", "serving.md"),
                                          ("serving_h200.png", "serving.md"),
                                          ("serving_h200_graphs.png", "serving.md"),
                                          ("gpu_engine_h200.png", "gpu.md"),
                                          ("autoscale_sim.png", "autoscaling.md"),
                                          ("kv_tiers_h200_a_d.png", "kv-memory.md"),
                                          ("kv_tiers_h200_b_c.png", "kv-memory.md")])
def test_plots_are_committed_and_shown_next_to_their_tables(png: str, doc: str) -> None:
    assert (DOCS / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"]({png})" in (DOCS / doc).read_text()
