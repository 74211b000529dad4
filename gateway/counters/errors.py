"""Counter-store errors that subclass a built-in exception other than ``Exception``:
kept out of the compiled modules (mypyc compiles no subclass of ``TimeoutError``); and
how their messages write seconds."""

from __future__ import annotations


class StoreTimeoutError(TimeoutError):
    """The store did not answer a round trip within the timeout after it was sent."""


class QueuedBehindTimeoutError(StoreTimeoutError):
    """A check never sent: the round trip ahead of it ran out of time, and it fails with
    it rather than wait on the same store once more. Answered like a timeout (fallback,
    or fail closed), but not counted by the breaker: that round trip's own checks are,
    so one slow reply does not weigh as much as the checks that queued behind it."""


class GivenUpError(ConnectionError):
    """The lean connection was dropped on purpose (a caller gave up, or the client
    closed): the round trips in flight on it are not worth sending again. A built-in
    ``ConnectionError`` (an ``OSError``: the breaker counts it as a connection failure),
    not redis-py's: the build that compiles ``resp.py`` does not know redis's classes,
    and a class cannot take a base it does not know."""


def seconds_text(value: float | None) -> str:
    """Seconds as messages write them (``0.05``, ``2``). A call rather than an f-string
    format spec: in a compiled module a spec turns the whole f-string into ``str.format``
    calls (tests/unit/test_native.py)."""
    return "-" if value is None else format(value, "g")
