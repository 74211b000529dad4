"""The admin application (its own port): Prometheus metrics, a liveness probe, the
operator's ``/info`` (counter store addresses, rule files, upstreams, the last reload
error), which the public port does not show, and the operator console (``/console``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.proxy.console import ConsoleSource, add_console


def create_admin_app(
    registry: CollectorRegistry,
    info: Callable[[], Awaitable[dict[str, object]]] | None = None,
    console: ConsoleSource | None = None,
) -> web.Application:
    """``registry``: this process's metrics, or (``--workers``) every worker's."""

    async def metrics_handler(request: web.Request) -> web.Response:
        body = generate_latest(registry)
        response = web.Response(body=body)
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def info_handler(request: web.Request) -> web.Response:
        assert info is not None
        return web.json_response(await info())

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/ok", ok)
    if info is not None:
        app.router.add_get("/info", info_handler)
    if console is not None:
        add_console(app, console)
    return app
