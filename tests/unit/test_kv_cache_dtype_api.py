"""`kvCacheDtype` (issue 45 item 3) from the spec to every place it is rendered: the sidecar's
env and settings, vLLM's flag, the routing plan and its hash, `kubectl pdd`, the sample. The
rule that both roles agree is in the shared spec table (spec_cases.py), run by all three
validators."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_cases import BASE, VLLM

from pdd_api import keys
from pdd_api.models import KV_CACHE_DTYPES
from pdd_api.plan import RoutingPlan, SidePlan
from pdd_api.routing import load_plan, plan_for_spec, plan_routing
from pdd_api.validation import parse_spec, validate_document
from pdd_operator.builders import Owner, build, plan_hash
from pdd_sidecar.env import ConfigError, InstanceSettings

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "manifests" / "samples" / "fp8-kv.yaml"
OWNER = Owner("demo", "ns1", "uid-1")
ENV = {"PDD_ROLE": "decode", "PDD_TP_SIZE": "1", "PDD_BLOCK_SIZE": "64",
       "PDD_ROUTING_FILE": "/etc/pdd/routing.json", "PDD_GRANT_KEY_FILE": "/k"}
# `plan_routing(P TP4/DCP4, D TP2/DCP2, 64).to_json()` before the field existed: an auto plan
# (every plan of a spec without kvCacheDtype) must stay this, byte for byte, and so keep its hash.
AUTO_PLAN = (
    '{"version":1,"case":"sharded-to-sharded","blockSize":64,"prefill":{"tensorParallelSize":4,'
    '"decodeContextParallelSize":4},"decode":{"tensorParallelSize":2,'
    '"decodeContextParallelSize":2},"decodeRanks":[{"rank":0,"reads":[{"prefillRank":0,'
    '"chunkModulus":4,"chunkResidue":0},{"prefillRank":2,"chunkModulus":4,"chunkResidue":2}],'
    '"notifies":[0,2]},{"rank":1,"reads":[{"prefillRank":1,"chunkModulus":4,"chunkResidue":1},'
    '{"prefillRank":3,"chunkModulus":4,"chunkResidue":3}],"notifies":[1,3]}],"prefillRanks":'
    '[{"rank":0,"expectedNotifications":1},{"rank":1,"expectedNotifications":1},{"rank":2,'
    '"expectedNotifications":1},{"rank":3,"expectedNotifications":1}]}'
)
AUTO_PLAN_HASH = "13d901209e"


def both(spec: dict[str, Any], dtype: str) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    for role in ("prefill", "decode"):
        spec[role]["kvCacheDtype"] = dtype
    return spec


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


def test_the_values_are_named_once_in_pdd_api() -> None:
    from pdd_sidecar.kv import fp8_layout

    assert KV_CACHE_DTYPES == ("auto", "fp8")
    assert fp8_layout.KV_CACHE_DTYPES is KV_CACHE_DTYPES


def test_the_sidecar_reads_its_dtype_and_refuses_another_naming_the_variable() -> None:
    assert InstanceSettings.from_env(ENV).kv_cache_dtype == "auto"
    assert InstanceSettings.from_env({**ENV, "PDD_KV_CACHE_DTYPE": ""}).kv_cache_dtype == "auto"
    assert InstanceSettings.from_env({**ENV, "PDD_KV_CACHE_DTYPE": "fp8"}).kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match=r"^PDD_KV_CACHE_DTYPE: must be one of auto, fp8, "
                                          r"got 'fp16'$"):
        InstanceSettings.from_env({**ENV, "PDD_KV_CACHE_DTYPE": "fp16"})


def test_fp8_reaches_both_roles_env_and_auto_writes_nothing() -> None:
    desired = build(OWNER, parse_spec(BASE))
    for role in ("prefill", "decode"):
        assert keys.ENV_KV_CACHE_DTYPE not in env_of(desired.pods[role][0])
    raw = both(BASE, "fp8")
    raw["decode"]["env"] = [{"name": keys.ENV_KV_CACHE_DTYPE, "value": "auto"}]
    desired = build(OWNER, parse_spec(raw))
    for role in ("prefill", "decode"):
        env = desired.pods[role][0]["spec"]["containers"][0]["env"]
        # The field is the one way to set it: a user entry of the same name is dropped.
        assert [e["value"] for e in env if e["name"] == keys.ENV_KV_CACHE_DTYPE] == ["fp8"]


def test_vllm_gets_its_kv_cache_dtype_flag_on_both_roles_only_for_fp8() -> None:
    for dtype, flag in (("auto", None), ("fp8", "fp8")):
        desired = build(OWNER, parse_spec(both(VLLM, dtype)))
        for role in ("prefill", "decode"):
            argv = desired.pods[role][0]["spec"]["containers"][0]["command"]
            hits = [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-cache-dtype"]
            assert hits == ([flag] if flag else [])


def S(tp: int, dcp: int) -> SidePlan:
    return SidePlan(tensor_parallel_size=tp, decode_context_parallel_size=dcp)


def test_an_auto_plan_is_byte_identical_and_an_fp8_plan_says_so() -> None:
    auto = plan_routing(S(4, 4), S(2, 2), 64)
    assert auto.to_json() == AUTO_PLAN
    assert plan_hash(auto) == AUTO_PLAN_HASH
    fp8 = plan_routing(S(4, 4), S(2, 2), 64, "fp8")
    doc = json.loads(fp8.to_json())
    assert doc["kvCacheDtype"] == "fp8"
    assert {k: v for k, v in doc.items() if k != "kvCacheDtype"} == json.loads(AUTO_PLAN)
    assert plan_hash(fp8) != plan_hash(auto)  # the router never pairs an FP8 pod with a bf16 one
    assert load_plan(fp8.to_json()) == fp8
    assert load_plan(AUTO_PLAN) == auto


def test_the_plan_of_a_spec_carries_its_dtype() -> None:
    assert plan_for_spec(parse_spec(both(BASE, "fp8"))).kv_cache_dtype == "fp8"
    assert plan_for_spec(parse_spec(BASE)).kv_cache_dtype == "auto"


def test_a_plan_with_an_unknown_dtype_is_refused_naming_the_field() -> None:
    text = plan_routing(S(1, 1), S(1, 1), 64, "fp8").to_json().replace('"fp8"', '"fp16"')
    with pytest.raises(ValueError, match=r"^malformed routing plan: kvCacheDtype: "):
        RoutingPlan.from_json(text)


def test_the_sample_validates_and_renders_fp8_on_both_roles() -> None:
    doc = yaml.safe_load(SAMPLE.read_text())
    assert validate_document(doc) == []
    desired = build(OWNER, parse_spec(doc["spec"]))
    for role in ("prefill", "decode"):
        assert env_of(desired.pods[role][0])[keys.ENV_KV_CACHE_DTYPE] == "fp8"
    assert desired.plan.kv_cache_dtype == "fp8"
    doc["spec"]["decode"]["kvCacheDtype"] = "auto"
    assert validate_document(doc) == [
        "spec.decode.kvCacheDtype: must equal spec.prefill.kvCacheDtype (fp8), got auto"]
