"""`spec.decode.speculative` (issue 47 item 6) from the spec to what each engine is told: the
decode's env and the sidecar's settings, vLLM's --speculative-config. The value rules are in the
shared spec table (spec_cases.py), run by all three validators."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from spec_cases import BASE, VLLM, speculative

from pdd_api import keys
from pdd_api.models_catalog import KNOWN_MODELS, without_mtp
from pdd_api.validation import parse_spec
from pdd_operator.builders import Owner, build
from pdd_sidecar.engine.speculative.ngram import NgramConfig
from pdd_sidecar.env import ConfigError, InstanceSettings, SpeculativeSettings

OWNER = Owner("demo", "ns1", "uid-1")
ENV = {"PDD_ROLE": "decode", "PDD_TP_SIZE": "1", "PDD_BLOCK_SIZE": "64",
       "PDD_ROUTING_FILE": "/etc/pdd/routing.json", "PDD_GRANT_KEY_FILE": "/k"}
SPEC_KEYS = {keys.ENV_SPECULATIVE_METHOD, keys.ENV_SPECULATIVE_TOKENS,
             keys.ENV_SPECULATIVE_NGRAM_MAX, keys.ENV_SPECULATIVE_NGRAM_MIN}


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


def test_mtp_is_served_by_both_engines() -> None:
    """pdd's decode serves mtp (engine/speculative/mtp_served.py), as vLLM does; only names
    known to lack the module are refused (MtpModelRule)."""
    assert parse_spec(speculative({"method": "mtp"})).decode.speculative is not None
    vllm = speculative({"method": "mtp"})
    vllm.update(engine="vllm", image="vllm/vllm-openai:v0.33.0", router={"image": "pdd:0.1.0"})
    assert parse_spec(vllm).decode.speculative is not None


def test_the_catalog_knows_which_checkpoints_carry_mtp() -> None:
    assert KNOWN_MODELS["deepseek-ai/DeepSeek-V3"].mtp_layers == 1
    assert KNOWN_MODELS["deepseek-ai/DeepSeek-R1"].mtp_layers == 1
    assert without_mtp() == ("DeepSeek-V2", "DeepSeek-V2-Chat", "DeepSeek-V2-Lite",
                             "DeepSeek-V2-Lite-Chat", "DeepSeek-V2.5")


@pytest.mark.parametrize(("value", "want"), [
    ({"method": "mtp", "tokens": 2},
     {"PDD_SPECULATIVE_METHOD": "mtp", "PDD_SPECULATIVE_TOKENS": "2"}),
    ({"method": "ngram", "tokens": 3},
     {"PDD_SPECULATIVE_METHOD": "ngram", "PDD_SPECULATIVE_TOKENS": "3",
      "PDD_SPECULATIVE_NGRAM_MAX": "4", "PDD_SPECULATIVE_NGRAM_MIN": "1"}),
    ({"method": "ngram", "tokens": 2, "ngram": {"maxN": 6, "minN": 2}},
     {"PDD_SPECULATIVE_METHOD": "ngram", "PDD_SPECULATIVE_TOKENS": "2",
      "PDD_SPECULATIVE_NGRAM_MAX": "6", "PDD_SPECULATIVE_NGRAM_MIN": "2"}),
])
def test_the_drafter_reaches_the_decode_and_its_sidecar_reads_it(
        value: dict[str, Any], want: dict[str, str]) -> None:
    raw = speculative(value)
    raw["decode"]["env"] = [{"name": keys.ENV_SPECULATIVE_TOKENS, "value": "8"}]
    desired = build(OWNER, parse_spec(raw))
    decode = env_of(desired.pods["decode"][0])
    assert {k: v for k, v in decode.items() if k in SPEC_KEYS} == want  # user env dropped
    prefill = {k: v for k, v in env_of(desired.pods["prefill"][0]).items() if k in SPEC_KEYS}
    # the prefill of an mtp decode runs the module (the draft state), told by the method alone
    assert prefill == ({"PDD_SPECULATIVE_METHOD": "mtp"} if value["method"] == "mtp" else {})
    if prefill:
        p = InstanceSettings.from_env({**ENV, **prefill, "PDD_ROLE": "prefill"})
        assert p.cache_extra_layers == 1
    s = InstanceSettings.from_env({**ENV, **want}).speculative
    assert s is not None and s.method == value["method"]
    assert s.tokens == value.get("tokens", 1)
    if s.method == "ngram":  # what the engine builds its drafter from
        NgramConfig(k=s.tokens, max_n=s.ngram_max, min_n=s.ngram_min)


def test_no_drafter_renders_nothing() -> None:
    desired = build(OWNER, parse_spec(BASE))
    for role in ("prefill", "decode"):
        assert not SPEC_KEYS & set(env_of(desired.pods[role][0]))
    assert InstanceSettings.from_env(ENV).speculative is None


@pytest.mark.parametrize(("extra", "message"), [
    ({"PDD_SPECULATIVE_METHOD": "eagle"},
     "PDD_SPECULATIVE_METHOD: must be one of mtp, ngram, got 'eagle'"),
    ({"PDD_SPECULATIVE_TOKENS": "2"},
     "PDD_SPECULATIVE_TOKENS: set without PDD_SPECULATIVE_METHOD (mtp, ngram), got '2'"),
    ({"PDD_SPECULATIVE_METHOD": "ngram", "PDD_SPECULATIVE_TOKENS": "9"},
     "PDD_SPECULATIVE_TOKENS: must be between 1 and 8, got 9"),
    ({"PDD_SPECULATIVE_METHOD": "ngram", "PDD_SPECULATIVE_TOKENS": "0"},
     "PDD_SPECULATIVE_TOKENS: must be >= 1, got 0"),
    ({"PDD_SPECULATIVE_METHOD": "ngram", "PDD_SPECULATIVE_NGRAM_MIN": "5"},
     "PDD_SPECULATIVE_NGRAM_MIN: must not exceed PDD_SPECULATIVE_NGRAM_MAX (4), got 5"),
    ({"PDD_SPECULATIVE_METHOD": "mtp", "PDD_SPECULATIVE_NGRAM_MAX": "3"},
     "PDD_SPECULATIVE_NGRAM_MAX: only with PDD_SPECULATIVE_METHOD=ngram, got 'mtp'"),
    ({"PDD_ROLE": "prefill", "PDD_SPECULATIVE_METHOD": "ngram"},
     "PDD_SPECULATIVE_METHOD: only a decode drafts, got 'ngram' on a prefill (a prefill "
     "takes PDD_SPECULATIVE_METHOD=mtp alone: it fills the MTP draft state)"),
    ({"PDD_ROLE": "prefill", "PDD_SPECULATIVE_METHOD": "mtp", "PDD_SPECULATIVE_TOKENS": "2"},
     "PDD_SPECULATIVE_TOKENS: only a decode drafts, got '2' on a prefill (a prefill "
     "takes PDD_SPECULATIVE_METHOD=mtp alone: it fills the MTP draft state)"),
])
def test_the_sidecar_refuses_a_drafter_it_cannot_run_naming_the_variable(
        extra: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        InstanceSettings.from_env({**ENV, **extra})
    assert str(info.value) == message


def test_settings_default_like_the_spec() -> None:
    s = InstanceSettings.from_env({**ENV, "PDD_SPECULATIVE_METHOD": "ngram"}).speculative
    assert s == SpeculativeSettings(method="ngram", tokens=1, ngram_max=4, ngram_min=1)


@pytest.mark.parametrize(("value", "config"), [
    ({"method": "mtp", "tokens": 2}, {"method": "mtp", "num_speculative_tokens": 2}),
    ({"method": "ngram"}, {"method": "ngram", "num_speculative_tokens": 1,
                           "prompt_lookup_max": 4, "prompt_lookup_min": 1}),
    ({"method": "ngram", "tokens": 3, "ngram": {"maxN": 5, "minN": 2}},
     {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
      "prompt_lookup_min": 2}),
])
def test_vllm_gets_its_speculative_config_on_the_decode_only(
        value: dict[str, Any], config: dict[str, Any]) -> None:
    raw = copy.deepcopy(VLLM)
    raw["model"] = {"name": "deepseek-ai/DeepSeek-V3"}
    raw["decode"] = {**raw["decode"], "speculative": value}
    desired = build(OWNER, parse_spec(raw))
    decode = desired.pods["decode"][0]["spec"]["containers"][0]["command"]
    hits = [decode[i + 1] for i, a in enumerate(decode) if a == "--speculative-config"]
    assert [json.loads(h) for h in hits] == [config]
    assert "--speculative-config" not in desired.pods["prefill"][0]["spec"]["containers"][0][
        "command"]
    assert not SPEC_KEYS & set(env_of(desired.pods["decode"][0]))  # vLLM's pods: no PDD_*
