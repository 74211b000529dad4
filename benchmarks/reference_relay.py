"""A reference point for ``dataplane_bench.py``: what Python itself can do here.

    python benchmarks/reference_relay.py PORT UPSTREAM_URL [memory|redis-pipelined|redis-awaited]
        [REDIS_URL]

A rate-limiting relay of about 300 lines on asyncio Protocols (uvloop) and httptools: one
Protocol per client connection, keep-alive upstream connections reused from a pool, the
response head rebuilt with ``RateLimit-Policy``, ``RateLimit`` and ``X-Request-Id``, and a
429 with a JSON body for an API key over its limit. The limit is counted

* ``memory``: in a dict (two fixed buckets weighted into a sliding window);
* ``redis-pipelined``: one EVALSHA per request, all the EVALSHAs of one loop turn written
  as one pipeline on one raw connection (replies read with hiredis);
* ``redis-awaited``: one ``await redis.evalsha(...)`` per request with redis-py asyncio, a
  task per request.

It is a floor, not a product: no access log, no metrics, no timeouts, no size limits, no
hop-by-hop handling beyond framing, no request bodies but ``Content-Length`` ones, no
identity hashing, no configuration. Rules are hard-wired to the benchmark's: ``/flood``
allows 1 request per key per 600 s, everything else 1,000,000,000 per 60 s. Loopback only;
stops on SIGTERM / SIGINT.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import hiredis
import httptools
import uvloop

FLOOD = (1, 600_000)  # (limit, window ms) of /flood
BENCH = (1_000_000_000, 60_000)
LUA = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local cur = math.floor(now / window)
local left = window - now % window
local ck, pk = KEYS[1] .. ':' .. cur, KEYS[1] .. ':' .. (cur - 1)
local c = tonumber(redis.call('GET', ck) or '0')
local p = tonumber(redis.call('GET', pk) or '0')
local used = math.floor(p * left / window) + c
if used >= limit then return {0, 0, left} end
redis.call('INCR', ck)
redis.call('PEXPIRE', ck, 2 * window)
return {1, limit - used - 1, left}
"""
HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length"})
_ids = itertools.count(int.from_bytes(os.urandom(6), "big"))
Verdict = tuple[int, int, int]  # allowed, remaining, ms until the window moves on


def rule(path: bytes) -> tuple[bytes, int, int]:
    limit, window = FLOOD if path.startswith(b"/flood") else BENCH
    return (b"flood" if limit == 1 else b"bench"), limit, window


