"""Configuration the runtime must accept or refuse, without starting processes."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from pdd_api.plan import SidePlan
from pdd_api.routing import check_plan_soundness, plan_routing
from pdd_sidecar.env import ConfigError, InstanceSettings, RouterSettings, parse_urls
from pdd_sidecar.serve.discovery import replicas, split_service
from pdd_sidecar.serve.openai import tokenizer

pytestmark = pytest.mark.dataplane

SIDES = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 4), (8, 8), (8, 1)]

BASE = {"PDD_ROLE": "prefill", "PDD_TP_SIZE": "4", "PDD_DCP_SIZE": "4", "PDD_BLOCK_SIZE": "64",
        "PDD_ROUTING_FILE": "/etc/pdd/routing.json",
        "PDD_GRANT_KEY_FILE": "/etc/pdd-grant/grant.key"}


@pytest.mark.parametrize(("p", "d"), list(itertools.product(SIDES, SIDES)))
def test_every_planner_output_is_sound(p: tuple[int, int], d: tuple[int, int]) -> None:
    plan = plan_routing(SidePlan(tensor_parallel_size=p[0], decode_context_parallel_size=p[1]),
                        SidePlan(tensor_parallel_size=d[0], decode_context_parallel_size=d[1]),
                        64)
    check_plan_soundness(plan)


def test_unsound_plans_are_named() -> None:
    plan = plan_routing(SidePlan(tensor_parallel_size=4, decode_context_parallel_size=4),
                        SidePlan(tensor_parallel_size=2, decode_context_parallel_size=2), 64)
    twice = plan.model_copy(update={"decode_ranks": [
        plan.decode_ranks[0].model_copy(
            update={"reads": plan.decode_ranks[0].reads + plan.decode_ranks[0].reads[:1]}),
        plan.decode_ranks[1]]})
    with pytest.raises(ValueError, match="decode rank 0 must read each chunk it holds exactly"):
        check_plan_soundness(twice)
    wrong = plan.model_copy(update={"prefill_ranks": [
        p.model_copy(update={"expected_notifications": 2}) for p in plan.prefill_ranks]})
    with pytest.raises(ValueError, match="prefill rank 0 expects 2 notifications, decode ranks "
                                         "send 1"):
        check_plan_soundness(wrong)


def test_instance_settings_defaults_and_refusals() -> None:
    s = InstanceSettings.from_env(BASE)
    assert (s.http_port, s.side_channel_port, s.device, s.dtype) == (8000, 5600, "auto", "float32")
    assert s.pod_ip == "127.0.0.1" and s.lease_seconds > s.transfer_timeout_s
    for key, value, message in (
        ("PDD_ROLE", "router", "PDD_ROLE: must be one of prefill, decode, got 'router'"),
        ("PDD_TP_SIZE", "four", "PDD_TP_SIZE: must be an integer, got 'four'"),
        ("PDD_DCP_SIZE", "2", "PDD_DCP_SIZE: must be 1 or equal to PDD_TP_SIZE (4), got 2"),
        ("PDD_DTYPE", "int8", "PDD_DTYPE: must be float32 or bfloat16, got 'int8'"),
        ("PDD_LEASE_SECONDS", "-1", "PDD_LEASE_SECONDS: must be >= 0, got -1.0"),
    ):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            InstanceSettings.from_env({**BASE, key: value})
    for required in ("PDD_ROUTING_FILE", "PDD_GRANT_KEY_FILE"):
        with pytest.raises(ConfigError, match=f"{required}: required"):
            InstanceSettings.from_env({k: v for k, v in BASE.items() if k != required})
    with pytest.raises(ConfigError, match="PDD_FAULT_PULL_DELAY_S: must be seconds"):
        InstanceSettings.from_env({**BASE, "PDD_FAULT_PULL_DELAY_S": "soon"})


def test_router_settings_need_replicas_from_somewhere() -> None:
    with pytest.raises(ConfigError, match="PDD_DECODE_URLS or PDD_DECODE_SERVICE"):
        RouterSettings.from_env({"PDD_PREFILL_URLS": "a:1"})
    # No prefill at all: aggregated (every request prefilled on its decode).
    assert RouterSettings.from_env({"PDD_DECODE_URLS": "a:1"}).aggregated
    s = RouterSettings.from_env({"PDD_PREFILL_SERVICE": "x-prefill.ns.svc",
                                 "PDD_DECODE_URLS": "http://d0:8000/, d1:9000"})
    assert s.decode == ["http://d0:8000", "http://d1:9000"] and s.port == 8000
    assert parse_urls(" , ") == []


def test_service_discovery_resolves_a_name_to_pod_urls() -> None:
    assert split_service("x-prefill.ns.svc") == ("x-prefill.ns.svc", 8000)
    assert split_service("http://x-decode.ns.svc:9000/") == ("x-decode.ns.svc", 9000)
    urls = asyncio.run(replicas([], "localhost:8123"))
    assert "http://127.0.0.1:8123" in urls
    assert asyncio.run(replicas(["http://a:1"], "localhost:8123")) == ["http://a:1"]


def test_byte_tokenizer_round_trips_utf8() -> None:
    text = "prefill → décodage"
    ids = tokenizer.encode(text)
    assert all(0 <= t < 256 for t in ids) and tokenizer.decode(ids) == text
