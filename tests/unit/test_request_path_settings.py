"""The request-path knobs reach the router the same way from `pdd serve`, the env and a
PDDeployment: --local-prefill-tokens / PDD_ROUTER_LOCAL_PREFILL_TOKENS /
spec.router.localPrefillTokens, and --no-prefill / PDD_ROUTER_NO_PREFILL / spec.router.noPrefill."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdd_api import keys
from pdd_api.models import DEFAULT_LOCAL_PREFILL_TOKENS
from pdd_api.validation import parse_spec
from pdd_cli.main import main
from pdd_operator.builders import Owner, build
from pdd_sidecar.env import ConfigError, RouterSettings
from pdd_sidecar.serve.local_stack import (
    InstancePorts,
    Ports,
    config_from_args,
    parser,
    router_env,
)

ROOT = Path(__file__).resolve().parents[2]
PORTS = Ports(router=8000, prefill=(InstancePorts(http=11000, side=12000, dist=13000),),
              decode=(InstancePorts(http=14000, side=15000, dist=16000),))


def test_pdd_serve_flags_reach_the_router() -> None:
    cfg = config_from_args(parser().parse_args([]))
    s = RouterSettings.from_env(router_env(cfg, PORTS))
    assert (s.local_prefill_tokens, s.no_prefill) == (DEFAULT_LOCAL_PREFILL_TOKENS, "fallback")
    cfg = config_from_args(parser().parse_args(["--local-prefill-tokens", "0",
                                                "--no-prefill", "refuse"]))
    s = RouterSettings.from_env(router_env(cfg, PORTS))
    assert (s.local_prefill_tokens, s.no_prefill) == (0, "refuse")


def test_a_bad_flag_names_itself(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--local-prefill-tokens", "-1"]) == 2
    err = capsys.readouterr().err
    assert ("pdd serve: --local-prefill-tokens: spec.router.localPrefillTokens: must be "
            "between 0 and 1048576, got -1") in err, err


def test_the_router_refuses_a_bad_env_naming_it() -> None:
    base = {"PDD_PREFILL_URLS": "http://p", "PDD_DECODE_URLS": "http://d"}
    with pytest.raises(ConfigError, match="PDD_ROUTER_LOCAL_PREFILL_TOKENS: must be >= 0"):
        RouterSettings.from_env({**base, "PDD_ROUTER_LOCAL_PREFILL_TOKENS": "-5"})
    with pytest.raises(ConfigError, match="PDD_ROUTER_NO_PREFILL: must be one of fallback, "
                                          "refuse, got 'wait'"):
        RouterSettings.from_env({**base, "PDD_ROUTER_NO_PREFILL": "wait"})


def _router_env(spec: dict[str, Any]) -> dict[str, str]:
    desired = build(Owner("demo", "ns", "uid"), parse_spec(spec))
    assert desired.router_deployment is not None
    container = desired.router_deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_the_crd_fields_reach_the_router_pod_only_when_not_the_default() -> None:
    path = ROOT / "manifests/examples/p-tp4-dcp4-to-d-tp4-dcp4.yaml"
    doc = copy.deepcopy(next(x for x in yaml.safe_load_all(path.read_text()) if x))
    env = _router_env(doc["spec"])
    assert keys.ENV_ROUTER_LOCAL_PREFILL_TOKENS not in env  # an existing router keeps its hash
    assert keys.ENV_ROUTER_NO_PREFILL not in env
    doc["spec"]["router"] = {"localPrefillTokens": 64, "noPrefill": "refuse"}
    env = _router_env(doc["spec"])
    assert env[keys.ENV_ROUTER_LOCAL_PREFILL_TOKENS] == "64"
    assert env[keys.ENV_ROUTER_NO_PREFILL] == "refuse"
    s = RouterSettings.from_env({**env, "PDD_PREFILL_URLS": "http://p"})
    assert (s.local_prefill_tokens, s.no_prefill) == (64, "refuse")


def test_prefill_replicas_0_is_an_aggregated_stack() -> None:
    from types import SimpleNamespace

    from pdd_sidecar.serve.local_stack import problems
    from pdd_sidecar.serve.openai.openai_request import GenRequest
    from pdd_sidecar.serve.router.prefill_path import LOCAL
    from pdd_sidecar.serve.router.upstreams import Router, Trip

    cfg = config_from_args(parser().parse_args(["--prefill-replicas", "0"]))
    assert problems(cfg) == []
    assert cfg.layout().startswith("aggregated: decode tp1/dcp1")
    ports = Ports(router=8000, prefill=(), decode=PORTS.decode)
    env = router_env(cfg, ports)
    assert env["PDD_PREFILL_URLS"] == ""
    s = RouterSettings.from_env(env)
    assert s.aggregated
    router = Router(s, SimpleNamespace(vocab_size=256, max_model_len=4096))
    assert not router.warmable and not router.routable  # no decode ready yet
    router.decode.mark(s.decode[0], True)
    assert not router.warmable  # an older decode (its /readyz says nothing) cannot serve it
    router.decode.local_prefill.add(s.decode[0])
    assert router.warmable and router.routable
    long = GenRequest("completion", list(range(1, 2001)), 4, {}, [], [], True, False, False)
    assert router.choose_path(long, Trip(warmup=True)) == LOCAL
    long.n = 2
    assert router.choose_path(long, Trip()) is None
    assert RouterSettings.from_env({"PDD_DECODE_URLS": "http://d"}).aggregated


def test_the_router_exposes_its_threshold_beside_the_paths() -> None:
    """The dashboard plots the decision's threshold next to the paths it splits."""
    from types import SimpleNamespace

    from pdd_sidecar.serve.router.upstreams import Router

    env = {"PDD_PREFILL_URLS": "http://p", "PDD_DECODE_URLS": "http://d",
           "PDD_ROUTER_LOCAL_PREFILL_TOKENS": "96"}
    router = Router(RouterSettings.from_env(env), SimpleNamespace(vocab_size=256,
                                                                   max_model_len=4096))
    text = router.metrics.expose().decode()
    assert "pdd_router_local_prefill_tokens 96.0" in text
