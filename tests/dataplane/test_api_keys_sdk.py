"""API keys on the router as the official `openai` SDK meets them (issue 39 item 6): without a
key or with a wrong one the SDK raises its AuthenticationError from a 401 in OpenAI's shape; with
a key it gets its answer; a key added to the key file is taken without a restart; probes stay
open."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_openai_api import FakeInstance, Loop
from tool_cases import deepseek_dir

from pdd_sidecar.env import RouterSettings
from pdd_sidecar.serve.router.router import build_app

pytestmark = pytest.mark.dataplane


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    ckpt = deepseek_dir(tmp_path_factory.mktemp("keys-ckpt"))
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text("# rotated by the platform\nsk-file-one\n")
    loop = Loop()
    try:
        fake = FakeInstance()
        fake.url = loop.serve(fake.app())
        env = {"PDD_PREFILL_URLS": fake.url, "PDD_DECODE_URLS": fake.url,
               "PDD_MODEL_NAME": "served", "PDD_MODEL_SOURCE": str(ckpt),
               "PDD_ROUTER_HEALTH_INTERVAL_S": "0.2", "PDD_ROUTER_LOCAL_PREFILL_TOKENS": "0",
               "PDD_API_KEY": "sk-env",
               "PDD_API_KEY_FILE": str(key_file)}
        yield loop.serve(build_app(RouterSettings.from_env(env))), key_file
    finally:
        loop.close()


def _client(url: str, key: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def _ask(url: str, key: str) -> Any:
    return _client(url, key).completions.create(model="served", prompt="hello", max_tokens=2)


def test_no_key_is_a_401_in_openais_shape(served: tuple[str, Path]) -> None:
    """The SDK always sends a key: a bare client shows what one without gets."""
    import json
    import urllib.error

    req = urllib.request.Request(served[0] + "/v1/completions", method="POST",
                                 data=b'{"model": "served", "prompt": "hi", "max_tokens": 2}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 401
    assert json.loads(err.value.read())["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("key", ["sk-wrong", "sk-env-but-longer", "Bearer sk-env"])
def test_a_wrong_key_is_a_401_the_sdk_reads(served: tuple[str, Path], key: str) -> None:
    import openai

    with pytest.raises(openai.AuthenticationError) as err:
        _ask(served[0], key)
    assert err.value.status_code == 401
    body = err.value.body
    assert isinstance(body, dict) and body.get("type") == "invalid_request_error", body
    with pytest.raises(openai.AuthenticationError):
        _client(served[0], key).chat.completions.create(
            model="served", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_keys_from_env_and_file_answer_and_a_rotated_file_needs_no_restart(
        served: tuple[str, Path]) -> None:
    import openai

    url, key_file = served
    for key in ("sk-env", "sk-file-one"):
        out = _ask(url, key)
        assert out.choices[0].finish_reason in ("length", "stop"), out
    assert [m.id for m in _client(url, "sk-env").models.list().data] == ["served"]
    key_file.write_text("sk-file-two\n")  # rotation: the old file key goes, the new one works
    deadline = time.monotonic() + 10
    while True:
        try:
            _ask(url, "sk-file-two")
            break
        except openai.AuthenticationError:
            assert time.monotonic() < deadline, "the rotated key was never taken"
            time.sleep(0.2)
    with pytest.raises(openai.AuthenticationError):
        _ask(url, "sk-file-one")


def test_probes_stay_open(served: tuple[str, Path]) -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        with urllib.request.urlopen(served[0] + path, timeout=10) as r:
            assert r.status == 200, path
