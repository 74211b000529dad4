"""Request plumbing shared by the control-plane handlers: app state, JSON errors, auth,
body and pagination parsing."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from aiohttp import web

from .config import ControlPlaneConfig
from .credentials import api_key_bytes, find_credential, is_valid_tenant_id
from .lifecycle import LifecycleDriver
from .storage import Conflict, ControlPlaneStore, Database, Row
from .validation import ValidationFailed, check_json_values, check_text

log = logging.getLogger("gateway.control_plane")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Missing = Callable[[str], NoReturn]
PUBLIC_ROUTE_PREFIX = "public:"
MAX_PAGE = 100
DEFAULT_PAGE = 20
MAX_OFFSET = 10_000_000


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
    except ValidationFailed as exc:
        return json_error(422, exc.detail)
    except Conflict as exc:
        return json_error(409, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        detail = exc.reason if exc.status != 404 else "Not Found"
        if exc.status == 413:
            detail = "Request body too large"
        return json_error(exc.status, detail, headers)
    except Exception:
        # No request data in the message: bodies may carry secret values.
        log.exception("control plane handler failed: %s %s", request.method, request.rel_url.path)
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


async def read_json(request: web.Request) -> object:
    """The request body as JSON; 422 when absent or malformed (size is bounded by the app),
    or when it holds a non-finite number or a string that is not encodable UTF-8."""
    raw = await request.read()
    if not raw.strip():
        raise ValidationFailed("body: a JSON body is required")
    try:
        document: object = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValidationFailed("body: malformed JSON") from None
    check_json_values(document)
    return document


def _int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValidationFailed(f"{name}: expected an integer") from None
    if not low <= value <= high:
        raise ValidationFailed(f"{name}: must be between {low} and {high}")
    return value


def page(request: web.Request) -> tuple[int, int]:
    """``limit`` (1..100, default 20) and ``offset`` (>= 0) from the query string."""
    return (
        _int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE),
        _int_param(request, "offset", 0, 0, MAX_OFFSET),
    )


def page_response(resources: list[dict[str, Any]], offset: int) -> web.Response:
    """The list envelope; ``offset`` is where the next page starts."""
    return web.json_response({"resources": resources, "offset": offset + len(resources)})


def path_id(request: web.Request, name: str) -> str:
    value = request.match_info[name]
    if len(value) > 256:
        raise ValidationFailed(f"{name}: at most 256 characters")
    return check_text(value, name)


# ---- the HTTP shapes shared by tenant-scoped resources ------------------------------------
# Each takes an unbound ControlPlaneStore method, called on the database thread with the
# request's tenant first, so every call stays scoped to that tenant.


async def create_resource(
    request: web.Request,
    validate: Callable[[object], Row],
    create: Callable[[ControlPlaneStore, str, Row, float], Row],
) -> web.Response:
    """POST: validate the body, create, 201 with the new resource."""
    rt = runtime(request)
    data = validate(await read_json(request))
    db = rt.database()
    resource = await db.run(create, db.store, tenant(request), data, rt.clock())
    return web.json_response(resource, status=201)


async def list_resources(
    request: web.Request, list_rows: Callable[[ControlPlaneStore, str, int, int], list[Row]]
) -> web.Response:
    """GET of a collection: one page of the tenant's resources."""
    limit, offset = page(request)
    db = runtime(request).database()
    rows = await db.run(list_rows, db.store, tenant(request), limit, offset)
    return page_response(rows, offset)


async def get_resource(
    request: web.Request,
    key: str,
    get: Callable[[ControlPlaneStore, str, str], Row | None],
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
