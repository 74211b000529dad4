"""What the control plane's OpenAPI document says about the API as a whole, the answers its
operations share, and the five operations of every tenant-scoped resource."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.upstreams.http_api.openapi import Api, Method, Operation, Response
from gateway.upstreams.http_api.problems import ErrorResponse
from gateway.upstreams.http_api.routes import Handler, Route
from gateway.upstreams.http_api.serving import (
    CODED_BODY,
    EXPECTATION_FAILED,
    MALFORMED_REQUEST,
    TRANSFER_CODED,
)

from .models import PageQuery, PathId

API = Api(
    title="Deployments control plane",
    version="2.0.0",
    description=(
        "Creates, reads, updates and deletes agent-server deployments and their revisions; "
        "listeners, an OAuth auth service and code-host integrations. Every path is also "
        "served under /api-host. Generated from the models the control plane validates with."
    ),
    tag="Control plane",
    security_schemes={
        "ApiKey": {"type": "apiKey", "in": "header", "name": "X-Api-Key"},
        "TenantId": {"type": "apiKey", "in": "header", "name": "X-Tenant-Id"},
    },
    common_responses={
        400: MALFORMED_REQUEST,
        415: CODED_BODY,
        417: EXPECTATION_FAILED,
        501: TRANSFER_CODED,
    },
)


def errors(*statuses: int) -> Mapping[int, Response]:
    """The documented error answers of an operation, each ``{"detail": ...}``."""
    return {status: Response(ERROR_MEANINGS[status], ErrorResponse) for status in statuses}


ERROR_MEANINGS = {
    401: "X-Api-Key missing or unknown",
    403: "X-Tenant-Id missing, malformed or not granted to the key",
    404: "No such resource for this tenant",
    409: (
        "A resource with this identifier exists, or the tenant's quota of such resources "
        "is reached (the detail names the setting; delete one first)"
    ),
    413: "Request body too large",
    422: (
        "Validation error: the detail names the field (a free-form object over "
        "max_json_field_bytes, a page over max_answer_bytes included)"
    ),
    429: (
        "The tenant's quota of pending authentication flows is reached (Retry-After says "
        "when one expires), or, for a request with a body, this client address has used "
        "its share of the server's time for parsing request bodies (Retry-After says when "
        "to try)"
    ),
}
AUTHENTICATED = (401, 403)


def links_from(
    source: str, operations: Mapping[str, Mapping[str, str]]
) -> dict[str, tuple[str, Mapping[str, str]]]:
    """Links from an answer to ``operations`` (operation id -> parameter -> field of the
    answer), named after their target."""
    return {
        f"{source}_{operation_id}": (
            operation_id,
            {name: f"$response.body#/{field}" for name, field in parameters.items()},
        )
        for operation_id, parameters in operations.items()
    }


@dataclass(frozen=True)
class Resource:
    """A tenant-scoped resource as documented: its names, path, bodies and answers. Every
    such resource has the same five operations (``resource_routes``)."""

    noun: str  # "deployment": operation ids create_deployment, get_deployment, ...
    plural: str  # "deployments": list_deployments
    base: str  # the collection's path; one resource is at base/{key}
    key: str  # the path parameter naming one resource
    view: Any  # the answer for one resource
    page: Any  # the answer for a page of them
    create_body: Any
    update_body: Any
    tag: str
    list_query: Any = PageQuery
    id_field: str = "id"  # the field of the answer that ``key`` takes
    conflicts: bool = False  # whether a create may find the identifier taken or a quota (409)
    summaries: Mapping[str, str] = field(default_factory=dict)  # by verb: the default's
    descriptions: Mapping[str, str] = field(default_factory=dict)  # by verb
    # More operations whose parameters come from a created resource (operation id ->
    # parameter -> field of the answer).
    created_links: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class ResourceHandlers:
    create: Handler
    list: Handler
    get: Handler
    update: Handler
    delete: Handler


def resource_routes(resource: Resource, handlers: ResourceHandlers) -> tuple[Route, ...]:
    """create (POST base), list (GET base), get, update (PATCH), delete of ``resource``."""
    r = resource
    one = f"{r.base}/{{{r.key}}}"
    by_id = {r.key: r.id_field}
    links = links_from(
        "created",
        {
            f"get_{r.noun}": by_id,
            f"update_{r.noun}": by_id,
            f"delete_{r.noun}": by_id,
            **r.created_links,
        },
    )
    created = errors(*AUTHENTICATED, *([409] if r.conflicts else []), 413, 422, 429)
    plain = {
        "create": f"Create a {r.noun}",
        "list": f"List {r.plural}, newest first",
        "get": f"Read a {r.noun}",
        "update": f"Update a {r.noun}",
        "delete": f"Delete a {r.noun}",
    }
    operations: dict[str, tuple[Method, str, dict[int, Response]]] = {
        "create": ("post", r.base, {201: Response(f"The {r.noun}", r.view, links), **created}),
        "list": ("get", r.base, {200: Response(f"A page of {r.plural}", r.page)}),
        "get": ("get", one, {200: Response(f"The {r.noun}", r.view), **errors(404)}),
        "update": ("patch", one, {200: Response(f"The {r.noun}", r.view), **errors(404, 413, 429)}),
        "delete": ("delete", one, {204: Response("Deleted"), **errors(404)}),
    }
    routes = []
    for verb, (method, path, answers) in operations.items():
        operation = Operation(
            method,
            path,
            f"list_{r.plural}" if verb == "list" else f"{verb}_{r.noun}",
            r.summaries.get(verb, plain[verb]),
            {**answers, **errors(*AUTHENTICATED, 422)} if verb != "create" else answers,
            body={"create": r.create_body, "update": r.update_body}.get(verb),
            query=r.list_query if verb == "list" else None,
            path_parameter=PathId if path == one else None,
            description=r.descriptions.get(verb, ""),
            tag=r.tag,
        )
        routes.append(Route(operation, getattr(handlers, verb)))
    return tuple(routes)
