"""`pdd plan -o diagram`: the routing plan drawn as the vLLM DCP pull request draws it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from pdd_api.plan import SidePlan
from pdd_api.routing import plan_routing
from pdd_cli.diagram import render_diagram
from pdd_cli.main import main

from .conftest import ROOT

# The picture of vllm-project/vllm#50611 (P TP4/DCP4 -> D TP2/DCP2), with each decode rank's
# sources and chunk residues under it.
PR_PICTURE = """\
pr: P TP4/DCP4 -> D TP2/DCP2
case sharded-to-sharded, blockSize 64, chunk g = tokens [g*64, (g+1)*64)

  Prefill  TP4/DCP4 -- KV sharded into 4 slices, one per rank
  +------+------+------+------+
  |  P0  |  P1  |  P2  |  P3  |
  +--+---+--+---+--+---+--+---+
     |      |      |      |
     v      v      v      v
  +------+------+------+------+
  |  D0  |  D1  |  D0  |  D1  |
  +------+------+------+------+
  Decode   TP2/DCP2 -- KV sharded into 2 slices, one per rank

  D0 <- P0 [g%4==0], P2 [g%4==2]
  D1 <- P1 [g%4==1], P3 [g%4==3]
"""


def test_pr_example_is_drawn_as_the_pr_draws_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = yaml.safe_load((ROOT / "manifests/examples/p-tp4-dcp4-to-d-tp4-dcp4.yaml").read_text())
    doc["metadata"]["name"] = "pr"
    doc["spec"]["decode"] = {"tensorParallelSize": 2, "decodeContextParallelSize": 2}
    f = tmp_path / "pr.yaml"
    f.write_text(yaml.safe_dump(doc))
    assert main(["plan", "-f", str(f), "-o", "diagram"]) == 0
    first = capsys.readouterr().out
    assert first == PR_PICTURE
    assert main(["plan", "-f", str(f), "-o", "diagram"]) == 0
    assert capsys.readouterr().out == first


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


LAYOUTS = [
    (tp_p, dcp_p, tp_d, dcp_d)
    for tp_p, tp_d in itertools.product((1, 2, 3, 4, 8), repeat=2)
    for dcp_p in {1, tp_p} for dcp_d in {1, tp_d}
    if dcp_p % dcp_d == 0 or dcp_d % dcp_p == 0
]


@pytest.mark.parametrize(("tp_p", "dcp_p", "tp_d", "dcp_d"), LAYOUTS)
def test_drawing_agrees_with_the_plan(tp_p: int, dcp_p: int, tp_d: int, dcp_d: int) -> None:
    """Every column of the picture names exactly the decode ranks that read that prefill rank,
    and every decode rank's line lists its reads with their residues, in the plan's order."""
    plan = plan_routing(SidePlan(tensor_parallel_size=tp_p, decode_context_parallel_size=dcp_p),
                        SidePlan(tensor_parallel_size=tp_d, decode_context_parallel_size=dcp_d),
                        16)
    lines = render_diagram(plan).splitlines()
    rows = [ln for ln in lines if ln.startswith("  |")]
    assert len(rows) == 2
    assert _cells(rows[0]) == [f"P{p}" for p in range(tp_p)]
    columns = _cells(rows[1])
    for p in range(tp_p):
        readers = [d.rank for d in plan.decode_ranks
                   if any(r.prefill_rank == p for r in d.reads)]
        assert columns[p] == (",".join(f"D{d}" for d in readers) or "-")
    arrows = next(ln for ln in lines if ln.strip().startswith("v"))
    assert arrows.count("v") == sum(1 for c in columns if c != "-")
    for d in plan.decode_ranks:
        line = next(ln for ln in lines if ln.strip().startswith(f"D{d.rank} "))
        for r in d.reads:
            residue = ("all chunks" if r.chunk_modulus == 1
                       else f"g%{r.chunk_modulus}=={r.chunk_residue}")
            assert f"P{r.prefill_rank} [{residue}]" in line
        assert line.count("[") == len(d.reads)
    if "-" in columns:
        assert any(ln.strip().startswith("'-'") for ln in lines)


def test_docs_show_the_current_drawing() -> None:
    text = (ROOT / "docs" / "kubectl.md").read_text()
    shown = text.split("```\n", 2)[1].split("```", 1)[0]
    assert shown == PR_PICTURE.replace("pr: ", "demo: ", 1)
