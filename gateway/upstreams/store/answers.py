"""How many bytes of item values the Store's answers may hold: per answer and in all.

A search may ask for 1000 items of up to ``max_body_bytes`` each (more, even: a number such
as ``1e15`` is stored as ``1000000000000000.0``), so one answer could hold gigabytes, all of
it in memory at once (the rows, then the answer's bytes). ``AnswerBytes`` bounds that
and never by answering fewer items than exist, which a client paging with ``limit`` and
``offset`` would read as the end of the results:

* per answer, ``store.max_answer_bytes``: the values' bytes are summed while the rows are
  read (a SQLite cursor row by row; on PostgreSQL the database sends a page's values only
  when they fit, see ``PageLoad``); once over, the read stops and the search is refused,
  ``422`` (``AnswerTooLargeError``): the same search with a smaller ``limit`` fits. An
  answer of one item is never refused (an item written before ``max_body_bytes`` was
  lowered, or grown by that re-serialisation, must stay readable with ``limit`` 1);
* in all, ``store.max_answer_bytes_in_flight``: the bytes every answer being built holds
  are reserved as they are read and given back when the answer has been sent or has failed
  (``AnswerBudget.close``); a read that would take the total over it is refused, ``503``
  with ``Retry-After`` (``AnswersBusyError``), unless no other answer holds anything (an
  answer alone always proceeds, within its own bound) or the answer is small: one whose
  values total at most ``SMALL_ANSWER_BYTES`` is never refused for the bytes in flight (it
  is still counted while held), so answers that are large and slow to send cannot starve
  the small ones. An answer's bytes are held until it is sent, at most
  ``store.answer_send_timeout_seconds`` (app.py ``_sent``; then its connection is closed).

A value's size is its JSON text as stored, in UTF-8 bytes: what the answer carries. The
answer splices that text in as it is, never parsing it (``rows.py``: parsed values would
take up to about 24 times their text, for adversarial shapes such as ``[[],[],…]``), so
building an answer takes memory in proportion to the bytes counted here: the rows' text,
then the answer's own bytes, each row dropped once encoded (a tracemalloc peak of about 3
times the values' text, measured with the client in the same process). The one item an
answer always may hold is bounded only by how it was stored: a value is re-serialised when
stored and can be about 3.8 times its request body (``1e15`` is stored as
``1000000000000000.0``), or larger than ``max_body_bytes`` if that was lowered since.

Reads run on worker threads (SQLite readers, PostgreSQL's index pool) and on the event loop,
so the counter takes a lock. ``AnswerBudget.close`` gives back everything and makes any
later reservation fail: a reader thread still running after its request was cancelled
cannot leave bytes reserved.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

from gateway.upstreams.store.errors import (
    AnswerClosedError,
    AnswersBusyError,
    AnswerTooLargeError,
    PageChangedError,
)

Row = TypeVar("Row", bound=Sequence[Any])

# On PostgreSQL a page's values come only when they total at most what the read was allowed
# beforehand (PageLoad): at most this much (less when the bytes in flight are few, see
# PostgresStorage), the answer's own bound and the room left. Larger pages are read again
# with exactly their size reserved (one more statement).
FIRST_READ_BYTES = 4 * 1024 * 1024
# Answers whose values total at most this many bytes are never refused for the bytes in
# flight (they still count while held): a GET or a short listing must not wait behind large
# answers whose clients read slowly. 1 MiB is the default max_body_bytes (any one item as
# written), a small share of the default in-flight bound (256 MiB); many of them at once are
# bounded by the connections the gateway serves and by the send timeout.
SMALL_ANSWER_BYTES = 1024 * 1024
# The most times a page is read (its values may grow between two reads: busy writers).
_PAGE_READS = 4


def value_bytes(text: str) -> int:
    """The UTF-8 size of a value's JSON text (``str.isascii`` costs nothing in CPython)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class AnswerBytes:
    """The bytes of values all answers being built hold, and the bound of each answer."""

    def __init__(self, per_answer: int, in_flight: int, small: int = SMALL_ANSWER_BYTES) -> None:
        if not 1 <= per_answer <= in_flight:
            raise ValueError("AnswerBytes: needs 1 <= per_answer <= in_flight")
        self.per_answer = per_answer
        self.in_flight = in_flight
        # Answers of at most this many bytes skip the in-flight check (SMALL_ANSWER_BYTES).
        self.small = small
        self._lock = threading.Lock()
        self._held = 0
        self._open = 0

    @property
    def held(self) -> int:
        """Bytes reserved by answers being built or sent (0 when none is)."""
        return self._held

    @property
    def open_answers(self) -> int:
        """Answers whose budget is not closed yet."""
        return self._open

    def budget(self, *, get: bool = False) -> AnswerBudget:
        """A budget for one answer (``get``: of a GET, else of a search: the 503's detail
        says what to do); close it (or use ``with``) once the answer is sent."""
        with self._lock:
            self._open += 1
        return AnswerBudget(self, get=get)


