"""bench/kv_tiers.py --quick end to end: every part runs with no failed request; the defaults
accept the long prompts and report their pools; the host tier serves revisited documents from
host memory (more cached tokens, KV loaded back) where the small pool alone recomputes them; a
burst sharing one uncached prefix computes it once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_fixtures import load_bench

pytestmark = pytest.mark.dataplane


def test_quick_run_of_every_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = load_bench("kv_tiers.py", monkeypatch)
    out = tmp_path / "kv_tiers.json"
    assert mod.main(["--quick", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    loads = {(x["stack"], x["load"]): x for x in res["loads"]}
    assert all(x["errors"] == 0 for x in res["loads"]), [x for x in res["loads"] if x["errors"]]
    assert set(res["stacks"]) == {"defaults", "explicit1", "small pool",
                                  "small pool + host tier"}
    # (a) the defaults hold the long prompts and say what they hold
    longs = [x for k, x in loads.items() if k[1].startswith("long")]
    assert len(longs) == 2 and all(x["out_tokens"] == 2 for x in longs)
    defaults = res["stacks"]["defaults"]
    assert defaults["max_model_len"] >= max(x["prompt_tokens"] for x in longs) + 2
    assert defaults["prefill"]["pdd_kv_pool_tokens"] > 0
    # (b) the tier turns revisits into hits the small pool alone lost
    revisit = next(k[1] for k in loads if k[1].endswith("revisits"))
    off, on = loads[("small pool", revisit)], loads[("small pool + host tier", revisit)]
    assert on["prompt_tokens"] == off["prompt_tokens"]
    assert on["cached_tokens"] > off["cached_tokens"]
    moved = res["stacks"]["small pool + host tier"]["host_tier_delta"]
    assert moved["load bytes"] > 0 and moved["offload bytes"] > 0
    assert res["stacks"]["small pool"]["host_tier_delta"]["load bytes"] == 0
    # (c) no reuse: nothing cached either way
    assert loads[("small pool", "no reuse")]["cached_tokens"] == 0
    assert loads[("small pool + host tier", "no reuse")]["cached_tokens"] == 0
    # (d) the shared part computed once: the computed tokens are the distinct ones
    shared = next(x for k, x in loads.items() if k[0] == "defaults" and "shared" in k[1])
    distinct = mod._distinct(mod.Load(**{k: v for k, v in shared.items() if k != "tok_s"}))
    assert shared["prompt_tokens"] - shared["cached_tokens"] <= 1.05 * distinct
    assert set(res["summary"]) >= {"(b) host tier", "(c) no reuse", "(d) shared burst"}
