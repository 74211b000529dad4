"""Read a request into a model: the JSON body or the query string, 422 when it does not fit."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from gateway.upstreams.http_api.problems import InvalidRequest, describe

T = TypeVar("T")


def decode_json(raw: bytes) -> object:
    """The body as JSON. NaN and Infinity are read as numbers so that the model, which
    knows the field, refuses them; malformed or undecodable text is a 422 for ``body``."""
    if not raw.strip():
        raise InvalidRequest("body: a JSON body is required")
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise InvalidRequest("body: must be UTF-8 encoded JSON") from None
    except (ValueError, RecursionError) as exc:
        reason = str(exc).split("\n", 1)[0][:200]
        raise InvalidRequest(f"body: malformed JSON ({reason})") from None


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

    def body(self, model: Callable[..., T] | type[T], raw: bytes) -> T:
        """``raw`` decoded as JSON and validated strictly into ``model``."""
        return self.json(model, decode_json(raw))

    def json(self, model: Callable[..., T] | type[T], data: object) -> T:
        """Decoded JSON validated strictly (no string-to-number or number-to-bool guesses)."""
        return self._validate(model, data, strict=True)

    def query(self, model: Callable[..., T] | type[T], query: Mapping[str, str]) -> T:
        """Query parameters (all text) validated with text-to-number conversion."""
        return self._validate(model, dict(query), strict=False)

    def _validate(self, model: Callable[..., T] | type[T], data: object, *, strict: bool) -> T:
        try:
            value: T = adapter(model).validate_python(data, strict=strict)
        except ValidationError as exc:
            raise InvalidRequest(describe(exc, patterns=self._patterns, tags=self._tags)) from None
        return value
