"""A small asyncio HTTP/1.1 load generator: ``dataplane_bench.py``'s fallback when wrk is
not installed. It reports the same fields as the bench's wrk parser, as one JSON line.

    python benchmarks/dataplane_load.py URL SECONDS CONNECTIONS PREFIX COUNT OFFSET
        [xff | sources=N]

CONNECTIONS keep-alive connections on raw sockets (asyncio streams, uvloop when
available), one request in flight per connection (no pipelining). Every request carries
an ``x-api-key`` taken round-robin from PREFIX-0 .. PREFIX-(COUNT-1), starting at OFFSET,
like ``benchmarks/wrk/keys.lua``; with ``xff`` each also names its client in
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

    async def read_response(self, reader: asyncio.StreamReader) -> tuple[int, bool]:
        """Status and whether the connection stays open; the body is read and dropped."""
        head = await reader.readuntil(b"\r\n\r\n")
        self.bytes += len(head)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length: int | None = None
        chunked = False
        close = lines[0].startswith("HTTP/1.0")
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value:
                chunked = True
            elif name == "connection":
                close = "close" in value
        if chunked:
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0], 16)
                await self.skip(reader, size + 2)
                self.bytes += len(size_line)
                if size == 0:
                    # trailers, if any, end with an empty line
                    while (await reader.readuntil(b"\r\n")) != b"\r\n":
                        pass
                    break
        elif length is not None:
            await self.skip(reader, length)
        else:
            while await reader.read(CHUNK):
                pass
            close = True
        return status, not close

    async def skip(self, reader: asyncio.StreamReader, n: int) -> None:
        while n > 0:
            got = await reader.read(min(n, CHUNK))
            if not got:
                raise ConnectionError("connection closed inside a body")
            n -= len(got)
            self.bytes += len(got)

    async def connection(self, stop: float, source: str | None = None) -> None:
        writer: asyncio.StreamWriter | None = None
        reader: asyncio.StreamReader | None = None
        while time.perf_counter() < stop:
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection(
                        self.host,
                        self.port,
                        limit=CHUNK,
                        local_addr=None if source is None else (source, 0),
                    )
                assert reader is not None
                start = time.perf_counter()
                writer.write(self.request())
                status, keep = await asyncio.wait_for(
                    self.read_response(reader), timeout=max(0.1, stop - start + 2)
                )
                self.latencies.append(time.perf_counter() - start)
                if not 200 <= status < 400:
                    self.non2xx += 1
                if not keep:
                    writer.close()
                    writer = None
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
                self.errors += 1
                if writer is not None:
                    writer.close()
                writer = None
                await asyncio.sleep(0.01)
        if writer is not None:
            writer.close()


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
            load.connection(start + seconds, f"127.0.0.{2 + i % sources}" if sources else None)
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
