"""A rejected request as one readable sentence: ``<field path>: <what is wrong>``.

Clients get ``422 {"detail": "<sentence>"}``, never a list of library internals. Messages
name types and bounds, and echo a number at most: a string the client sent may be a secret.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails
from typing_extensions import TypedDict

# A field path in a detail is cut to this many characters.
MAX_PATH_IN_DETAIL = 200


class InvalidRequest(Exception):
    """A request the API refuses (422 unless told), with a detail naming the field;
    ``retry_after``: whole seconds for a ``Retry-After`` header (a refusal for now)."""

    def __init__(self, detail: str, status: int = 422, *, retry_after: int | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status
        self.retry_after = retry_after

    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after is None else {"Retry-After": str(self.retry_after)}


_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "list_type": "an array",
    "tuple_type": "an array",
    "dict_type": "a JSON object",
    "model_type": "a JSON object",
    "model_attributes_type": "a JSON object",
    "typed_dict_type": "a JSON object",
}


def describe(
    error: ValidationError,
    *,
    patterns: Mapping[str, str] | None = None,
    tags: Collection[str] = (),
    name: str | None = None,
    fields: Collection[str] = (),
) -> str:
    """The first problem of ``error`` as ``path: message``.

    ``patterns`` maps a regular expression of the models to what it means in words.
    ``tags`` are the discriminator values of a tagged union validated at the top: pydantic
    puts the chosen one first in every location, and it is no field. ``name`` is the name of
    what was validated, when it is one parameter rather than a body. ``fields`` are the
    fields of a body, named when an unknown one is refused.
    """
    details = error.errors(include_url=False)
    first = details[0]
    # Of the errors of the first failing field, the one that went deepest says most.
    field = _loc(first, tags)[:1]
    best = max(
        (d for d in details if _loc(d, tags)[:1] == field),
        key=lambda d: len(_loc(d, tags)),
    )
    loc = _loc(best, tags)
    path = [*([name] if name else []), *loc, *best.get("ctx", {}).get("path", [])]
    message = _message(best, patterns or {})
    if best["type"] == "extra_forbidden" and len(loc) == 1 and fields:
        message += f" (accepted: {', '.join(fields)})"
    return f"{render_path(path)}: {message}"


def _loc(detail: ErrorDetails, tags: Collection[str]) -> list[str | int]:
    loc = list(detail["loc"])
    if loc and loc[0] in tags:
        loc = loc[1:]
    if detail["type"] in ("union_tag_invalid", "union_tag_not_found"):
        loc.append(str(detail.get("ctx", {}).get("discriminator", "")).strip("'"))
    return loc


def render_path(path: list[str | int]) -> str:
    """``["a", 0, "b"]`` as ``a[0].b``; the whole body is ``body``."""
    rendered = ""
    for step in path:
        if isinstance(step, int):
            rendered += f"[{step}]"
        else:
            # A key is shown with any lone surrogate escaped, so the detail stays encodable.
            safe = step.encode("utf-8", "backslashreplace").decode("utf-8")
            rendered += f".{safe}" if rendered else safe
        if len(rendered) > MAX_PATH_IN_DETAIL:
            return rendered[:MAX_PATH_IN_DETAIL] + "..."
    return rendered or "body"


def json_type(value: object) -> str:
    """The JSON name of a decoded value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, float) and not math.isfinite(value):
        return "a non-finite number"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    return "object"


def _number(value: object) -> str:
    return repr(value) if isinstance(value, int | float) and not isinstance(value, bool) else ""


def _message(detail: ErrorDetails, patterns: Mapping[str, str]) -> str:
    kind = detail["type"]
    ctx: dict[str, Any] = dict(detail.get("ctx") or {})
    given = detail.get("input")
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {json_type(given)}"
    if kind == "missing" or kind == "union_tag_not_found":
        return "field required"
    if kind == "extra_forbidden":
        return "unknown field"
    if kind in ("literal_error", "enum", "union_tag_invalid"):
        expected = str(ctx.get("expected") or ctx.get("expected_tags", ""))
        one = " or " not in expected and ", " not in expected
        return f"expected {expected}" if one else f"expected one of {expected}"
    if kind == "string_too_short":
        if ctx.get("min_length") == 1:
            return "must not be empty"
        return f"must be at least {ctx.get('min_length')} characters"
    if kind == "string_too_long":
        return f"must be at most {ctx.get('max_length')} characters"
    if kind == "too_short":
        if ctx.get("min_length") == 1:
            return "must not be empty"
        return f"must have at least {ctx.get('min_length')} items"
    if kind == "too_long":
        noun = "fields" if ctx.get("field_type") == "Dictionary" else "items"
        return f"at most {ctx.get('max_length')} {noun} are allowed"
    bound = {
        "greater_than_equal": ("at least", "ge"),
        "greater_than": ("greater than", "gt"),
        "less_than_equal": ("at most", "le"),
        "less_than": ("less than", "lt"),
    }.get(kind)
    if bound is not None:
        words, key = bound
        got = _number(given)
        return f"must be {words} {ctx.get(key)}" + (f", got {got}" if got else "")
    if kind == "finite_number":
        return "must be a finite number"
    if kind == "string_unicode":
        return "not valid UTF-8 text (lone surrogate escape)"
    if kind == "string_pattern_mismatch":
        pattern = str(ctx.get("pattern", ""))
        return patterns.get(pattern, f"must match the pattern {pattern}")
    # Our own validators (PydanticCustomError) and anything else: pydantic's sentence.
    return detail["msg"]


class ErrorResponse(TypedDict):
    """Every error answer: ``detail`` is one sentence, ``<field path>: <what is wrong>`` for
    an invalid request."""

    detail: str
