"""PostgreSQL URLs: checked, and shown without their password. (No driver import here:
settings validation uses it.)"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

SCHEMES = ("postgresql", "postgres")


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
