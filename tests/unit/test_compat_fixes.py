"""A hand-off refused for a differing cache layout names the MTP setting, the likely cause
when the checkpoints agree (a prefill without the module's layer beside an mtp decode)."""

from __future__ import annotations

import pytest

from pdd_sidecar.kv.compat import CompatError, CompatRecord, cache_layout, check_compatible


def test_a_layout_one_layer_apart_names_the_mtp_setting() -> None:
    mtp = CompatRecord("m", "bfloat16", 64, cache_layout(28, 64, 576), 1, "x")
    plain = CompatRecord("m", "bfloat16", 64, cache_layout(27, 64, 576), 1, "x")
    check_compatible(mtp, CompatRecord.from_dict(mtp.to_dict()), "peer p")
    with pytest.raises(CompatError) as err:
        check_compatible(mtp, plain, "prefill 0 rank 0")
    text = str(err.value)
    assert "cache_layout: local" in text and "layers=28" in text and "layers=27" in text
    assert "PDD_SPECULATIVE_METHOD=mtp" in text and "prefill and its mtp decode" in text
