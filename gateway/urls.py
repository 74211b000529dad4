"""URLs as messages, logs and ``/info`` show them: never with their credentials. A leaf
module (it imports nothing of the package), so that every part may use it: the
control-plane client, which imports nothing else of the gateway, included."""

from __future__ import annotations

from urllib.parse import urlsplit


def display_url(url: str) -> str:
    """``url`` as logs and ``/info`` show it: without a user, a password, a query or a
    fragment, any of which may hold a secret (an IdP's basic auth, a token parameter).
    A '@' after the host (Firebase's and Google's service-account JWKS paths hold one)
    may also be the end of a password holding an unencoded '/', which a URL parser
    takes for the end of the host: then the path is not shown, nor a host that has a
    ':' (it may be ``user:password``)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises for a port that is not a number)
    except ValueError:
        return "(a URL that does not parse)"
    netloc, path = parts.netloc, parts.path
    if "@" in netloc:
        shown = "***@" + netloc.rpartition("@")[2]
    elif "@" in path or "@" in parts.query or "@" in parts.fragment:
        shown = "***" if ":" in netloc else netloc
        path = "/..." if path else ""
    else:
        shown = netloc
    tail = "?***" if parts.query else ""
    tail += "#***" if parts.fragment else ""
    return f"{parts.scheme}://{shown}{path}{tail}"
