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

import os
from typing import Final

MAX_CLIENT_ID_BYTES: Final = 128

# The counter's last two hex digits, by value.
_LOW: Final = tuple("%02x" % i for i in range(256))  # noqa: UP031


class _Ids:
    """The process's prefix and counter. An id is ``prefix + "%016x" % counter``; the
    first 30 digits are formatted once per 256 ids and the last two looked up (the whole
    format per id was about a tenth of a refused request's instructions)."""

    def __init__(self) -> None:
        self.prefix = ""  # 16 hex digits, drawn once per process
        self.count = 0
        self.high = -1  # counter >> 8 of the ids ``head`` starts
        self.head = ""
        self.draw()

    def draw(self) -> None:
        self.prefix = os.urandom(8).hex()
        # Starts below 2**62, so it stays 16 hex digits for 400,000 years at a million
        # ids/s (and a native int in compiled code).
        self.count = int.from_bytes(os.urandom(8), "big") >> 2
        self.high = -1

    def next(self) -> str:
        count = self.count
        self.count = count + 1
        high = count >> 8
        if high != self.high:
            self.high = high
            self.head = self.prefix + "%014x" % high  # noqa: UP031
        return self.head + _LOW[count & 255]


_IDS: Final = _Ids()
os.register_at_fork(after_in_child=_IDS.draw)


def new_request_id() -> str:
    """32 lowercase hex digits, unique across requests, processes and restarts."""
    return _IDS.next()


def accept_request_id(value: bytes) -> str | None:
    """A client's ``X-Request-Id`` if it is 1 to 128 bytes of printable ASCII (space
    included), else None: anything else could forge or break an access-log line."""
    if 0 < len(value) <= MAX_CLIENT_ID_BYTES and value.isascii():
        text = value.decode("ascii")
        if text.isprintable():
            return text
    return None
