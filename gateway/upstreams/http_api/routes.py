"""Routes and their documentation from one table, so the OpenAPI document lists exactly
the operations the application serves."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.upstreams.http_api.decoding import adapter
from gateway.upstreams.http_api.openapi import Api, Operation, openapi_document
from gateway.upstreams.http_api.serving import Handler, expect_handler

__all__ = ["Handler", "Route", "add_routes", "document_bytes"]


@dataclass(frozen=True)
class Route:
    """An operation and the handler that serves it."""

    operation: Operation
    handler: Handler


def add_routes(
    router: web.UrlDispatcher,
    routes: Sequence[Route],
    prefix: str = "",
    public_name_prefix: str = "",
) -> None:
    """Register every route under ``prefix``. The routes of public operations are named
    ``<public_name_prefix><operation id><prefix>``, so middleware can tell them apart."""
    for route in routes:
        op = route.operation
        if op.body is not None:
            # Its validator built now, not by the first request: building one takes
            # hundreds of milliseconds of CPU on a busy host, which the parse budget would
            # charge to whichever client came first (http_api/body_budget.py).
            adapter(op.body)
        name = None
        if public_name_prefix and op.public:
            name = f"{public_name_prefix}{op.operation_id}{prefix.replace('/', '-')}"
        router.add_route(
            op.method.upper(),
            prefix + op.path,
            route.handler,
            name=name,
            expect_handler=expect_handler,  # a coded body refused before 100 Continue
        )


def document_bytes(api: Api, routes: Sequence[Route]) -> bytes:
    """The OpenAPI document of ``routes`` as served: compact JSON, built once per app."""
    document: dict[str, Any] = openapi_document(api, [route.operation for route in routes])
    return json.dumps(document, separators=(",", ":")).encode()
