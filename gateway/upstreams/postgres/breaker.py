"""A circuit breaker in front of the built-in Store's and control plane's PostgreSQL.

Without it, while the database is away every request waits out the connect and pool
timeouts (~5 s) for its 503, and the control plane, which runs its statements one after
another on one thread, makes them wait one after another. With it:

* closed (the database answers): calls go to the database. The first failure that means
  the database is away (``connection.is_outage``: no connection to be had, a connection
  lost, nothing answered in time) opens the breaker and is logged once, without the URL's
  password. A statement that fails on a database that answers (a statement or lock
  timeout) does not.
* open: every call is refused at once with ``DatabaseUnavailable`` (503 and a
  ``Retry-After`` of the seconds until the next probe); nothing waits, nothing connects.
* half open: ``retry_seconds`` after it opened, one probe (one fresh connection and
  ``SELECT 1``, bounded by the connect and statement timeouts) runs in the background, never
  in a request; calls are still refused meanwhile. Its success closes the breaker (logged
  once) and traffic flows again; its failure opens it for another ``retry_seconds``.

So while the database is away it is connected to at most once per ``retry_seconds``, and
the breaker's state (``healthy``, ``state``) tells a readiness check whether the service can
serve: ``database_ready(app)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web

from gateway.upstreams.postgres.connection import DatabaseUnavailable, unavailable
from gateway.urls import display_url

log = logging.getLogger("gateway.postgres")

CLOSED: Final = "closed"
OPEN: Final = "open"
HALF_OPEN: Final = "half_open"

Probe = Callable[[], Awaitable[None]]


class DatabaseBreaker:
    """Opens on the first outage, refuses calls while open, closes on a probe's success.

    State changes happen on the event loop; ``refuse_unless_closed`` may be called from a
    database thread (it only reads).
    """

    def __init__(
        self,
        service: str,
        url: str,
        *,
        probe: Probe | None = None,
        retry_seconds: float = 1.0,
        probe_timeout_seconds: float = 10.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not math.isfinite(retry_seconds) or retry_seconds <= 0:
            raise ValueError(f"retry_seconds must be a number > 0, got {retry_seconds!r}")
        self.service = service
        self._where = display_url(url)
        self._probe = probe
        self._retry = retry_seconds
        self._probe_timeout = probe_timeout_seconds
        self._monotonic = monotonic
        self._state: str = CLOSED
        self._opened_at = 0.0
        self._probing = False
        self._task: asyncio.Task[None] | None = None
        # Counters for tests and metrics: probes run, calls refused, times opened.
        self.probes = 0
        self.refused = 0
        self.openings = 0

    # -- state ----------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``closed`` (serving), ``open`` (refusing) or ``half_open`` (a probe is running)."""
        return self._state

    @property
    def healthy(self) -> bool:
        """Whether the database answered last time it was asked (the breaker is closed)."""
        return self._state == CLOSED

    @property
    def retry_seconds(self) -> float:
        return self._retry

    def seconds_until_probe(self) -> float:
        """How long until the next probe may run (0 when it may run now, or when closed)."""
        if self._state == CLOSED:
            return 0.0
        return max(0.0, self._opened_at + self._retry - self._monotonic())

    def refusal(self) -> DatabaseUnavailable:
        """The error a refused call raises: the service's 503, retry after the next probe."""
        refused = unavailable(self.service)
        refused.retry_after = max(1, math.ceil(self.seconds_until_probe()))
        return refused

    def refuse_unless_closed(self) -> None:
        """Raise ``refusal()`` unless the breaker is closed; call before using the database."""
        if self._state != CLOSED:
            self.refused += 1
            raise self.refusal()

    # -- verdicts -------------------------------------------------------------------------

    def failed(self, exc: BaseException) -> None:
        """A call failed with ``exc``: an outage (``DatabaseUnavailable.outage``) opens the
        breaker. Its 503 then carries the time until the probe in ``Retry-After``."""
        if not (isinstance(exc, DatabaseUnavailable) and exc.outage):
            return
        if self._state == CLOSED:
            self._open(exc)
        exc.retry_after = max(1, math.ceil(self.seconds_until_probe()))

    def _open(self, exc: BaseException) -> None:
        cause = exc.__cause__ or exc
        self._state = OPEN
        self._opened_at = self._monotonic()
        self.openings += 1
        # The driver's message names host and port, never the password; the URL is shown
        # without its credentials or query (``display_url``).
        log.warning(
            "%s database %s unavailable (%s); answering 503 at once, probing every %gs",
            self.service,
            self._where,
            type(cause).__name__,
            self._retry,
        )
        self._start_prober()

    def _close(self) -> None:
        self._state = CLOSED
        log.info("%s database %s answers again; serving", self.service, self._where)

    # -- the probe ------------------------------------------------------------------------

    async def probe_once(self) -> bool:
        """Run the probe if one is due and none is running; True when it closed the
        breaker. (The background prober calls this; tests may call it with a fake clock.)"""
        if self._state == CLOSED or self._probing or self._probe is None:
            return False
        if self.seconds_until_probe() > 0:
            return False
        self._probing = True
        self._state = HALF_OPEN
        self.probes += 1
        try:
            async with asyncio.timeout(self._probe_timeout):
                await self._probe()
        except asyncio.CancelledError:
            self._state = OPEN
            raise
        except Exception as exc:  # any failure: still away, try again later
            log.debug("%s database probe failed: %s", self.service, type(exc).__name__)
            self._state = OPEN
            self._opened_at = self._monotonic()
            return False
        else:
            self._close()
            return True
        finally:
            self._probing = False

    def _start_prober(self) -> None:
        if self._probe is None or (self._task is not None and not self._task.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): probe_once() by hand
            return
        self._task = loop.create_task(self._probe_until_closed(), name=f"{self.service}-db-probe")

    async def _probe_until_closed(self) -> None:
        while self._state != CLOSED:
            await asyncio.sleep(self.seconds_until_probe())
            await self.probe_once()

    async def close(self) -> None:
        """Stop the background prober (at application cleanup)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def probe_connection(url: str, kwargs: dict[str, object]) -> Probe:
    """A probe that opens one fresh connection with ``kwargs`` (the bounded connect and
    statement timeouts), runs ``SELECT 1`` and closes it."""
    import psycopg

    async def probe() -> None:
        conn = await psycopg.AsyncConnection.connect(url, **kwargs)  # type: ignore[arg-type]
        try:
            await conn.execute("SELECT 1")
        finally:
            await conn.close()

    return probe


# The breaker of an application whose database is PostgreSQL (absent on SQLite).
DATABASE_BREAKER_KEY: Final = web.AppKey("database_breaker", DatabaseBreaker)


def database_breaker(app: web.Application) -> DatabaseBreaker | None:
    """The built-in application's database breaker; None when it keeps its data in SQLite."""
    return app.get(DATABASE_BREAKER_KEY)


def database_ready(app: web.Application) -> bool:
    """For a readiness check: False while the application's PostgreSQL is not answering
    (its breaker is open or probing); True on SQLite or while PostgreSQL answers."""
    breaker = database_breaker(app)
    return breaker is None or breaker.healthy
