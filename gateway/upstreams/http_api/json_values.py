"""JSON value types for request models: the bounds that JSON Schema cannot state.

JSON parses into things no answer can carry and no storage can keep: a lone surrogate
escape (``"\\ud800"`` has no UTF-8 form), a number beyond a double (``1e400`` parses as
infinity, a 400-digit integer reads as infinity in double-based clients), and documents
nested deep enough to exhaust a recursive walk. The types here refuse them with the path
of the offending node, so the error names the field.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
)
from pydantic_core import PydanticCustomError, core_schema

# Arrays and objects inside one field may nest at most this deep (the field's own value is
# level 1); deeper documents are refused before anything walks them recursively.
MAX_JSON_DEPTH = 64
# Values (arrays, objects, texts, numbers, booleans, nulls) one field may hold in all: what
# walking, indexing and writing a value costs is bounded by this, not only by the body's
# size (a 1 MiB body holds up to ~350,000 empty arrays).
MAX_JSON_NODES = 100_000
_TOO_DEEP = f"arrays and objects may nest at most {MAX_JSON_DEPTH} levels deep"
_LARGEST_NUMBER = sys.float_info.max

PathStep = str | int
LONE_SURROGATE = "not valid UTF-8 text (lone surrogate escape)"


def invalid_at(path: list[PathStep], message: str) -> PydanticCustomError:
    """An error for the node at ``path`` below the field being validated."""
    return PydanticCustomError("json_value", message, {"path": path})


def require_utf8(text: str) -> str:
    """``text`` unless it holds a lone surrogate, which has no UTF-8 form."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid_at([], LONE_SURROGATE) from None
    return text


def check_json_tree(value: Any) -> Any:
    """``value`` when every node is storable JSON: text without lone surrogates (keys too),
    finite numbers within a double's range, nesting at most ``MAX_JSON_DEPTH`` levels, at
    most ``MAX_JSON_NODES`` values in all.

    Iterative, so a deep document cannot exhaust the interpreter's stack here; one pass
    that builds no path per node (a node's path is made only for the error), so what it
    costs is a fraction of a microsecond a value, bounded by MAX_JSON_NODES: 300,000
    empty arrays in a 900 KB Store item held the event loop ~1 s when every node carried
    its own path list (review, seventeenth session).
    """
    # Each array or object met: (its parent's place, its step from the parent); a node's
    # path is the chain of places up to the root (place 0, the field itself).
    places: list[tuple[int, PathStep]] = [(-1, "")]
    stack: list[tuple[Any, int, int]] = []  # (array or object, depth, its place)
    nodes = 1
    if isinstance(value, dict | list):
        stack.append((value, 1, 0))
    else:
        _leaf(value, places, 0, None)
    while stack:
        node, depth, place = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise invalid_at(_path(places, place, None), _TOO_DEEP)
        nodes += len(node)
        if nodes > MAX_JSON_NODES:
            raise invalid_at(
                _path(places, place, None),
                f"a value may hold at most {MAX_JSON_NODES} arrays, objects, texts, "
                "numbers, booleans and nulls in all; store it as several items",
            )
        # Two loops alike, for objects and arrays, rather than one over (step, child) pairs
        # made for both: this is the walk's hot loop, run once a value.
        if isinstance(node, dict):
            for key, child in node.items():
                if not key.isascii():
                    _text(key, places, place, key)
                kind = type(child)
                if kind is dict or kind is list:
                    if child:
                        places.append((place, key))
                        stack.append((child, depth + 1, len(places) - 1))
                    elif depth >= MAX_JSON_DEPTH:  # (an empty one is not walked)
                        raise invalid_at(_path(places, place, key), _TOO_DEEP)
                elif kind is not bool and child is not None:
                    _leaf(child, places, place, key)
        else:
            for index, child in enumerate(node):
                kind = type(child)
                if kind is dict or kind is list:
                    if child:
                        places.append((place, index))
                        stack.append((child, depth + 1, len(places) - 1))
                    elif depth >= MAX_JSON_DEPTH:  # (an empty one is not walked)
                        raise invalid_at(_path(places, place, index), _TOO_DEEP)
                elif kind is not bool and child is not None:
                    _leaf(child, places, place, index)
    return value


