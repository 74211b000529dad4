"""Serving the built-in APIs (the Store, the control plane) on their own ports.

What aiohttp does on its own that these APIs must not:

* A request aiohttp's parser refuses (a request line or header over 8190 bytes, a
  malformed header, bad framing) never reaches the application or its middleware:
  ``RequestHandler.handle_error`` answers it, as plain text quoting the offending bytes.
  ``ApiAppRunner`` serves an application with a request handler whose ``handle_error``
  answers ``{"detail": ...}`` JSON instead, with a fixed sentence per kind of error (no
  request bytes) and a status the APIs' OpenAPI documents list (400; 500 for a failure
  outside every handler). The connection is closed after it, as aiohttp does.
* aiohttp inflates a request body sent with ``Content-Encoding: gzip`` (or deflate, br)
  as it arrives, a whole received chunk at a time, before any size check: a 200 KB gzip
  bomb cost the loop 0.3 s, and bad gzip an "Unhandled exception" traceback. The built-in
  APIs take JSON bodies as sent (the langgraph-sdk client sends them so): their server
  never inflates (``auto_decompress=False``), and a body with any content coding but
  ``identity`` is refused with 415 and ``Accept-Encoding: identity`` (RFC 9110 15.5.16)
  before anything reads it (``refuse_coded_bodies``), and before ``100 Continue`` would ask
  the client to send it (``expect_handler``, which also answers an unknown expectation as
  JSON: aiohttp's 417 is plain text quoting the header). A request no route takes gets
  the same, or its 404/405 without ``100 Continue`` (``_unrouted_expectations``).
* Every answer carries ``Server: Python/3.x aiohttp/3.y``, which the gateway's proxy passes
  on to clients. ``neutral_server_header`` (installed by the applications themselves) and
  the error answers above send ``Server: SERVER_NAME`` instead, which names no software
  version.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import HttpVersion11, web
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadHttpMethod,
    BadStatusLine,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    PayloadEncodingError,
)
from multidict import CIMultiDict

from gateway.upstreams.http_api.body_budget import refusal_before_body
from gateway.upstreams.http_api.log_safety import exception_summary
from gateway.upstreams.http_api.openapi import Response
from gateway.upstreams.http_api.problems import ErrorResponse

# Every operation of a built-in API may answer this (``Api.common_responses``).
MALFORMED_REQUEST: Final = Response(
    "Malformed HTTP request: the request line, a header field or the body's framing could "
    "not be parsed, or exceeds this server's limits (8190 bytes a line)",
    ErrorResponse,
)

# The Server header of the built-in APIs: no implementation, no version.
SERVER_NAME: Final = "ratelimit-gateway"

# Every operation of a built-in API may answer this too (``refuse_coded_bodies``).
CODED_BODY: Final = Response(
    "The request body has a content coding (Content-Encoding other than identity): send "
    "it uncompressed",
    ErrorResponse,
)

CODED_BODY_DETAIL: Final = (
    "body: has a content coding (Content-Encoding other than identity), which this API "
    "does not take: send it uncompressed"
)

TRANSFER_CODED_DETAIL: Final = (
    "body: has a transfer coding other than chunked (Transfer-Encoding), which this API "
    "does not implement: send it with Content-Length, or chunked only"
)
# Every operation of a built-in API may answer this too (``refuse_coded_bodies``).
TRANSFER_CODED: Final = Response(
    "The request body has a transfer coding other than chunked: send it with "
    "Content-Length, or chunked only",
    ErrorResponse,
)

EXPECTATION_DETAIL: Final = "Expect: only 100-continue is understood"
# Every operation of a built-in API may answer this too (``expect_handler``).
EXPECTATION_FAILED: Final = Response(
    "The request's Expect header asks for something other than 100-continue",
    ErrorResponse,
)

# A built-in API application: served by ``ApiAppRunner`` (see ``runner_for``).
BUILTIN_API_KEY: Final = web.AppKey("builtin_api", str)

# A request handler (also what ``routes`` registers: defined here, which it imports).
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

MALFORMED: Final = "malformed HTTP request"
# Parser errors by kind, most specific first: what the client is told (never its bytes).
_PARSER_DETAILS: Final[tuple[tuple[type[Exception], str], ...]] = (
    (LineTooLong, "request line or header field longer than this server accepts"),
    (BadHttpMethod, "malformed HTTP request line: unknown method"),
    (InvalidURLError, "malformed HTTP request target"),
    (BadStatusLine, "malformed HTTP request line"),
    (InvalidHeader, "malformed HTTP header field"),
    (PayloadEncodingError, "malformed HTTP request body framing"),
    (BadHttpMessage, MALFORMED),
)


def parser_error_detail(exc: BaseException | None) -> str:
    """What a client is told about a request aiohttp could not parse: a fixed sentence per
    kind of error, never the request's bytes (aiohttp's own messages quote them)."""
    for kind, detail in _PARSER_DETAILS:
        if isinstance(exc, kind):
            return detail
    return MALFORMED


def error_response(status: int, detail: str) -> web.Response:
    """``{"detail": ...}`` as the APIs answer every error (ASCII JSON, neutral Server)."""
    body = json.dumps({"detail": detail}, separators=(",", ":")).encode()
    response = web.Response(body=body, status=status, content_type="application/json")
    response.headers["Server"] = SERVER_NAME
    return response


class JsonErrorRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, answering the errors it handles itself as JSON."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # Neither logs the exception's message: aiohttp's parser errors quote the offending
        # request line or header field (an X-Api-Key with a control character, say).
        if 400 <= status < 500:
            # A request the parser refused: the client's doing, not worth a traceback.
            self.logger.debug(
                "refused a malformed request from %s: %s (%s)",
                request.remote,
                parser_error_detail(exc),
                type(exc).__name__,
            )
            response = error_response(400, parser_error_detail(exc))
        else:
            self.logger.error(
                "Error handling request from %s: %s", request.remote, exception_summary(exc)
            )
            response = error_response(500, "internal error")
        # As aiohttp: once part of an answer was sent, no other answer can follow.
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was sent already; cannot send the error answer")
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    """aiohttp's ``Server`` whose connections use ``JsonErrorRequestHandler``."""

    def __init__(
        self, base: web.Server, app: web.Application, loop: asyncio.AbstractEventLoop
    ) -> None:
        # The handler options (limits, timeouts, logging) the runner chose for ``base``;
        # bodies are never inflated (module docstring).
        self._handler_options: dict[str, Any] = {**base._kwargs, "auto_decompress": False}
        super().__init__(
            _unrouted_expectations(base.request_handler, app),
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            loop=loop,
            **self._handler_options,
        )
        self._handler_loop = loop

    def __call__(self) -> web.RequestHandler:
        return JsonErrorRequestHandler(self, loop=self._handler_loop, **self._handler_options)


