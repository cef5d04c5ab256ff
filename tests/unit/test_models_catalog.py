"""`pdd plan --tokens N` for DeepSeek-V3: KV bytes each decode rank holds at DCP 1, 8 and 16."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdd_cli.main import main

# DeepSeek-V3's config.json: 61 layers, each caching kv_lora_rank 512 + qk_rope_head_dim 64
# values per token, 2 bytes each in bfloat16.
V3_BYTES_PER_TOKEN = 61 * (512 + 64) * 2
TOKENS = 131072  # 2048 blocks of 64


def _v3_doc(valid_doc: dict[str, Any], tp: int, dcp: int) -> dict[str, Any]:
    doc = copy.deepcopy(valid_doc)
    doc["metadata"]["name"] = f"v3-d-tp{tp}-dcp{dcp}"
    doc["spec"]["model"] = {"name": "deepseek-ai/DeepSeek-V3"}
    doc["spec"]["prefill"]["tensorParallelSize"] = 8
    doc["spec"]["prefill"]["decodeContextParallelSize"] = 1
    doc["spec"]["prefill"]["resources"] = {"limits": {"nvidia.com/gpu": 8}}
    doc["spec"]["decode"]["tensorParallelSize"] = tp
    doc["spec"]["decode"]["decodeContextParallelSize"] = dcp
    doc["spec"]["decode"]["resources"] = {"limits": {"nvidia.com/gpu": tp}}
    return doc


@pytest.mark.parametrize("tp,dcp", [(8, 1), (8, 8), (16, 16)])
def test_plan_shows_v3_kv_bytes_per_decode_rank(
    valid_doc: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], tp: int,
    dcp: int,
) -> None:
    f = tmp_path / "v3.yaml"
    f.write_text(yaml.safe_dump(_v3_doc(valid_doc, tp, dcp)))
    assert main(["plan", "-f", str(f), "--tokens", str(TOKENS)]) == 0
    out = capsys.readouterr().out
    per_rank = TOKENS // dcp * V3_BYTES_PER_TOKEN
    rows = [line.split() for line in out.splitlines() if line.startswith("D")]
    assert len(rows) == tp
    assert all(r[-1] == f"{per_rank:,}" for r in rows), out
    assert f"({V3_BYTES_PER_TOKEN:,} bytes per token)" in out
