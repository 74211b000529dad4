"""Streams a request to an upstream and the response back, both ways, without buffering."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from gateway.metrics import Metrics
from gateway.proxy.headers import add_via, end_to_end
from gateway.proxy.responses import json_error

log = logging.getLogger("gateway.proxy")

CHUNK = 64 * 1024
# A response of known length up to this size that has already arrived whole is sent with
# its headers in one write (one syscall instead of three); anything else streams.
SMALL_BODY_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True)
class Upstream:
    name: str
    base_url: str  # scheme://host:port with no trailing slash (a path prefix is allowed)
    preserve_host: bool = True


class StreamAbortedError(Exception):
    """A response stream ended early after its headers were sent (status for the log)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class _BodyReader:
    """Streams the client's body to the upstream, enforcing the size and idle limits."""

    def __init__(self, request: web.Request, limits: ForwardLimits) -> None:
        self._request = request
        self._limits = limits
        self.too_large = False
        self.timed_out = False

    async def chunks(self) -> AsyncIterator[bytes]:
        received = 0
        content = self._request.content
        while True:
            try:
                async with asyncio.timeout(self._limits.body_read_timeout):
                    chunk = await content.readany()
            except TimeoutError:
                self.timed_out = True
                raise
            if not chunk:
                return
            received += len(chunk)
            if received > self._limits.max_body_bytes:
                self.too_large = True
                raise ValueError("request body over the limit")
            yield chunk


@dataclass(frozen=True, slots=True)
class ForwardLimits:
    max_body_bytes: int
    body_read_timeout: float
    upstream_timeout: float


