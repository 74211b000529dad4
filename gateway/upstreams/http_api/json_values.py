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

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic_core import PydanticCustomError

# Arrays and objects inside one field may nest at most this deep (the field's own value is
# level 1); deeper documents are refused before anything walks them recursively.
MAX_JSON_DEPTH = 64
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
    finite numbers within a double's range, nesting at most ``MAX_JSON_DEPTH`` levels.

    Iterative, so a deep document cannot exhaust the interpreter's stack here.
    """
    stack: list[tuple[Any, int, list[PathStep]]] = [(value, 1, [])]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            _text(node, path)
        elif isinstance(node, float) or (isinstance(node, int) and not isinstance(node, bool)):
            if not -_LARGEST_NUMBER <= node <= _LARGEST_NUMBER:  # also False for NaN
                raise invalid_at(path, "must be a finite number (at most about 1.8e308)")
        elif isinstance(node, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise invalid_at(
                    path, f"arrays and objects may nest at most {MAX_JSON_DEPTH} levels deep"
                )
            if isinstance(node, dict):
                for key, child in node.items():
                    _text(key, [*path, key])
                    stack.append((child, depth + 1, [*path, key]))
            else:
                stack.extend((child, depth + 1, [*path, i]) for i, child in enumerate(node))
    return value


def _text(text: str, path: list[PathStep]) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid_at(path, LONE_SURROGATE) from None


def _integral(value: Any) -> Any:
    # JSON has one number type: 2.0 is the integer 2 (as JSON Schema says), 2.5 is not.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Put these after the constraints in an Annotated (``Annotated[str, Field(...), UTF8]``):
# pydantic then keeps the constraints in the JSON Schema (minimum, maxLength, pattern, ...).
UTF8 = AfterValidator(require_utf8)
"""The string has a UTF-8 form."""
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
