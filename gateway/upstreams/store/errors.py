"""Errors a Store request can end in; each becomes a JSON ``{"detail": ...}`` response."""

from __future__ import annotations


class StoreRequestError(Exception):
    """A request the Store refuses, with the HTTP status and a detail naming the field."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def invalid(field: str, why: str) -> StoreRequestError:
    """A 422 for one field of the request."""
    return StoreRequestError(422, f"{field}: {why}")
