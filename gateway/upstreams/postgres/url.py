"""PostgreSQL URLs: checked, and shown without their password. (No driver import here:
settings validation uses it.)"""

from __future__ import annotations

from urllib.parse import urlsplit

from gateway.urls import display_url

SCHEMES = ("postgresql", "postgres")


def is_postgres_url(url: str) -> bool:
    return urlsplit(url).scheme in SCHEMES


def check_url(url: str) -> str:
    """``url`` when it is a PostgreSQL URL; a ``ValueError`` (without the password) if not."""
    try:
        parts = urlsplit(url)
    except ValueError:  # (its text may quote part of a password)
        raise ValueError(
            f"database_url does not parse: {display_url(url)!r} (a password holding '/', "
            "'?', '#', '[' or ']' must be percent-encoded)"
        ) from None
    if parts.scheme not in SCHEMES:
        raise ValueError(f"database_url must start with postgresql://, not {display_url(url)!r}")
    if not parts.hostname and "host=" not in parts.query:
        raise ValueError(f"database_url names no host: {display_url(url)!r}")
    return url
