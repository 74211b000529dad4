"""Errors a Store request can end in besides an invalid request (``InvalidRequest``, 422):
a body over the size limit (413), an answer over its size bound (422), a busy database, a
read over its time budget and answers holding their in-flight bound (503). Each becomes a
JSON ``{"detail": ...}`` response, with ``Retry-After`` when the error names one."""

from __future__ import annotations

# How long a client told the answers in flight are full should wait (seconds): answers give
# their bytes back as soon as they are sent.
BUSY_RETRY_AFTER_SECONDS = 1


class StoreRequestError(Exception):
    """A request the Store refuses, with the HTTP status and a detail naming the field."""

    # Seconds for a Retry-After header (None: no header).
    retry_after: int | None = None

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


class AnswerTooLargeError(StoreRequestError):
    """The values of the items asked for exceed ``store.max_answer_bytes``: 422, since the
    same request is refused every time; a smaller ``limit`` fits."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            422,
            f"limit: the answer would exceed store.max_answer_bytes ({limit} bytes of item "
            "values); ask for fewer items with a smaller limit and page through the rest "
            "with offset",
        )


class AnswersBusyError(StoreRequestError):
    """The answers being built hold ``store.max_answer_bytes_in_flight``: 503, retry. The
    detail fits the request: a GET can only retry, a search may also ask for fewer items."""

    retry_after = BUSY_RETRY_AFTER_SECONDS

    def __init__(self, limit: int, *, small: int, get: bool = False) -> None:
        busy = (
            "the store is busy: the answers it is sending hold store.max_answer_bytes_in_flight "
            f"({limit} bytes of values) until their clients have read them (at most "
            "store.answer_send_timeout_seconds each); "
        )
        if get:
            todo = "retry shortly"
        else:
            todo = (
                "retry shortly, or ask for fewer items with a smaller limit (an answer of at "
                f"most {small} bytes of values is always served)"
            )
        super().__init__(503, busy + todo)


class AnswerClosedError(StoreRequestError):
    """A read went on after its answer was given up (the request was cancelled)."""

    def __init__(self) -> None:
        super().__init__(503, "the answer was given up while it was being read")


class PageChangedError(StoreRequestError):
    """A PostgreSQL page's values kept growing between its reads (busy writers)."""

    retry_after = BUSY_RETRY_AFTER_SECONDS

    def __init__(self) -> None:
        super().__init__(503, "the items changed while they were being read; retry")
