"""The control-plane aiohttp application (served on its own loopback socket)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from . import auth_service, deployments, integrations, listeners
from .config import ControlPlaneConfig
from .http_helpers import RUNTIME_KEY, Runtime, auth_middleware, error_middleware
from .lifecycle import LifecycleDriver
from .storage import Database

log = logging.getLogger("gateway.control_plane")

# The gateway forwards paths unchanged, and self-hosted installs put the control plane
# under /api-host, so every route exists at both places.
ROUTE_PREFIXES = ("", "/api-host")


def create_control_plane_app(
    config: ControlPlaneConfig, *, clock: Callable[[], float] | None = None
) -> web.Application:
    """Build the app; SQLite and the lifecycle driver live in ``app.cleanup_ctx``.

    ``clock`` (epoch seconds, default ``time.time``) stamps records and paces revisions;
    it must be a wall clock because its values are persisted across restarts.
    """
    app = web.Application(
        middlewares=[error_middleware, auth_middleware], client_max_size=config.max_body_bytes
    )
    app[RUNTIME_KEY] = Runtime(config=config, clock=clock or time.time)
    for prefix in ROUTE_PREFIXES:
        deployments.add_routes(app.router, prefix)
        listeners.add_routes(app.router, prefix)
        auth_service.add_routes(app.router, prefix)
        integrations.add_routes(app.router, prefix)
    app.cleanup_ctx.append(_lifetime)
    return app


async def _lifetime(app: web.Application) -> AsyncIterator[None]:
    rt = app[RUNTIME_KEY]
    db = Database(rt.config.database_path)
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
        rt.config.database_path,
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
