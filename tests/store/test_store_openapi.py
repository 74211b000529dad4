"""The Store serves an OpenAPI 3.1 document generated from its models: it describes exactly
its routes, carries the service description's names, and accepts exactly what the Store
accepts (each request below is schema-valid if and only if the Store takes it)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from gateway.upstreams.http_api.routes import document_bytes
from gateway.upstreams.store.app import API, ROUTES
from tests.support.openapi_document import unresolved_refs, validator

from .store_support import RunningStore
from .test_store_validation import NAMESPACES_CASES, PUT_CASES, SEARCH_CASES


async def _document(http: aiohttp.ClientSession) -> Any:
    async with http.get("/store/openapi.json") as response:
        assert response.status == 200
        assert response.content_type == "application/json"
        return await response.json()


async def test_openapi_document_matches_the_routes(
    http: aiohttp.ClientSession, running_store: RunningStore
) -> None:
    document = await _document(http)
    assert document["openapi"] == "3.1.0"
    # The served document is the one the models generate now, not a kept copy.
    assert document == json.loads(document_bytes(API, ROUTES))
    documented = {
        (method.upper(), path)
        for path, operations in document["paths"].items()
        for method in operations
    }
    served = {
        (route.method, route.resource.canonical)
        for route in running_store.app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }
    assert documented == served
    assert unresolved_refs(document) == []


async def test_openapi_document_has_the_service_description_names(
    http: aiohttp.ClientSession,
) -> None:
    document = await _document(http)
    search = document["paths"]["/store/items/search"]["post"]
    assert search["operationId"] == "search_items"
    assert search["tags"] == ["Store"]
    assert search["requestBody"]["required"] is True
    body = search["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/StoreSearchRequest"}
    ok = search["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/SearchItemsResponse"}
    error = search["responses"]["422"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    schemas = document["components"]["schemas"]
    fields = schemas["StoreSearchRequest"]["properties"]
    assert set(fields) == {
        "namespace_prefix",
        "filter",
        "limit",
        "offset",
        "query",
        "refresh_ttl",
    }
    assert fields["limit"]["default"] == 10
    assert (fields["limit"]["minimum"], fields["limit"]["maximum"]) == (1, 1000)
    assert fields["offset"]["default"] == 0
    assert set(schemas["Item"]["required"]) == {
        "namespace",
        "key",
        "value",
        "created_at",
        "updated_at",
    }
    assert schemas["ErrorResponse"]["required"] == ["detail"]
    operation_ids = {
        operation["operationId"]
        for operations in document["paths"].values()
        for operation in operations.values()
    }
    assert {"put_item", "get_item", "delete_item", "search_items", "list_namespaces"} <= (
        operation_ids
    )


_GOOD = {"namespace": ["a"], "key": "k", "value": {"x": 1}}
AGREEMENT_CASES = [
    *(("PUT /store/items", "StorePutRequest", body) for body, _ in PUT_CASES),
    *(("POST /store/items/search", "StoreSearchRequest", body) for body, _ in SEARCH_CASES),
    *(("POST /store/namespaces", "StoreListNamespacesRequest", b) for b, _ in NAMESPACES_CASES),
    ("PUT /store/items", "StorePutRequest", _GOOD),
    ("PUT /store/items", "StorePutRequest", {**_GOOD, "index": False, "ttl": 1.5}),
    ("PUT /store/items", "StorePutRequest", {**_GOOD, "index": ["a.b", "c[*].d", "$"]}),
    ("PUT /store/items", "StorePutRequest", {**_GOOD, "unknown": "ignored"}),
    ("POST /store/items/search", "StoreSearchRequest", {"limit": 2.0, "offset": 1_000_000}),
    ("POST /store/items/search", "StoreSearchRequest", {"offset": 1_000_001}),
    ("POST /store/items/search", "StoreSearchRequest", {"offset": None}),
    ("POST /store/items/search", "StoreSearchRequest", {"filter": {"a": {"$gt": 1, "b": 2}}}),
    ("POST /store/items/search", "StoreSearchRequest", {"filter": {"a": {"b": {"$c": 1}}}}),
    ("POST /store/items/search", "StoreSearchRequest", {"filter": {f"k{n}": n for n in range(65)}}),
    ("POST /store/namespaces", "StoreListNamespacesRequest", {"prefix": ["*", "x"]}),
]


@pytest.mark.parametrize(("operation", "schema", "body"), AGREEMENT_CASES)
async def test_schema_and_store_agree_on_each_body(
    http: aiohttp.ClientSession, operation: str, schema: str, body: Any
) -> None:
    document = await _document(http)
    schema_of_body = validator(document, {"$ref": f"#/components/schemas/{schema}"})
    method, path = operation.split(" ")
    async with http.request(method, path, json=body) as response:
        accepted = response.status != 422
        detail = await response.text()
    assert schema_of_body.is_valid(body) == accepted, (body, detail)
