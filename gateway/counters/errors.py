"""Counter-store errors that subclass a built-in exception other than ``Exception``:
kept out of the compiled modules (mypyc compiles no subclass of ``TimeoutError``)."""

from __future__ import annotations


class StoreTimeoutError(TimeoutError):
    """The store did not answer a round trip within the timeout after it was sent."""
