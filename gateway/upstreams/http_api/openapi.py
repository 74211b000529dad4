"""The OpenAPI 3.1 document of an API, generated from the models its handlers validate with.

Each operation names its request body, query and response types; their JSON Schemas come
from pydantic (JSON Schema 2020-12, which OpenAPI 3.1 uses as is) and land once each in
``components/schemas``. Nothing here is written by hand, so the document cannot drift from
what the handlers accept and answer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode

from gateway.upstreams.http_api.decoding import adapter

REF_TEMPLATE = "#/components/schemas/{model}"
Method = Literal["get", "put", "post", "patch", "delete"]
_PATH_PARAMETER = re.compile(r"\{([^}/]+)\}")


@dataclass(frozen=True)
class Response:
    """One documented answer: a description, the body's type (None: no body), and links:
    operations whose parameters come from this answer (name -> operation id ->
    parameter -> ``$response.body#/...`` expression)."""

    description: str
    model: Any = None
    links: Mapping[str, tuple[str, Mapping[str, str]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Operation:
    """One method on one path, as documented."""

    method: Method
    path: str
    operation_id: str
    summary: str
    responses: Mapping[int, Response]
    body: Any = None
    query: Any = None
    path_parameter: Any = None  # the type of every ``{name}`` in the path
    description: str = ""
    public: bool = False  # True: no credentials needed (when the API has security schemes)
    tag: str = ""  # the group in the document; empty: the API's own tag


@dataclass(frozen=True)
class Api:
    """What the document says about the API as a whole."""

    title: str
    version: str
    description: str
    tag: str  # operations name their own group, or are in this one
    security_schemes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Answers any operation may give (an operation's own description of a status wins):
    # for example 400 for a request the HTTP parser refuses before any handler runs.
    common_responses: Mapping[int, Response] = field(default_factory=dict)


def openapi_document(api: Api, operations: Sequence[Operation]) -> dict[str, Any]:
    """The OpenAPI 3.1 document for ``operations``."""
    schemas = _Schemas()
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        paths.setdefault(op.path, {})[op.method] = _operation(api, op, schemas)
    tags = dict.fromkeys(op.tag or api.tag for op in operations)
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": api.title, "version": api.version, "description": api.description},
        "tags": [{"name": tag} for tag in tags],
        "paths": paths,
        "components": {"schemas": schemas.definitions()},
    }
    if api.security_schemes:
        document["components"]["securitySchemes"] = dict(api.security_schemes)
        document["security"] = [{name: [] for name in api.security_schemes}]
    return document


def _operation(api: Api, op: Operation, schemas: _Schemas) -> dict[str, Any]:
    out: dict[str, Any] = {
        "operationId": op.operation_id,
        "tags": [op.tag or api.tag],
        "summary": op.summary,
    }
    if op.description:
        out["description"] = op.description
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": schemas.ref(op.path_parameter)}
        for name in _PATH_PARAMETER.findall(op.path)
    ]
    if op.query is not None:
        parameters += _query_parameters(op.query)
    if parameters:
        out["parameters"] = parameters
    if op.body is not None:
        out["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schemas.ref(op.body)}},
        }
    responses = {**api.common_responses, **op.responses}
    out["responses"] = {
        str(status): _response(responses[status], schemas) for status in sorted(responses)
    }
    if op.public and api.security_schemes:
        out["security"] = []
    return out


def _query_parameters(model: Any) -> list[dict[str, Any]]:
    schema = adapter(model).json_schema(ref_template=REF_TEMPLATE)
    # Query models hold only scalars: a nested model would have nowhere to be defined.
    assert "$defs" not in schema, f"query model {model} must not nest models"
    required = set(schema.get("required", ()))
    parameters = []
    for name, prop in schema.get("properties", {}).items():
        prop = _not_null(prop)
        prop.pop("title", None)
        parameter: dict[str, Any] = {"name": name, "in": "query", "required": name in required}
        if "description" in prop:
            parameter["description"] = prop.pop("description")
        parameter["schema"] = prop
        parameters.append(parameter)
    return parameters


def _not_null(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A query parameter is absent or text, never null: ``X | None`` is documented as X."""
    options = schema.get("anyOf")
    out = dict(schema)
    if options and {"type": "null"} in options:
        rest = [option for option in options if option != {"type": "null"}]
        out.pop("anyOf")
        if out.get("default", "") is None:
            out.pop("default")
        out.update(rest[0] if len(rest) == 1 else {"anyOf": rest})
    return out


def _response(response: Response, schemas: _Schemas) -> dict[str, Any]:
    out: dict[str, Any] = {"description": response.description}
    if response.model is not None:
        schema = schemas.ref(response.model, mode="serialization")
        out["content"] = {"application/json": {"schema": schema}}
    if response.links:
        out["links"] = {
            name: {"operationId": operation_id, "parameters": dict(parameters)}
            for name, (operation_id, parameters) in response.links.items()
        }
    return out


class _Schemas:
    """Collects the types an API names and generates their schemas in one pass, so a model
    used in several places is one entry of ``components/schemas``."""

    def __init__(self) -> None:
        self._wanted: dict[tuple[int, JsonSchemaMode], Any] = {}
        self._placeholders: list[tuple[dict[str, Any], int, JsonSchemaMode]] = []

    def ref(self, model: Any, mode: JsonSchemaMode = "validation") -> dict[str, Any]:
        """A schema for ``model`` (usually a ``$ref``), filled in by ``definitions``."""
        self._wanted[(id(model), mode)] = model
        placeholder: dict[str, Any] = {}
        self._placeholders.append((placeholder, id(model), mode))
        return placeholder

    def definitions(self) -> dict[str, Any]:
        inputs: list[tuple[int, JsonSchemaMode, Any]] = [
            (key, mode, adapter(model).core_schema) for (key, mode), model in self._wanted.items()
        ]
        generator = GenerateJsonSchema(ref_template=REF_TEMPLATE)
        by_key, definitions = generator.generate_definitions(inputs)
        for placeholder, key, mode in self._placeholders:
            placeholder.update(by_key[(key, mode)])
        return dict(sorted(definitions.items()))
