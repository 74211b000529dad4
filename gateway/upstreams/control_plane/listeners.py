"""Listeners (v2): one per compute cluster of a tenant."""

from __future__ import annotations

from typing import NoReturn

from aiohttp import web

from gateway.upstreams.http_api.openapi import Operation, Response
from gateway.upstreams.http_api.routes import Route

from .api_doc import AUTHENTICATED, errors, links_from
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
from .models import Listener, ListenerCreate, ListenerList, ListenerPatch, PageQuery, PathId
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


_LISTENER = {"listener_id": "id"}
_CREATED_LINKS = links_from(
    "created",
    {"get_listener": _LISTENER, "update_listener": _LISTENER, "delete_listener": _LISTENER},
)
_BASE = "/v2/listeners"
_ONE = _BASE + "/{listener_id}"

ROUTES = (
    Route(
        Operation(
            "post",
            _BASE,
            "create_listener",
            "Create a listener for a compute cluster",
            {
                201: Response("The listener", Listener, _CREATED_LINKS),
                **errors(*AUTHENTICATED, 409, 413, 422),
            },
            body=ListenerCreate,
            tag=TAG,
        ),
        create_listener,
    ),
    Route(
        Operation(
            "get",
            _BASE,
            "list_listeners",
            "List listeners, newest first",
            {200: Response("A page of listeners", ListenerList), **errors(*AUTHENTICATED, 422)},
            query=PageQuery,
            tag=TAG,
        ),
        list_listeners,
    ),
    Route(
        Operation(
            "get",
            _ONE,
            "get_listener",
            "Read a listener",
            {200: Response("The listener", Listener), **errors(*AUTHENTICATED, 404, 422)},
            path_parameter=PathId,
            tag=TAG,
        ),
        get_listener,
    ),
    Route(
        Operation(
            "patch",
            _ONE,
            "update_listener",
            "Update a listener's compute config or version",
            {200: Response("The listener", Listener), **errors(*AUTHENTICATED, 404, 413, 422)},
            body=ListenerPatch,
            path_parameter=PathId,
            tag=TAG,
        ),
        patch_listener,
    ),
    Route(
        Operation(
            "delete",
            _ONE,
            "delete_listener",
            "Delete a listener",
            {204: Response("Deleted"), **errors(*AUTHENTICATED, 404, 422)},
            path_parameter=PathId,
            tag=TAG,
        ),
        delete_listener,
    ),
)
