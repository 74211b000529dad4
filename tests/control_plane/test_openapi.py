"""The control plane serves an OpenAPI 3.1 document generated from its models, without
credentials, at /openapi.json and /api-host/openapi.json: it describes exactly its routes,
names the operations of the service description, and accepts exactly what the control plane
accepts (each body below is schema-valid if and only if the control plane takes it)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from gateway.upstreams.control_plane.api_doc import API
from gateway.upstreams.control_plane.app import ROUTE_PREFIXES, routes
from gateway.upstreams.control_plane.http_helpers import RUNTIME_KEY
from gateway.upstreams.http_api.routes import document_bytes
from tests.support.openapi_document import unresolved_refs, validator

from .support import deployment_body, headers

H = headers()


async def _document(http, prefix: str = "") -> Any:
    r = await http.get(prefix + "/openapi.json")  # no credentials: the document is public
    assert r.status == 200
    assert r.content_type == "application/json"
    return await r.json()


@pytest.mark.parametrize("prefix", ROUTE_PREFIXES)
async def test_document_is_generated_from_the_models(http, control_plane, prefix):
    document = await _document(http, prefix)
    assert document["openapi"] == "3.1.0"
    config = control_plane.app[RUNTIME_KEY].config
    assert document == json.loads(document_bytes(API, routes(config)))
    documented = {
        (method.upper(), path) for path, ops in document["paths"].items() for method in ops
    }
    served = {
        (route.method, route.resource.canonical)
        for route in control_plane.app.router.routes()
        if route.method != "HEAD" and not route.resource.canonical.startswith("/api-host/")
    }
    assert documented == served
    assert unresolved_refs(document) == []


async def test_document_names_the_service_description_operations(http):
    document = await _document(http)
    paths = document["paths"]
    quickstart = {
        ("post", "/v2/deployments"): "create_deployment",
        ("get", "/v2/deployments"): "list_deployments",
        ("get", "/v2/deployments/{deployment_id}"): "get_deployment",
        ("patch", "/v2/deployments/{deployment_id}"): "update_deployment",
        ("delete", "/v2/deployments/{deployment_id}"): "delete_deployment",
        ("get", "/v2/deployments/{deployment_id}/revisions"): "list_revisions",
        ("get", "/v2/deployments/{deployment_id}/revisions/{revision_id}"): "get_revision",
    }
    for (method, path), operation_id in quickstart.items():
        assert paths[path][method]["operationId"] == operation_id
        assert paths[path][method]["tags"] == ["Deployments"]
    assert paths["/v2/deployments"]["post"]["responses"]["201"]
    assert set(paths["/v2/deployments/{deployment_id}"]["delete"]["responses"]) >= {"204", "404"}
    tags = {tag["name"] for tag in document["tags"]}
    assert {"Deployments", "Listeners", "Auth Service", "Integrations"} <= tags
    schemes = document["components"]["securitySchemes"]
    assert {scheme["name"] for scheme in schemes.values()} == {"X-Api-Key", "X-Tenant-Id"}
    assert document["security"] == [{"ApiKey": [], "TenantId": []}]
    assert paths["/v2/auth/callback/{provider_id}"]["get"]["security"] == []
    schemas = document["components"]["schemas"]
    create = schemas["GithubDeploymentCreate"]["properties"]
    assert {"name", "source", "source_config", "source_revision_config", "secrets"} == set(create)
    assert {"id", "latest_revision_id"} <= set(schemas["Deployment"]["required"])
    assert {"id", "status", "created_at"} <= set(schemas["Revision"]["required"])


def _body(**changes: Any) -> dict[str, Any]:
    body = deployment_body()
    for path, value in changes.items():
        node = body
        *parents, last = path.split("__")
        for parent in parents:
            node = node[parent]
        if value is _DROP:
            node.pop(last)
        else:
            node[last] = value
    return body


_DROP = object()
_DOCKER = {
    "name": "image",
    "source": "external_docker",
    "source_revision_config": {"image_uri": "registry.example/a:1"},
}
_LISTENER = {"compute_type": "k8s", "compute_id": "c1", "compute_config": {}}
_PROVIDER = {
    "provider_id": "gh",
    "name": "GitHub",
    "client_id": "cid",
    "auth_url": "https://github.example/authorize",
    "token_url": "https://github.example/token",
}
AGREEMENT_CASES = [
    ("POST /v2/deployments", _body()),
    ("POST /v2/deployments", _body(name=_DROP)),
    ("POST /v2/deployments", _body(name="")),
    ("POST /v2/deployments", _body(name="   ")),
    ("POST /v2/deployments", _body(source="gitlab")),
    ("POST /v2/deployments", _body(unknown=1)),
    ("POST /v2/deployments", _body(source_config=None)),
    ("POST /v2/deployments", _body(source_config__repo_url=_DROP)),
    ("POST /v2/deployments", _body(source_config__repo_url="")),
    ("POST /v2/deployments", _body(source_config__deployment_type="huge")),
    ("POST /v2/deployments", _body(source_revision_config__langgraph_config_path=_DROP)),
    (
        "POST /v2/deployments",
        _body(source_revision_config__graph_config_path="x.json"),
    ),
    ("POST /v2/deployments", _body(secrets=[{"name": "1BAD", "value": "x"}])),
    ("POST /v2/deployments", _body(secrets=[{"name": "A", "value": "1", "extra": 2}])),
    ("POST /v2/deployments", _DOCKER),
    ("POST /v2/deployments", {**_DOCKER, "source_revision_config": {}}),
    ("POST /v2/deployments", {**_DOCKER, "source_config": {"repo_url": None}, "secrets": None}),
    ("POST /v2/listeners", _LISTENER),
    ("POST /v2/listeners", {**_LISTENER, "compute_type": "vm"}),
    ("POST /v2/listeners", {**_LISTENER, "compute_config": {"k8s_namespaces": "a"}}),
    ("POST /v2/auth/providers", _PROVIDER),
    ("POST /v2/auth/providers", {**_PROVIDER, "auth_url": "ftp://x"}),
    ("POST /v2/auth/providers", {**_PROVIDER, "provider_id": "-bad"}),
    ("POST /v2/auth/providers", {**_PROVIDER, "code_challenge_method": None}),
]


@pytest.mark.parametrize(("operation", "body"), AGREEMENT_CASES)
async def test_schema_and_control_plane_agree_on_each_body(http, operation, body):
    document = await _document(http)
    method, path = operation.split(" ")
    schema = document["paths"][path][method.lower()]["requestBody"]["content"]
    schema_of_body = validator(document, schema["application/json"]["schema"])
    r = await http.request(method, path, json=copy.deepcopy(body), headers=H)
    accepted = r.status != 422
    assert schema_of_body.is_valid(body) == accepted, (body, await r.text())
