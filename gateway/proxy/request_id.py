"""Request ids: the one a client sent when it is sane, else a new one of ours.

A new id is 32 lowercase hex digits: 64 random bits drawn once per process, then a 64-bit
counter. Not ``uuid.uuid4()``: that reads 16 bytes from the OS and builds a UUID object on
every request, about ten times the cost of a counter step and one format.

Unique inside a process because the counter never repeats. Unique across processes
(workers, hosts, restarts) because each draws its own prefix from ``os.urandom``, and a
forked child draws a new one, so it cannot repeat its parent's ids: two of a million
process starts share a prefix with odds of about 3 in 100 million.

What an id reveals: nothing about the request or the host. The counter starts at a random
point, so it does not tell how many requests a process has served; two ids a client
sees from the same process do tell how many requests that process served in between.
"""

from __future__ import annotations

import itertools
import os
from typing import Final

MAX_CLIENT_ID_BYTES: Final = 128

_prefix = ""  # 16 hex digits, formatted once per process
_counter = itertools.count()


def _draw_prefix() -> None:
    global _prefix, _counter
    _prefix = os.urandom(8).hex()
    # Starts below 2**62, so it stays 16 hex digits for 400,000 years at a million ids/s.
    _counter = itertools.count(int.from_bytes(os.urandom(8), "big") >> 2)


_draw_prefix()
os.register_at_fork(after_in_child=_draw_prefix)


def new_request_id() -> str:
    """32 lowercase hex digits, unique across requests, processes and restarts."""
    return _prefix + "%016x" % next(_counter)  # noqa: UP031 (the fastest spelling)


def accept_request_id(value: bytes) -> str | None:
    """A client's ``X-Request-Id`` if it is 1 to 128 bytes of printable ASCII (space
    included), else None: anything else could forge or break an access-log line."""
    if 0 < len(value) <= MAX_CLIENT_ID_BYTES and value.isascii():
        text = value.decode("ascii")
        if text.isprintable():
            return text
    return None
