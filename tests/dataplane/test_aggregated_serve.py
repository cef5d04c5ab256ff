"""`pdd serve --prefill-replicas 0`: no prefill at all, each decode prefills its requests
itself (aggregated), ready once its own warm round trip ran, and the same tokens."""

from __future__ import annotations

from pathlib import Path

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
import torch  # noqa: F401  (the tier needs it; never skip)
from runtime_fixtures import http, reference_tokens  # noqa: E402

pytestmark = pytest.mark.dataplane

BLOCK = 16


def test_prefill_replicas_0_serves_aggregated(tmp_path: Path) -> None:
    from pdd_sidecar.serve.local_stack import LocalStack, StackConfig

    cfg = StackConfig(prefill_replicas=0, decode_tp=2, decode_dcp=2, port=0, block_size=BLOCK,
                      log_level="WARNING")
    with LocalStack(cfg, tmp_path / "logs") as served:
        served.start(timeout_s=300)
        assert served.prefill_urls == []
        status, ready = http("GET", f"{served.url}/readyz")
        assert status == 200 and ready["warm"] and ready["prefill"] == {}, ready
        for n in (5, 300):  # short, and longer than any local-prefill threshold
            prompt = [(i * 17 + n) % 251 + 1 for i in range(n)]
            status, body = http("POST", f"{served.url}/v1/completions",
                                {"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                 "ignore_eos": True})
            assert status == 200, body
            assert body["pdd"]["path"] == "local_prefill" and body["pdd"]["prefill"] is None
            assert body["choices"][0]["token_ids"] == reference_tokens(prompt, 5, BLOCK)
        status, body = http("POST", f"{served.url}/v1/completions",
                            {"prompt": [1, 2, 3], "max_tokens": 2, "n": 2})
        assert status == 400 and body["error"]["param"] == "n", body
        assert "no prefill instance" in body["error"]["message"]
