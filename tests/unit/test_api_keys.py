"""API keys on the router: Bearer keys compared against every configured key, a 401 in OpenAI's
format, probes and metrics open, a key file read again when it changes (a rotated Secret, a
removed key), one that breaks later refusing its keys (fail closed), and an unreadable or empty
file refusing to start rather than opening the router."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdd_sidecar.env import RouterSettings
from pdd_sidecar.serve.openai.api_keys import (
    ApiKeys,
    KeyFileError,
    key_check,
    parse_keys,
    read_key_file,
)


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


def test_a_changed_file_is_read_again_and_a_removed_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-old\nsk-other\n")
    clock = Clock()
    keys = ApiKeys((), str(path), clock=clock)
    assert keys.allows("Bearer sk-old") and keys.allows("Bearer sk-other")
    path.write_text("sk-new\nsk-other\n")
    os.utime(path, ns=(1, 10**18))  # a new identity even within the file system's tick
    assert keys.allows("Bearer sk-old")  # not looked at again within RECHECK_S
    clock.t += 2
    assert keys.allows("Bearer sk-new") and not keys.allows("Bearer sk-old")
    path.write_text("sk-new\n")  # sk-other revoked
    os.utime(path, ns=(1, 2 * 10**18))
    clock.t += 2
    assert keys.allows("Bearer sk-new") and not keys.allows("Bearer sk-other")


MISSING = "<missing>"


def _swap(path: Path, text: str, clock: Clock) -> None:
    if text == MISSING:
        path.unlink()
    else:
        path.write_text(text)
    clock.t += 2


@pytest.mark.parametrize("broken", ["", "# all revoked\n", MISSING])
def test_an_emptied_or_missing_file_refuses_everyone_until_keys_are_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, broken: str) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a\n")
    clock = Clock()
    keys = ApiKeys(["sk-setting"], str(path), clock=clock)
    assert keys.allows("Bearer sk-a")
    with caplog.at_level(logging.INFO, logger="pdd_sidecar.serve.openai.api_keys"):
        _swap(path, broken, clock)
        for _ in range(3):  # one log line for the change, none per request
            assert not keys.allows("Bearer sk-a")
            clock.t += 2
        assert keys.enabled and not keys.allows(None)
        assert keys.allows("Bearer sk-setting")  # the settings' keys are not the file's
        refused = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(refused) == 1 and str(path) in refused[0].getMessage(), caplog.text
        _swap(path, "sk-b\n", clock)
        assert keys.allows("Bearer sk-b") and not keys.allows("Bearer sk-a")
        assert keys.allows("Bearer sk-b")
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.INFO], caplog.text


def _write_atomically(folder: Path, files: dict[str, str], n: int) -> None:
    """The kubelet's way with a Secret volume: a new timestamped folder, then `..data` swapped
    to it; the visible names are links through `..data`."""
    version = folder / f"..v{n}"
    version.mkdir()
    for name, text in files.items():
        (version / name).write_text(text)
    tmp = folder / "..data_tmp"
    tmp.symlink_to(version.name)
    tmp.replace(folder / "..data")
    for link in folder.iterdir():
        if not link.name.startswith(".") and link.name not in files:
            link.unlink()
    for name in files:
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")


def test_a_mounted_secret_rotates_loses_its_keys_and_gets_them_back(tmp_path: Path) -> None:
    folder = tmp_path / "api-keys"
    folder.mkdir()
    _write_atomically(folder, {"alice": "sk-alice\n", "bob": "sk-bob\n"}, 1)
    clock = Clock()
    keys = ApiKeys((), str(folder), clock=clock)
    assert keys.allows("Bearer sk-alice") and keys.allows("Bearer sk-bob")
    _write_atomically(folder, {"alice": "sk-alice-2\n"}, 2)  # rotated, bob's data key removed
    clock.t += 2
    assert keys.allows("Bearer sk-alice-2")
    assert not keys.allows("Bearer sk-alice") and not keys.allows("Bearer sk-bob")
    _write_atomically(folder, {}, 3)  # every data key removed from the Secret
    clock.t += 2
    assert not keys.allows("Bearer sk-alice-2")
    _write_atomically(folder, {"carol": "sk-carol\n"}, 4)
    clock.t += 2
    assert keys.allows("Bearer sk-carol") and not keys.allows("Bearer sk-alice-2")


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
