"""bench/router_overhead.py runs the real router against stub upstreams: every streamed
request completes with its tokens, and the router's CPU time per request is measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_fixtures import load_bench

pytestmark = pytest.mark.dataplane

def test_bursts_complete_and_the_router_cpu_is_counted(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    mod = load_bench("router_overhead.py", monkeypatch)
    out = tmp_path / "router.json"
    assert mod.main(["--bursts", "16:16:3,4:64:1", "--rounds", "4", "--json", str(out)]) == 0
    bursts = json.loads(out.read_text())["bursts"]
    assert [b["burst"] for b in bursts] == ["16:16:3", "4:64:1"]
    for b in bursts:
        assert b["errors"] == 0 and b["requests"] == 4 * int(b["burst"].split(":")[0])
        assert b["router_cpu_ms_per_request"] >= 0 and b["wall_ms_per_burst"] > 0
        assert b["stubs_cpu_ms_per_request"] >= 0
    # /proc counts CPU time in clock ticks (10 ms): 64 requests of ~1 ms are several
    assert bursts[0]["router_cpu_ms_per_request"] > 0


def test_a_paced_decode_streams_every_token(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`--pace-ms`: the stub decode sends a token per interval; every request still gets all
    its tokens, and a burst lasts at least the intervals its tokens were spaced by."""
    mod = load_bench("router_overhead.py", monkeypatch)
    out = tmp_path / "router.json"
    assert mod.main(["--bursts", "8:16:4", "--rounds", "2", "--pace-ms", "5",
                     "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    (burst,) = got["bursts"]
    assert got["pace_ms"] == 5.0 and burst["errors"] == 0 and burst["requests"] == 16
    assert burst["wall_ms_per_burst"] >= 3 * 5.0  # the decode's 3 tokens, 5 ms apart
