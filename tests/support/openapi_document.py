"""Reading a served OpenAPI document in tests: its references, and a validator for one of
its schemas (as schemathesis judges a request: JSON Schema 2020-12, references resolved)."""

from __future__ import annotations

from typing import Any

import jsonschema_rs


def refs(node: Any) -> list[str]:
    """Every ``$ref`` in ``node``."""
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [ref for child in node.values() for ref in refs(child)]
    if isinstance(node, list):
        return [ref for child in node for ref in refs(child)]
    return []


def unresolved_refs(document: dict[str, Any]) -> list[str]:
    """The references that name no schema of ``components/schemas``."""
    schemas = document["components"]["schemas"]
    return [r for r in refs(document) if r.removeprefix("#/components/schemas/") not in schemas]


def validator(document: dict[str, Any], schema: dict[str, Any]) -> Any:
    """A validator of ``schema`` (usually a ``$ref``) within ``document``."""
    return jsonschema_rs.validator_for({**document, **schema})
