import asyncio
import importlib.util

import pytest

from pdd_sidecar.env import ConfigError, RouterSettings
from pdd_sidecar.serve.event_loop import loop_kind, new_event_loop


@pytest.mark.parametrize("choice,installed,kind", [
    ("auto", True, "uvloop"), ("auto", False, "asyncio"), ("uvloop", True, "uvloop"),
    ("asyncio", True, "asyncio"), ("asyncio", False, "asyncio"),
])
def test_loop_kind(choice: str, installed: bool, kind: str) -> None:
    assert loop_kind(choice, installed) == kind


def test_forced_uvloop_without_the_package_names_the_setting() -> None:
    with pytest.raises(ConfigError, match="PDD_EVENT_LOOP: uvloop, but the uvloop package is "
                                          "not installed"):
        loop_kind("uvloop", False)


def test_settings_read_and_check_the_choice() -> None:
    router_env = {"PDD_PREFILL_URLS": "http://p:8000", "PDD_DECODE_URLS": "http://d:8000"}
    assert RouterSettings.from_env(router_env).event_loop == "auto"
    assert RouterSettings.from_env({**router_env, "PDD_EVENT_LOOP": "asyncio"}).event_loop \
        == "asyncio"
    with pytest.raises(ConfigError, match="PDD_EVENT_LOOP: must be one of auto, uvloop, "
                                          "asyncio, got 'tokio'"):
        RouterSettings.from_env({**router_env, "PDD_EVENT_LOOP": "tokio"})


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop not installed")
def test_auto_runs_on_uvloop_when_installed() -> None:
    import uvloop

    loop = new_event_loop(loop_kind("auto", True), "test")
    try:
        assert isinstance(loop, uvloop.Loop)
        assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
    finally:
        loop.close()
    plain = new_event_loop(loop_kind("asyncio", True), "test")
    try:
        assert not isinstance(plain, uvloop.Loop)
    finally:
        plain.close()
