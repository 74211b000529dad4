"""Which upstream serves a path, and which region a Host header belongs to."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from typing import Final

from gateway.proxy.upstream_pool import Upstream
from gateway.urls import display_url


class Router:
    """Longest segment-prefix match over (prefix, upstream) pairs; a default upstream last."""

    def __init__(self, routes: Sequence[tuple[str, Upstream]], default: Upstream | None) -> None:
        self._routes = sorted(routes, key=lambda r: -len(r[0]))
        # Each prefix with its "prefix/" form, built once rather than on every request.
        self._matches = [(prefix, prefix + "/", upstream) for prefix, upstream in self._routes]
        self.default = default

    def route(self, path: str) -> Upstream | None:
        for prefix, below, upstream in self._matches:
            if prefix == "/" or path == prefix or path.startswith(below):
                return upstream
        return self.default

    def describe(self) -> list[tuple[str, str, str]]:
        """Each prefix, its upstream's name and URL as logs show URLs (``display_url``:
        no credentials, no query), for the start-up log."""
        rows = [(prefix, u.name, display_url(u.base_url)) for prefix, u in self._routes]
        if self.default is not None:
            default = self.default
            rows.append(("(everything else)", default.name, display_url(default.base_url)))
        return rows

    def info(self) -> list[dict[str, str | bool]]:
        """The operator's view (admin ``/info``): each prefix, its upstream's name and URL
        as logs show it (``display_url``), and whether it takes upgrades."""
        rows: list[tuple[str, Upstream]] = list(self._routes)
        if self.default is not None:
            rows.append(("(everything else)", self.default))
        return [
            {"prefix": prefix, "upstream": u.name, "url": display_url(u.base_url),
             "upgrade": u.upgrade}
            for prefix, u in rows
        ]  # fmt: skip


# RFC 9110 7.2 / RFC 3986 3.2.2-3.2.3: Host = uri-host [ ":" port ]; uri-host is an
# IPv6 address in brackets or a reg-name (unreserved, sub-delims, %HH: an IPv4 address is
# one too); port is digits. Anything else is refused (RFC 9112 3.2: 400), so that the
# gateway and the upstream cannot read two hosts from one value: "api.eu.example.com:80:80"
# was in no region's list here while nginx, which ends the host at the first ':', served
# it as api.eu.example.com; "[api.eu.example.com]:80", which Go's SplitHostPort reads as
# api.eu.example.com. (IPvFuture literals and zone ids, which no client sends, are refused.)
_HOST_SYNTAX: Final = re.compile(
    rb"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?:[0-9A-Za-z._~!$&'()*+,;=-]|%[0-9A-Fa-f]{2})*)"
    rb"(?::(?P<port>[0-9]{0,5}))?"
)
_last_valid_host = b""  # a connection's requests repeat one Host: checked once


def valid_host(value: bytes) -> bool:
    """Whether a Host header's value is one host and an optional port (RFC 9110 7.2)."""
    global _last_valid_host
    if value == _last_valid_host:
        return True
    found = _HOST_SYNTAX.fullmatch(value)
    if found is None:
        return False
    v6, port = found["v6"], found["port"]
    if port and int(port) > 65535:
        return False
    if v6 is not None:
        try:
            ipaddress.IPv6Address(v6.decode("ascii"))
        except ValueError:
            return False
    _last_valid_host = value
    return True


class RegionMap:
    """Host header (without port, lower-case) to region; the default region otherwise."""

    def __init__(self, default: str, hosts: Mapping[str, str]) -> None:
        self.default = default
        self._hosts = dict(hosts)
        self.by_host = bool(self._hosts)  # False: every request is in the default region

    def region_for(self, host: str | None) -> str:
        if not host or not self._hosts:
            return self.default
        name = host.lower()
        if name.startswith("["):
            name = name[: name.find("]") + 1]
        else:
            name = name.rsplit(":", 1)[0] if name.count(":") == 1 else name
        # "api.example.com." is the same host as "api.example.com".
        return self._hosts.get(name.rstrip("."), self.default)
