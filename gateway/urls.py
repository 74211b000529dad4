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
    ':' (it may be ``user:password``). A list of hosts (``h1:5432,h2:5432``: libpq's and
    Redis Cluster's and Sentinel's forms) is shown as it is.

    Every URL a message, a log line or ``/info`` shows goes through here: the counter
    store's, the database's, the upstreams', a JWKS's, the control plane's."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a URL that does not parse)"
    netloc, path = parts.netloc, parts.path
    hosts = netloc.rpartition("@")[2]
    if not _hosts_parse(hosts):
        # A port that is not a number may be a password typed without its '@'.
        return "(a URL that does not parse)"
    if "@" in netloc:
        shown = "***@" + hosts
    elif "@" in path or "@" in parts.query or "@" in parts.fragment:
        shown = "***" if ":" in netloc else netloc
        path = "/..." if path else ""
    else:
        shown = netloc
    tail = "?***" if parts.query else ""
    tail += "#***" if parts.fragment else ""
    return f"{parts.scheme}://{shown}{path}{tail}"


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
