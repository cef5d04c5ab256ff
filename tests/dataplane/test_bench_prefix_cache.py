"""bench/prefix_cache.py --quick runs cache off and on end to end: no request fails, the answers
are the same token for token, the prefill's own count of tokens it computed and the answers'
cached tokens add up to the prompts, the cache computes the shared system prompt once (its first
round's requests, sent together, wait for the one computing it), every chat turn after the first
computes less, and the decode reads, from the second turn on, only the new tokens' KV and the
previous answer's last token's (off: the whole prompt's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_fixtures import load_bench

pytestmark = pytest.mark.dataplane

def test_quick_run_compares_cache_off_and_on(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    mod = load_bench("prefix_cache.py", monkeypatch)
    out = tmp_path / "prefix_cache.json"
    assert mod.main(["--quick", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    cfg = res["config"]
    assert cfg["num_blocks"] is None and {pool["sized_by"] for pool in cfg["pools"].values()} \
        == {"cpu default"}  # the stack a user gets
    phases = res["phases"]
    off = [p for p in phases if not p["cache"]]
    on = [p for p in phases if p["cache"]]
    assert len(off) == len(on) == cfg["rounds"] + cfg["turns"]
    for a, b in zip(off, on, strict=True):
        assert (a["workload"], a["phase"]) == (b["workload"], b["phase"])
        assert a["errors"] == b["errors"] == 0
        assert a["prompt_tokens"] == b["prompt_tokens"]
        assert a["computed_tokens"] == a["prompt_tokens"] and a["cached_tokens"] == 0
        # the prefill's counter against what the answers say came from its cache
        assert b["computed_tokens"] + b["cached_tokens"] == b["prompt_tokens"]
        assert a["tokens"] == b["tokens"], (a["workload"], a["phase"])
        assert [len(t) for t in a["tokens"]] == [cfg["max_tokens"]] * a["requests"]
        assert a["kv_bytes_read"] >= b["kv_bytes_read"] > 0
        assert a["kv_bytes_read"] == a["prompt_tokens"] * res["kv_bytes_per_token"]
        assert b["ttft_p50_ms"] > 0
    shared = [p for p in on if p["workload"] == "shared"]
    # The first round's requests arrive together: one computes the system prompt, the rest
    # wait for it and compute only their own tokens.
    assert shared[0]["computed_tokens"] == cfg["shared"] + cfg["concurrency"] * cfg["unique"]
    # After the first round every request finds the system prompt (whole blocks) cached.
    assert all(p["computed_tokens"] == cfg["concurrency"] * cfg["unique"] for p in shared[1:])
    chat = [p for p in on if p["workload"] == "chat"]
    assert chat[0]["cached_tokens"] == 0
    assert all(a["computed_tokens"] < b["computed_tokens"]
               for a, b in zip(chat[1:], [p for p in off if p["workload"] == "chat"][1:],
                               strict=True))
    # A first round that runs as one prefill step computes every prompt whole (its prompts
    # find nothing cached yet); the later rounds only their own tokens.
    each, rounds = cfg["concurrency"] * (cfg["shared"] + cfg["unique"]), cfg["rounds"]
    assert res["summary"]["shared"]["computed_ratio"] <= (
        each + (rounds - 1) * cfg["concurrency"] * cfg["unique"]) / (rounds * each)
    # A later turn reads its new tokens and the answer's unfed last token, nothing of what the
    # turn before fed: the decode adopts the partial unit it left as well as the whole ones.
    turn = cfg["turn_tokens"]
    for a, b in zip(chat[1:], [p for p in off if p["workload"] == "chat"][1:], strict=True):
        assert b["kv_over_new"] > a["kv_over_new"]
        assert a["kv_over_new"] == pytest.approx((turn + 1) / turn, rel=1e-9)
        assert a["kv_bytes_read"] == pytest.approx(
            a["requests"] * (turn + 1) * res["kv_bytes_per_token"], rel=1e-9)
