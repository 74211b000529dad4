"""Request plumbing shared by the control-plane handlers: app state, JSON errors, auth,
reading requests into models, and the HTTP shapes of tenant-scoped resources."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar, overload

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from gateway.upstreams.http_api.body_budget import read_model
from gateway.upstreams.http_api.decoding import ModelReader
from gateway.upstreams.http_api.log_safety import exception_summary
from gateway.upstreams.http_api.problems import InvalidRequest
from gateway.upstreams.http_api.routes import Handler
from gateway.upstreams.postgres.connection import DatabaseUnavailable

from .config import ControlPlaneConfig
from .credentials import api_key_bytes, find_credential, is_valid_tenant_id
from .database import Database
from .lifecycle import LifecycleDriver
from .limits import Refused
from .models import PATTERNS, SOURCES, PageQuery, PathId
from .rows import Row
from .storage import ControlPlaneStore
from .tables import Conflict

log = logging.getLogger("gateway.control_plane")

Missing = Callable[[str], NoReturn]
T = TypeVar("T")
PUBLIC_ROUTE_PREFIX = "public:"
# The create body is a union tagged by ``source``: its tag is no field of an error's path.
READ = ModelReader(PATTERNS, tags=SOURCES)


@dataclass
class Runtime:
    """Per-app state; ``db`` and ``driver`` exist between startup and cleanup."""

    config: ControlPlaneConfig
    clock: Callable[[], float]
    db: Database | None = None
    driver: LifecycleDriver | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def database(self) -> Database:
        if self.db is None:
            raise web.HTTPServiceUnavailable(reason="control plane is starting")
        return self.db

    def revision_created(self) -> None:
        if self.driver is not None:
            self.driver.wake()


RUNTIME_KEY = web.AppKey("control_plane_runtime", Runtime)
TENANT_KEY = web.RequestKey("control_plane_tenant", str)


def runtime(request: web.Request) -> Runtime:
    return request.app[RUNTIME_KEY]


def tenant(request: web.Request) -> str:
    return request[TENANT_KEY]


def json_error(status: int, detail: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"detail": detail}, status=status, headers=headers)


def not_found(detail: str) -> NoReturn:
    raise web.HTTPNotFound(text=json.dumps({"detail": detail}), content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes ``{"detail": ...}`` JSON; nothing leaks a traceback."""
    try:
        return await handler(request)
    except InvalidRequest as exc:
        return json_error(exc.status, exc.detail, exc.headers())
    except Conflict as exc:
        return json_error(409, str(exc))
    except Refused as exc:
        return json_error(exc.status, exc.detail, exc.headers or None)
    except DatabaseUnavailable as exc:
        return json_error(503, exc.detail, {"Retry-After": str(exc.retry_after)})
    except RequestPayloadError:
        # The body's framing broke while reading it (a bad chunk, a short body).
        return json_error(400, "Malformed HTTP body framing")
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        detail = exc.reason if exc.status != 404 else "Not Found"
        if exc.status == 413:
            detail = "Request body too large"
        return json_error(exc.status, detail, headers)
    except Exception as exc:
        # No request data and no exception message in the log: bodies and headers may
        # carry secret values, and a message may quote them.
        log.error(
            "control plane handler failed: %s %s: %s",
            request.method,
            request.rel_url.path,
            exception_summary(exc),
        )
        return json_error(500, "Internal error")


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """``X-Api-Key`` → 401 when missing or unknown; ``X-Tenant-Id`` → 403 when not granted."""
    route = request.match_info.route
    if request.match_info.http_exception is not None or (route.name or "").startswith(
        PUBLIC_ROUTE_PREFIX
    ):
        return await handler(request)
    api_key = request.headers.get("X-Api-Key", "")
    if not api_key:
        return json_error(401, "Missing X-Api-Key header.")
    # None for a key that is not UTF-8 (aiohttp keeps such header bytes as lone
    # surrogates) or longer than MAX_API_KEY_BYTES bytes: no credential can match it.
    presented = api_key_bytes(api_key)
    credential = None
    if presented is not None:
        credential = find_credential(runtime(request).config.credentials, presented)
    if credential is None:
        return json_error(401, "Invalid API key.")
    tenant_id = request.headers.get("X-Tenant-Id", "")
    if not tenant_id:
        return json_error(403, "Missing X-Tenant-Id header.")
    if not is_valid_tenant_id(tenant_id) or tenant_id not in credential.tenant_ids:
        return json_error(403, "This API key is not allowed to act on this tenant.")
    request[TENANT_KEY] = tenant_id
    return await handler(request)