class Forwarder:
    """One ``ClientSession`` (one connection pool) for every upstream of the process."""

    def __init__(self, session: aiohttp.ClientSession, limits: ForwardLimits, metrics: Metrics):
        self._session = session
        self._limits = limits
        self._metrics = metrics

    async def forward(
        self,
        request: web.Request,
        upstream: Upstream,
        path: str,
        query: str,
        extra_headers: list[tuple[str, str]],
        trusted_peer: bool,
        request_id: str | None = None,
    ) -> tuple[web.StreamResponse, float]:
        """Forward and stream back. Returns the response and the upstream latency (s)."""
        headers = _request_headers(request, upstream, trusted_peer)
        if request_id:
            headers["X-Request-Id"] = request_id  # one id across gateway and upstream logs
        length = request.content_length
        if length is not None and length > self._limits.max_body_bytes:
            return json_error(413, _too_large(self._limits.max_body_bytes), extra_headers), 0.0
        reader = _BodyReader(request, self._limits) if request.body_exists else None
        body = reader.chunks() if reader is not None else None
        # encoded=True: the query string goes out byte for byte as the client sent it.
        url = URL(upstream.base_url + path + ("?" + query if query else ""), encoded=True)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self._limits.upstream_timeout):
                upstream_response = await self._session.request(
                    request.method,
                    url,
                    headers=headers,
                    data=body,
                    allow_redirects=False,
                    skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                )
        except TimeoutError:
            if reader is not None and reader.timed_out:
                return json_error(408, "the request body stalled", extra_headers), 0.0
            self._metrics.upstream_errors.labels(upstream.name, "timeout").inc()
            detail = f"upstream {upstream.name!r} did not answer in time"
            return json_error(504, detail, extra_headers), time.perf_counter() - started
        except (aiohttp.ClientError, OSError) as exc:
            if reader is not None and reader.too_large:
                # aiohttp wraps errors raised by the body generator; the reader knows why.
                self._metrics.upstream_errors.labels(upstream.name, "body_too_large").inc()
                return json_error(413, _too_large(self._limits.max_body_bytes), extra_headers), 0.0
            if reader is not None and reader.timed_out:
                return json_error(408, "the request body stalled", extra_headers), 0.0
            self._metrics.upstream_errors.labels(upstream.name, "unreachable").inc()
            log.warning("upstream %s unreachable: %s", upstream.name, type(exc).__name__)
            detail = f"upstream {upstream.name!r} is unreachable"
            return json_error(502, detail, extra_headers), time.perf_counter() - started
        latency = time.perf_counter() - started
        self._metrics.child(self._metrics.upstream_latency, upstream.name).observe(latency)
        try:
            return await self._relay(request, upstream, upstream_response, extra_headers), latency
        finally:
            upstream_response.release()

    @staticmethod
    async def _small_body(upstream_response: aiohttp.ClientResponse, length: int) -> bytes | None:
        """A short body that has already arrived whole, so headers and body leave in one
        write; None to stream it instead. Never waits: a body still on its way streams."""
        content = upstream_response.content
        if content.total_bytes < length:
            return None
        try:
            return await content.readexactly(length) if length else b""
        except (aiohttp.ClientError, asyncio.IncompleteReadError):
            return None

    async def _relay(
        self,
        request: web.Request,
        upstream: Upstream,
        upstream_response: aiohttp.ClientResponse,
        extra_headers: list[tuple[str, str]],
    ) -> web.StreamResponse:
        headers = end_to_end(upstream_response.headers)
        add_via(headers)
        for name, value in extra_headers:
            headers[name] = value
        length = upstream_response.content_length
        if length is not None and length <= SMALL_BODY_BYTES and "Content-Length" in headers:
            small = await self._small_body(upstream_response, length)
            if small is not None:
                headers.popall("Content-Length", None)  # aiohttp sets it from the body
                return web.Response(
                    status=upstream_response.status,
                    reason=upstream_response.reason,
                    body=small,
                    headers=headers,
                )
        response = web.StreamResponse(
            status=upstream_response.status, reason=upstream_response.reason
        )
        response.headers.update(headers)
        if length is not None and "Content-Length" in headers:
            response.content_length = length
        elif request.version >= aiohttp.HttpVersion11:
            response.enable_chunked_encoding()
        try:
            await response.prepare(request)
        except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
            raise StreamAbortedError(499, "client went away") from exc
        content = upstream_response.content
        while True:
            try:
                chunk = await content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                # Headers are gone already: the only honest signal left is a cut connection.
                self._metrics.upstream_errors.labels(upstream.name, "broken_stream").inc()
                log.warning("upstream %s broke the response stream: %s", upstream.name, exc)
                if request.transport is not None:
                    request.transport.close()
                raise StreamAbortedError(502, "upstream broke the stream") from exc
            if not chunk:
                break
            try:
                await response.write(chunk)
            except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
                # The client hung up (common with event streams): not the upstream's fault.
                raise StreamAbortedError(499, "client went away") from exc
        try:
            await response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
            raise StreamAbortedError(499, "client went away") from exc
        return response


UNTRUSTED_FORWARDING = ("Forwarded", "X-Real-IP", "X-Forwarded-Host", "X-Forwarded-Port")


def forwarded_for_chain(request: web.Request) -> str:
    """Every ``X-Forwarded-For`` line joined in order: proxies may add their own line."""
    return ", ".join(request.headers.getall("X-Forwarded-For", ()))


def _too_large(limit: int) -> str:
    return f"request body is larger than the {limit} bytes this gateway accepts"


def _request_headers(
    request: web.Request, upstream: Upstream, trusted_peer: bool
) -> CIMultiDict[str]:
    headers = end_to_end(request.headers)
    peer = request.remote or ""
    forwarded_for = forwarded_for_chain(request)
    if trusted_peer and forwarded_for:
        headers["X-Forwarded-For"] = f"{forwarded_for}, {peer}"
    else:
        # From an untrusted peer forwarding headers are whatever the client wrote: replace
        # the one we own, drop the others so the upstream cannot be misled by them.
        headers["X-Forwarded-For"] = peer
        for name in UNTRUSTED_FORWARDING:
            headers.popall(name, None)
    if not (trusted_peer and "X-Forwarded-Proto" in request.headers):
        headers["X-Forwarded-Proto"] = "https" if request.secure else "http"
    add_via(headers)
    if not upstream.preserve_host:
        headers.pop("Host", None)
    return headers