def _leaf(node: Any, places: list[tuple[int, PathStep]], place: int, step: PathStep | None) -> None:
    """A node that is not an array or object: text must have a UTF-8 form, a number be
    finite within a double's range (anything else JSON cannot hold is not looked at)."""
    if isinstance(node, str):
        if not node.isascii():
            _text(node, places, place, step)
    elif isinstance(node, float) or (isinstance(node, int) and not isinstance(node, bool)):
        if not -_LARGEST_NUMBER <= node <= _LARGEST_NUMBER:  # also False for NaN
            raise invalid_at(
                _path(places, place, step), "must be a finite number (at most about 1.8e308)"
            )
    elif isinstance(node, dict | list):  # (a subclass: walked as the tree's own would be)
        check_json_tree(node)


def _path(places: list[tuple[int, PathStep]], place: int, step: PathStep | None) -> list[PathStep]:
    """The path from the field to the node ``step`` below ``places[place]``."""
    path: list[PathStep] = [] if step is None else [step]
    while place > 0:
        place, at = places[place]
        path.append(at)
    path.reverse()
    return path


NUL_IN_TEXT = "must not hold a NUL character (\\u0000): no database text column can store it"


def require_storable_text(text: str) -> str:
    """``text`` when it has a UTF-8 form and holds no NUL, which PostgreSQL's text columns
    refuse (an API answering the same on every backend refuses it on SQLite too)."""
    if "\x00" in text:
        raise invalid_at([], NUL_IN_TEXT)
    return require_utf8(text)


def _text(text: str, places: list[tuple[int, PathStep]], place: int, step: PathStep | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid_at(_path(places, place, step), LONE_SURROGATE) from None


def _integral(value: Any) -> Any:
    # JSON has one number type: 2.0 is the integer 2 (as JSON Schema says), 2.5 is not.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Put these after the constraints in an Annotated (``Annotated[str, Field(...), UTF8]``):
# pydantic then keeps the constraints in the JSON Schema (minimum, maxLength, pattern, ...).
UTF8 = AfterValidator(require_utf8)
"""The string has a UTF-8 form."""
NO_NUL_PATTERN = "^[^\\x00]*$"


class _StorableText:
    """The check ``require_storable_text``, and in the JSON Schema the part of it a schema
    can say (no NUL: a ``pattern``, or beside the field's own pattern under ``allOf``), so
    clients generated from the document do not send what is refused."""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> Any:
        return core_schema.no_info_after_validator_function(require_storable_text, handler(source))

    def __get_pydantic_json_schema__(self, schema: Any, handler: GetJsonSchemaHandler) -> Any:
        found = handler(schema)
        target = handler.resolve_ref_schema(found)
        if "pattern" in target:
            target.setdefault("allOf", []).append({"pattern": NO_NUL_PATTERN})
        else:
            target["pattern"] = NO_NUL_PATTERN
        return found


STORABLE_TEXT = _StorableText()
"""The string has a UTF-8 form and holds no NUL (any database's text column keeps it)."""
INTEGRAL = BeforeValidator(_integral)
"""A number with a zero fraction (``2.0``) counts as the integer."""

Text = Annotated[str, UTF8]
"""A string that has a UTF-8 form."""


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


def omissible() -> Any:
    """The default of a field that may be left out but is never null when given: its value
    is then None ("not given", so read such a model with ``exclude_unset``), and the JSON
    Schema shows no default."""
    return Field(default=None, json_schema_extra=_no_default)


JsonObject = Annotated[dict[str, Any], AfterValidator(check_json_tree)]
"""A free-form JSON object whose every node is storable JSON."""
