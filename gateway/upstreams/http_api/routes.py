"""Routes and their documentation from one table, so the OpenAPI document lists exactly
the operations the application serves."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.upstreams.http_api.openapi import Api, Operation, openapi_document

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    """An operation and the handler that serves it."""

    operation: Operation
    handler: Handler


def add_routes(
    router: web.UrlDispatcher, routes: Sequence[Route], prefix: str = "", name: str = ""
) -> None:
    """Register every route under ``prefix``; ``name`` prefixes the route names (public
    routes are recognised by it)."""
    for route in routes:
        op = route.operation
        route_name = f"{name}{op.operation_id}{prefix.replace('/', '-')}" if name else None
        router.add_route(op.method.upper(), prefix + op.path, route.handler, name=route_name)


def document_bytes(api: Api, routes: Sequence[Route]) -> bytes:
    """The OpenAPI document of ``routes`` as served: compact JSON, built once per app."""
    document: dict[str, Any] = openapi_document(api, [route.operation for route in routes])
    return json.dumps(document, separators=(",", ":")).encode()
