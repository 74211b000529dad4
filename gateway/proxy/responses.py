"""JSON error responses in the ``{"detail": ...}`` shape the API uses everywhere."""

from __future__ import annotations

import json
from collections.abc import Iterable

from aiohttp import web


def json_error(status: int, detail: str, headers: Iterable[tuple[str, str]] = ()) -> web.Response:
    response = web.Response(
        status=status,
        body=json.dumps({"detail": detail}).encode(),
        content_type="application/json",
    )
    for name, value in headers:
        response.headers[name] = value
    return response


def json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=json.dumps(payload).encode(), content_type="application/json"
    )
