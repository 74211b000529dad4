"""The admin application (its own port): Prometheus metrics and a liveness probe."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.metrics import Metrics


def create_admin_app(metrics: Metrics) -> web.Application:
    async def metrics_handler(request: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        response = web.Response(body=body)
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/ok", ok)
    return app
