"""Every cache on the request path is bounded in what one entry may hold, not only in
entries: a client sending a new long value each request (path, query, header) costs
CPU, never memory (SECURITY.md). Found by class, not by name: after requests with long
distinct paths, queries and header values, no dict of the request path's modules or of
the running gateway's objects (two levels down) holds an entry carrying one of them.

The review of the seventeenth session found the upstream request-line cache keeping
4 KiB paths (4,096 of them: ~34 MB a process); this fails without its bound."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

from tests.support.gateway import running_gateway
from tests.support.raw_upstream import running_raw_upstream

MARK = "Q" * 300  # longer than every per-entry bound (256 path characters, 512 bytes)
MODULES = ("gateway.proxy.", "gateway.policy.", "gateway.ratelimit.", "gateway.identity.")


def _strings(value: Any, depth: int = 0) -> Iterator[str | bytes]:
    if isinstance(value, (str, bytes, bytearray)):
        yield bytes(value) if isinstance(value, bytearray) else value
    elif depth < 3 and isinstance(value, (tuple, list, frozenset, set)):
        for item in value:
            yield from _strings(item, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k, depth + 1)
            yield from _strings(v, depth + 1)
    elif depth < 2 and value is not None:
        for name in _attributes(value):
            yield from _strings(getattr(value, name, None), depth + 1)


def _attributes(obj: Any) -> list[str]:
    """Its data attributes: from ``__dict__`` and ``__slots__``, or for a class compiled
    by mypyc (neither) from ``dir``, methods and properties left out."""
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        names += [s for s in getattr(cls, "__slots__", ()) if isinstance(s, str)]
    if not names:
        cls = type(obj)
        names = [
            n for n in dir(obj)
            if not n.startswith("__") and not isinstance(getattr(cls, n, None), property)
            and not callable(getattr(cls, n, None))
        ]  # fmt: skip
    return names


def _dicts(root: Any) -> Iterator[tuple[str, dict[Any, Any]]]:
    """Module-level dicts of the request path, and dicts held by the running gateway's
    objects up to two attribute levels down."""
    for name, module in list(sys.modules.items()):
        if name.startswith(MODULES):
            for attr, value in vars(module).items():
                if isinstance(value, dict) and not attr.startswith("__"):
                    yield f"{name}.{attr}", value
    seen: set[int] = set()
    todo: list[tuple[str, Any, int]] = [("proxy", root, 0)]
    while todo:
        where, obj, depth = todo.pop()
        if id(obj) in seen or depth > 2:
            continue
        seen.add(id(obj))
        for attr in _attributes(obj):
            value = getattr(obj, attr, None)
            if isinstance(value, dict):
                yield f"{where}.{attr}", value
            elif type(value).__module__.startswith("gateway."):
                todo.append((f"{where}.{attr}", value, depth + 1))


def _holds_mark(value: Any) -> bool:
    return any((MARK in s) if isinstance(s, str) else (MARK.encode() in s) for s in _strings(value))


async def _send(port: int, head: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


async def test_no_request_path_cache_keeps_a_long_client_value():
    async with (
        running_raw_upstream() as up,
        running_gateway(up.url, access_log="plain") as gw,
    ):
        port = int(gw.url.rsplit(":", 1)[1])
        for i in range(6):
            answer = await _send(
                port,
                f"GET /runs/{MARK}{i}?q={MARK}{i} HTTP/1.1\r\nHost: a\r\n"
                f"x-api-key: k{i}{MARK}\r\nX-Request-Id: r{i}{MARK}\r\n"
                f"User-Agent: {MARK}{i}\r\nConnection: close\r\n\r\n".encode(),
            )
            assert answer.startswith(b"HTTP/1.1 "), answer[:100]
        assert up.recording.requests, "nothing was forwarded: the test proves nothing"
        assert any(MARK.encode() in r.target for r in up.recording.requests)
        kept = [where for where, found in _dicts(gw.proxy) if _holds_mark(found)]
        assert kept == [], f"caches keeping a {len(MARK)}-character client value: {kept}"
