"""Errors a Store request can end in besides an invalid request (``InvalidRequest``, 422):
a body over the size limit (413), a busy database and a read over its time budget (503).
Each becomes a JSON ``{"detail": ...}`` response."""

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


class StoreQueryTimeoutError(StoreRequestError):
    """A read ran past ``query_timeout_seconds`` on its SQLite reader and was aborted.

    503, not 422: the request is valid and the same one may finish on a less loaded store
    (the budget is a capacity limit, like PostgreSQL's statement_timeout, which that
    backend also answers 503); the detail says what makes a search cheaper.
    """

    def __init__(self, seconds: float) -> None:
        super().__init__(
            503,
            f"the search ran longer than the store's {seconds:g} s budget per query and was "
            "stopped; narrow namespace_prefix or the filter, or lower limit and offset",
        )
