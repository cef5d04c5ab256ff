"""An HTTP proxy in front of the test API server that hides API groups, so a test sees a
cluster without them (e.g. without kopf's peering CRDs) while the shared control plane, used by
other tests at the same time, keeps them.

A hidden group is absent from `/apis` discovery and every path under it answers as the API
server does for a group it does not serve: a plain-text `404 page not found`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import tempfile
import threading
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

_HOP = {"host", "content-length", "transfer-encoding", "connection", "authorization"}


class HidingProxy:
    def __init__(self, kubeconfig: Path, hidden_groups: set[str]) -> None:
        cfg = json.loads(kubeconfig.read_text())
        cluster = cfg["clusters"][0]["cluster"]
        user = cfg["users"][0]["user"]
        self.upstream = cluster["server"].rstrip("/")
        self.hidden = hidden_groups
        self._dir = tempfile.TemporaryDirectory(prefix="pdd-proxy-")
        d = Path(self._dir.name)
        for name, key in (("ca.crt", "certificate-authority-data"),):
            (d / name).write_bytes(base64.b64decode(cluster[key]))
        (d / "tls.crt").write_bytes(base64.b64decode(user["client-certificate-data"]))
        (d / "tls.key").write_bytes(base64.b64decode(user["client-key-data"]))
        self.ssl = ssl.create_default_context(cafile=str(d / "ca.crt"))
        self.ssl.load_cert_chain(str(d / "tls.crt"), str(d / "tls.key"))
        self.port = 0
        self.requests: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> HidingProxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("proxy did not start")
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._dir.cleanup()

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig that reaches the cluster through this proxy (no credentials needed)."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "proxy",
                          "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "proxy", "user": {}}],
            "contexts": [{"name": "proxy", "context": {"cluster": "proxy", "user": "proxy"}}],
            "current-context": "proxy",
        }))
        return path

    def _hidden_path(self, path: str) -> bool:
        return any(path == f"/apis/{g}" or path.startswith(f"/apis/{g}/") for g in self.hidden)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(f"{request.method} {request.path}")
        if self._hidden_path(request.path):
            return web.Response(status=404, text="404 page not found\n",
                                content_type="text/plain")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        if request.path == "/apis":
            headers["Accept"] = "application/json"  # the plain group list, filtered below
        body = await request.read()
        assert self._session is not None
        async with self._session.request(request.method, self.upstream + request.path_qs,
                                         data=body or None, headers=headers) as up:
            if request.path == "/apis" and up.status == 200:
                doc: Any = await up.json()
                doc["groups"] = [g for g in doc.get("groups", []) if g["name"] not in self.hidden]
                return web.json_response(doc)
            resp = web.StreamResponse(status=up.status)
            if "Content-Type" in up.headers:
                resp.content_type = up.headers["Content-Type"].split(";")[0]
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self.ssl),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=600))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()
        await self._session.close()

    _session: aiohttp.ClientSession | None = None
