"""bench/ngram_index.py times the first feed of a long prompt both ways (the bulk arrays and
the per-token dict of the same run) and a later token's proposal, for each maxN asked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import ngram_index  # noqa: E402


def test_both_indexes_are_measured_for_each_max_n(tmp_path: Path) -> None:
    out = tmp_path / "ngram.json"
    assert ngram_index.main(["--tokens", "3000", "--max-n", "2,5", "--later", "20",
                             "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["max_n"], r["index"]) for r in rows] == [(2, "dict"), (2, "bulk"), (5, "dict"),
                                                         (5, "bulk")]
    assert all(r["first_feed_ms"] > 0 and r["held_mib"] > 0 and r["later_token_us"] > 0
               for r in rows)
