"""Upgraded connections (WebSocket and other ``Upgrade`` protocols): after the upstream's
``101 Switching Protocols`` the client's and the upstream's connections are joined and
bytes are relayed both ways as they come, with the transports' own backpressure.

The request that asked for the upgrade went through the gateway like any other (checked,
counted once by the rule table, logged); what follows is no longer HTTP and is not parsed.
What a client controls is bounded: tunnels open at once from one address and in all
(``Tunnels.take``), silence (``idle_timeout``), and, when configured, a tunnel's bytes and
lifetime.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

log = logging.getLogger("gateway.proxy")

CLIENT: Final = 0
UPSTREAM: Final = 1


@dataclass(frozen=True, slots=True)
class TunnelLimits:
    max_tunnels: int = 1024  # upgraded connections open at once, all clients
    max_tunnels_per_client: int = 64  # ... from one (untrusted) client address
    idle_timeout: float = 300.0  # no byte either way for this long: both closed
    max_seconds: float = 0.0  # a tunnel's lifetime (0: unbounded)
    max_bytes: int = 0  # bytes both ways together (0: unbounded)


class TunnelEnd(asyncio.Protocol):
    """The protocol of one of a tunnel's two transports once it is joined."""

    def __init__(self, tunnel: Tunnel, side: int) -> None:
        self.tunnel = tunnel
        self.side = side

    def data_received(self, data: bytes) -> None:
        self.tunnel.received(self.side, data)

    def eof_received(self) -> bool | None:
        return self.tunnel.eof(self.side)

    def connection_lost(self, exc: Exception | None) -> None:
        self.tunnel.lost(self.side)

    def pause_writing(self) -> None:
        self.tunnel.writable(self.side, False)

    def resume_writing(self) -> None:
        self.tunnel.writable(self.side, True)


class Tunnel:
    """Two joined transports: what one side sends, the other is written."""

    def __init__(
        self,
        tunnels: Tunnels,
        client: asyncio.Transport,
        upstream: asyncio.Transport,
        client_address: str | None,
        on_client_lost: Callable[[], None],
    ) -> None:
        self.tunnels = tunnels
        self.transports = (client, upstream)
        self.client_address = client_address
        self.on_client_lost = on_client_lost
        self.opened = tunnels.loop.time()
        self.last_activity = self.opened
        self.bytes = 0
        self.eofs = [False, False]
        self.closed = [False, False]
        self.ended = False

    def join(self, to_client: bytes, to_upstream: bytes) -> None:
        """Take over both transports; ``to_client`` / ``to_upstream``: bytes that came
        with the 101 / after the upgrade request, before the join."""
        client, upstream = self.transports
        client.set_protocol(TunnelEnd(self, CLIENT))
        upstream.set_protocol(TunnelEnd(self, UPSTREAM))
        if to_client:
            self.received(UPSTREAM, to_client)
        if to_upstream:
            self.received(CLIENT, to_upstream)
        # Reading may have been paused while the upgrade was pending.
        for transport in self.transports:
            if not transport.is_closing():
                transport.resume_reading()

    def received(self, side: int, data: bytes) -> None:
        if self.ended:
            return
        self.last_activity = self.tunnels.loop.time()
        self.bytes += len(data)
        limit = self.tunnels.limits.max_bytes
        if limit and self.bytes > limit:
            self.end("max_bytes")
            return
        other = self.transports[1 - side]
        if not other.is_closing():
            other.write(data)

    def eof(self, side: int) -> bool:
        """One side finished sending: pass the end on, keep the other direction open."""
        self.eofs[side] = True
        other = self.transports[1 - side]
        if all(self.eofs):
            self.end("closed")
            return False
        if not other.is_closing() and other.can_write_eof():
            other.write_eof()
            return True  # keep reading the other direction
        self.end("closed")
        return False

    def writable(self, side: int, writable: bool) -> None:
        """``side``'s write buffer filled (or drained): pause (resume) reading the other."""
        other = self.transports[1 - side]
        if other.is_closing():
            return
        if writable:
            other.resume_reading()
        else:
            other.pause_reading()

    def lost(self, side: int) -> None:
        self.closed[side] = True
        if side == CLIENT:
            self.on_client_lost()
        if not self.ended:
            self.end("closed")
        other = self.transports[1 - side]
        if not self.closed[1 - side] and not other.is_closing():
            other.close()  # after what is buffered for it has been written

    def end(self, reason: str, abort: bool = False) -> None:
        if self.ended:
            return
        self.ended = True
        self.tunnels.release(self, reason)
        for transport in self.transports:
            if not transport.is_closing():
                if abort:
                    transport.abort()
                else:
                    transport.close()

    def check(self, now: float) -> None:
        limits = self.tunnels.limits
        if now - self.last_activity >= limits.idle_timeout:
            self.end("idle", abort=True)
        elif limits.max_seconds and now - self.opened >= limits.max_seconds:
            self.end("max_seconds", abort=True)


class Tunnels:
    """Every open tunnel of a data plane, counted per client address and in all."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        limits: TunnelLimits,
        closed: Callable[[str], None] | None = None,
    ) -> None:
        self.loop = loop
        self.limits = limits
        self.open: set[Tunnel] = set()
        self.reserved = 0  # taken by requests still waiting for their 101
        self.per_client: dict[str, int] = {}
        self.closed = closed  # called with the reason a tunnel ended (metrics)

    def take(self, client: str | None) -> int:
        """Reserve a tunnel for ``client``: 0 when taken, else the status to answer (429:
        this address has its share; 503: all are taken)."""
        limits = self.limits
        if client is not None and self.per_client.get(client, 0) >= limits.max_tunnels_per_client:
            return 429
        if len(self.open) + self.reserved >= limits.max_tunnels:
            return 503
        self.reserved += 1
        if client is not None:
            self.per_client[client] = self.per_client.get(client, 0) + 1
        return 0

    def give_back(self, client: str | None) -> None:
        """A reservation that did not become a tunnel (the upstream declined, failed)."""
        self.reserved -= 1
        self._uncount(client)

    def opened(self, tunnel: Tunnel) -> None:
        self.reserved -= 1
        self.open.add(tunnel)

    def release(self, tunnel: Tunnel, reason: str) -> None:
        if tunnel in self.open:
            self.open.discard(tunnel)
            self._uncount(tunnel.client_address)
            if self.closed is not None:
                self.closed(reason)

    def _uncount(self, client: str | None) -> None:
        if client is None:
            return
        held = self.per_client.get(client, 0) - 1
        if held > 0:
            self.per_client[client] = held
        else:
            self.per_client.pop(client, None)

    def sweep(self, now: float) -> None:
        for tunnel in list(self.open):
            tunnel.check(now)

    def close_all(self) -> None:
        for tunnel in list(self.open):
            tunnel.end("stopping", abort=True)
