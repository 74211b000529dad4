"""The control-plane aiohttp application (served on its own loopback socket)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from aiohttp import web

from gateway.upstreams.http_api.body_budget import address_policy, use_parse_budget
from gateway.upstreams.http_api.openapi import Operation, Response
from gateway.upstreams.http_api.parse_budget import ParseBudget
from gateway.upstreams.http_api.problems import ErrorResponse
from gateway.upstreams.http_api.routes import Route, add_routes, document_bytes
from gateway.upstreams.http_api.serving import mark_builtin_api
from gateway.upstreams.postgres.breaker import DATABASE_BREAKER_KEY
from gateway.urls import display_url

from . import auth_service, deployments, integrations, listeners
from .api_doc import API
from .config import ControlPlaneConfig
from .database import Database
from .http_helpers import (
    PUBLIC_ROUTE_PREFIX,
    RUNTIME_KEY,
    Runtime,
    auth_middleware,
    error_middleware,
)
from .lifecycle import LifecycleDriver

log = logging.getLogger("gateway.control_plane")

# The gateway forwards paths unchanged, and self-hosted installs put the control plane
# under /api-host, so every route exists at both places.
ROUTE_PREFIXES = ("", "/api-host")
OPENAPI_KEY = web.AppKey("control_plane_openapi", bytes)


async def openapi_document(request: web.Request) -> web.Response:
    """GET /openapi.json: the OpenAPI 3.1 description of the control plane."""
    return web.Response(body=request.app[OPENAPI_KEY], content_type="application/json")


_OPENAPI_ROUTE = Route(
    Operation(
        "get",
        "/openapi.json",
        "control_plane_openapi",
        "This document",
        {200: Response("OpenAPI 3.1 document", dict[str, Any])},
        public=True,
    ),
    openapi_document,
)


_UNAVAILABLE = Response(
    "The control plane's database is unavailable (PostgreSQL not answering in time), or "
    "the control plane is starting; Retry-After says when to try again",
    ErrorResponse,
)


def _may_be_unavailable(route: Route) -> Route:
    """``route``, documented with the 503 of an operation that uses the database."""
    responses = {**route.operation.responses, 503: _UNAVAILABLE}
    return dataclasses.replace(
        route, operation=dataclasses.replace(route.operation, responses=responses)
    )


def routes(config: ControlPlaneConfig) -> tuple[Route, ...]:
    """Every route of the control plane, as served and as documented."""
    with_database = (
        *deployments.ROUTES,
        *listeners.ROUTES,
        *auth_service.routes(config.auth_wait_max_seconds),
    )
    return (
        *(_may_be_unavailable(route) for route in with_database),
        *integrations.ROUTES,
        _OPENAPI_ROUTE,
    )


def create_control_plane_app(
    config: ControlPlaneConfig,
    *,
    clock: Callable[[], float] | None = None,
    parse_budget: ParseBudget | None = None,
    trusted_proxies: Sequence[str] = (),
    ipv6_prefix: int = 64,
) -> web.Application:
    """Build the app; SQLite and the lifecycle driver live in ``app.cleanup_ctx``.

    ``clock`` (epoch seconds, default ``time.time``) stamps records and paces revisions;
    it must be a wall clock because its values are persisted across restarts.
    ``parse_budget``: the event loop's one for parsing request bodies (the apps of one
    loop share it; by default one of its own); ``trusted_proxies``: peers believed, besides
    loopback, for the client address it counts by, IPv6 ones by ``ipv6_prefix``
    (``http_api/body_budget.py``).
    """
    app = web.Application(
        middlewares=[error_middleware, auth_middleware], client_max_size=config.max_body_bytes
    )
    app[RUNTIME_KEY] = Runtime(config=config, clock=clock or time.time)
    use_parse_budget(app, parse_budget, address_policy(trusted_proxies, ipv6_prefix))
    mark_builtin_api(app, "control-plane")
    if config.database_url is not None:
        from .pg_storage import control_plane_breaker

        # For a readiness check: postgres.breaker.database_ready(app).
        app[DATABASE_BREAKER_KEY] = control_plane_breaker(
            config.database_url, config.database_timeout_seconds, config.database_retry_seconds
        )
    served = routes(config)
    app[OPENAPI_KEY] = document_bytes(API, served)
    for prefix in ROUTE_PREFIXES:
        add_routes(app.router, served, prefix, public_name_prefix=PUBLIC_ROUTE_PREFIX)
    app.cleanup_ctx.append(_lifetime)
    return app


async def _lifetime(app: web.Application) -> AsyncIterator[None]:
    rt = app[RUNTIME_KEY]
    db: Database
    if rt.config.database_url is not None:
        from .pg_storage import PostgresDatabase

        db = PostgresDatabase(
            rt.config.database_url,
            rt.config.database_timeout_seconds,
            app[DATABASE_BREAKER_KEY],
            rt.config.limits,
        )
        where = f"PostgreSQL {display_url(rt.config.database_url)}"
    else:
        db = Database(rt.config.database_path, rt.config.limits)
        where = f"SQLite {rt.config.database_path}"
    await db.open()
    rt.db = db
    driver = LifecycleDriver(
        lambda now, step: db.run(db.store.advance_revisions, now, step),
        rt.config.revision_step_seconds,
        rt.clock,
    )
    rt.driver = driver
    task = asyncio.create_task(driver.run(), name="control-plane-lifecycle")
    log.info(
        "control plane started: database=%s revision_step_seconds=%g",
        where,
        rt.config.revision_step_seconds,
    )
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        rt.driver = None
        rt.db = None
        await db.close()
