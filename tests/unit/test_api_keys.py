"""API keys on the router: Bearer keys compared against every configured key, a 401 in OpenAI's
format, probes and metrics open, a key file read again when it changes (a rotated Secret), and
an unreadable or empty file refusing to start rather than opening the router."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdd_sidecar.env import RouterSettings
from pdd_sidecar.serve.api_keys import ApiKeys, KeyFileError, key_check, parse_keys, read_key_file


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_bearer_keys_from_settings_and_the_header_forms() -> None:
    keys = ApiKeys(["sk-one", "sk-two"])
    assert keys.enabled
    assert keys.allows("Bearer sk-one") and keys.allows("bearer sk-two")
    assert not keys.allows("Bearer sk-three")
    assert not keys.allows("sk-one") and not keys.allows("Basic sk-one")
    assert not keys.allows(None) and not keys.allows("Bearer ") and not keys.allows("")
    assert not keys.allows("Bearer sk-on")  # a prefix is not the key
    assert not ApiKeys().enabled


def test_key_files_skip_comments_and_blank_lines_and_read_folders(tmp_path: Path) -> None:
    assert parse_keys("# rotated monthly\nsk-a\n\n  sk-b  \n") == ["sk-a", "sk-b"]
    folder = tmp_path / "secret"
    folder.mkdir()
    (folder / "alice").write_text("sk-alice\n")
    (folder / "bob").write_text("sk-bob\n")
    (folder / "..data").mkdir()  # a mounted Secret's own entries are not keys
    assert read_key_file(folder) == ["sk-alice", "sk-bob"]


def test_unreadable_or_empty_key_files_refuse_naming_the_variable(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match=r"PDD_API_KEY_FILE: cannot read .*missing"):
        ApiKeys((), str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n")
    with pytest.raises(KeyFileError, match="holds no API key"):
        ApiKeys((), str(empty))


def test_a_changed_file_is_read_again_and_a_broken_one_keeps_the_last_keys(
        tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-old\n")
    clock = Clock()
    keys = ApiKeys((), str(path), clock=clock)
    assert keys.allows("Bearer sk-old")
    path.write_text("sk-new\n")
    os.utime(path, ns=(1, 10**18))  # a new identity even within the file system's tick
    assert keys.allows("Bearer sk-old")  # not looked at again within RECHECK_S
    clock.t += 2
    assert keys.allows("Bearer sk-new") and not keys.allows("Bearer sk-old")
    path.write_text("")  # a half-written rotation: no key in it
    os.utime(path, ns=(1, 2 * 10**18))
    clock.t += 2
    assert keys.allows("Bearer sk-new")
    path.unlink()
    clock.t += 2
    assert keys.allows("Bearer sk-new")


def test_router_settings_read_keys_and_file_from_env() -> None:
    s = RouterSettings.from_env({"PDD_PREFILL_URLS": "a:1", "PDD_DECODE_URLS": "b:2",
                                 "PDD_API_KEY": "sk-a, sk-b,", "PDD_API_KEY_FILE": "/k"})
    assert s.api_keys == ("sk-a", "sk-b") and s.api_key_file == "/k"


def test_the_middleware_answers_401_in_openai_format_and_leaves_probes_open() -> None:
    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def run() -> None:
        app = web.Application(middlewares=[key_check(ApiKeys(["sk-good"]))])
        for path in ("/v1/completions", "/v1/models", "/healthz", "/readyz", "/metrics"):
            app.router.add_route("*", path, ok)
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/v1/completions", json={})
            assert resp.status == 401
            assert resp.headers["WWW-Authenticate"] == "Bearer"
            body = await resp.json()
            assert body["error"]["code"] == "invalid_api_key"
            assert body["error"]["type"] == "invalid_request_error"
            assert "didn't provide an API key" in body["error"]["message"]
            resp = await client.get("/v1/models", headers={"Authorization": "Bearer sk-bad"})
            assert resp.status == 401
            assert "Incorrect API key" in (await resp.json())["error"]["message"]
            resp = await client.get("/v1/models", headers={"Authorization": "Bearer sk-good"})
            assert resp.status == 200
            for path in ("/healthz", "/readyz", "/metrics"):
                assert (await client.get(path)).status == 200, path

    asyncio.run(run())
