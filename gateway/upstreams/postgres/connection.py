"""The database URL, connection options that bound every wait, and the 503 error.

Every wait on PostgreSQL is bounded, so a request never hangs on a database that is gone:
connecting (``connect_timeout``), waiting for a pooled connection (the pool's ``timeout``),
one statement (``statement_timeout``) and silence on an established connection
(``tcp_user_timeout`` and keepalives). A request that hits any of them is answered
``503 {"detail": ...}``; the pool reconnects by itself once the database is back.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import psycopg
import psycopg_pool

SCHEMES = ("postgresql", "postgres")
# Seconds: how long a request may wait for the database in total before it is answered 503.
DEFAULT_TIMEOUT_SECONDS = 5.0


class DatabaseUnavailable(Exception):
    """PostgreSQL did not answer in time or the connection broke (answered with 503)."""

    status = 503

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


# What a lost, refused or timed-out database looks like to psycopg and its pool.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    psycopg.OperationalError,
    psycopg.errors.QueryCanceled,
    psycopg.errors.AdminShutdown,
    psycopg.errors.CannotConnectNow,
    psycopg_pool.PoolTimeout,
    psycopg_pool.TooManyRequests,
)


def unavailable(service: str) -> DatabaseUnavailable:
    return DatabaseUnavailable(f"the {service} database is unavailable; retry the request")


def is_postgres_url(url: str) -> bool:
    return urlsplit(url).scheme in SCHEMES


def check_url(url: str) -> str:
    """``url`` when it is a PostgreSQL URL; a ``ValueError`` (without the password) if not."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"database_url must start with postgresql://, not {redact(url)!r}")
    if not parts.hostname and "host=" not in parts.query:
        raise ValueError(f"database_url names no host: {redact(url)!r}")
    return url


def redact(url: str) -> str:
    """The URL with its password (if any) replaced by ``***``: safe to log."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    query = "&".join(
        "password=***" if piece.startswith("password=") else piece
        for piece in parts.query.split("&")
        if piece
    )
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, query, parts.fragment))


def connection_kwargs(timeout_seconds: float, application_name: str) -> dict[str, object]:
    """Options for every connection: bounded connect, statement and network waits."""
    millis = int(timeout_seconds * 1000)
    return {
        "connect_timeout": max(1, int(timeout_seconds)),
        "application_name": application_name,
        "options": f"-c statement_timeout={millis} -c lock_timeout={millis}",
        "tcp_user_timeout": millis,
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 2,
        "autocommit": True,
    }
