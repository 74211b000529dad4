"""A small asyncio HTTP/1.1 load generator: ``dataplane_bench.py``'s fallback when wrk is
not installed. It reports the same fields as the bench's wrk parser, as one JSON line.

    python benchmarks/dataplane_load.py URL SECONDS CONNECTIONS PREFIX COUNT OFFSET
        [xff | sources=N]

CONNECTIONS keep-alive connections, each an asyncio Protocol (uvloop when available)
that writes its next request from the callback that read the last response's end: one
request in flight per connection (no pipelining), no task or stream per request. Every
request carries an ``x-api-key`` taken round-robin from PREFIX-0 .. PREFIX-(COUNT-1),
starting at OFFSET, like ``benchmarks/wrk/keys.lua``; with ``xff`` each also names its client in
``X-Forwarded-For`` (key i from address i % 768 of the RFC 5737 documentation ranges), as
``dataplane_bench.py --table shipped`` has wrk do. With ``sources=N`` connection i is bound
to the loopback address 127.0.0.(2 + i % N) instead, so the server sees N client addresses
as TCP peers (still to and from loopback only: all of 127.0.0.0/8 is this machine).
Bodies are read by Content-Length or chunked encoding and counted, never kept. A
connection the server closes is reopened. Latency is measured from writing the request
to reading the last byte of the response.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import time
from urllib.parse import urlsplit

CHUNK = 256 * 1024


NETS = ("192.0.2", "198.51.100", "203.0.113")


def client_address(i: int) -> str:
    slot = i % (256 * len(NETS))
    return f"{NETS[slot // 256]}.{slot % 256}"


class Load:
    def __init__(self, url: str, prefix: str, count: int, offset: int, xff: bool = False) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = f"GET {target} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
        self.requests = [
            (
                f"{head}x-api-key: {prefix}-{i}\r\n"
                + (f"X-Forwarded-For: {client_address(i)}\r\n" if xff else "")
                + "\r\n"
            ).encode()
            for i in range(count)
        ]
        self.next = offset % count
        self.latencies: list[float] = []
        self.non2xx = 0
        self.errors = 0
        self.bytes = 0

    def request(self) -> bytes:
        data = self.requests[self.next]
        self.next = (self.next + 1) % len(self.requests)
        return data


def _field(head: bytes, name: bytes) -> bytes:
    """The value of the (first) header line starting with ``name`` (``\\r\\nname:``)."""
    start = head.find(name) + len(name)
    end = head.find(b"\r\n", start)
    return head[start:] if end < 0 else head[start:end]


# Response parsing states of a connection.
HEAD, BODY, CHUNK_SIZE, CHUNK_DATA, TRAILERS, UNTIL_CLOSE = range(6)


class Connection(asyncio.Protocol):
    """One keep-alive connection driven by callbacks: a request written, its response
    parsed as it arrives, the next request written in the same callback. No task, stream
    or timer per request: the generator's own CPU per request is a fraction of what an
    asyncio-streams loop costs (which took most of a core at 15,000 requests a second,
    and shares that core with the upstream and Redis: rows measured the generator)."""

    def __init__(self, load: Load, stop: float, finished: asyncio.Future[None]) -> None:
        self.load = load
        self.stop = stop
        self.finished = finished
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.state = HEAD
        self.remaining = 0
        self.status = 0
        self.close_after = False
        self.started = 0.0
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is not a subclass)
        self.send()

    def send(self) -> None:
        transport = self.transport
        assert transport is not None
        if time.perf_counter() >= self.stop:
            self.busy = False
            transport.close()
            return
        self.state = HEAD
        self.busy = True
        self.started = time.perf_counter()
        transport.write(self.load.request())

    def data_received(self, data: bytes) -> None:
        self.load.bytes += len(data)
        buf = self.buf
        buf += data
        while True:
            state = self.state
            if state == HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(buf[:end]).lower()
                del buf[: end + 4]
                try:
                    self._head(head)
                except ValueError:
                    self.load.errors += 1
                    self.busy = False
                    assert self.transport is not None
                    self.transport.abort()
                    return
                if self.state == BODY and self.remaining == 0:
                    self._complete()
                    return
            elif state in (BODY, CHUNK_DATA):
                take = min(self.remaining, len(buf))
                del buf[:take]
                self.remaining -= take
                if self.remaining:
                    return
                if state == BODY:
                    self._complete()
                    return
                self.state = CHUNK_SIZE
            elif state == CHUNK_SIZE:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
                del buf[: end + 2]
                if size == 0:
                    self.state = TRAILERS
                else:
                    self.state, self.remaining = CHUNK_DATA, size + 2
            elif state == TRAILERS:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                empty = end == 0
                del buf[: end + 2]
                if empty:
                    self._complete()
                    return
            else:  # UNTIL_CLOSE: the body ends with the connection
                buf.clear()
                return

    def _head(self, head: bytes) -> None:
        """Status and framing from a lower-cased head: a few searches, not a split per
        header line (the same answers for the heads these rows get)."""
        self.status = int(head[9:12])
        self.close_after = head.startswith(b"http/1.0")
        if b"\r\nconnection:" in head:
            self.close_after = _field(head, b"\r\nconnection:").find(b"close") >= 0
        if b"\r\ntransfer-encoding:" in head and b"chunked" in _field(
            head, b"\r\ntransfer-encoding:"
        ):
            self.state = CHUNK_SIZE
        elif b"\r\ncontent-length:" in head:
            self.state, self.remaining = BODY, int(_field(head, b"\r\ncontent-length:"))
        else:
            self.state, self.close_after = UNTIL_CLOSE, True

    def _complete(self) -> None:
        load = self.load
        load.latencies.append(time.perf_counter() - self.started)
        if not 200 <= self.status < 400:
            load.non2xx += 1
        self.busy = False
        if self.buf:  # nothing was asked for beyond this response
            load.errors += 1
            self.close_after = True
        if self.close_after:
            assert self.transport is not None
            self.transport.close()
        else:
            self.send()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy:
            if self.state == UNTIL_CLOSE and exc is None:
                self.busy = False
                self.load.latencies.append(time.perf_counter() - self.started)
                if not 200 <= self.status < 400:
                    self.load.non2xx += 1
            else:
                self.load.errors += 1
        if not self.finished.done():
            self.finished.set_result(None)


async def keep_connected(load: Load, stop: float, source: str | None) -> None:
    """One connection slot until ``stop``: reopened when the server closes it. A request
    in flight at ``stop`` gets 2 s to finish."""
    loop = asyncio.get_running_loop()
    while time.perf_counter() < stop:
        finished: asyncio.Future[None] = loop.create_future()
        try:
            transport, _ = await loop.create_connection(
                functools.partial(Connection, load, stop, finished),
                load.host,
                load.port,
                local_addr=None if source is None else (source, 0),
            )
        except OSError:
            load.errors += 1
            await asyncio.sleep(0.01)
            continue
        try:
            await asyncio.wait_for(
                asyncio.shield(finished), max(0.1, stop - time.perf_counter() + 2)
            )
        except TimeoutError:
            load.errors += 1
            transport.abort()
            return


async def run(
    url: str,
    seconds: float,
    connections: int,
    prefix: str,
    count: int,
    offset: int,
    xff: bool,
    sources: int,
):
    load = Load(url, prefix, count, offset, xff)
    start = time.perf_counter()
    await asyncio.gather(
        *(
            keep_connected(load, start + seconds, f"127.0.0.{2 + i % sources}" if sources else None)
            for i in range(connections)
        )
    )
    elapsed = time.perf_counter() - start
    lat = sorted(load.latencies)

    def pct(p: float) -> float | None:
        return 1000 * lat[min(len(lat) - 1, int(len(lat) * p))] if lat else None

    return {
        "requests": len(lat),
        "seconds": elapsed,
        "rps": len(lat) / elapsed,
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "non2xx": load.non2xx,
        "errors": load.errors,
        "bytes": load.bytes,
    }


def main() -> None:
    url, seconds, connections = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    prefix, count, offset = sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
    mode = sys.argv[7] if len(sys.argv) > 7 else ""
    sources = int(mode.partition("=")[2]) if mode.startswith("sources=") else 0
    if not 0 <= sources <= 250:
        raise SystemExit("sources=N: 1 to 250 loopback addresses")
    coro = run(url, seconds, connections, prefix, count, offset, mode == "xff", sources)
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        result = asyncio.run(coro)
    else:
        result = uvloop.run(coro)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
