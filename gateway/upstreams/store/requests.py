"""The Store's requests as typed values, validated field by field (422 naming the field)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.upstreams.store.config import MAX_TTL_MINUTES
from gateway.upstreams.store.errors import StoreRequestError, invalid
from gateway.upstreams.store.filters import FilterClause, parse_filter
from gateway.upstreams.store.text_index import PathStep, parse_index_paths

Namespace = tuple[str, ...]

MAX_LABEL_LENGTH = 256
MAX_NAMESPACE_DEPTH = 32
MAX_KEY_LENGTH = 1024
MAX_QUERY_LENGTH = 2048
MAX_LIMIT = 1000
# Offsets past this are a scan of the whole table, not a page; refuse them.
MAX_OFFSET = 1_000_000
RESERVED_FIRST_LABEL = "langgraph"
# Arrays and objects inside one field of a body may nest at most this deep (the field's own
# value is level 1). Deeper documents are refused before anything walks them recursively.
MAX_JSON_DEPTH = 64
# A field path in an error detail is cut to this many characters.
MAX_PATH_IN_DETAIL = 200
_LARGEST_NUMBER = sys.float_info.max


@dataclass(frozen=True, slots=True)
class PutItem:
    namespace: Namespace
    key: str
    value: dict[str, Any]
    value_json: str
    index_paths: tuple[tuple[PathStep, ...], ...] | None
    ttl_minutes: float | None  # None: the configured default applies


@dataclass(frozen=True, slots=True)
class ItemRef:
    namespace: Namespace
    key: str


@dataclass(frozen=True, slots=True)
class SearchItems:
    namespace_prefix: Namespace
    filter: tuple[FilterClause, ...]
    limit: int
    offset: int
    query: str | None
    refresh_ttl: bool | None


@dataclass(frozen=True, slots=True)
class ListNamespaces:
    prefix: Namespace | None
    suffix: Namespace | None
    max_depth: int | None
    limit: int
    offset: int


def decode_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; malformed JSON or another type is a 422."""
    if not raw.strip():
        raise invalid("body", "a JSON object is required")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise invalid("body", "must be UTF-8 encoded JSON") from None
    except (ValueError, RecursionError) as exc:
        raise invalid("body", f"malformed JSON ({_short(exc)})") from None
    if not isinstance(body, dict):
        raise invalid("body", f"must be a JSON object, got {_json_type(body)}")
    check_json_tree(body)
    return body


# A path to a node of the body, innermost step first: (step, parent) or None for the root.
_Path = tuple[str | int, "_Path"] | None


