"""Header rules for a proxy: hop-by-hop removal and the forwarding headers."""

from __future__ import annotations

from collections.abc import Iterable

from multidict import CIMultiDict, CIMultiDictProxy

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade", "Proxy-Connection",
    )
)  # fmt: skip
VIA = "1.1 ratelimit-gateway"


def connection_tokens(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> set[str]:
    """Lower-case header names listed in ``Connection`` (hop-by-hop for this request)."""
    named: set[str] = set()
    for value in headers.getall("Connection", ()):
        named.update(token.strip().lower() for token in value.split(",") if token.strip())
    return named


def end_to_end(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: Iterable[str] = ()
) -> CIMultiDict[str]:
    """A copy without hop-by-hop headers (including those the Connection header names)."""
    skip = HOP_BY_HOP | connection_tokens(headers) | {d.lower() for d in drop}
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in skip:
            out.add(name, value)
    return out


def add_via(headers: CIMultiDict[str]) -> None:
    existing = headers.get("Via")
    headers["Via"] = f"{existing}, {VIA}" if existing else VIA
