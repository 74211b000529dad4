"""The Store's requests and answers, declared once: the handlers validate with these models
and the OpenAPI document (``/store/openapi.json``) is generated from them.

Field names and defaults follow the published Store API (``StoreSearchRequest``: ``limit``
10, ``offset`` 0, ...). Unknown fields in a body are ignored, as the reference does.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, NamedTuple

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict

from gateway.upstreams.http_api.json_values import INTEGRAL, UTF8, JsonObject, invalid_at
from gateway.upstreams.http_api.problems import json_type
from gateway.upstreams.store.config import MAX_TTL_MINUTES
from gateway.upstreams.store.filters import Filter, FilterClause, filter_clauses
from gateway.upstreams.store.text_index import (
    INDEX_PATH_PATTERN,
    MAX_INDEX_PATH_LENGTH,
    MAX_INDEX_PATHS,
    PathStep,
    index_steps,
    searchable_text,
)

MAX_LABEL_LENGTH = 256
MAX_NAMESPACE_DEPTH = 32
MAX_KEY_LENGTH = 1024
MAX_QUERY_LENGTH = 2048
MAX_LIMIT = 1000
# Offsets past this are a scan of the whole table, not a page; refuse them.
MAX_OFFSET = 1_000_000
RESERVED_FIRST_LABEL = "langgraph"

LABEL_PATTERN = r"^[^.]+$"
# The GET form of a namespace: labels joined by "."; empty for the empty namespace.
_DOTTED_LABEL = rf"[^.]{{1,{MAX_LABEL_LENGTH}}}"
_MORE_LABELS = rf"(?:\.{_DOTTED_LABEL}){{0,{MAX_NAMESPACE_DEPTH - 1}}}"
DOTTED_NAMESPACE_PATTERN = rf"^(?:{_DOTTED_LABEL}{_MORE_LABELS})?$"

# What each pattern means, for error details.
PATTERNS = {
    LABEL_PATTERN: "labels cannot contain '.'",
    DOTTED_NAMESPACE_PATTERN: (
        f"expected labels joined by '.', each 1 to {MAX_LABEL_LENGTH} characters, "
        f"at most {MAX_NAMESPACE_DEPTH} labels"
    ),
    INDEX_PATH_PATTERN: "expected a field path such as 'a.b', 'items[*].text' or '$'",
}

Namespace = tuple[str, ...]

Label = Annotated[str, Field(min_length=1, max_length=MAX_LABEL_LENGTH, pattern=LABEL_PATTERN)]
NamespaceLabels = Annotated[
    list[Label],
    Field(max_length=MAX_NAMESPACE_DEPTH, description="Namespace labels, outermost first"),
]


def _not_reserved(labels: list[str]) -> list[str]:
    if labels and labels[0] == RESERVED_FIRST_LABEL:
        raise invalid_at([0], f"the root label {RESERVED_FIRST_LABEL!r} is reserved")
    return labels


WritableNamespace = Annotated[
    list[Label],
    Field(
        min_length=1,
        max_length=MAX_NAMESPACE_DEPTH,
        description=f"Non-empty; the first label may not be {RESERVED_FIRST_LABEL!r}",
        json_schema_extra={"not": {"prefixItems": [{"const": RESERVED_FIRST_LABEL}]}},
    ),
    AfterValidator(_not_reserved),
]
Key = Annotated[str, Field(min_length=1, max_length=MAX_KEY_LENGTH), UTF8]
IndexPath = Annotated[
    str, Field(min_length=1, max_length=MAX_INDEX_PATH_LENGTH, pattern=INDEX_PATH_PATTERN)
]


def _index_argument(raw: Any) -> Any:
    # false and [] both mean "not searchable"; anything else but a list or null is wrong.
    if raw is False:
        return []
    if raw is None or isinstance(raw, list):
        return raw
    raise PydanticCustomError(
        "index_type",
        "expected false, null or a list of field paths, got {got}",
        {"got": json_type(raw)},
    )


def _index_schema(schema: dict[str, Any]) -> None:
    schema["anyOf"].insert(0, {"const": False})


IndexArgument = Annotated[
    Annotated[list[IndexPath], Field(max_length=MAX_INDEX_PATHS)] | None,
    BeforeValidator(_index_argument),
    Field(
        description=(
            "null: index the text of the whole value; false: not searchable; a list of field "
            "paths ('a.b', 'items[*].text', '$') to index only those"
        ),
        json_schema_extra=_index_schema,
    ),
]
Limit = Annotated[int, Field(ge=1, le=MAX_LIMIT), INTEGRAL]
Offset = Annotated[int, Field(ge=0, le=MAX_OFFSET), INTEGRAL]


class StoredForms(NamedTuple):
    """What a Store write keeps of its value: its JSON text and its searchable text."""

    value_json: str
    text: str | None


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class StorePutRequest(_Body):
    """``PUT /store/items``: insert or replace an item."""

    namespace: WritableNamespace
    key: Key
    value: JsonObject
    index: IndexArgument = None
    ttl: (
        Annotated[
            float,
            Field(
                gt=0,
                le=MAX_TTL_MINUTES,
                allow_inf_nan=False,
                description="Minutes until expiry; null uses the configured default",
            ),
        ]
        | None
    ) = None

    def index_paths(self) -> tuple[tuple[PathStep, ...], ...] | None:
        """What text is searchable: None (the whole value), () (none) or these paths."""
        return index_steps(self.index)

    def stored_forms(self) -> StoredForms:
        """The value as stored (its JSON text) and its searchable text. They walk every value
        of the item as its parse does, so the handler makes them with the parse, within
        the loop's parse budget (``http_api/body_budget.py``), and hands them to the
        storage's ``put``."""
        # The model refused non-finite numbers; allow_nan=False is the backstop.
        value_json = json.dumps(
            self.value, ensure_ascii=False, separators=(",", ":"), allow_nan=False
        )
        return StoredForms(value_json, searchable_text(self.value, self.index_paths()))


