"""A decode's drafting from its settings: the self-disable knobs and what the engine runs."""

from __future__ import annotations

import pytest

from pdd_sidecar.engine.speculative.config import DEFAULT_MAX_BATCH, SpeculativeConfig
from pdd_sidecar.env import ConfigError, InstanceSettings
from pdd_sidecar.serve.instance.server import speculative_config

ENV = {"PDD_ROLE": "decode", "PDD_TP_SIZE": "1", "PDD_BLOCK_SIZE": "64",
       "PDD_ROUTING_FILE": "/etc/pdd/routing.json", "PDD_GRANT_KEY_FILE": "/k"}
NGRAM = {**ENV, "PDD_SPECULATIVE_METHOD": "ngram"}


def test_the_engine_runs_what_the_settings_say() -> None:
    s = InstanceSettings.from_env({**NGRAM, "PDD_SPECULATIVE_TOKENS": "2",
                                   "PDD_SPECULATIVE_NGRAM_MAX": "5",
                                   "PDD_SPECULATIVE_MAX_BATCH": "8",
                                   "PDD_SPECULATIVE_MIN_ACCEPTANCE": "0"})
    assert speculative_config(s) == SpeculativeConfig(tokens=2, ngram_max=5, max_batch=8,
                                                      min_acceptance=0.0)
    default = speculative_config(InstanceSettings.from_env(NGRAM))
    assert default is not None and default.max_batch == DEFAULT_MAX_BATCH
    assert speculative_config(InstanceSettings.from_env(ENV)) is None


def test_mtp_on_a_checkpoint_without_the_module_is_refused_at_start() -> None:
    s = InstanceSettings.from_env({**ENV, "PDD_SPECULATIVE_METHOD": "mtp"})
    with pytest.raises(ConfigError, match="PDD_SPECULATIVE_METHOD: 'mtp' needs a checkpoint "
                                          "with an MTP module, and model 'builtin' has none"):
        speculative_config(s)


def test_the_prefill_of_an_mtp_decode_runs_the_module_and_drafts_nothing() -> None:
    """PDD_SPECULATIVE_METHOD=mtp alone on a prefill: its cache has the module's layer (as
    its decode's must, for the hand-off's layout check) and its driver does not speculate."""
    s = InstanceSettings.from_env({**ENV, "PDD_ROLE": "prefill",
                                   "PDD_SPECULATIVE_METHOD": "mtp"})
    assert s.speculative is not None and s.cache_extra_layers == 1
    assert InstanceSettings.from_env(NGRAM).cache_extra_layers == 0


@pytest.mark.parametrize(("extra", "message"), [
    ({**ENV, "PDD_SPECULATIVE_MAX_BATCH": "4"},
     "PDD_SPECULATIVE_MAX_BATCH: set without PDD_SPECULATIVE_METHOD (mtp, ngram), got '4'"),
    ({**NGRAM, "PDD_SPECULATIVE_MIN_ACCEPTANCE": "1.5"},
     "PDD_SPECULATIVE_MIN_ACCEPTANCE: must be in [0, 1], got '1.5'"),
    ({**NGRAM, "PDD_SPECULATIVE_MAX_BATCH": "-1"}, "PDD_SPECULATIVE_MAX_BATCH"),
])
def test_bad_knobs_are_refused_naming_the_variable(extra: dict[str, str], message: str
                                                   ) -> None:
    with pytest.raises(ConfigError) as info:
        InstanceSettings.from_env(extra)
    assert str(info.value).startswith(message)
