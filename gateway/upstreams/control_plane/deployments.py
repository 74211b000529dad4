"""Deployments (v2) and their revisions."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NoReturn

from aiohttp import web

from . import validation
from .http_helpers import (
    Runtime,
    delete_resource,
    get_resource,
    not_found,
    page,
    page_response,
    path_id,
    read_json,
    runtime,
    tenant,
)
from .integrations import integration_visible
from .storage import ControlPlaneStore as Store

log = logging.getLogger("gateway.control_plane")


def _missing_deployment(deployment_id: str) -> NoReturn:
    not_found(f"Deployment ID {deployment_id} not found.")


def _check_integration(rt: Runtime, tenant_id: str, source_config: Mapping[str, Any]) -> None:
    """A named ``integration_id`` must be one this tenant can see, when integrations are
    configured at all. Another tenant's integration and a non-existent one get the same
    422, so the answer reveals nothing about other tenants. With no integrations configured
    (the default embedded setup) any id is accepted, so the quick-start works as is."""
    integration_id = source_config.get("integration_id")
    if integration_id is None or not rt.config.github_integrations:
        return
    if not integration_visible(rt.config, tenant_id, str(integration_id)):
        raise validation.ValidationFailed(
            f"source_config.integration_id: no integration {integration_id} is available "
            "to this tenant (see GET /v1/integrations/github/install)"
        )


async def create_deployment(request: web.Request) -> web.Response:
    rt = runtime(request)
    data = validation.deployment_create(await read_json(request))
    _check_integration(rt, tenant(request), data["source_config"])
    db = rt.database()
    deployment = await db.run(db.store.create_deployment, tenant(request), data, rt.clock)
    rt.revision_created()
    log.info(
        "deployment created: id=%s tenant=%s revision=%s",
        deployment["id"],
        deployment["tenant_id"],
        deployment["latest_revision_id"],
    )
    return web.json_response(deployment, status=201)


async def list_deployments(request: web.Request) -> web.Response:
    limit, offset = page(request)
    name_contains = request.query.get("name_contains") or None
    if name_contains is not None and len(name_contains) > validation.MAX_NAME:
        raise validation.ValidationFailed(
            f"name_contains: at most {validation.MAX_NAME} characters"
        )
    db = runtime(request).database()
    rows = await db.run(db.store.list_deployments, tenant(request), limit, offset, name_contains)
    return page_response(rows, offset)


async def get_deployment(request: web.Request) -> web.Response:
    return await get_resource(request, "deployment_id", Store.get_deployment, _missing_deployment)


async def patch_deployment(request: web.Request) -> web.Response:
    rt = runtime(request)
    deployment_id = path_id(request, "deployment_id")
    patch = validation.deployment_patch(await read_json(request))
    _check_integration(rt, tenant(request), patch.get("source_config", {}))
    db = rt.database()
    result = await db.run(
        db.store.patch_deployment,
        tenant(request),
        deployment_id,
        patch,
        validation.check_complete,
        rt.clock,
    )
    if result is None:
        _missing_deployment(deployment_id)
    deployment, new_revision = result
    if new_revision:
        rt.revision_created()
        log.info(
            "deployment updated with a new revision: id=%s revision=%s",
            deployment_id,
            deployment["latest_revision_id"],
        )
    return web.json_response(deployment)


async def delete_deployment(request: web.Request) -> web.Response:
    response = await delete_resource(
        request, "deployment_id", Store.delete_deployment, _missing_deployment
    )
    log.info("deployment deleted: id=%s", request.match_info["deployment_id"])
    return response


async def list_revisions(request: web.Request) -> web.Response:
    deployment_id = path_id(request, "deployment_id")
    limit, offset = page(request)
    db = runtime(request).database()
    rows = await db.run(db.store.list_revisions, tenant(request), deployment_id, limit, offset)
    if rows is None:
        _missing_deployment(deployment_id)
    return page_response(rows, offset)


async def get_revision(request: web.Request) -> web.Response:
    deployment_id = path_id(request, "deployment_id")
    revision_id = path_id(request, "revision_id")
    db = runtime(request).database()
    revision = await db.run(db.store.get_revision, tenant(request), deployment_id, revision_id)
    if revision is None:
        if await db.run(db.store.get_deployment, tenant(request), deployment_id) is None:
            _missing_deployment(deployment_id)
        not_found(f"Revision ID {revision_id} not found.")
    return web.json_response(revision)


async def redeploy_revision(request: web.Request) -> web.Response:
    rt = runtime(request)
    deployment_id = path_id(request, "deployment_id")
    revision_id = path_id(request, "revision_id")
    db = rt.database()
    deployment = await db.run(
        db.store.redeploy, tenant(request), deployment_id, revision_id, rt.clock
    )
    if deployment is None:
        if await db.run(db.store.get_deployment, tenant(request), deployment_id) is None:
            _missing_deployment(deployment_id)
        not_found(f"Revision ID {revision_id} not found.")
    rt.revision_created()
    log.info(
        "revision redeployed: deployment=%s from=%s new=%s",
        deployment_id,
        revision_id,
        deployment["latest_revision_id"],
    )
    return web.json_response(deployment)


def add_routes(router: web.UrlDispatcher, prefix: str) -> None:
    base = f"{prefix}/v2/deployments"
    router.add_post(base, create_deployment)
    router.add_get(base, list_deployments, allow_head=False)
    router.add_get(base + "/{deployment_id}", get_deployment, allow_head=False)
    router.add_patch(base + "/{deployment_id}", patch_deployment)
    router.add_delete(base + "/{deployment_id}", delete_deployment)
    router.add_get(base + "/{deployment_id}/revisions", list_revisions, allow_head=False)
    router.add_get(
        base + "/{deployment_id}/revisions/{revision_id}", get_revision, allow_head=False
    )
    router.add_post(base + "/{deployment_id}/revisions/{revision_id}/redeploy", redeploy_revision)
