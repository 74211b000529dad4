"""The database URL, connection options that bound every wait, and the 503 error.

Every wait on PostgreSQL is bounded, so a request never hangs on a database that is gone:
connecting (``connect_timeout``), waiting for a pooled connection (the pool's ``timeout``),
one statement (``statement_timeout``) and silence on an established connection
(``tcp_user_timeout`` and keepalives); and the server ends a transaction left open with
nothing sent (``idle_in_transaction_session_timeout``), so a frozen gateway cannot hold
locks that the others wait for. A request that hits any of them is answered
``503 {"detail": ...}`` with ``Retry-After``. A failure that means the database is away
(``is_outage``) opens the service's circuit breaker (``breaker.py``): until a probe finds the
database answering again, every later request is answered 503 at once, without waiting.
"""

from __future__ import annotations

import psycopg
import psycopg_pool

from gateway.upstreams.postgres.url import check_url, is_postgres_url

__all__ = ["check_url", "is_postgres_url"]

# Seconds: how long a request may wait for the database in total before it is answered 503.
DEFAULT_TIMEOUT_SECONDS = 5.0


class DatabaseUnavailable(Exception):
    """PostgreSQL did not answer in time or the connection broke (answered with 503).

    ``outage``: the failure means the database is away (it opens the breaker), not that one
    statement was slow or lost a lock wait. ``retry_after``: whole seconds for the answer's
    ``Retry-After``.
    """

    status = 503

    def __init__(self, detail: str, *, outage: bool = False, retry_after: int = 1) -> None:
        super().__init__(detail)
        self.detail = detail
        self.outage = outage
        self.retry_after = max(1, retry_after)


# What a lost, refused or timed-out database looks like to psycopg and its pool.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    psycopg.OperationalError,
    psycopg.errors.QueryCanceled,
    psycopg.errors.AdminShutdown,
    psycopg.errors.CannotConnectNow,
    psycopg_pool.PoolTimeout,
    psycopg_pool.TooManyRequests,
)


# SQLSTATE classes and codes with which a server that answers says it cannot serve at all:
# 08 connection exception, 57P01-57P05 shut down / crashed / starting / idle session
# timeout, 53300 too many connections.
_OUTAGE_SQLSTATES = ("08", "57P", "53300")


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` means the database is away (no connection to be had, a connection
    lost, nothing answered in time), as opposed to one statement failing on a database that
    answers (``statement_timeout``, ``lock_timeout``, a serialization failure)."""
    if isinstance(exc, psycopg_pool.TooManyRequests):
        return False  # this process's own queue for connections is full: local overload
    if isinstance(exc, psycopg_pool.PoolTimeout | TimeoutError):
        return True
    if isinstance(exc, psycopg.OperationalError):
        sqlstate = exc.sqlstate
        # No SQLSTATE: the client gave up (refused, unreachable, broken connection).
        return sqlstate is None or sqlstate.startswith(_OUTAGE_SQLSTATES)
    return False


def unavailable(service: str, cause: BaseException | None = None) -> DatabaseUnavailable:
    """The 503 of ``service``; ``cause`` (the driver's error) tells whether it is an outage."""
    return DatabaseUnavailable(
        f"the {service} database is unavailable; retry the request",
        outage=cause is not None and is_outage(cause),
    )


def connection_kwargs(timeout_seconds: float, application_name: str) -> dict[str, object]:
    """Options for every connection: bounded connect, statement and network waits, and a
    bound on how long a transaction may sit open with nothing sent (see below)."""
    millis = int(timeout_seconds * 1000)
    # A gateway that freezes (SIGSTOP, a hung host, a network partition that keeps the TCP
    # connection up) mid-transaction would otherwise hold its locks, among them the control
    # plane's write lock, until the server's TCP keepalive gives up (hours by default):
    # every other instance's writes and revision steps would wait on it. Our transactions
    # send their statements back to back, so one idle for twice a request's whole budget
    # belongs to a request already answered 503 or to an instance that is gone: the server
    # ends it (and the session), the locks go, and the others carry on.
    idle_millis = 2 * millis
    return {
        "connect_timeout": max(1, int(timeout_seconds)),
        "application_name": application_name,
        "options": (
            f"-c statement_timeout={millis} -c lock_timeout={millis} "
            f"-c idle_in_transaction_session_timeout={idle_millis}"
        ),
        "tcp_user_timeout": millis,
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 2,
        "autocommit": True,
    }
