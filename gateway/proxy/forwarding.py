"""The forwarding half of a client connection: once the gateway has decided to pass a
request on, opening (or reusing) an upstream connection and sending the request through
a ``Relay``, the caps on streamed uploads and downloads and on upgraded connections, the
callbacks the relay makes as the answer comes back (``forward_head``, ``forward_done``,
``forward_failed``, ``download_started``), and an upgrade becoming a tunnel
(``tunnel_open``, ``gateway.proxy.tunnel``).

``Forwarding`` is the base class of ``gateway.proxy.server.ClientConnection``, which
holds the other half (parsing, the request cycle, the connection's lifecycle and
deadlines). A base class rather than an object of its own: still one object per
connection, and under mypyc (both modules compiled together) a call between the halves
is a native method call, as it was within one class.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Final

from gateway.proxy.batched_writes import BatchedTransport
from gateway.proxy.handler import Peer
from gateway.proxy.relay import BUFFER_BEFORE_FORWARD, Relay, request_head, stale_connection
from gateway.proxy.request import Incoming, bodiless_method_with_content
from gateway.proxy.tunnel import Tunnel
from gateway.proxy.upstream_pool import Upstream, UpstreamConnection
from gateway.proxy.wire import CONTINUE_100, Answer

if TYPE_CHECKING:
    from gateway.proxy.plane import DataPlane

log = logging.getLogger("gateway.proxy")

# Deadline kinds (one at a time per connection, besides the request body's own), set by
# both halves and enforced by ClientConnection.check (the plane's sweep calls it).
IDLE: Final = 1
HEAD: Final = 2
UPSTREAM: Final = 3
RESPONSE: Final = 4
NO_PEER: Final = Peer(None, False, "unknown")
perf_counter: Final = time.perf_counter


class BodyStalledError(Exception):
    """The client stopped sending its request body for longer than allowed."""


def stalled(req: Incoming) -> Answer:
    return Answer.error(408, "the request body stalled", req.rate_headers)


class Forwarding(asyncio.Protocol):
    """The forwarding half of one client connection (``ClientConnection``'s base)."""

    def __init__(self, plane: DataPlane) -> None:
        # What both halves use: the port, the client and its transport, the request being
        # answered and those read behind it, reading's pauses, the deadlines.
        self.plane = plane
        self.gateway = plane.gateway
        self.limits = plane.limits
        self.transport: BatchedTransport | None = None
        self.peer = NO_PEER
        self.active: Incoming | None = None  # being answered
        self.pipeline: deque[Incoming] = deque()
        self.paused: set[str] = set()
        self.reading_paused = False
        self.deadline = 0.0
        self.body_deadline = 0.0
        self.lost = False
        self.response_started = False
        # The forwarding of the active request.
        self.relay: Relay | None = None
        self.upstream: Upstream | None = None  # where the active request is forwarded
        self.upstream_address: tuple[str, int, bool, str] = ("", 0, False, "")  # its address
        self.attempt = 0
        self.forward_started = 0.0
        self.waiting_body = False  # a small body is read whole before forwarding
        # Once the upstream has switched protocols, the joined connections (the protocol
        # of this connection's transport is then the tunnel's: see gateway.proxy.tunnel).
        self.tunnel: Tunnel | None = None
        # Bytes that came after an Upgrade request's head (without a body), kept until
        # the upstream has answered: a tunnel passes them on (bounded; then reading pauses).
        self.upgrade_early: bytearray | None = None

    # --- what the other half provides (ClientConnection overrides each): what this half
    # calls, and the rest of what a Relay asks of the connection (relay.ClientSide)

    def _answer(self, req: Incoming, answer: Answer, keep: bool = True) -> None:
        """Write one of the gateway's own answers and end the request."""
        raise NotImplementedError

    def _finish(self, req: Incoming, keep: bool) -> None:
        raise NotImplementedError

    def _set_deadline(self, kind: int, seconds: float) -> None:
        raise NotImplementedError

    def connection_lost(self, exc: Exception | None) -> None:
        raise NotImplementedError

    def write(self, data: bytes) -> None:
        raise NotImplementedError

    def set_paused(self, reason: str, paused: bool) -> None:
        raise NotImplementedError

    def body_sink_ready(self) -> None:
        raise NotImplementedError

    def keep_alive_after(self, req: Incoming) -> bool:
        raise NotImplementedError

    def response_progress(self) -> None:
        raise NotImplementedError

    # --- forwarding

    def _forward(self, req: Incoming, upstream: Upstream) -> None:
        """Start forwarding ``req``: by callbacks from here on, no task unless a new
        upstream connection must be opened."""
        if req.content_length is not None and req.content_length > self.limits.max_body_bytes:
            self._answer(req, self._too_large(req), keep=False)
            return
        if req.upgrade and upstream.upgrade and not self._take_tunnel(req):
            return
        if req.expect_continue and not req.body_done and self.transport is not None:
            self.transport.write(CONTINUE_100)
        self.upstream = upstream
        self.attempt = 0
        if not req.body_done and req.body_size < BUFFER_BEFORE_FORWARD:
            # A small body is read whole first: a trickling client holds no upstream.
            self.waiting_body = True
            return
        self._connect(req)

    def _per_client(self, req: Incoming) -> str | None:
        """The client address a request's per-client slots (exchanges, tunnels) are
        counted under: the client a trusted proxy names in X-Forwarded-For, as any
        client's. None, not capped per address, only for a trusted proxy's request that
        names no client behind it: that is all its clients (as its connections are not
        capped either). Judged by the X-Forwarded-For walk (``names_client``), not by
        comparing grouped addresses: a client in the proxy's own IPv6 prefix is capped."""
        if req.trusted_peer and not req.names_client:
            return None
        return req.client_ip

    def _take_tunnel(self, req: Incoming) -> bool:
        """An Upgrade to an upstream that takes upgrades: pass it on, with a tunnel slot
        reserved (False: answered 429 / 503 instead). Not passed on (the request is plain
        HTTP, as it is where upgrades are not offered): h2c, which this data plane does
        not speak, and an Upgrade request with a body (forwarded whole as HTTP)."""
        value = b", ".join(v for n, v in req.headers if n.lower() == b"upgrade")
        if (
            not value
            or self.upgrade_early is None  # a body was declared: read as HTTP
            or b"h2c" in {t.strip().lower() for t in value.split(b",")}
        ):
            return True
        refused = self.plane.tunnels.take(self._per_client(req))
        if refused:
            limits = self.limits.tunnels
            if refused == 429:
                reason = "tunnels_per_client"
                detail = (
                    f"too many upgraded connections open from this client (at most "
                    f"{limits.max_tunnels_per_client}); close one and retry"
                )
            else:
                reason = "tunnels_total"
                detail = (
                    f"every upgraded connection slot ({limits.max_tunnels}) is in use; "
                    "retry shortly"
                )
            self.gateway.metrics.upstream_errors.labels("-", reason).inc()
            headers = [*req.rate_headers, ("Retry-After", "1")]
            self._answer(req, Answer.error(refused, detail, headers), keep=False)
            return False
        req.tunnel = True
        req.upgrade_value = value
        return True

    def tunnel_open(self, relay: Relay, rest: bytes) -> None:
        """The upstream switched protocols: end the HTTP request (logged, 101) and join
        the two connections (``gateway.proxy.tunnel``)."""
        req = relay.req
        uconn = relay.uconn
        client = self.transport
        upstream = None if uconn is None else uconn.transport
        if self.active is not req or not req.tunnel:
            if upstream is not None:
                upstream.abort()
            return
        latency = perf_counter() - self.forward_started
        metrics = self.gateway.metrics
        metrics.child(metrics.upstream_latency, relay.upstream.name).observe(latency)
        record = req.record
        if record is not None:
            record.status = 101
            record.upstream_ms = int(latency * 1e6) / 1000
        if self.lost or client is None or upstream is None or upstream.is_closing():
            if upstream is not None:
                upstream.abort()
            if record is not None:
                record.status = 502 if not self.lost else 499
            self._finish(req, keep=False)
            return
        early = bytes(self.upgrade_early or b"")
        self.upgrade_early = None
        req.tunnel = False  # the reservation becomes the tunnel
        address = self._per_client(req)
        # (the 101 answer still held is written first; the tunnel writes straight on)
        tunnel = self.tunnel = Tunnel(
            self.plane.tunnels,
            client.detach(),
            upstream.detach(),
            address,
            self._tunnel_client_lost,
        )
        self.plane.tunnels.opened(tunnel)
        metrics.child(metrics.tunnels_opened).inc()
        # The HTTP request ends here (metrics, access log); the connection goes on as the
        # tunnel, its deadlines now the tunnel's.
        self.active = None
        metrics.inflight.dec()
        self._release_slots(req)
        self.deadline = self.body_deadline = 0.0
        self.pipeline.clear()
        self.paused.clear()
        self.reading_paused = False
        if record is not None:
            self.gateway.finished(record, req.started)
        tunnel.join(rest, early)

    def _tunnel_client_lost(self) -> None:
        self.connection_lost(None)

    def _take_upload(self, req: Incoming) -> bool:
        """A body that streams holds an upstream connection while it arrives: at most
        ``max_uploads_per_client`` per client, half the pool in all (else 429 / 503)."""
        refused = self.plane.take_upload(req.client_ip)
        if not refused:
            req.upload_client = req.client_ip
            return True
        upstream = self.upstream
        limits = self.limits
        if refused == 429:
            reason = "uploads_per_client"
            detail = (
                f"too many uploads in progress from this client (at most "
                f"{limits.max_uploads_per_client} at once); retry when one has finished"
            )
        else:
            reason = "uploads_total"
            detail = (
                f"the upstream connections set aside for uploads ({limits.max_uploads}) "
                "are all in use; retry shortly"
            )
        self.gateway.metrics.upstream_errors.labels(
            upstream.name if upstream else "-", reason
        ).inc()
        headers = [*req.rate_headers, ("Retry-After", "1")]
        self._answer(req, Answer.error(refused, detail, headers), keep=False)
        return False

    def _too_many_downloads(self, req: Incoming, upstream: Upstream) -> None:
        self._client_busy(
            req,
            upstream,
            "downloads_per_client",
            f"too many answers still streaming to this client (at most "
            f"{self.limits.max_downloads_per_client} at once); read them, or retry when "
            "one has finished",
        )

    def _too_many_exchanges(self, req: Incoming, upstream: Upstream) -> None:
        self._client_busy(
            req,
            upstream,
            "exchanges_per_client",
            f"too many requests from this client still in progress upstream (at most "
            f"{self.limits.max_exchanges_per_client} at once while the upstream connections "
            "are in demand); retry when one has finished",
        )

    def _client_busy(self, req: Incoming, upstream: Upstream, kind: str, detail: str) -> None:
        """429 for a client holding its share of upstream connections, counted by kind."""
        self.gateway.metrics.upstream_errors.labels(upstream.name, kind).inc()
        headers = [*req.rate_headers, ("Retry-After", "1")]
        self._answer(req, Answer.error(429, detail, headers))

    def download_started(self, relay: Relay) -> None:
        """An answer outlasted the read its head came in: it holds its upstream
        connection until the client has read it, counted per client address."""
        req = relay.req
        # Only a slot taken is released (in _finish): answers that started together past
        # the cap (the check in _connect came before any of them streamed) are not
        # counted, rather than releasing slots other answers hold.
        if (
            req is self.active
            and req.download_client is None
            and self.plane.take_download(req.client_ip)
        ):
            req.download_client = req.client_ip

    def _end_upload(self, req: Incoming) -> None:
        client, req.upload_client = req.upload_client, None
        if client is not None:
            self.plane.end_upload(client)

    def _body_progress(self, req: Incoming) -> None:
        if (
            self.waiting_body
            and req is self.active
            and (req.body_done or req.body_size >= BUFFER_BEFORE_FORWARD)
        ):
            self.waiting_body = False
            self._connect(req)

    def _connect(self, req: Incoming) -> None:
        upstream = self.upstream
        assert upstream is not None
        if not req.body_done and req.upload_client is None and not self._take_upload(req):
            return
        if self.plane.downloads and self.plane.downloads_full(req.client_ip):
            self._too_many_downloads(req, upstream)
            return
        if not req.exchange_counted:  # (a retry keeps the slot it has)
            client = self._per_client(req)
            if not self.plane.take_exchange(client):
                self._too_many_exchanges(req, upstream)
                return
            req.exchange_counted = True
            req.exchange_client = client
        self.attempt += 1
        if self.attempt == 1:
            self.forward_started = perf_counter()
            self._set_deadline(UPSTREAM, self.limits.upstream_timeout)
        address = self.upstream_address = self.plane.address(upstream)
        host, port, tls, _ = address
        uconn = self.plane.pool.take_idle(host, port, tls)
        if uconn is not None:
            self._send(req, uconn)
        else:
            self.plane.spawn(self._open_and_send(req, host, port, tls))

    async def _open_and_send(self, req: Incoming, host: str, port: int, tls: bool) -> None:
        upstream = self.upstream
        if upstream is None or self.active is not req:
            return  # answered meanwhile (a refused body, a lost client)
        try:
            uconn = await self.plane.pool.acquire(host, port, tls)
        except TimeoutError:
            self._forward_error(req, self._upstream_timeout(req, upstream))
            return
        except OSError as exc:
            self._forward_error(req, self._unreachable(req, upstream, exc))
            return
        if self.lost or self.active is not req:
            self.plane.pool.release(uconn)
            return
        self._send(req, uconn)

    def _send(self, req: Incoming, uconn: UpstreamConnection) -> None:
        upstream = self.upstream
        assert upstream is not None
        prefix = self.upstream_address[3]
        head = req.upstream_head
        if head is None:
            req.close_upstream = bodiless_method_with_content(
                req.method, req.content_length, req.chunked
            ) or (
                req.keep_override
                and bodiless_method_with_content(req.rule_method, req.content_length, req.chunked)
            )
            head = req.upstream_head = request_head(
                req, upstream, prefix, self.plane.host_header(upstream), self.peer.address or "",
                self.plane.scheme == "https",
            )  # fmt: skip
        relay = self.relay = Relay(self, req, upstream, self.gateway.metrics)
        relay.send(uconn, head)
        if not req.body_done:
            # While the body streams, its silence is what is bounded (body_read_timeout);
            # the wait for the answer (upstream_timeout) starts once all of it is sent.
            self.deadline = 0.0

    def _forward_error(self, req: Incoming, answer: Answer) -> None:
        if self.active is req and not self.lost:
            self.relay = None
            self._answer(req, answer, keep=False)

    # --- relay callbacks

    def forward_failed(self, relay: Relay, exc: BaseException) -> None:
        """The upstream did not answer: retry a stale keep-alive connection once, else
        answer 504 / 408 / 502."""
        req = relay.req
        upstream = relay.upstream
        if self.active is not req or self.lost:
            return
        if isinstance(exc, TimeoutError):
            answer = self._upstream_timeout(req, upstream)
        elif isinstance(exc, BodyStalledError):
            answer = stalled(req)
        elif self.attempt == 1 and stale_connection(relay):
            self.relay = None
            self._connect(req)
            return
        else:
            answer = self._unreachable(req, upstream, exc)
        self._forward_error(req, answer)

    def forward_head(self, relay: Relay) -> None:
        """The response head is on its way to the client."""
        latency = perf_counter() - self.forward_started
        metrics = self.gateway.metrics
        metrics.child(metrics.upstream_latency, relay.upstream.name).observe(latency)
        record = relay.req.record
        if record is not None:
            record.upstream_ms = int(latency * 1e6) / 1000  # whole µs, as duration_ms
        self.response_started = True
        self._set_deadline(RESPONSE, self.limits.upstream_read_timeout)

    def forward_done(self, relay: Relay, outcome: int) -> None:
        """The response ended: ``outcome`` is its status, or -502 (the upstream broke the
        stream) / -499 (the client went away)."""
        req = relay.req
        if self.active is not req:
            return
        record = req.record
        if record is not None:
            record.status = relay.status if outcome > 0 else -outcome
        uconn = relay.uconn
        if outcome < 0:
            if uconn is not None:
                uconn.abort()
            if self.transport is not None:
                self.transport.abort()
            self._finish(req, keep=False)
            return
        if not req.body_done:
            # The upstream answered before the whole body arrived: its connection is
            # mid-request and cannot be reused; the rest of the body is read and dropped
            # so the client's connection stays usable (bounded by max_body_bytes).
            req.sink = self._discard
            req.answered_early = True
            if uconn is not None:
                uconn.abort()
        elif not relay.forwarded_whole():
            # What went upstream is not the whole message that was parsed: the upstream
            # may read the next request as the rest of this one (request smuggling).
            # Neither connection is used again.
            log.error("request %s was not forwarded whole: both connections closed",
                      req.request_id)  # fmt: skip
            if uconn is not None:
                uconn.abort()
            self._finish(req, keep=False)
            return
        elif uconn is not None:
            if req.close_upstream:
                # (A CL.0 upstream may still be reading the content as a request of its
                # own: its answer must never reach the next client on this connection.)
                uconn.abort()
            else:
                self.plane.pool.release(uconn)
        self._finish(req, keep=not relay.close_after)

    def _too_large(self, req: Incoming) -> Answer:
        limit = self.limits.max_body_bytes
        detail = f"request body is larger than the {limit} bytes this gateway accepts"
        return Answer.error(413, detail, req.rate_headers)

    def _upstream_timeout(self, req: Incoming, upstream: Upstream) -> Answer:
        self.gateway.metrics.upstream_errors.labels(upstream.name, "timeout").inc()
        detail = f"upstream {repr(upstream.name)} did not answer in time"
        return Answer.error(504, detail, req.rate_headers)

    def _unreachable(self, req: Incoming, upstream: Upstream, exc: BaseException) -> Answer:
        self.gateway.metrics.upstream_errors.labels(upstream.name, "unreachable").inc()
        log.warning("upstream %s unreachable: %s", upstream.name, type(exc).__name__)
        return Answer.error(502, f"upstream {repr(upstream.name)} is unreachable", req.rate_headers)

    # --- when a request ends

    def _release_slots(self, req: Incoming) -> None:
        """What an ended request held: its upload, download and exchange slots, its
        relay."""
        if req.upload_client is not None:
            self._end_upload(req)
        if req.exchange_counted:
            req.exchange_counted = False
            self.plane.end_exchange(req.exchange_client)
            req.exchange_client = None
        if req.download_client is not None:
            self.plane.end_download(req.download_client)
            req.download_client = None
        self.relay = None
        self.upstream = None

    def _discard(self, data: bytes) -> None:
        """Sink for the body of a request that was answered without reading it."""
