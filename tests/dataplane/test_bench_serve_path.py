"""bench/serve_path.py --quick runs a whole stack end to end: every level completes, each
request's breakdown is there and adds up to no more than its TTFT (the prefill's token) and
its second token (the decode's first), the bounds are real."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from bench_fixtures import load_bench

from pdd_sidecar.engine.timing import PREFILL_DETAIL, STAGES, TTFT_STAGES

pytestmark = pytest.mark.dataplane

EPS_MS = 0.1  # each stage is rounded to a microsecond

DETAIL = {f"prefill_{k}" for k in PREFILL_DETAIL}


def test_quick_run_reports_every_level_with_its_breakdown(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    mod = load_bench("serve_path.py", monkeypatch)
    out = tmp_path / "serve_path.json"
    assert mod.main(["--quick", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["device"] == "cpu" and res["config"]["model"] == "builtin"
    # the stack a user gets: pdd serve's block size and pools, not sized for the run
    assert res["config"]["block_size"] == 16 and res["config"]["num_blocks"] is None
    assert {role: (pool["blocks"], pool["sized_by"]) for role, pool in
            res["config"]["pools"].items()} == {"prefill": (1024, "cpu default"),
                                                "decode": (1024, "cpu default")}
    assert [lv["level"] for lv in res["levels"]] == mod.QUICK_LEVELS.split(",")
    bounds = res["bounds"]
    values = [*bounds["prefill_ms"].values(), *bounds["prefill_one_pass_ms"].values(),
              *bounds["decode_step_ms"].values()]
    assert values and all(v > 0 for v in values)
    for lv in res["levels"]:
        assert lv["errors"] == 0 and lv["requests"] == max(lv["concurrency"], 4), lv["level"]
        assert lv["output_tokens"] == lv["requests"] * lv["max_tokens"]
        assert 0 < lv["ttft_p50_ms"] < lv["second_p50_ms"] and lv["tokens_per_s"] > 0
        assert lv["bounds"]["ttft_bound_ms"] > 0 and lv["bounds"]["ttft_ratio"] > 0
        assert lv["read_bytes"] > 0 and lv["read_GBps"] > 0
        assert len(lv["timings"]) == lv["requests"]
        for t in lv["timings"]:
            assert set(t) == {*STAGES, "ttft", "second_token", *DETAIL}, sorted(t)
            assert t["prefill_inbox"] + t["prefill_gather"] <= t["prefill_queue"] + EPS_MS, t
            assert abs(t["prefill_launch"] + t["prefill_to_host"]
                       - t["prefill_compute"]) <= EPS_MS, t
            assert all(math.isfinite(v) and v >= 0 for v in t.values()), t
            assert sum(t[k] for k in TTFT_STAGES) <= t["ttft"] + EPS_MS, t
            assert sum(t[k] for k in STAGES) <= t["second_token"] + EPS_MS, t
        assert set(lv["timing_p50_ms"]) == {*STAGES, "ttft", "second_token"}
        assert lv["probe_failures"] == 0 and lv["probe_max_ms"] > 0, lv["level"]
        assert set(lv["cpu_s"]) == set(lv["gc_pauses"]) == {"router", "prefill", "decode",
                                                           "client"}, lv["level"]
        assert all(v > 0 for v in lv["cpu_s"].values()), lv["cpu_s"]
        since = lv["gc_since_start"]
        assert set(since) == set(lv["gc_pauses"]), since
        for n, secs, long in lv["gc_pauses"].values():
            assert 0 <= long <= n and secs >= 0, lv["gc_pauses"]
    # Every server times its collections: an instance's warm-up ends in one, and the router
    # collects while it relays tokens. A process that never installed its timer reports none.
    last = res["levels"][-1]["gc_since_start"]
    for name in ("router", "prefill", "decode"):
        n, secs, long = last[name]
        assert n >= 1 and secs > 0 and long <= n, (name, last)
    first = res["first_after_ready"]
    assert first["first_ttft_ms"] > 0 and first["steady_ttft_ms"] > 0
    assert first["ratio"] == pytest.approx(first["first_ttft_ms"] / first["steady_ttft_ms"])
    mixed = res["long_then_short"]
    assert mixed["short_ttft_ms"] > 0 and mixed["long_ttft_ms"] > 0 and mixed["ratio"] > 0
    assert mixed["worst_short_ttft_ms"] >= mixed["short_ttft_ms"] == statistics.median(
        mixed["short_ttfts_ms"])
    assert 1 <= mixed["shorts_sent"] and mixed["shorts_during"] <= mixed["shorts_sent"]
    assert mixed["overtaking_steps"] == mixed["overtaking_waited"] == 0  # a CPU never overtakes
    # every prefill step of the run, enqueued in order: the long prompt's chunks and the shorts'
    assert mixed["in_order_enqueued"] >= 1 + mixed["shorts_sent"]
    assert mixed["in_order_enqueue_ms"] > 0 and mixed["overtaking_enqueued"] == 0
    assert set(mixed["short_timing"]) == {*STAGES, "ttft", "second_token", *DETAIL}
    assert len(mixed["short_prefill_ms"]) == len(mixed["short_ttfts_ms"])
    # new prompts, as the run says (the prefix cache is on): no level sent them before
    assert mixed["long_cached_tokens"] == 0
    assert mixed["short_cached_tokens"] == [0] * len(mixed["short_ttfts_ms"])
    assert all(set(t) == set(mod.SHORT_PREFILL_PARTS) for t in mixed["short_prefill_ms"])
    many = [lv for lv in res["levels"] if lv["max_tokens"] >= mod.MANY_TOKENS]
    assert all(lv["bounds"]["tokens_per_s_bound"] > 0 for lv in many)
