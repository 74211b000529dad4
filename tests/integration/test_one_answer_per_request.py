"""One request, one answer: a malformed body after its request was answered closes the
connection without a second answer.

A request can be answered before its body ends: from its head (a 429, a 404, a refusal)
or by an upstream that answers early; the rest of the body is then read and dropped. A
framing error in that rest used to be answered with a 400 of its own, which the client
reads as the answer to a request it has not sent (a review saw ``200 OK`` followed by
``400 Invalid character in chunk size`` for one POST)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from tests.support.gateway import running_gateway


@asynccontextmanager
async def early_upstream() -> AsyncIterator[str]:
    """Answers 200 as soon as a request's head has arrived, and keeps the connection."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await reader.read()  # whatever else comes, until the gateway lets go
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def _exchange(port: int, head: bytes, first: bytes, bad: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + first)
        await writer.drain()
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.write(bad)
        await writer.drain()
        rest = await asyncio.wait_for(reader.read(), 10)  # to the close
        return answer + rest
    finally:
        writer.close()


HEAD = b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
BAD_CHUNKS = [b"zz\r\n", b"0x5\r\nhello\r\n", b"5\r\nhello\r\r\n", b"\r\n\r\n"]


@pytest.mark.parametrize("bad", BAD_CHUNKS)
async def test_answered_from_its_head_then_a_bad_chunk(bad):
    async with running_gateway(None) as gw:  # no upstream: 404 from the head
        port = int(gw.url.rsplit(":", 1)[1])
        reply = await _exchange(port, HEAD, b"5\r\nhello\r\n", bad)
    assert reply.startswith(b"HTTP/1.1 404"), reply[:200]
    assert reply.count(b"HTTP/1.1 ") == 1, reply


@pytest.mark.parametrize("bad", BAD_CHUNKS)
async def test_answered_early_by_the_upstream_then_a_bad_chunk(bad):
    big = b"x" * (200 * 1024)  # past what is buffered before forwarding: streamed
    first = b"%x\r\n" % len(big) + big + b"\r\n"
    async with early_upstream() as url, running_gateway(url) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        reply = await _exchange(port, HEAD, first, bad)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    assert reply.count(b"HTTP/1.1 ") == 1, reply