class ApiAppRunner(web.AppRunner):
    """``web.AppRunner`` for the built-in APIs: errors aiohttp answers before the
    application sees the request (parser errors) are answered as the APIs' JSON."""

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()  # starts the application (on_startup)
        return _JsonErrorServer(base, self.app, asyncio.get_running_loop())


def runner_for(app: web.Application, **kwargs: Any) -> web.AppRunner:
    """The runner to serve ``app`` with: ``ApiAppRunner`` for a built-in API (marked with
    ``BUILTIN_API_KEY``), aiohttp's ``AppRunner`` for any other application."""
    if BUILTIN_API_KEY in app:
        return ApiAppRunner(app, **kwargs)
    return web.AppRunner(app, **kwargs)


async def _neutral_server(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_NAME


def _codings(request: web.BaseRequest, field: str, plain: str) -> list[str]:
    """The codings ``field`` lists (every field line, comma-separated, case-insensitive),
    ``plain`` (the one that changes nothing to read) left out."""
    codings = []
    for line in request.headers.getall(field, ()):
        for coding in line.split(","):
            coding = coding.strip(" \t").lower()
            if coding and coding != plain:
                codings.append(coding)
    return codings


def content_codings(request: web.BaseRequest) -> list[str]:
    """The content codings of the request's body (``Content-Encoding``, as RFC 9110 8.4
    lists them), ``identity`` left out."""
    return _codings(request, "Content-Encoding", "identity")


def transfer_codings(request: web.BaseRequest) -> list[str]:
    """The transfer codings of the request's body besides ``chunked`` (RFC 9112 6.1).
    aiohttp frames a body whose last coding is ``chunked`` and hands the rest to the
    handler still coded: a ``gzip, chunked`` body reached the model as gzip bytes (422
    "malformed JSON"), where RFC 9112 asks for 501, as the gateway's own port answers."""
    return _codings(request, "Transfer-Encoding", "chunked")


def _transfer_coded_response() -> web.Response:
    # A fixed sentence, the header not quoted back; the connection closes (the body's
    # framing past the codings is not this server's to trust).
    response = error_response(501, TRANSFER_CODED_DETAIL)
    response.force_close()
    return response


def _coded_body_response() -> web.Response:
    # A fixed sentence: the client's header is not quoted back (as for parser errors).
    response = error_response(415, CODED_BODY_DETAIL)
    response.headers["Accept-Encoding"] = "identity"
    return response


@web.middleware
async def refuse_coded_bodies(request: web.Request, handler: Handler) -> web.StreamResponse:
    """501 for a body with a transfer coding other than chunked, 415 for one with a content
    coding, before anything reads it (module docstring). A request without a body passes
    whatever it says."""
    if request.body_exists and transfer_codings(request):
        return _transfer_coded_response()
    if request.body_exists and content_codings(request):
        return _coded_body_response()
    return await handler(request)


def _expectation_refused(request: web.BaseRequest) -> web.Response | None:
    """The answer to a request's ``Expect`` before its body is asked for, or None: it may
    be. A body with a content coding is refused (415); an expectation other than
    ``100-continue`` is answered as the APIs answer errors (aiohttp's own handler answers
    417 in plain text quoting the header). Both close the connection: the body the
    request announced is not coming, or not wanted."""
    if transfer_codings(request):
        return _transfer_coded_response()
    if content_codings(request):
        refused = _coded_body_response()
    elif request.headers.get("Expect", "").lower() != "100-continue":
        refused = error_response(417, EXPECTATION_DETAIL)
    else:
        return None
    refused.force_close()
    return refused


async def expect_handler(request: web.Request) -> web.StreamResponse | None:
    """The ``Expect`` handler of every built-in API route (``routes.add_routes``; aiohttp
    runs it before any middleware): ``_expectation_refused``, or the parse budget's
    refusal of the body (``body_budget.py``), else as aiohttp: ``100 Continue`` on
    HTTP/1.1."""
    refused = _expectation_refused(request)
    if refused is not None:
        return refused
    budget = refusal_before_body(request)
    if budget is not None:  # the body would be refused unread: not asked for either
        refused = error_response(budget.status, f"body: {budget.detail}")
        refused.headers["Retry-After"] = str(budget.retry_after)
        refused.force_close()
        return refused
    if request.version == HttpVersion11:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # (as aiohttp: the answer has not started)
    return None


def _unrouted_expectations(
    handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]], app: web.Application
) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    """``handler`` (the application's), answering ``Expect`` on a request that no route
    takes (404, 405) as the routes do, where aiohttp's default handler would run: it
    answered ``100 Continue`` (the client then sent a body only to get 404), and an
    unknown expectation as plain text quoting the header. Such a request gets
    ``_expectation_refused``, or its 404/405 at once, without ``100 Continue`` and with
    the connection closed (the announced body is not wanted)."""

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if not request.headers.get("Expect"):  # (an empty one: aiohttp ignores it too)
            return await handler(request)
        assert isinstance(request, web.Request)  # (the application's request factory)
        match = await app.router.resolve(request)
        if match.http_exception is None:
            return await handler(request)  # the route's own expect_handler decides
        refused = _expectation_refused(request)
        if refused is not None:
            return refused
        # clone() encodes every value as strict UTF-8, while aiohttp read them with
        # surrogateescape: a value that is not UTF-8 gets U+FFFD where it is not (it
        # raised, and the request got 500 and an error in the log).
        headers: CIMultiDict[str] = CIMultiDict()
        for name, value in request.headers.items():
            if name.lower() != "expect":
                raw = value.encode("utf-8", "surrogateescape")
                headers.add(name, raw.decode("utf-8", "replace"))
        routed = request.clone(headers=headers)
        response = await handler(routed)
        response.force_close()
        # Prepared here, with the request the application matched (the one aiohttp
        # prepares it with has no match, so the application's on_response_prepare
        # hooks, the neutral Server header among them, would not run).
        await response.prepare(routed)
        return response

    return handle


def mark_builtin_api(app: web.Application, name: str) -> None:
    """Mark ``app`` as a built-in API (``runner_for``) and make every answer it prepares
    carry ``Server: SERVER_NAME`` instead of aiohttp's version banner, and refuse request
    bodies with a content coding (``refuse_coded_bodies``)."""
    app[BUILTIN_API_KEY] = name
    app.on_response_prepare.append(_neutral_server)
    # Outermost: a coded body is refused before any other middleware could read it.
    app.middlewares.insert(0, refuse_coded_bodies)
