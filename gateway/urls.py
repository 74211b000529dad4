"""URLs as messages, logs and ``/info`` show them: never with their credentials. A leaf
module (it imports nothing of the package), so that every part may use it: the
control-plane client, which imports nothing else of the gateway, included."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

# Query keys whose values say where a service is and never hold a secret (libpq's host,
# port, database and TLS mode; a Redis URL's db): shown, so an outage message still says
# which socket or host is down. Every other value is shown as ``***``.
SHOWN_QUERY_KEYS = frozenset({"host", "hostaddr", "port", "dbname", "sslmode", "db",
                              "target_session_attrs", "application_name"})  # fmt: skip
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def display_url(url: str) -> str:
    """``url`` as logs and ``/info`` show it: without a user, a password, a fragment or
    the query's values, any of which may hold a secret (an IdP's basic auth, a token
    parameter), but those that say where a database is.
    A '@' after the host (Firebase's and Google's service-account JWKS paths hold one)
    may also be the end of a password holding an unencoded '/', which a URL parser
    takes for the end of the host: then the path is not shown, nor a host that has a
    ':' (it may be ``user:password``) or no '.' (it may be a user name). Of the query
    only the values of ``SHOWN_QUERY_KEYS`` are shown (where a database is), the rest as
    ``***``; characters that are not printable as ``?``. A list of hosts
    (``h1:5432,h2:5432``: libpq's, Redis Cluster's and Sentinel's forms) is shown as it is.

    Every URL a message, a log line or ``/info`` shows goes through here (the database's,
    the upstreams', a JWKS's, the control plane's, the Store index's), but for the
    counter store's start-up line, which shows what its own parser read
    (``CounterUrl.display``) and falls back to this."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a URL that does not parse)"
    netloc, path = parts.netloc, parts.path
    hosts = netloc.rpartition("@")[2]
    if not _hosts_parse(hosts):
        # A port that is not a number may be a password typed without its '@'.
        return "(a URL that does not parse)"
    # A '@' after the host: what follows the netloc may be a password's tail.
    cut_short = "@" not in netloc and ("@" in path or "@" in parts.query or "@" in parts.fragment)
    if "@" in netloc:
        shown = "***@" + hosts
    elif cut_short:
        # The part before may be a user, or a user and a password, written with a '/',
        # '?' or '#' that ended it early: shown only when it reads as a host name.
        shown = netloc if ":" not in netloc and "." in netloc else "***"
        path = "/..." if path else ""
    else:
        shown = netloc
    if not parts.query:
        tail = ""
    elif cut_short:  # the query may be a password's tail too (its key names included:
        # 'https://u:?p4ss=@host/' has the query 'p4ss=@host/', whose key is a password's)
        tail = "?***"
    else:
        tail = _query(parts.query)
    tail += "#***" if parts.fragment else ""
    text = f"{parts.scheme}://{shown}{path}{tail}"
    if not text.isprintable():  # a log line stays one line, and a terminal's own
        text = "".join(c if c.isprintable() else "?" for c in text)
    return text


def _query(query: str) -> str:
    """``?`` and the query with each value hidden but those of ``SHOWN_QUERY_KEYS``."""
    pieces = []
    for piece in query.split("&"):
        key, sep, value = piece.partition("=")
        if key in SHOWN_QUERY_KEYS and value.isprintable() and "@" not in value:
            pieces.append(piece)
        else:
            pieces.append(f"{key}=***" if sep and key.isidentifier() else "***")
    return "?" + "&".join(pieces)


def urls_shown(text: str, shown: str) -> str:
    """``text`` (a library's error message, say) with every URL in it replaced by
    ``shown``: libraries name the URL they were given in their own forms (aiohttp without
    the user, with the query), so replacing the configured spelling is not enough."""
    return _URL_IN_TEXT.sub(shown, text)


def _hosts_parse(hosts: str) -> bool:
    """Whether each comma-separated ``host[:port]`` of ``hosts`` has a port that is a
    number, or none (an empty list too: ``unix:///path``, ``postgresql:///db``)."""
    for item in hosts.split(","):
        if item.startswith("["):
            end = item.find("]")
            if end < 0:
                return False
            rest = item[end + 1 :]
            if rest and not (rest[0] == ":" and _port(rest[1:])):
                return False
        elif ":" in item and not _port(item.rpartition(":")[2]):
            return False
    return True


def _port(text: str) -> bool:
    return text == "" or (text.isascii() and text.isdigit())
