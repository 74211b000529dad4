"""The Store as an aiohttp application serving the full public ``/store/...`` paths."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from gateway.upstreams.http_api.body_budget import address_policy, read_model, use_parse_budget
from gateway.upstreams.http_api.decoding import ModelReader
from gateway.upstreams.http_api.openapi import Api, Method, Operation, Response
from gateway.upstreams.http_api.parse_budget import ParseBudget
from gateway.upstreams.http_api.problems import ErrorResponse, InvalidRequest
from gateway.upstreams.http_api.routes import Handler, Route, add_routes, document_bytes
from gateway.upstreams.http_api.serving import (
    CODED_BODY,
    EXPECTATION_FAILED,
    MALFORMED_REQUEST,
    TRANSFER_CODED,
    mark_builtin_api,
)
from gateway.upstreams.postgres.breaker import DATABASE_BREAKER_KEY
from gateway.upstreams.postgres.connection import DatabaseUnavailable
from gateway.upstreams.store.backend import StoreStorage, create_storage, describe
from gateway.upstreams.store.config import StoreConfig
from gateway.upstreams.store.errors import StoreRequestError
from gateway.upstreams.store.models import (
    PATTERNS,
    Item,
    ListNamespaceResponse,
    SearchItemsResponse,
    StoreDeleteRequest,
    StoredForms,
    StoreGetQuery,
    StoreListNamespacesRequest,
    StorePutRequest,
    StoreSearchRequest,
)
from gateway.upstreams.store.rows import check_search_depth, item_answer, search_answer
from gateway.upstreams.store.semantic import SemanticIndex
from gateway.upstreams.store.sweeper import sweep_forever

log = logging.getLogger("gateway.store")

STORAGE_KEY = web.AppKey("store_storage", StoreStorage)
CONFIG_KEY = web.AppKey("store_config", StoreConfig)
OPENAPI_KEY = web.AppKey("store_openapi", bytes)
# Hook (issue 12): present only when store.index is configured.
SEMANTIC_KEY = web.AppKey("store_semantic", SemanticIndex)

READ = ModelReader(PATTERNS)
T = TypeVar("T")


def _json(data: Any, status: int = 200, *, ascii_only: bool = False) -> web.Response:
    return _json_body(
        json.dumps(data, ensure_ascii=ascii_only, separators=(",", ":")).encode(), status
    )


def _json_body(body: bytes, status: int = 200) -> web.Response:
    """A JSON answer already encoded: the item answers (``rows.search_answer`` and
    ``rows.item_answer``), which splice each value's stored JSON text in unparsed."""
    return web.Response(body=body, status=status, content_type="application/json")


def _detail(status: int, detail: str, headers: dict[str, str] | None = None) -> web.Response:
    # ASCII with escapes: a detail quoting request text can always be encoded.
    response = _json({"detail": detail}, status, ascii_only=True)
    if headers:
        response.headers.update(headers)
    return response


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes ``{"detail": ...}`` JSON; no plain text, no traceback."""
    try:
        return await handler(request)
    except StoreRequestError as exc:
        retry = None if exc.retry_after is None else {"Retry-After": str(exc.retry_after)}
        return _detail(exc.status, exc.detail, retry)
    except InvalidRequest as exc:
        return _detail(exc.status, exc.detail, exc.headers())
    except DatabaseUnavailable as exc:
        return _detail(503, exc.detail, {"Retry-After": str(exc.retry_after)})
    except RequestPayloadError:
        # The body's framing broke while reading it (a bad chunk, a short body).
        return _detail(400, "body: malformed HTTP body framing")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _detail(exc.status, _http_detail(request, exc), headers)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("store request %s %s failed", request.method, request.path)
        return _detail(500, "internal error in the store")


def _http_detail(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == 404:
        return f"no store endpoint at {request.path}"
    if exc.status == 405:
        return f"method {request.method} is not allowed on {request.path}"
    if exc.status == 413:
        limit = request.app[CONFIG_KEY].max_body_bytes
        return f"body: request body exceeds {limit} bytes"
    return exc.reason


async def _body(request: web.Request) -> bytes:
    limit = request.app[CONFIG_KEY].max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise StoreRequestError(413, f"body: request body exceeds {limit} bytes")
    # request.read() enforces client_max_size (the same limit) on chunked bodies too.
    return await request.read()


async def _read(request: web.Request, model: type[T]) -> T:
    """The JSON body as ``model``, parsed within the loop's parse budget (429/503 when the
    client's address, or every address together, has used its share: body_budget.py)."""
    return await read_model(request, lambda raw: READ.body(model, raw), lambda: _body(request))


def _put_request(
    raw: bytes, semantic: SemanticIndex | None
) -> tuple[StorePutRequest, StoredForms, list[tuple[str, str]] | None]:
    # The item's stored forms, and with an index the texts to embed, walk all of it as
    # the parse does: made now, charged with it.
    item = READ.body(StorePutRequest, raw)
    texts = None if semantic is None else semantic.item_texts(item)
    return item, item.stored_forms(), texts