def rate_lines(name: bytes, limit: int, window: int, verdict: Verdict) -> bytes:
    return b'RateLimit-Policy: "%s";q=%d;w=%d\r\nRateLimit: "%s";r=%d;t=%d\r\n' % (
        name,
        limit,
        window // 1000,
        name,
        verdict[1],
        -(-verdict[2] // 1000),
    )


class MemoryCounter:
    def __init__(self) -> None:
        self.buckets: dict[bytes, list[int]] = {}  # key -> [bucket number, previous, current]

    def check(self, key: bytes, limit: int, window: int, done: Callable[[Verdict], None]) -> None:
        now = int(time.monotonic() * 1000)
        cur, left = divmod(now, window)
        left = window - left
        b = self.buckets.get(key)
        if b is None or b[0] < cur - 1:
            b = self.buckets[key] = [cur, 0, 0]
        elif b[0] == cur - 1:
            b[:] = [cur, b[2], 0]
        used = b[1] * left // window + b[2]
        if used >= limit:
            done((0, 0, left))
        else:
            b[2] += 1
            done((1, limit - used - 1, left))


class PipelinedRedis(asyncio.Protocol):
    """One raw connection; the EVALSHAs of a loop turn leave in one write."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.waiting: deque[Callable[[Verdict], None]] = deque()
        self.out: list[bytes] = []
        self.transport: Any = None
        self.sha = b""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            if isinstance(reply, Exception):
                raise reply
            self.waiting.popleft()(tuple(reply))  # type: ignore[arg-type]

    def check(self, key: bytes, limit: int, window: int, done: Callable[[Verdict], None]) -> None:
        if not self.out:
            asyncio.get_running_loop().call_soon(self.flush)
        self.out.append(pack(b"EVALSHA", self.sha, b"1", key, b"%d" % limit, b"%d" % window))
        self.waiting.append(done)

    def flush(self) -> None:
        self.transport.write(b"".join(self.out))
        self.out.clear()


class AwaitedRedis:
    def __init__(self, url: str) -> None:
        import redis.asyncio

        self.client = redis.asyncio.Redis.from_url(url)
        self.sha = ""

    def check(self, key: bytes, limit: int, window: int, done: Callable[[Verdict], None]) -> None:
        async def call() -> None:
            done(tuple(await self.client.evalsha(self.sha, 1, key, limit, window)))  # type: ignore[arg-type]

        asyncio.get_running_loop().create_task(call())


def pack(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class Upstream(asyncio.Protocol):
    def __init__(self, pool: deque[Upstream]) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.client: Client | None = None
        self.transport: Any = None
        self.headers: list[bytes] = []
        self.chunked = False
        self.reason = b""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool:
            self.pool.remove(self)

    def on_message_begin(self) -> None:
        self.headers = []
        self.chunked = False
        self.reason = b""

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-length":
            self.headers.append(b"Content-Length: " + value + b"\r\n")
        elif lower not in HOP:
            self.headers.append(name + b": " + value + b"\r\n")
        elif lower == b"transfer-encoding":
            self.chunked = True

    def on_headers_complete(self) -> None:
        client = self.client
        assert client is not None
        status = self.parser.get_status_code()
        framing = b"Transfer-Encoding: chunked\r\n" if self.chunked else b""
        client.write(
            b"HTTP/1.1 %d %s\r\n%s%s%sX-Request-Id: %x\r\n\r\n"
            % (status, self.reason, b"".join(self.headers), client.rate, framing, next(_ids))
        )

    def on_body(self, body: bytes) -> None:
        assert self.client is not None
        self.client.write(b"%x\r\n%s\r\n" % (len(body), body) if self.chunked else body)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        assert client is not None
        if self.chunked:
            client.write(b"0\r\n\r\n")
        self.pool.append(self)
        client.done()


class Client(asyncio.Protocol):
    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.queue: deque[tuple[bytes, bytes, list[bytes], list[bytes]]] = deque()
        self.busy = False
        self.rate = b""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def write(self, data: bytes) -> None:
        if not self.transport.is_closing():  # the client may have gone meanwhile
            self.transport.write(data)

    def on_message_begin(self) -> None:
        self.url = b""
        self.key = b"-"
        self.lines: list[bytes] = []
        self.body: list[bytes] = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-api-key":
            self.key = value
        self.lines.append(name + b": " + value + b"\r\n")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        self.queue.append((method, self.url, self.lines, [self.key, *self.body]))
        if not self.busy:
            self.next()

    def next(self) -> None:
        if not self.queue:
            return
        self.busy = True
        method, url, lines, (key, *body) = self.queue.popleft()
        name, limit, window = rule(url)

        def decided(verdict: Verdict) -> None:
            self.rate = rate_lines(name, limit, window, verdict)
            if verdict[0]:
                self.relay.forward(self, method, url, lines, b"".join(body))
                return
            wait = -(-verdict[2] // 1000)
            detail = b'{"detail": "rate limit exceeded for rule \'%s\'; retry in %d seconds"}' % (
                name,
                wait,
            )
            self.write(
                b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n%sRetry-After: %d\r\nX-Request-Id: %x\r\n\r\n%s"
                % (len(detail), self.rate, wait, next(_ids), detail)
            )
            self.done()

        self.relay.counter.check(b"rl:" + name + b":" + key, limit, window, decided)

    def done(self) -> None:
        self.busy = False
        self.next()


class Relay:
    def __init__(self, upstream: str, counter: Any) -> None:
        parts = urlsplit(upstream)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.counter = counter
        self.pool: deque[Upstream] = deque()

    def forward(
        self, client: Client, method: bytes, url: bytes, lines: list[bytes], body: bytes
    ) -> None:
        head = b"%s %s HTTP/1.1\r\n%s" % (method, url, b"".join(lines))
        if body:
            head += b"Content-Length: %d\r\n" % len(body)
        data = head + b"\r\n" + body
        if self.pool:
            up = self.pool.pop()
            up.client = client
            up.transport.write(data)
        else:
            asyncio.get_running_loop().create_task(self.open_and_send(client, data))

    async def open_and_send(self, client: Client, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        _, up = await loop.create_connection(lambda: Upstream(self.pool), self.host, self.port)
        up.client = client
        up.transport.write(data)


async def main(port: int, upstream: str, mode: str, redis_url: str | None) -> None:
    loop = asyncio.get_running_loop()
    counter: Any
    if mode == "memory":
        counter = MemoryCounter()
    elif mode == "redis-pipelined":
        parts = urlsplit(redis_url or "redis://127.0.0.1:6379")
        _, counter = await loop.create_connection(
            PipelinedRedis, parts.hostname or "127.0.0.1", parts.port or 6379
        )
        import redis.asyncio

        loader = redis.asyncio.Redis.from_url(redis_url or "")
        counter.sha = (await loader.script_load(LUA)).encode()
        await loader.aclose()
    elif mode == "redis-awaited":
        counter = AwaitedRedis(redis_url or "")
        counter.sha = await counter.client.script_load(LUA)
    else:
        raise SystemExit(f"unknown counters {mode!r}")
    relay = Relay(upstream, counter)
    server = await loop.create_server(lambda: Client(relay), "127.0.0.1", port, backlog=1024)
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    await stop
    server.close()


if __name__ == "__main__":
    args = sys.argv[1:]
    uvloop.run(
        main(
            int(args[0]),
            args[1],
            args[2] if len(args) > 2 else "memory",
            args[3] if len(args) > 3 else None,
        )
    )