def check_json_tree(body: dict[str, Any]) -> None:
    """Refuse what JSON parses but the Store cannot keep or answer with: 422 naming the field.

    * a string or object key holding a lone surrogate (a ``\\ud800`` escape): it has no UTF-8
      form, so SQLite cannot bind it and no JSON answer could carry it;
    * a number that is not finite (``1e400`` parses as infinity, which JSON cannot express),
      or an integer beyond the range of a double (clients such as the SDK, and SQLite's JSON
      functions, read it as infinity);
    * arrays and objects nested deeper than ``MAX_JSON_DEPTH`` inside one field.

    Iterative, so a deep document cannot exhaust the interpreter's stack here.
    """
    stack: list[tuple[Any, int, _Path]] = []
    for key, child in body.items():
        path: _Path = (key, None)
        _check_text(key, path)
        stack.append((child, 1, path))
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            _check_text(node, path)
        elif isinstance(node, float) or (isinstance(node, int) and not isinstance(node, bool)):
            if not -_LARGEST_NUMBER <= node <= _LARGEST_NUMBER:  # also False for NaN
                raise invalid(_render_path(path), "must be a finite number (at most about 1.8e308)")
        elif isinstance(node, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise invalid(
                    _render_path(path),
                    f"arrays and objects may nest at most {MAX_JSON_DEPTH} levels deep",
                )
            if isinstance(node, dict):
                for key, child in node.items():
                    child_path: _Path = (key, path)
                    _check_text(key, child_path)
                    stack.append((child, depth + 1, child_path))
            else:
                stack.extend((child, depth + 1, (i, path)) for i, child in enumerate(node))


def _check_text(text: str, path: _Path) -> None:
    if not text.isascii():
        _require_utf8(text, _render_path(path))


def _require_utf8(text: str, field: str) -> None:
    """422 for ``field`` when ``text`` holds a lone surrogate (it has no UTF-8 form)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(field, "not valid Unicode text (lone surrogate escape)") from None


def _render_path(path: _Path) -> str:
    steps: list[str | int] = []
    while path is not None:
        step, path = path
        steps.append(step)
    rendered = ""
    for step in reversed(steps):
        if isinstance(step, int):
            rendered += f"[{step}]"
        else:
            # A key is shown with any lone surrogate escaped, so the detail stays encodable.
            safe = step.encode("utf-8", "backslashreplace").decode("utf-8")
            rendered += f".{safe}" if rendered else safe
        if len(rendered) > MAX_PATH_IN_DETAIL:
            return rendered[:MAX_PATH_IN_DETAIL] + "..."
    return rendered


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _short(exc: Exception) -> str:
    return str(exc).split("\n", 1)[0][:200]


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def parse_put(body: Mapping[str, Any]) -> PutItem:
    """Validate a ``PUT /store/items`` body."""
    namespace = _namespace(_required(body, "namespace"), "namespace", write=True)
    key = _key(_required(body, "key"))
    value = _required(body, "value")
    if not isinstance(value, dict):
        raise invalid("value", f"must be a JSON object, got {_json_type(value)}")
    index_paths = parse_index_paths(body.get("index"))
    ttl_raw = body.get("ttl")
    ttl = None if ttl_raw is None else _ttl(ttl_raw)
    try:
        # allow_nan=False: never store Infinity/NaN, which are not JSON (check_json_tree
        # refuses them first; this is the backstop).
        value_json = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise invalid("value", "numbers must be finite") from None
    return PutItem(namespace, key, value, value_json, index_paths, ttl)


def parse_delete(body: Mapping[str, Any]) -> ItemRef:
    """Validate a ``DELETE /store/items`` body."""
    namespace = _namespace(_required(body, "namespace"), "namespace", write=False)
    return ItemRef(namespace, _key(_required(body, "key")))


def parse_get(query: Mapping[str, str]) -> tuple[ItemRef, bool | None]:
    """Validate ``GET /store/items`` query parameters (namespace is dot-joined)."""
    if "namespace" not in query:
        raise invalid("namespace", "query parameter is required (labels joined by '.')")
    if "key" not in query:
        raise invalid("key", "query parameter is required")
    dotted = query["namespace"]
    labels = dotted.split(".") if dotted else []
    namespace = _namespace(labels, "namespace", write=False)
    refresh_raw = query.get("refresh_ttl")
    refresh: bool | None = None
    if refresh_raw is not None:
        lowered = refresh_raw.strip().lower()
        if lowered in ("true", "1", "yes"):
            refresh = True
        elif lowered in ("false", "0", "no"):
            refresh = False
        else:
            raise invalid("refresh_ttl", "must be true or false")
    return ItemRef(namespace, _key(query["key"])), refresh


def parse_search(body: Mapping[str, Any]) -> SearchItems:
    """Validate a ``POST /store/items/search`` body."""
    prefix_raw = body.get("namespace_prefix")
    prefix = () if prefix_raw is None else _namespace(prefix_raw, "namespace_prefix", write=False)
    query_raw = body.get("query")
    query: str | None = None
    if query_raw is not None:
        if not isinstance(query_raw, str):
            raise invalid("query", f"must be a string or null, got {_json_type(query_raw)}")
        if len(query_raw) > MAX_QUERY_LENGTH:
            raise invalid("query", f"must be at most {MAX_QUERY_LENGTH} characters")
        _require_utf8(query_raw, "query")
        # An empty query asks for nothing in particular: listing mode.
        query = query_raw if query_raw.strip() else None
    return SearchItems(
        namespace_prefix=prefix,
        filter=parse_filter(body.get("filter")),
        limit=_integer(body, "limit", default=10, low=1, high=MAX_LIMIT),
        offset=_integer(body, "offset", default=0, low=0, high=MAX_OFFSET),
        query=query,
        refresh_ttl=_optional_bool(body, "refresh_ttl"),
    )


def parse_list_namespaces(body: Mapping[str, Any]) -> ListNamespaces:
    """Validate a ``POST /store/namespaces`` body; ``*`` in prefix/suffix matches any label."""
    prefix_raw = body.get("prefix")
    suffix_raw = body.get("suffix")
    max_depth_raw = body.get("max_depth")
    max_depth = (
        None
        if max_depth_raw is None
        else _integer(body, "max_depth", default=0, low=1, high=MAX_NAMESPACE_DEPTH)
    )
    return ListNamespaces(
        prefix=None if prefix_raw is None else _namespace(prefix_raw, "prefix", write=False),
        suffix=None if suffix_raw is None else _namespace(suffix_raw, "suffix", write=False),
        max_depth=max_depth,
        limit=_integer(body, "limit", default=100, low=1, high=MAX_LIMIT),
        offset=_integer(body, "offset", default=0, low=0, high=MAX_OFFSET),
    )


def _required(body: Mapping[str, Any], field: str) -> Any:
    if field not in body or body[field] is None:
        raise invalid(field, "field required")
    return body[field]


def _namespace(raw: object, field: str, *, write: bool) -> Namespace:
    if not isinstance(raw, list | tuple):
        raise invalid(field, f"must be an array of strings, got {_json_type(raw)}")
    if len(raw) > MAX_NAMESPACE_DEPTH:
        raise invalid(field, f"at most {MAX_NAMESPACE_DEPTH} labels are allowed")
    for position, label in enumerate(raw):
        where = f"{field}[{position}]"
        if not isinstance(label, str):
            raise invalid(where, f"must be a string, got {_json_type(label)}")
        if not label:
            raise invalid(where, "labels must be non-empty strings")
        if "." in label:
            raise invalid(where, f"labels cannot contain '.', got {label!r}")
        if len(label) > MAX_LABEL_LENGTH:
            raise invalid(where, f"labels must be at most {MAX_LABEL_LENGTH} characters")
        _require_utf8(label, where)
    if write:
        if not raw:
            raise invalid(field, "must not be empty")
        if raw[0] == RESERVED_FIRST_LABEL:
            raise invalid(f"{field}[0]", f"the root label {RESERVED_FIRST_LABEL!r} is reserved")
    return tuple(raw)


def _key(raw: object) -> str:
    if not isinstance(raw, str):
        raise invalid("key", f"must be a string, got {_json_type(raw)}")
    if not raw:
        raise invalid("key", "must be a non-empty string")
    if len(raw) > MAX_KEY_LENGTH:
        raise invalid("key", f"must be at most {MAX_KEY_LENGTH} characters")
    _require_utf8(raw, "key")
    return raw


def _ttl(raw: object) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise invalid("ttl", f"must be a number of minutes or null, got {_json_type(raw)}")
    if not 0 < raw <= MAX_TTL_MINUTES:
        raise invalid("ttl", f"must be > 0 and <= {MAX_TTL_MINUTES:g} minutes, got {raw!r}")
    return float(raw)


def _integer(body: Mapping[str, Any], field: str, *, default: int, low: int, high: int) -> int:
    raw = body.get(field)
    if raw is None:
        return default
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise invalid(field, f"must be an integer, got {_json_type(raw)}")
    if not low <= raw <= high:
        raise invalid(field, f"must be between {low} and {high}, got {raw}")
    return raw


def _optional_bool(body: Mapping[str, Any], field: str) -> bool | None:
    raw = body.get(field)
    if raw is None or isinstance(raw, bool):
        return raw
    raise invalid(field, f"must be true, false or null, got {_json_type(raw)}")


__all__ = [
    "ItemRef",
    "ListNamespaces",
    "Namespace",
    "PutItem",
    "SearchItems",
    "StoreRequestError",
    "check_json_tree",
    "decode_json_body",
    "parse_delete",
    "parse_get",
    "parse_list_namespaces",
    "parse_put",
    "parse_search",
]