async def put_item(request: web.Request) -> web.Response:
    """PUT /store/items: insert or replace an item."""
    semantic = request.app.get(SEMANTIC_KEY)
    item, forms, texts = await read_model(
        request, lambda raw: _put_request(raw, semantic), lambda: _body(request)
    )
    # Hook (issue 12): embed first, so a provider outage (503) leaves nothing written.
    vectors = None if semantic is None else await semantic.embed_item(item, texts)
    await request.app[STORAGE_KEY].put(item, vectors, forms)
    return web.Response(status=204)


async def _sent(request: web.Request, response: web.Response) -> web.Response:
    """``response``, sent: an answer's reservation of item bytes (``answers.py``) lasts
    until its body has left (the transport's buffer drained), not only until it is built;
    a client gone meanwhile ends the sending, quietly (aiohttp notes it). A client that
    has not read the answer within ``store.answer_send_timeout_seconds`` is cut off (its
    connection aborted), so that it cannot keep the bytes from the other answers."""
    seconds = request.app[CONFIG_KEY].answer_send_timeout_seconds
    try:
        async with asyncio.timeout(seconds):
            await response.prepare(request)
            await response.write_eof()
    except ConnectionError:
        pass
    except TimeoutError:
        log.warning(
            "store answer to %s %s not read within %g s; connection closed",
            request.method,
            request.path,
            seconds,
        )
        if request.transport is not None:
            request.transport.abort()
    return response


async def get_item(request: web.Request) -> web.Response:
    """GET /store/items?namespace=a.b&key=k: the item, or JSON null when absent."""
    query = READ.query(StoreGetQuery, request.query)
    storage = request.app[STORAGE_KEY]
    with storage.answers.budget(get=True) as budget:
        row = await storage.get_row(query.labels(), query.key, query.refresh_ttl, budget)
        return await _sent(request, _json_body(item_answer(row)))


async def delete_item(request: web.Request) -> web.Response:
    """DELETE /store/items with a JSON body: 204 whether or not the item existed."""
    ref = await _read(request, StoreDeleteRequest)
    await request.app[STORAGE_KEY].delete(tuple(ref.namespace), ref.key)
    return web.Response(status=204)


async def search_items(request: web.Request) -> web.Response:
    """POST /store/items/search: listing mode, or ranked search when ``query`` is given."""
    search = await _read(request, StoreSearchRequest)
    # Before the query is embedded: a page too deep is refused without a provider call.
    check_search_depth(search, request.app[CONFIG_KEY].max_search_depth)
    # Hook (issue 12): with an index, a query is ranked by meaning (vector or hybrid).
    semantic = request.app.get(SEMANTIC_KEY)
    ranker = None if semantic is None else await semantic.ranker(search)
    storage = request.app[STORAGE_KEY]
    # The answer's item bytes count against store.max_answer_bytes (422 past it, never a
    # short page) and, until the answer is sent, against the bytes in flight (503).
    with storage.answers.budget() as budget:
        rows = await storage.search_rows(search, ranker, budget)
        return await _sent(request, _json_body(search_answer(rows)))


async def list_namespaces(request: web.Request) -> web.Response:
    """POST /store/namespaces: distinct namespaces by prefix, suffix and depth."""
    listing = await _read(request, StoreListNamespacesRequest)
    return _json({"namespaces": await request.app[STORAGE_KEY].list_namespaces(listing)})


async def openapi_document(request: web.Request) -> web.Response:
    """GET /store/openapi.json: the OpenAPI 3.1 description of these endpoints."""
    return web.Response(body=request.app[OPENAPI_KEY], content_type="application/json")


API = Api(
    title="Store API",
    version="1.0.0",
    description=(
        "Namespaced JSON document store with listing and full-text search, compatible with "
        "langgraph-sdk's StoreClient. Generated from the models the Store validates with."
    ),
    tag="Store",
    common_responses={
        400: MALFORMED_REQUEST,
        415: CODED_BODY,
        417: EXPECTATION_FAILED,
        501: TRANSFER_CODED,
    },
)
_INVALID = Response("Validation error: the detail names the field", ErrorResponse)
_TOO_LARGE = Response("Request body too large", ErrorResponse)
_BUSY_TEXT = (
    "Store busy or its database unavailable (locked beyond the busy timeout, or "
    "PostgreSQL not answering in time: once found away, answered at once until it answers "
    "again; Retry-After says when to try), or the embedding provider unavailable, or (a "
    "request with a body) all clients together have used the share of the server's time "
    "for parsing request bodies (Retry-After says when to try)"
)
_BUSY = Response(_BUSY_TEXT, ErrorResponse)
# Answers that carry items also count their values against the bytes in flight.
_BUSY_ANSWERING = Response(
    f"{_BUSY_TEXT}, or the answers being sent hold store.max_answer_bytes_in_flight bytes "
    "of item values (Retry-After says when to try; an answer of at most 1 MiB of values is "
    "always served, and an answer not read within store.answer_send_timeout_seconds is "
    "cut off)",
    ErrorResponse,
)
_INVALID_OR_TOO_MANY = Response(
    "Validation error: the detail names the field; or the items asked for hold more than "
    "store.max_answer_bytes bytes of values (detail 'limit: the answer would exceed "
    "store.max_answer_bytes …'): ask for fewer items with a smaller limit and page with "
    "offset. Never a shorter list than the items that exist",
    ErrorResponse,
)
_ERRORS = {422: _INVALID, 503: _BUSY}
_PARSE_SHARE = Response(
    "This client address has used its share of the server's time for parsing request "
    "bodies (store.body_parse_share; large or deeply nested JSON costs the most): "
    "Retry-After says when to try",
    ErrorResponse,
)
_BODY_ERRORS = {413: _TOO_LARGE, 429: _PARSE_SHARE, **_ERRORS}


