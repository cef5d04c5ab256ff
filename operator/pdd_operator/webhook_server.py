"""The admission webhook's HTTPS server, on a thread of its own with its own event loop.

The API server holds every PDDeployment create and update until the webhook answers. Served
inside kopf's event loop (kopf's WebhookServer), each admission review waited behind the
handlers and passes of the PDDeployments already admitted: when hundreds are applied at once,
admission latency grew with the backlog and delayed the later objects' first passes, and kopf's
per-review machinery (memo, diff, handler bookkeeping) took the loop's time from the passes.
Here a review costs one JSON parse and `webhook.review` (the `pdd validate` rules), on a loop
that nothing else uses; the GIL is still shared, but the reviews no longer queue behind passes.

The server's TLS context is reloaded in place on this thread's loop (tls_reload): a renewed
certificate is served by every handshake after the reload, on the same listening socket.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from pdd_operator.tls_reload import reload_forever

log = logging.getLogger("pdd_operator.webhook")

Review = Callable[[dict[str, Any]], dict[str, Any]]


class WebhookThread:
    """`start()` returns once the port listens (or raises why it cannot); `stop()` closes it.
    `reload_interval`: how often the certificate files are checked for a renewal. Port 0 takes
    a free port, `port` says which once started."""

    def __init__(self, addr: str, port: int, path: str, context: ssl.SSLContext,
                 certfile: Path, keyfile: Path, reload_interval: float, review: Review) -> None:
        self.addr, self.port, self.path = addr, port, path
        self.context = context
        self.certfile, self.keyfile = certfile, keyfile
        self.reload_interval = reload_interval
        self.review = review
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="pdd-webhook", daemon=True)

    def start(self, timeout: float = 30.0) -> WebhookThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"webhook server on {self.addr}:{self.port} did not start "
                               f"within {timeout:.0f} s")
        if self._error is not None:
            raise RuntimeError(f"webhook server on {self.addr}:{self.port} could not start: "
                               f"{self._error}") from self._error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self.loop is not None and self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to start() or logged
            if not self._ready.is_set():
                self._error = exc
                self._ready.set()
            else:
                log.error("webhook server stopped: %s", exc)

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_post(self.path, self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.addr, self.port, ssl_context=self.context).start()
            self.port = runner.addresses[0][1]  # the port taken when asked for 0
            reload = asyncio.create_task(reload_forever(
                self.context, self.certfile, self.keyfile, self.reload_interval))
            self._ready.set()
            await self._stop.wait()
            reload.cancel()
        finally:
            await runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            return web.json_response({"message": f"not a JSON AdmissionReview: {exc}"},
                                     status=400)
        if not isinstance(body, dict) or not isinstance(body.get("request"), dict):
            return web.json_response({"message": "not an AdmissionReview: no request"},
                                     status=400)
        try:
            answer = self.review(body)
        except Exception as exc:  # noqa: BLE001 - the API server gets a refusal, never a hang
            log.exception("admission review failed")
            answer = {"apiVersion": body.get("apiVersion", "admission.k8s.io/v1"),
                      "kind": "AdmissionReview",
                      "response": {"uid": body["request"].get("uid", ""), "allowed": False,
                                   "status": {"code": 500, "message": f"webhook error: {exc}"}}}
        return web.json_response(answer)
