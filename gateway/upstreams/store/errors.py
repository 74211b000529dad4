"""Errors a Store request can end in besides an invalid request (``InvalidRequest``, 422):
a body over the size limit (413) and a busy database (503). Each becomes a JSON
``{"detail": ...}`` response."""

from __future__ import annotations


class StoreRequestError(Exception):
    """A request the Store refuses, with the HTTP status and a detail naming the field."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class StoreBusyError(StoreRequestError):
    """The database stayed locked by other writers for longer than the busy timeout."""

    def __init__(self) -> None:
        super().__init__(503, "the store is busy (database locked); retry the request")