def _body_route(
    handler: Handler,
    method: Method,
    path: str,
    summary: str,
    answer: Response,
    body: Any,
    errors: Mapping[int, Response] | None = None,
) -> Route:
    """An operation that reads a JSON body ``body``, named after its handler: its answer
    (200, or 204 when it has no model), or 413, 422, 429 or 503 (``errors`` describes some of
    them its own way)."""
    status = 200 if answer.model is not None else 204
    answers = {status: answer, **_BODY_ERRORS, **(errors or {})}
    return Route(Operation(method, path, handler.__name__, summary, answers, body=body), handler)


ROUTES = (
    _body_route(
        put_item,
        "put",
        "/store/items",
        "Store or update an item",
        Response("Stored"),
        StorePutRequest,
    ),
    Route(
        Operation(
            "get",
            "/store/items",
            "get_item",
            "Retrieve a single item",
            {
                200: Response("The item, or null when absent or expired", Item | None),
                **_ERRORS,
                503: _BUSY_ANSWERING,
            },
            query=StoreGetQuery,
        ),
        get_item,
    ),
    _body_route(
        delete_item,
        "delete",
        "/store/items",
        "Delete an item (also when absent)",
        Response("Deleted"),
        StoreDeleteRequest,
    ),
    _body_route(
        search_items,
        "post",
        "/store/items/search",
        "List items under a namespace prefix (newest update first) or search them",
        Response("Matching items", SearchItemsResponse),
        StoreSearchRequest,
        {422: _INVALID_OR_TOO_MANY, 503: _BUSY_ANSWERING},
    ),
    _body_route(
        list_namespaces,
        "post",
        "/store/namespaces",
        "List namespaces",
        Response("Namespaces, sorted", ListNamespaceResponse),
        StoreListNamespacesRequest,
    ),
    Route(
        Operation(
            "get",
            "/store/openapi.json",
            "store_openapi",
            "This document",
            {200: Response("OpenAPI 3.1 document", dict[str, Any])},
        ),
        openapi_document,
    ),
)


def create_store_app(
    config: StoreConfig,
    *,
    clock: Callable[[], float] | None = None,
    parse_budget: ParseBudget | None = None,
) -> web.Application:
    """The Store application; storage and the TTL sweeper live in ``cleanup_ctx``.
    ``parse_budget``: the one of the process (the apps of one event loop share it); by
    default its own, from ``config``."""
    app = web.Application(middlewares=[json_errors], client_max_size=config.max_body_bytes)
    app[CONFIG_KEY] = config
    budget = ParseBudget(config.parse_share()) if parse_budget is None else parse_budget
    use_parse_budget(app, budget, address_policy(config.trusted_proxies, config.client_ipv6_prefix))
    mark_builtin_api(app, "store")
    storage = create_storage(config, clock or time.time)
    app[STORAGE_KEY] = storage
    if config.database_url is not None:
        from gateway.upstreams.store.pg_storage import PostgresStorage

        assert isinstance(storage, PostgresStorage)
        # For a readiness check: postgres.breaker.database_ready(app).
        app[DATABASE_BREAKER_KEY] = storage.breaker
    if config.index is not None:
        # Hook (issue 12): the index runs its own SQL through the storage's read/write.
        app[SEMANTIC_KEY] = SemanticIndex(config.index, storage)
    app[OPENAPI_KEY] = document_bytes(API, ROUTES)
    app.cleanup_ctx.append(_storage_lifetime)
    add_routes(app.router, ROUTES)
    return app


async def _storage_lifetime(app: web.Application) -> AsyncIterator[None]:
    storage = app[STORAGE_KEY]
    await storage.open()
    log.info("store items in %s", describe(app[CONFIG_KEY]))
    semantic = app.get(SEMANTIC_KEY)
    if semantic is not None:  # Hook (issue 12): after storage, closed before it
        await semantic.open()
    sweeper = asyncio.create_task(
        sweep_forever(storage, app[CONFIG_KEY].sweep_interval_seconds), name="store-ttl-sweeper"
    )
    try:
        yield
    finally:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        if semantic is not None:
            await semantic.close()
        await storage.close()