class AnswerBudget:
    """What one answer holds of ``AnswerBytes``: reserved as its rows are read, all given
    back by ``close`` (the answer was sent, or failed, or its request was cancelled)."""

    def __init__(self, pool: AnswerBytes, *, get: bool = False) -> None:
        self._pool = pool
        self._get = get
        self._bytes = 0
        self._items = 0
        self._closed = False

    @property
    def bytes(self) -> int:
        return self._bytes

    def take(self, size: int) -> None:
        """Reserve one more value of ``size`` bytes, or raise (and reserve nothing):
        ``AnswerTooLargeError`` over the answer's bound, ``AnswersBusyError`` over the
        in-flight one."""
        pool = self._pool
        with pool._lock:
            self._check(size, 1)
            self._bytes += size
            self._items += 1
            pool._held += size

    def reserve(self, size: int, items: int) -> None:
        """Reserve ``size`` bytes for ``items`` values to come (counted by ``settle``), or
        raise as ``take``."""
        pool = self._pool
        with pool._lock:
            self._check(size, items)
            self._bytes += size
            pool._held += size

    def grant(self, want: int) -> int:
        """Reserve up to ``want`` bytes, as many as the answer's bound and the room left
        allow (maybe 0); never raises but on a closed budget. Returns the bytes reserved."""
        pool = self._pool
        with pool._lock:
            if self._closed:
                raise AnswerClosedError()
            room = min(
                want,
                max(0, pool.per_answer - self._bytes),
                # A small answer may take its bytes even when the bytes in flight are full.
                max(0, pool.in_flight - pool._held, pool.small - self._bytes),
            )
            self._bytes += room
            pool._held += room
            return room

    def settle(self, reserved: int, used: int, items: int) -> None:
        """Of ``reserved`` bytes (from ``grant`` or ``reserve``), keep ``used`` for ``items``
        values read and give back the rest."""
        pool = self._pool
        with pool._lock:
            if self._closed:
                return  # close gave everything back already
            back = reserved - used
            self._bytes -= back
            pool._held -= back
            self._items += items

    def _check(self, size: int, items: int) -> None:
        pool = self._pool
        if self._closed:
            raise AnswerClosedError()
        alone = self._items == 0 and items == 1  # an answer's one item always fits
        if self._bytes + size > pool.per_answer and not alone:
            raise AnswerTooLargeError(pool.per_answer)
        if self._bytes + size <= pool.small:
            return  # a small answer: counted, never refused for the bytes in flight
        others = pool._held - self._bytes
        if others > 0 and pool._held + size > pool.in_flight:
            raise AnswersBusyError(pool.in_flight, small=pool.small, get=self._get)

    def close(self) -> None:
        """Give back every byte; any later reservation raises ``AnswerClosedError``."""
        pool = self._pool
        with pool._lock:
            if self._closed:
                return
            self._closed = True
            pool._held -= self._bytes
            pool._open -= 1
            self._bytes = 0

    def __enter__(self) -> AnswerBudget:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class PageLoad:
    """Reading one page of rows on PostgreSQL, where the database sends a page's values only
    when their total is at most a cutoff (the statement's first parameter; every row carries
    the total): libpq receives a whole result before any row can be counted, so the bytes
    are reserved before the statement runs, not as its rows arrive.

    ``start`` reserves up to ``first_read`` bytes and gives the first cutoff. ``check`` with
    the total the rows report either keeps what they hold (``None``: done) or, when they
    did not fit, reserves their exact total (or raises ``AnswerTooLargeError`` /
    ``AnswersBusyError``) and gives the cutoff to read them again with. ``close`` gives back
    what an unfinished read holds (call it in ``finally``).
    """

    def __init__(self, budget: AnswerBudget, first_read: int) -> None:
        self._budget = budget
        self._first_read = first_read
        self._reserved = 0
        self._reads = 0

    def start(self) -> int:
        self._reserved = self._budget.grant(self._first_read)
        return self._reserved

    def check(self, total: int, items: int) -> int | None:
        budget = self._budget
        if total <= self._reserved:
            reserved, self._reserved = self._reserved, 0
            budget.settle(reserved, total, items)
            return None
        reserved, self._reserved = self._reserved, 0
        budget.settle(reserved, 0, 0)
        self._reads += 1
        if self._reads >= _PAGE_READS:
            raise PageChangedError()
        budget.reserve(total, items)
        self._reserved = total
        return total

    def close(self) -> None:
        reserved, self._reserved = self._reserved, 0
        if reserved:
            self._budget.settle(reserved, 0, 0)


def answer_budget(
    answers: AnswerBytes, budget: AnswerBudget | None
) -> contextlib.AbstractContextManager[AnswerBudget]:
    """``budget`` as is (its owner closes it once the answer is sent), or, for a caller that
    brought none, a new one closed when the read ends."""
    if budget is not None:
        return contextlib.nullcontext(budget)
    return answers.budget()


def _page_total(rows: Sequence[Row]) -> int:
    return int(rows[0][-1]) if rows else 0


def read_page(
    budget: AnswerBudget, fetch: Callable[[int], list[Row]], first_read: int
) -> list[Row]:
    """``fetch(cutoff)`` (rows ending with their page's values total; values sent only up
    to ``cutoff``) until the rows hold their values, within ``budget``; the first read is
    allowed up to ``first_read`` bytes (``PageLoad``)."""
    load = PageLoad(budget, first_read)
    try:
        cutoff = load.start()
        while True:
            rows = fetch(cutoff)
            again = load.check(_page_total(rows), len(rows))
            if again is None:
                return rows
            cutoff = again
    finally:
        load.close()


async def aread_page(
    budget: AnswerBudget, fetch: Callable[[int], Awaitable[list[Row]]], first_read: int
) -> list[Row]:
    """``read_page`` with an asynchronous ``fetch``."""
    load = PageLoad(budget, first_read)
    try:
        cutoff = load.start()
        while True:
            rows = await fetch(cutoff)
            again = load.check(_page_total(rows), len(rows))
            if again is None:
                return rows
            cutoff = again
    finally:
        load.close()