@overload
async def read_body(
    request: web.Request, model: type[T], check: Callable[[T], None] | None = None
) -> T: ...
@overload
async def read_body(
    request: web.Request, model: object, check: Callable[[Any], None] | None = None
) -> Any: ...
async def read_body(
    request: web.Request, model: Any, check: Callable[[Any], None] | None = None
) -> Any:
    """The JSON body validated into ``model`` (a class, or a type such as a tagged union;
    its size is bounded by the app) and passed to ``check`` (what walks its values
    further), parsed within the loop's parse budget (429/503 when the client's address, or
    every address together, has used its share: http_api/body_budget.py)."""

    def parse(raw: bytes) -> Any:
        value = READ.body(model, raw)
        if check is not None:
            check(value)
        return value

    return await read_model(request, parse)


def page(request: web.Request) -> PageQuery:
    """``limit`` (1..100, default 20) and ``offset`` (>= 0) from the query string."""
    return READ.query(PageQuery, request.query)


def json_bytes_response(body: bytes) -> web.Response:
    """200 with ``body``, JSON already encoded (as UTF-8)."""
    return web.Response(body=body, content_type="application/json", charset="utf-8")


def page_response(resources: Sequence[Mapping[str, Any]], offset: int) -> web.Response:
    """The list envelope; ``offset`` is where the next page starts. Compact UTF-8 JSON, as
    the pages of deployments and revisions (``storage._page``): no byte grows sixfold into
    a ``\\uXXXX`` escape."""
    page = {"resources": resources, "offset": offset + len(resources)}
    text = json.dumps(page, separators=(",", ":"), ensure_ascii=False)
    return json_bytes_response(text.encode("utf-8"))


def path_id(request: web.Request, name: str) -> str:
    """The path parameter ``name`` (at most 256 characters of UTF-8 text)."""
    value: str = READ.parameter(PathId, name, request.match_info[name])
    return value


# ---- the HTTP shapes shared by tenant-scoped resources ------------------------------------
# Each takes an unbound ControlPlaneStore method, called on the database thread with the
# request's tenant first, so every call stays scoped to that tenant.


async def create_resource(
    request: web.Request,
    data: Row,
    create: Callable[[ControlPlaneStore, str, Row, float], Mapping[str, Any]],
) -> web.Response:
    """POST: create from validated ``data``, 201 with the new resource."""
    rt = runtime(request)
    db = rt.database()
    resource = await db.run(create, db.store, tenant(request), data, rt.clock())
    return web.json_response(resource, status=201)


async def list_resources(
    request: web.Request,
    list_rows: Callable[[ControlPlaneStore, str, int, int], Sequence[Mapping[str, Any]]],
) -> web.Response:
    """GET of a collection: one page of the tenant's resources."""
    query = page(request)
    db = runtime(request).database()
    rows = await db.run(list_rows, db.store, tenant(request), query.limit, query.offset)
    return page_response(rows, query.offset)


async def get_resource(
    request: web.Request,
    key: str,
    get: Callable[[ControlPlaneStore, str, str], Mapping[str, Any] | None],
    missing: Missing,
) -> web.Response:
    """GET of the resource named by path parameter ``key``; ``missing`` raises the 404."""
    resource_id = path_id(request, key)
    db = runtime(request).database()
    resource = await db.run(get, db.store, tenant(request), resource_id)
    if resource is None:
        missing(resource_id)
    return web.json_response(resource)


async def delete_resource(
    request: web.Request,
    key: str,
    delete: Callable[[ControlPlaneStore, str, str], bool],
    missing: Missing,
) -> web.Response:
    """DELETE of the resource named by path parameter ``key``: 204, or ``missing``'s 404."""
    resource_id = path_id(request, key)
    db = runtime(request).database()
    if not await db.run(delete, db.store, tenant(request), resource_id):
        missing(resource_id)
    return web.Response(status=204)
