"""The router's HTTP calls to the prefill and decode instances, and how their failures reach the
client: an instance's 4xx is the client's answer, anything else a 5xx naming the replica."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from pdd_sidecar.serve.openai.openai_request import ApiError

# A replica's address that no longer answers (a pod just deleted) costs this much before the
# request goes to another replica.
CONNECT_TIMEOUT_S = 5.0


def upstream_error(role: str, url: str, status: int, data: Any,
                   headers: Mapping[str, str] | None = None) -> ApiError:
    """An instance's error, old (`{"error": "text"}`) or new (OpenAI-style) format."""
    err = data.get("error") if isinstance(data, dict) else None
    type_ = None
    if isinstance(err, dict):
        message = str(err.get("message", err))
        type_ = err.get("type") if isinstance(err.get("type"), str) else None
    elif isinstance(err, str):
        message = err
    else:
        message = str(data)[:500]
    out_headers = {}
    if status == 429 and headers and "Retry-After" in headers:
        out_headers["Retry-After"] = headers["Retry-After"]
    if status >= 500:
        message = f"{role} {url}: {message}"
    return ApiError(status, message, None, type_, None, out_headers)


class Unreachable(ApiError):
    """No connection: the replica never saw the request, so another may take it."""


async def post_json(session: aiohttp.ClientSession, role: str, url: str, path: str,
                    body: dict[str, Any], timeout_s: float | None,
                    headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """POST a JSON body, answer the JSON object the replica returned with a 2xx (202: taken,
    done between two steps)."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=CONNECT_TIMEOUT_S)
        async with session.post(f"{url}{path}", json=body, headers=headers,
                                timeout=timeout) as resp:
            try:
                data = await resp.json(content_type=None)
            except (json.JSONDecodeError, UnicodeDecodeError):
                data = None
            if not 200 <= resp.status < 300:
                raise upstream_error(role, url, resp.status, data, resp.headers)
            if not isinstance(data, dict):
                raise ApiError(502, f"{role} {url}{path}: answered {resp.status} without a JSON "
                               "object")
            return data
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise ApiError(502, f"{role} {url}{path}: {type(exc).__name__}: {exc}") from None
