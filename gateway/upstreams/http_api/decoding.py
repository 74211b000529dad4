"""Read a request into a model: the JSON body or the query string, 422 when it does not fit."""

from __future__ import annotations

import json
import sys
from collections.abc import Collection, Mapping
from typing import Any, TypeVar, overload

from pydantic import BaseModel, TypeAdapter, ValidationError

from gateway.upstreams.http_api.problems import InvalidRequest, describe

T = TypeVar("T")

NOT_UTF8 = "body: must be UTF-8 encoded JSON (RFC 8259)"


def decode_json(raw: bytes) -> object:
    """The body as JSON. NaN and Infinity are read as numbers so that the model, which
    knows the field, refuses them; malformed or undecodable text is a 422 for ``body``.

    The bytes must be UTF-8 (RFC 8259 8.1; a leading byte order mark is ignored, as it
    allows). ``json.loads`` given bytes would guess UTF-16 or UTF-32 from their NULs and
    decode with ``surrogatepass`` (taking encoded lone surrogates): not here."""
    if not raw.strip():
        raise InvalidRequest("body: a JSON body is required")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InvalidRequest(NOT_UTF8) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:  # the decoder's own words: what, and where
        if b"\x00" in raw[:4]:
            # A JSON text starts with ASCII: a NUL among its first four bytes is the
            # UTF-16 or UTF-32 form of it (RFC 4627 3), which UTF-8 decoding let through.
            raise InvalidRequest(NOT_UTF8) from None
        raise InvalidRequest(
            f"body: malformed JSON ({exc.msg}: line {exc.lineno} column {exc.colno})"
        ) from None
    except RecursionError:
        raise InvalidRequest("body: JSON nested too deeply") from None
    except ValueError:
        # Not the interpreter's words (they named sys.set_int_max_str_digits, a setting
        # of this server's, to an API client): the only other ValueError json.loads
        # raises is an integer of more digits than Python converts.
        raise InvalidRequest(
            f"body: a number has more than {sys.get_int_max_str_digits()} digits"
        ) from None


_ADAPTERS: dict[Any, TypeAdapter[Any]] = {}


def adapter(model: Any) -> TypeAdapter[Any]:
    """One TypeAdapter per model type (building one compiles a validator)."""
    found = _ADAPTERS.get(model)
    if found is None:
        found = _ADAPTERS[model] = TypeAdapter(model)
    return found


class ModelReader:
    """Validates decoded JSON or query strings into models, with an API's error wording."""

    def __init__(
        self, patterns: Mapping[str, str] | None = None, tags: Collection[str] = ()
    ) -> None:
        self._patterns = dict(patterns or {})
        self._tags = tuple(tags)

    @overload
    def body(self, model: type[T], raw: bytes) -> T: ...
    @overload
    def body(self, model: object, raw: bytes) -> Any: ...
    def body(self, model: Any, raw: bytes) -> Any:
        """``raw`` decoded as JSON and validated strictly into ``model`` (a class, or a type
        such as a tagged union)."""
        return self.json(model, decode_json(raw))

    @overload
    def json(self, model: type[T], data: object) -> T: ...
    @overload
    def json(self, model: object, data: object) -> Any: ...
    def json(self, model: Any, data: object) -> Any:
        """Decoded JSON validated strictly (no string-to-number or number-to-bool guesses)."""
        return self._validate(model, data, strict=True)

    def query(self, model: type[T], query: Mapping[str, str]) -> T:
        """Query parameters (all text) validated with text-to-number conversion."""
        value: T = self._validate(model, dict(query), strict=False)
        return value

    def parameter(self, model: Any, name: str, value: str) -> Any:
        """One path parameter, validated into ``model``; errors name the parameter."""
        return self._validate(model, value, strict=True, name=name)

    def _validate(self, model: Any, data: object, *, strict: bool, name: str | None = None) -> Any:
        try:
            value = adapter(model).validate_python(data, strict=strict)
        except ValidationError as exc:
            fields = (
                model.model_fields
                if isinstance(model, type) and issubclass(model, BaseModel)
                else ()
            )
            detail = describe(
                exc, patterns=self._patterns, tags=self._tags, name=name, fields=list(fields)
            )
            raise InvalidRequest(detail) from None
        return value
