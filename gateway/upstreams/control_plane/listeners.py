"""Listeners (v2): one per compute cluster of a tenant."""

from __future__ import annotations

from typing import NoReturn

from aiohttp import web

from . import validation
from .http_helpers import (
    create_resource,
    delete_resource,
    get_resource,
    list_resources,
    not_found,
    path_id,
    read_json,
    runtime,
    tenant,
)
from .storage import ControlPlaneStore as Store


def _missing(listener_id: str) -> NoReturn:
    not_found(f"Listener ID {listener_id} not found.")


async def create_listener(request: web.Request) -> web.Response:
    return await create_resource(request, validation.listener_create, Store.create_listener)


async def list_listeners(request: web.Request) -> web.Response:
    return await list_resources(request, Store.list_listeners)


async def get_listener(request: web.Request) -> web.Response:
    return await get_resource(request, "listener_id", Store.get_listener, _missing)


async def patch_listener(request: web.Request) -> web.Response:
    rt = runtime(request)
    listener_id = path_id(request, "listener_id")
    body = await read_json(request)
    db = rt.database()
    current = await db.run(db.store.get_listener, tenant(request), listener_id)
    if current is None:
        _missing(listener_id)
    patch = validation.listener_patch(body, current)
    listener = await db.run(
        db.store.patch_listener, tenant(request), listener_id, patch, rt.clock()
    )
    if listener is None:
        _missing(listener_id)
    return web.json_response(listener)


async def delete_listener(request: web.Request) -> web.Response:
    return await delete_resource(request, "listener_id", Store.delete_listener, _missing)


def add_routes(router: web.UrlDispatcher, prefix: str) -> None:
    base = f"{prefix}/v2/listeners"
    router.add_post(base, create_listener)
    router.add_get(base, list_listeners, allow_head=False)
    router.add_get(base + "/{listener_id}", get_listener, allow_head=False)
    router.add_patch(base + "/{listener_id}", patch_listener)
    router.add_delete(base + "/{listener_id}", delete_listener)
