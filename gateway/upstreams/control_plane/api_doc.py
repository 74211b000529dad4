"""What the control plane's OpenAPI document says about answers shared by its operations."""

from __future__ import annotations

from collections.abc import Mapping

from gateway.upstreams.http_api.openapi import Api, Response
from gateway.upstreams.http_api.problems import ErrorResponse

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
)


def errors(*statuses: int) -> Mapping[int, Response]:
    """The documented error answers of an operation, each ``{"detail": ...}``."""
    return {status: Response(ERROR_MEANINGS[status], ErrorResponse) for status in statuses}


ERROR_MEANINGS = {
    401: "X-Api-Key missing or unknown",
    403: "X-Tenant-Id missing, malformed or not granted to the key",
    404: "No such resource for this tenant",
    409: "A resource with this identifier exists",
    413: "Request body too large",
    422: "Validation error: the detail names the field",
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
