"""The proxy port as a whole: its listening sockets, every open client connection, the
one sweep timer that enforces their deadlines, and graceful stop. The connections
themselves are ``gateway.proxy.server.ClientConnection``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from gateway.proxy.handler import Gateway
from gateway.proxy.server import ClientConnection
from gateway.proxy.upstream_pool import Upstream, UpstreamPool

log = logging.getLogger("gateway.proxy")


@dataclass(frozen=True, slots=True)
class PlaneLimits:
    max_body_bytes: int = 32 * 1024 * 1024
    max_head_bytes: int = 64 * 1024  # the whole request head, all headers together
    header_timeout: float = 10.0
    client_idle_timeout: float = 75.0
    body_read_timeout: float = 60.0
    upstream_timeout: float = 60.0
    upstream_read_timeout: float = 300.0
    max_connections: int = 10_000
    max_uploads_per_client: int = 8
    max_uploads: int = 128  # all clients together: half the upstream pool



class DataPlane:
    """The proxy port's server: connections, their deadlines, graceful stop."""

    def __init__(self, gateway: Gateway, pool: UpstreamPool, limits: PlaneLimits) -> None:
        self.gateway = gateway
        self.pool = pool
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        self.connections: set[ClientConnection] = set()
        self.closing = False
        self.refused = 0
        # Streamed uploads holding an upstream connection, per client address and in all.
        self.uploads: dict[str, int] = {}
        self.uploads_open = 0
        self._refused_logged = 0.0
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._addresses: dict[Upstream, tuple[str, int, bool, str]] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        shortest = min(
            limits.header_timeout, limits.client_idle_timeout, limits.body_read_timeout,
            limits.upstream_timeout, limits.upstream_read_timeout,
        )  # fmt: skip
        self._tick = max(0.05, min(1.0, shortest / 4))
        self._sweeps = 0
        self._all_closed: asyncio.Future[None] | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False) -> list[str]:
        server = await self.loop.create_server(
            lambda: ClientConnection(self),
            host,
            port,
            reuse_port=reuse_port or None,
            backlog=1024,
        )
        self._servers.append(server)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self._tick, self._sweep)
        addresses = []
        for sock in getattr(server, "sockets", ()):
            name = sock.getsockname()
            shown = f"[{name[0]}]" if ":" in name[0] else name[0]
            addresses.append(f"http://{shown}:{name[1]}")
        return addresses

    @property
    def ports(self) -> list[int]:
        return [
            int(s.getsockname()[1]) for srv in self._servers for s in getattr(srv, "sockets", ())
        ]

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("request task failed", exc_info=task.exception())

    def address(self, upstream: Upstream) -> tuple[str, int, bool, str]:
        found = self._addresses.get(upstream)
        if found is None:
            found = self._addresses[upstream] = upstream.address()
        return found

    def take_upload(self, client: str) -> int:
        """Reserve an upload slot for ``client``: 0 when taken, else the status to answer
        (429: this client has its share; 503: the slots of all clients are taken).

        A request body over 64 KiB streams to the upstream as it arrives, so the upstream
        connection is held for as long as the client takes to send it. Without these caps
        a few hundred clients trickling large bodies would hold the whole pool and every
        other request would wait for a connection (hardening issue, slow-body starvation).
        """
        held = self.uploads.get(client, 0)
        if held >= self.limits.max_uploads_per_client:
            return 429
        if self.uploads_open >= self.limits.max_uploads:
            return 503
        self.uploads[client] = held + 1
        self.uploads_open += 1
        return 0

    def end_upload(self, client: str) -> None:
        held = self.uploads.get(client, 0) - 1
        if held > 0:
            self.uploads[client] = held
        else:
            self.uploads.pop(client, None)
        self.uploads_open -= 1

    def connection_closed(self, conn: ClientConnection) -> None:
        self.connections.discard(conn)
        if not self.connections and self._all_closed is not None and not self._all_closed.done():
            self._all_closed.set_result(None)

    def refused_connection(self) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._refused_logged > 10:
            self._refused_logged = now
            log.warning(
                "connection limit reached (%d open): new connections are closed at once "
                "(%d so far); raise max_connections if this is legitimate traffic",
                len(self.connections),
                self.refused,
            )

    def _sweep(self) -> None:
        now = self.loop.time()
        for conn in list(self.connections):
            if conn.deadline or conn.body_deadline:
                conn.check(now)
        self._sweeps += 1
        if self._sweeps % max(1, int(10 / self._tick)) == 0:
            self.pool.sweep()
        self._sweeper = self.loop.call_later(self._tick, self._sweep)

    async def stop(self, grace: float) -> None:
        """Stop accepting, let requests in flight finish (up to ``grace`` s), close."""
        self.closing = True
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            if conn.active is None and conn.current is None and conn.transport is not None:
                conn.transport.close()
        self._all_closed = self.loop.create_future()
        if self.connections:
            with suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._all_closed), grace)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self.pool.close()
        for server in self._servers:
            await server.wait_closed()
