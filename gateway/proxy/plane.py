"""The proxy port as a whole: its listening sockets, every open client connection, the
one sweep timer that enforces their deadlines, and graceful stop. The connections
themselves are ``gateway.proxy.server.ClientConnection``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from gateway.proxy.batched_writes import write_batch
from gateway.proxy.handler import Gateway
from gateway.proxy.server import ClientConnection
from gateway.proxy.tls import TlsListener
from gateway.proxy.tunnel import TunnelLimits, Tunnels
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
    max_downloads_per_client: int = 8
    max_exchanges_per_client: int = 64  # forwarded, not yet answered, per client address
    # ... enforced once this many are in progress from all clients (half the pool)
    exchanges_contended: int = 128
    max_client_connections: int = 1250  # open at once from one (untrusted) address
    # upgraded connections (WebSocket ...)
    tunnels: TunnelLimits = field(default_factory=TunnelLimits)


class DataPlane:
    """The proxy port's server: connections, their deadlines, graceful stop."""

    def __init__(self, gateway: Gateway, pool: UpstreamPool, limits: PlaneLimits) -> None:
        self.gateway = gateway
        self.pool = pool
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        # The loop's clock, bound once (a deadline is set several times a request; see
        # batched_writes.BatchedTransport for why).
        self.clock: Callable[[], float] = self.loop.time
        self.writes = write_batch(self.loop)  # shared with the upstream connections
        self.connections: set[ClientConnection] = set()
        self.closing = False
        self.refused = 0
        # A connection answers a byte-identical repeat of a request refused from a known
        # refusal without parsing it again (ClientConnection._replay); how many were.
        self.replay_refusals = True
        self.replayed = 0
        # "https" once start() serves TLS: what upstreams are told in X-Forwarded-Proto.
        self.scheme = "http"
        # Streamed uploads holding an upstream connection, per client address and in all.
        self.uploads: dict[str, int] = {}
        self.uploads_open = 0
        # Streamed answers holding an upstream connection, per client address.
        self.downloads: dict[str, int] = {}
        # Requests forwarded and not yet answered whole, per client address, and in all.
        self.exchanges: dict[str, int] = {}
        self.exchanges_open = 0
        # Open connections per TCP peer address (trusted proxies are not capped).
        self.per_address: dict[str, int] = {}
        self.tunnels = Tunnels(
            self.loop,
            limits.tunnels,
            lambda reason: gateway.metrics.child(gateway.metrics.tunnels_closed, reason).inc(),
        )
        self._refused_logged = 0.0
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: set[asyncio.Task[None]] = set()
        # By base URL, all an address comes from: a str hashes in C, while Upstream's
        # dataclass __hash__ ran as Python code on every request.
        self._addresses: dict[str, tuple[str, int, bool, str]] = {}
        self._host_headers: dict[str, str] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        shortest = min(
            limits.header_timeout, limits.client_idle_timeout, limits.body_read_timeout,
            limits.upstream_timeout, limits.upstream_read_timeout,
        )  # fmt: skip
        self._tick = max(0.05, min(1.0, shortest / 4))
        self._sweeps = 0
        self._all_closed: asyncio.Future[None] | None = None
        self._hurried = False  # a second signal: stop waits for nothing more

    async def start(
        self, host: str, port: int, reuse_port: bool = False, tls: TlsListener | None = None
    ) -> list[str]:
        """Listen on host:port: plain HTTP, or HTTPS with ``tls`` (each connection's
        handshake under the listener's deadline, plain HTTP answered 400). The addresses
        served, as URLs."""
        scheme = "http" if tls is None else "https"
        if self._servers and scheme != self.scheme:
            # One scheme per plane: the relay tells upstreams X-Forwarded-Proto from it.
            raise ValueError(
                "this data plane already serves " + self.scheme + ": start another for " + scheme
            )
        if tls is None:
            server = await self.loop.create_server(
                lambda: ClientConnection(self),
                host,
                port,
                reuse_port=reuse_port or None,
                backlog=1024,
            )
        else:
            server = await tls.serve(
                self.loop, lambda: ClientConnection(self), host, port, reuse_port=reuse_port
            )
        self.scheme = scheme
        self._servers.append(server)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self._tick, self._sweep)
        addresses = []
        for sock in getattr(server, "sockets", ()):
            name = sock.getsockname()
            shown = f"[{name[0]}]" if ":" in name[0] else name[0]
            addresses.append(f"{scheme}://{shown}:{name[1]}")
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
        found = self._addresses.get(upstream.base_url)
        if found is None:
            found = self._addresses[upstream.base_url] = upstream.address()
        return found

    def host_header(self, upstream: Upstream) -> str:
        """``upstream.host_header()``, one string per upstream, not one built per
        request."""
        found = self._host_headers.get(upstream.base_url)
        if found is None:
            found = self._host_headers[upstream.base_url] = upstream.host_header()
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

    def take_exchange(self, client: str | None) -> bool:
        """Count a request forwarded upstream, from before it takes (or waits for) an
        upstream connection until it has been answered whole: False when ``client``
        already has ``max_exchanges_per_client`` in progress while the pool is
        contended (half of it in use). ``client`` None: a trusted proxy's own request
        (no forwarded client), counted in all only.

        Taken before the connection, in the same step as the check: a burst of requests
        that arrive together cannot all pass a check made before any of them is
        counted, as answers that start streaming together passed the download cap
        (hardening, third round). While the pool has room an address may use more than
        its share (a batch job's ordinary concurrency); once it is contended, long
        polls, slow answers and unread downloads from one address hold at most this
        share, and the rest stays for the others."""
        if client is None:
            self.exchanges_open += 1
            return True
        held = self.exchanges.get(client, 0)
        limits = self.limits
        if (
            held >= limits.max_exchanges_per_client
            and self.exchanges_open >= limits.exchanges_contended
        ):
            return False
        self.exchanges[client] = held + 1
        self.exchanges_open += 1
        return True

    def end_exchange(self, client: str | None) -> None:
        self.exchanges_open -= 1
        if client is None:
            return
        held = self.exchanges.get(client, 0) - 1
        if held > 0:
            self.exchanges[client] = held
        else:
            self.exchanges.pop(client, None)

    def take_download(self, client: str) -> bool:
        """Count an answer streaming to ``client`` (it holds an upstream connection until
        the client has read it): False when the client already has its share.

        A client that asks for large answers and never reads them holds one upstream
        connection each until ``upstream_read_timeout``; without this cap a few hundred
        such requests from one address starve the pool for everyone (hardening issue,
        second round, finding 3)."""
        held = self.downloads.get(client, 0)
        if held >= self.limits.max_downloads_per_client:
            return False
        self.downloads[client] = held + 1
        return True

    def downloads_full(self, client: str) -> bool:
        return self.downloads.get(client, 0) >= self.limits.max_downloads_per_client

    def end_download(self, client: str) -> None:
        held = self.downloads.get(client, 0) - 1
        if held > 0:
            self.downloads[client] = held
        else:
            self.downloads.pop(client, None)

    def connection_opened(self, address: str) -> bool:
        """Count a connection from ``address``: False (and not counted) when that address
        already holds ``max_client_connections``, so one address cannot take every slot
        of ``max_connections`` and lock the others out."""
        held = self.per_address.get(address, 0)
        if held >= self.limits.max_client_connections:
            return False
        self.per_address[address] = held + 1
        return True

    def address_closed(self, address: str) -> None:
        held = self.per_address.get(address, 0) - 1
        if held > 0:
            self.per_address[address] = held
        else:
            self.per_address.pop(address, None)

    def connection_closed(self, conn: ClientConnection) -> None:
        self.connections.discard(conn)
        if not self.connections and self._all_closed is not None and not self._all_closed.done():
            self._all_closed.set_result(None)

    def refused_connection(self, address: str | None = None) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._refused_logged > 10:
            self._refused_logged = now
            if address is None:
                log.warning(
                    "connection limit reached (%d open): new connections are closed at once "
                    "(%d so far); raise max_connections if this is legitimate traffic",
                    len(self.connections),
                    self.refused,
                )
            else:
                log.warning(
                    "%s holds %d connections, the most one address may "
                    "(max_client_connections): its new ones are closed at once (%d so far)",
                    address,
                    self.limits.max_client_connections,
                    self.refused,
                )

    def _sweep(self) -> None:
        now = self.loop.time()
        for conn in list(self.connections):
            if conn.deadline or conn.body_deadline:
                conn.check(now)
        if self.tunnels.open:
            self.tunnels.sweep(now)
        self._sweeps += 1
        if self._sweeps % max(1, int(10 / self._tick)) == 0:
            self.pool.sweep()
        self._sweeper = self.loop.call_later(self._tick, self._sweep)

    def hurry(self) -> None:
        """End ``stop``'s wait for requests in flight now (a second signal)."""
        self._hurried = True
        closed = self._all_closed
        if closed is not None and not closed.done():
            closed.set_result(None)

    async def stop(self, grace: float) -> None:
        """Stop accepting, let requests in flight finish (up to ``grace`` s), close."""
        self.closing = True
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            # (an upgraded connection gets the grace too: its peers may be closing it)
            if (
                conn.active is None
                and conn.current is None
                and conn.tunnel is None
                and conn.transport is not None
            ):
                conn.transport.close()
        self._all_closed = self.loop.create_future()
        if self.connections and not self._hurried:
            with suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._all_closed), grace)
        self.tunnels.close_all()
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
