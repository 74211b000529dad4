"""Listeners (v2): one per compute cluster of a tenant."""

from __future__ import annotations

from typing import NoReturn

from aiohttp import web

from . import validation
from .http_helpers import not_found, page, page_response, path_id, read_json, runtime, tenant


def _missing(listener_id: str) -> NoReturn:
    not_found(f"Listener ID {listener_id} not found.")


async def create_listener(request: web.Request) -> web.Response:
    rt = runtime(request)
    data = validation.listener_create(await read_json(request))
    db = rt.database()
    listener = await db.run(db.store.create_listener, tenant(request), data, rt.clock())
    return web.json_response(listener, status=201)


async def list_listeners(request: web.Request) -> web.Response:
    limit, offset = page(request)
    db = runtime(request).database()
    rows = await db.run(db.store.list_listeners, tenant(request), limit, offset)
    return page_response(rows, offset)


async def get_listener(request: web.Request) -> web.Response:
    listener_id = path_id(request, "listener_id")
    db = runtime(request).database()
    listener = await db.run(db.store.get_listener, tenant(request), listener_id)
    if listener is None:
        _missing(listener_id)
    return web.json_response(listener)


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
    listener_id = path_id(request, "listener_id")
    db = runtime(request).database()
    if not await db.run(db.store.delete_listener, tenant(request), listener_id):
        _missing(listener_id)
    return web.Response(status=204)


def add_routes(router: web.UrlDispatcher, prefix: str) -> None:
    base = f"{prefix}/v2/listeners"
    router.add_post(base, create_listener)
    router.add_get(base, list_listeners, allow_head=False)
    router.add_get(base + "/{listener_id}", get_listener, allow_head=False)
    router.add_patch(base + "/{listener_id}", patch_listener)
    router.add_delete(base + "/{listener_id}", delete_listener)
