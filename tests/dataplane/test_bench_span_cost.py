"""bench/span_cost.py makes a decode's spans through pdd's tracing helpers and exports them in
the process and through the exporting child to a local OTLP receiver: every span arrives both
ways, and each CPU figure is counted. Run in a child process: the bench installs the process's
tracer provider, which can be set once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dataplane

ROOT = Path(__file__).resolve().parents[2]


def test_every_span_arrives_both_ways_and_the_cpu_is_counted(tmp_path: Path) -> None:
    out = tmp_path / "spans.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "span_cost.py"), "--spans",
                           "400", "--json", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every span received" in proc.stdout
    got = json.loads(out.read_text())
    assert got["spans"] == 400
    assert got["make_us"] > 0 and got["export_in_process_us"] > 0
    assert got["hand_to_child_us"] > 0 and got["plan_to_child_us"] > 0
