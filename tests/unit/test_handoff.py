"""The hand-off parameters: written and signed once, verified and parsed once, refused by kind."""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest

from pdd_sidecar.kv.grants import GRANT_FIELDS, GrantError, GrantExpired, sign, verify
from pdd_sidecar.kv.handoff import VERSION, MalformedGrant, TransferParams

KEY = b"k" * 32
NOW = 1_000_000.0


def _params(**changes: Any) -> TransferParams:
    base: dict[str, Any] = dict(
        request_id="r1", instance_id="inst", host="10.0.0.1", side_channel_port=5600, tp=2,
        dcp=2, block_size=4, block_ids=(3, 4, 5), num_tokens=9, plan_digest="d" * 8, epoch=7,
        expires_at=NOW + 30.0, lease_seconds=60.0)
    return TransferParams(**{**base, **changes})


def test_a_written_grant_parses_back_to_the_same_record_and_carries_the_version() -> None:
    for params in (_params(), _params(rank_endpoints=(("a", 1), ("b", 2))),
                   _params(lease_seconds=None)):
        grant = json.loads(json.dumps(params.to_grant(KEY)))  # as it crosses HTTP
        assert grant["version"] == VERSION
        assert set(GRANT_FIELDS) <= set(grant)
        assert TransferParams.from_grant(grant, KEY, 0.5, now=NOW) == params
        verify(grant, KEY, now=NOW)  # the plain HMAC check of kv/grants agrees


def test_a_reparsed_grant_signs_to_the_same_wire_text_for_the_claim() -> None:
    grant = json.loads(json.dumps(_params(expires_at=NOW + 1.25).to_grant(KEY)))
    again = TransferParams.from_grant(grant, KEY, 0.0, now=NOW).to_grant(KEY)
    assert again == grant


def test_the_record_pickles_as_the_step_command_carries_it() -> None:
    params = _params(rank_endpoints=(("a", 1), ("b", 2)))
    assert pickle.loads(pickle.dumps(params)) == params


@pytest.mark.parametrize("version", [None, 0, 2, "1", True, 1.5])
def test_an_unknown_version_is_malformed_naming_the_field_and_value(version: Any) -> None:
    grant = {k: v for k, v in _params().to_grant(KEY).items() if k != "signature"}
    if version is None:
        del grant["version"]
    else:
        grant["version"] = version
    grant = sign(grant, KEY)  # even a genuine signature does not make it readable
    with pytest.raises(MalformedGrant, match=r"kv_transfer_params\.version: .*" +
                       repr(version).replace(".", r"\.")):
        TransferParams.from_grant(grant, KEY, 0.0, now=NOW)


@pytest.mark.parametrize(("change", "needle"), [
    ({"host": 5}, "expected a string"),
    ({"epoch": "7"}, "expected an integer"),
    ({"epoch": True}, "expected an integer"),
    ({"block_ids": [1, "x"]}, "expected an integer"),
    ({"block_ids": [1]}, "need 2 block ids"),
    ({"block_ids": [-1, 2]}, "need 2 block ids"),
    ({"num_tokens": 0}, "must be positive"),
    ({"side_channel_port": 70000}, "must be positive"),
    ({"expires_at": "soon"}, "expires_at"),
    ({"rank_endpoints": [["a", 1]]}, "rank_endpoints"),
])
def test_a_malformed_grant_is_refused_before_its_signature_is_checked(
        change: dict[str, Any], needle: str) -> None:
    grant = {**_params().to_grant(KEY), **change}
    with pytest.raises(MalformedGrant, match=needle):
        TransferParams.from_grant(grant, KEY, 0.0, now=NOW)


def test_a_missing_field_and_a_non_object_are_malformed() -> None:
    grant = _params().to_grant(KEY)
    del grant["epoch"]
    with pytest.raises(MalformedGrant, match="missing 'epoch'"):
        TransferParams.from_grant(grant, KEY, 0.0, now=NOW)
    with pytest.raises(MalformedGrant, match="must be an object"):
        TransferParams.from_grant([1], KEY, 0.0, now=NOW)


def test_a_forged_altered_or_stripped_grant_is_forbidden() -> None:
    grant = _params(rank_endpoints=(("a", 1), ("b", 2))).to_grant(KEY)
    for bad in (_params().to_grant(b"another deployment's key"),
                {**grant, "epoch": 8},
                {**grant, "rank_endpoints": [["a", 1], ["c", 2]]},
                {k: v for k, v in grant.items() if k != "rank_endpoints"},
                {k: v for k, v in grant.items() if k != "signature"}):
        with pytest.raises(GrantError) as info:
            TransferParams.from_grant(bad, KEY, 0.0, now=NOW)
        assert not isinstance(info.value, GrantExpired)


def test_expiry_counts_the_margin_and_the_prefill_ignores_it() -> None:
    grant = _params(expires_at=NOW + 1.0).to_grant(KEY)
    assert TransferParams.from_grant(grant, KEY, 0.5, now=NOW).epoch == 7
    with pytest.raises(GrantExpired):
        TransferParams.from_grant(grant, KEY, 1.5, now=NOW)
    old = _params(expires_at=1.0).to_grant(KEY)
    assert TransferParams.from_own_grant(old, KEY).expires_at == 1.0


def test_the_prefill_refuses_an_unsigned_body_as_forbidden_not_malformed() -> None:
    with pytest.raises(GrantError) as info:
        TransferParams.from_own_grant(None, KEY)
    assert not isinstance(info.value, MalformedGrant)


def test_endpoints_default_to_consecutive_ports_of_one_host() -> None:
    assert _params().endpoints == [("10.0.0.1", 5600), ("10.0.0.1", 5601)]
    assert _params(rank_endpoints=(("a", 1), ("b", 2))).endpoints == [("a", 1), ("b", 2)]
