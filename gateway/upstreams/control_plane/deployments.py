"""Deployments (v2) and their revisions."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from aiohttp import web

from gateway.upstreams.http_api.openapi import Operation, Response
from gateway.upstreams.http_api.routes import Route

from . import rules
from .api_doc import AUTHENTICATED, Resource, ResourceHandlers, errors, resource_routes
from .http_helpers import (
    READ,
    delete_resource,
    get_resource,
    json_bytes_response,
    not_found,
    page,
    path_id,
    read_body,
    runtime,
    tenant,
)
from .limits import check_free_form_fields
from .models import (
    Deployment,
    DeploymentCreate,
    DeploymentList,
    DeploymentListQuery,
    DeploymentPatch,
    DockerDeploymentCreate,
    GithubDeploymentCreate,
    PageQuery,
    PathId,
    Revision,
    RevisionList,
    secret_pairs,
)
from .storage import ControlPlaneStore as Store

TAG = "Deployments"  # the group of these operations in the OpenAPI document
log = logging.getLogger("gateway.control_plane")


def _missing_deployment(deployment_id: str) -> NoReturn:
    not_found(f"Deployment ID {deployment_id} not found.")


def _create_data(body: GithubDeploymentCreate | DockerDeploymentCreate) -> dict[str, Any]:
    """A validated create body as the storage keeps it (config path under its stored name,
    secrets as name/value pairs)."""
    source_config = {
        "integration_id": None,
        "repo_url": None,
        "deployment_type": "dev",
        "build_on_push": False,
        "custom_url": None,
        "resource_spec": None,
    }
    if body.source_config is not None:
        source_config.update(body.source_config.given())
    revision_config: dict[str, Any] = {
        "repo_ref": None,
        "langgraph_config_path": None,
        "image_uri": None,
    }
    revision_config.update(body.source_revision_config.given())
    return {
        "name": body.name.strip(),
        "source": body.source,
        "source_config": source_config,
        "source_revision_config": revision_config,
        "secrets": secret_pairs(body.secrets),
    }


async def create_deployment(request: web.Request) -> web.Response:
    rt = runtime(request)
    limit = rt.config.limits.max_json_field_bytes
    body: GithubDeploymentCreate | DockerDeploymentCreate = await read_body(
        request,
        DeploymentCreate,
        # (a walk of the free-form fields: with the parse, in its budget)
        lambda given: (
            None
            if given.source_config is None
            else check_free_form_fields(given.source_config.given(), limit)
        ),
    )
    data = _create_data(body)
    rules.check_integration(rt.config, tenant(request), data["source_config"])
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
    query = READ.query(DeploymentListQuery, request.query)
    db = runtime(request).database()
    body = await db.run(
        db.store.list_deployments,
        tenant(request),
        query.limit,
        query.offset,
        query.name_contains or None,
    )
    return json_bytes_response(body)


async def get_deployment(request: web.Request) -> web.Response:
    return await get_resource(request, "deployment_id", Store.get_deployment, _missing_deployment)


async def patch_deployment(request: web.Request) -> web.Response:
    rt = runtime(request)
    deployment_id = path_id(request, "deployment_id")
    limit = rt.config.limits.max_json_field_bytes

    def check(given: DeploymentPatch) -> None:  # with the parse, in its budget
        if "source_config" in given.model_fields_set:
            check_free_form_fields(given.source_config.given(), limit)

    body = await read_body(request, DeploymentPatch, check)
    patch: dict[str, Any] = {}
    if "source_config" in body.model_fields_set:
        patch["source_config"] = body.source_config.given()
    if "source_revision_config" in body.model_fields_set:
        patch["source_revision_config"] = body.source_revision_config.given()
    if "secrets" in body.model_fields_set:
        patch["secrets"] = secret_pairs(body.secrets)
    rules.check_integration(rt.config, tenant(request), patch.get("source_config", {}))
    db = rt.database()
    result = await db.run(
        db.store.patch_deployment,
        tenant(request),
        deployment_id,
        patch,
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
    query = page(request)
    db = runtime(request).database()
    body = await db.run(
        db.store.list_revisions, tenant(request), deployment_id, query.limit, query.offset
    )
    if body is None:
        _missing_deployment(deployment_id)
    return json_bytes_response(body)


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


_ONE = "/v2/deployments/{deployment_id}"
_REVISION = _ONE + "/revisions/{revision_id}"
_LATEST = {"deployment_id": "id", "revision_id": "latest_revision_id"}

DEPLOYMENTS = Resource(
    noun="deployment",
    plural="deployments",
    base="/v2/deployments",
    key="deployment_id",
    view=Deployment,
    page=DeploymentList,
    create_body=DeploymentCreate,
    update_body=DeploymentPatch,
    tag=TAG,
    list_query=DeploymentListQuery,
    conflicts=True,
    summaries={
        "create": "Create a deployment and its first revision",
        "update": "Update a deployment; a revision config or secrets make a new revision",
        "delete": "Delete a deployment and its revisions",
    },
    descriptions={
        "create": (
            "`source` github needs `integration_id`, `repo_url`, `repo_ref` and the config "
            "path; external_docker needs `image_uri`. When integrations are configured, "
            "`integration_id` must name one the tenant can see (422 otherwise). Input that "
            "is well-formed but cannot build is accepted and fails the revision with "
            "BUILD_FAILED."
        ),
        "update": (
            "Objects are merged field by field into the stored configuration. A named "
            "`integration_id` is checked as on create."
        ),
    },
    created_links={
        "list_revisions": {"deployment_id": "id"},
        "get_revision": _LATEST,
        "redeploy_revision": _LATEST,
    },
)

ROUTES = (
    *resource_routes(
        DEPLOYMENTS,
        ResourceHandlers(
            create_deployment,
            list_deployments,
            get_deployment,
            patch_deployment,
            delete_deployment,
        ),
    ),
    Route(
        Operation(
            "get",
            _ONE + "/revisions",
            "list_revisions",
            "List a deployment's revisions, latest first",
            {
                200: Response("A page of revisions", RevisionList),
                **errors(*AUTHENTICATED, 404, 422),
            },
            query=PageQuery,
            path_parameter=PathId,
            tag=TAG,
        ),
        list_revisions,
    ),
    Route(
        Operation(
            "get",
            _REVISION,
            "get_revision",
            "Read a revision (poll it until DEPLOYED, or a status containing FAILED)",
            {200: Response("The revision", Revision), **errors(*AUTHENTICATED, 404, 422)},
            path_parameter=PathId,
            tag=TAG,
        ),
        get_revision,
    ),
    Route(
        Operation(
            "post",
            _REVISION + "/redeploy",
            "redeploy_revision",
            "Start a new revision from a past revision's configuration",
            {200: Response("The deployment", Deployment), **errors(*AUTHENTICATED, 404, 422)},
            path_parameter=PathId,
            tag=TAG,
        ),
        redeploy_revision,
    ),
)
