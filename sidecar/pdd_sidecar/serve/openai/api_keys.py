"""API keys on the router: `Authorization: Bearer <key>` on every OpenAI route.

Keys come from the settings (`pdd serve --api-key`, PDD_API_KEY) and from a file or a folder of
files (PDD_API_KEY_FILE; in a pod the mounted Secret of `spec.router.apiKeySecretRef`), one key
per line. The file is read again when it changes, so a rotated Secret takes effect without a
restart (the kubelet swaps a mounted Secret's files in place). The file is the truth for its
keys: a key taken out of it is refused from the next look on, and a file that later goes
missing, cannot be read or holds no key refuses every key it gave (fail closed: a revoked key
must never keep working because its file broke), logged once on the way in and once on the way
back. At start such a file stops the router: a key file that cannot be read must never open it.

Health, readiness and metrics stay open: probes and Prometheus scrapers carry no key (keep
/metrics inside the cluster: the router's NetworkPolicy admits its HTTP port from anywhere).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from aiohttp import web

from pdd_sidecar.serve.openai.openai_request import ApiError

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
RECHECK_S = 1.0  # how often the key file's identity is looked at, at most


class KeyFileError(ValueError):
    """The key file or folder cannot be read, or holds no key; the message names the path."""


def parse_keys(text: str) -> list[str]:
    """One key per line; blank lines and `#` comments skipped."""
    return [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]


def _files(path: Path) -> list[Path]:
    if path.is_dir():  # a mounted Secret: one file per data key; `..data` and friends skipped
        return sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.is_file())
    return [path]


def read_key_file(path: str | Path) -> list[str]:
    path = Path(path)
    try:
        keys = [k for f in _files(path) for k in parse_keys(f.read_text())]
    except OSError as exc:
        raise KeyFileError(f"PDD_API_KEY_FILE: cannot read {path}: {exc.strerror or exc}") from None
    if not keys:
        raise KeyFileError(f"PDD_API_KEY_FILE: {path} holds no API key (one per line)")
    return keys


def _identity(path: Path) -> tuple[tuple[str, int, int, int], ...]:
    out = []
    for f in _files(path):
        st = f.stat()
        out.append((f.name, st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)


class ApiKeys:
    """The keys a request may present; none configured means the router is open."""

    def __init__(self, keys: Iterable[str] = (), key_file: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fixed = [k for k in keys if k]
        self._file = Path(key_file) if key_file else None
        self._clock = clock
        self._from_file: list[str] = []
        self._seen: tuple[tuple[str, int, int, int], ...] | None = None
        self._checked = float("-inf")
        if self._file is not None:
            self._from_file = read_key_file(self._file)  # refuses to start without keys
            self._seen = _identity(self._file)
            self._checked = clock()

    @property
    def enabled(self) -> bool:
        return bool(self._fixed) or self._file is not None

    def current(self) -> list[str]:
        self._reload()
        return self._fixed + self._from_file

    def allows(self, authorization: str | None) -> bool:
        """`Bearer <key>` with one of the keys, compared in constant time against each."""
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return False
        token = given.strip().encode()
        ok = False
        for key in self.current():
            ok |= hmac.compare_digest(token, key.encode())
        return ok

    def _reload(self) -> None:
        if self._file is None or self._clock() - self._checked < RECHECK_S:
            return
        self._checked = self._clock()
        try:
            seen = _identity(self._file)
            if seen == self._seen:
                return
            keys = read_key_file(self._file)
        except (OSError, KeyFileError) as exc:
            if self._from_file:
                log.error("API keys: refusing the %d keys of %s until it holds keys again: %s",
                          len(self._from_file), self._file, exc)
            self._from_file, self._seen = [], None
            return
        self._from_file, self._seen = keys, seen
        log.info("API keys: %d read from %s", len(keys), self._file)


def key_check(keys: ApiKeys) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The middleware: a 401 in OpenAI's error format before any other work."""

    @web.middleware
    async def check(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        if request.path in OPEN_PATHS or keys.allows(request.headers.get("Authorization")):
            return await handler(request)
        given = "Authorization" in request.headers
        message = ("Incorrect API key provided" if given else
                   "You didn't provide an API key: send it as `Authorization: Bearer <key>`")
        return ApiError(401, message, code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"}).response()

    return check

