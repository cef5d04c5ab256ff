"""The hand-off's optional draft state: written beside the signed grant, read back exactly,
ignored by a version-1 decoder that predates it, refused by name when malformed."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from pdd_sidecar.engine.speculative.draft_state import decode_draft_state, encode_draft_state
from pdd_sidecar.kv.grants import verify
from pdd_sidecar.kv.handoff import DraftState, MalformedGrant, TransferParams

KEY = b"k" * 32
NOW = 1_000_000.0


def _params(**changes: Any) -> TransferParams:
    base: dict[str, Any] = dict(
        request_id="r1", instance_id="inst", host="10.0.0.1", side_channel_port=5600, tp=1,
        dcp=1, block_size=4, block_ids=(3, 4, 5), num_tokens=9, plan_digest="d" * 8, epoch=7,
        expires_at=NOW + 30.0)
    return TransferParams(**{**base, **changes})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hidden_state_crosses_the_wire_exactly(dtype: torch.dtype) -> None:
    h = torch.randn(64, generator=torch.Generator().manual_seed(1)).to(dtype)
    params = _params(draft_state=encode_draft_state(h, 8))
    grant = json.loads(json.dumps(params.to_grant(KEY)))  # as it crosses HTTP
    back = TransferParams.from_grant(grant, KEY, 0.5, now=NOW)
    assert back == params
    assert back.draft_state is not None
    assert torch.equal(decode_draft_state(back.draft_state, 64, dtype=dtype), h)
    with pytest.raises(ValueError, match=r"draft_state\.hidden: 64 values, .* hidden size is 32"):
        decode_draft_state(back.draft_state, 32)


def test_old_decoders_and_old_prefills_still_meet() -> None:
    """The signature covers what it covered: a grant with the state verifies as one without
    it (a version-1 decoder that predates the field reads it so), and a grant without it
    parses to a record without one (the decode drafts from its next step)."""
    plain = _params()
    with_state = _params(draft_state=encode_draft_state(torch.ones(8), 8))
    g_plain, g_state = plain.to_grant(KEY), with_state.to_grant(KEY)
    assert "draft_state" not in g_plain
    assert {k: v for k, v in g_state.items() if k != "draft_state"} == g_plain
    verify(g_state, KEY, now=NOW)
    assert TransferParams.from_grant(g_plain, KEY, 0.5, now=NOW).draft_state is None


@pytest.mark.parametrize(("state", "needle"), [
    ("x", r"draft_state: must be an object"),
    ({"position": 3, "dtype": "float32", "hidden": "AAAAAA=="},
     r"draft_state\.position: must be the prompt's last position \(8\), got 3"),
    ({"position": 8, "dtype": "float16", "hidden": "AAAAAA=="},
     r"draft_state\.dtype: must be one of float32, bfloat16, got 'float16'"),
    ({"position": 8, "dtype": "float32", "hidden": "%%%"}, r"draft_state\.hidden: must be base64"),
    ({"position": 8, "dtype": "float32", "hidden": "AAA="},
     r"draft_state\.hidden: 2 bytes is no whole number of float32 values"),
])
def test_a_malformed_state_is_refused_naming_the_field(state: Any, needle: str) -> None:
    grant = _params().to_grant(KEY)
    grant["draft_state"] = state
    with pytest.raises(MalformedGrant, match=needle):
        TransferParams.from_grant(grant, KEY, 0.5, now=NOW)


def test_the_record_is_what_the_state_says() -> None:
    s = DraftState(8, "float32", b"\0" * 8)
    assert DraftState.parse(s.to_wire(), 9) == s
