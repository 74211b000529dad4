"""Listeners (v2): one per compute cluster of a tenant."""

from __future__ import annotations

from typing import NoReturn

from aiohttp import web

from .api_doc import Resource, ResourceHandlers, resource_routes
from .http_helpers import (
    create_resource,
    delete_resource,
    get_resource,
    list_resources,
    not_found,
    path_id,
    read_body,
    runtime,
    tenant,
)
from .models import Listener, ListenerCreate, ListenerList, ListenerPatch
from .storage import ControlPlaneStore as Store


def _missing(listener_id: str) -> NoReturn:
    not_found(f"Listener ID {listener_id} not found.")


TAG = "Listeners"  # the group of these operations in the OpenAPI document


async def create_listener(request: web.Request) -> web.Response:
    body = await read_body(request, ListenerCreate)
    return await create_resource(request, body.model_dump(), Store.create_listener)


async def list_listeners(request: web.Request) -> web.Response:
    return await list_resources(request, Store.list_listeners)


async def get_listener(request: web.Request) -> web.Response:
    return await get_resource(request, "listener_id", Store.get_listener, _missing)


async def patch_listener(request: web.Request) -> web.Response:
    rt = runtime(request)
    listener_id = path_id(request, "listener_id")
    given = (await read_body(request, ListenerPatch)).model_dump(exclude_unset=True)
    db = rt.database()
    listener = await db.run(
        db.store.patch_listener, tenant(request), listener_id, given, rt.clock()
    )
    if listener is None:
        _missing(listener_id)
    return web.json_response(listener)


async def delete_listener(request: web.Request) -> web.Response:
    return await delete_resource(request, "listener_id", Store.delete_listener, _missing)


LISTENERS = Resource(
    noun="listener",
    plural="listeners",
    base="/v2/listeners",
    key="listener_id",
    view=Listener,
    page=ListenerList,
    create_body=ListenerCreate,
    update_body=ListenerPatch,
    tag=TAG,
    conflicts=True,
    summaries={"create": "Create a listener for a compute cluster"},
)
ROUTES = resource_routes(
    LISTENERS,
    ResourceHandlers(
        create_listener, list_listeners, get_listener, patch_listener, delete_listener
    ),
)