class StoreDeleteRequest(_Body):
    """``DELETE /store/items``: remove an item (also when absent)."""

    namespace: NamespaceLabels
    key: Key


class StoreSearchRequest(_Body):
    """``POST /store/items/search``: listing mode, or search mode when ``query`` is given."""

    namespace_prefix: NamespaceLabels | None = None
    filter: Filter | None = None
    limit: Limit = 10
    offset: Offset = 0
    query: (
        Annotated[
            str,
            Field(
                max_length=MAX_QUERY_LENGTH,
                description="Absent or blank: listing mode (newest update first). Otherwise "
                "search mode: ranked by relevance, best first",
            ),
            UTF8,
        ]
        | None
    ) = None
    refresh_ttl: bool | None = None

    def prefix(self) -> Namespace:
        return tuple(self.namespace_prefix or ())

    def search_query(self) -> str | None:
        """The query, or None in listing mode (an empty query asks for nothing in particular)."""
        return self.query if self.query is not None and self.query.strip() else None

    def clauses(self) -> tuple[FilterClause, ...]:
        return filter_clauses(self.filter)


class StoreListNamespacesRequest(_Body):
    """``POST /store/namespaces``: distinct namespaces; ``*`` in prefix/suffix is any label."""

    prefix: NamespaceLabels | None = None
    suffix: NamespaceLabels | None = None
    max_depth: Annotated[int, Field(ge=1, le=MAX_NAMESPACE_DEPTH), INTEGRAL] | None = None
    limit: Limit = 100
    offset: Offset = 0


class StoreGetQuery(BaseModel):
    """``GET /store/items`` query parameters."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    namespace: Annotated[
        str,
        Field(pattern=DOTTED_NAMESPACE_PATTERN, description="Namespace labels joined by '.'"),
        UTF8,
    ]
    key: Key
    refresh_ttl: bool | None = Field(
        None, description="Refresh the item's TTL on this read; absent: the store's default"
    )

    def labels(self) -> Namespace:
        return tuple(self.namespace.split(".")) if self.namespace else ()


# -- answers ----------------------------------------------------------------------------

Timestamp = Annotated[str, Field(json_schema_extra={"format": "date-time"})]


class Item(TypedDict):
    """A stored document."""

    namespace: list[str]
    key: str
    value: dict[str, Any]
    created_at: Timestamp
    updated_at: Timestamp


class SearchItem(Item):
    """An item found by search; ``score`` is the relevance (higher is better), null when
    listing."""

    score: float | None


class SearchItemsResponse(TypedDict):
    items: list[SearchItem]


class ListNamespaceResponse(TypedDict):
    namespaces: list[list[str]]
