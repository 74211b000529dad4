"""The Store serves an OpenAPI 3.1 document that describes exactly its routes."""

from __future__ import annotations

from typing import Any

import aiohttp

from .store_support import RunningStore


async def test_openapi_document_matches_the_routes(
    http: aiohttp.ClientSession, running_store: RunningStore
) -> None:
    async with http.get("/store/openapi.json") as response:
        assert response.status == 200
        assert response.content_type == "application/json"
        document = await response.json()
    assert document["openapi"].startswith("3.1")
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
    schemas = document["components"]["schemas"]
    search = schemas["StoreSearchRequest"]["properties"]
    assert search["limit"] == {"type": "integer", "minimum": 1, "maximum": 1000, "default": 10}
    assert set(schemas["Item"]["required"]) == {
        "namespace",
        "key",
        "value",
        "created_at",
        "updated_at",
    }
    for ref in _refs(document):
        assert ref.startswith("#/components/schemas/")
        assert ref.removeprefix("#/components/schemas/") in schemas, ref


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [ref for child in node.values() for ref in _refs(child)]
    if isinstance(node, list):
        return [ref for child in node for ref in _refs(child)]
    return []
