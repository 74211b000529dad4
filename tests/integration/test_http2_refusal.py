"""A client speaking HTTP/2 with prior knowledge (issue 26 item 4): the data plane does not
serve HTTP/2 yet, and says so in a frame the client reads: the server's SETTINGS, then
GOAWAY with HTTP_1_1_REQUIRED and a reason. A real HTTP/2 implementation (h2) is the
client; the preface may arrive in one write or byte by byte."""

from __future__ import annotations

import asyncio

import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest

from tests.support.gateway import running_gateway


async def _h2_exchange(port: int, split: bool) -> list[h2.events.Event]:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(
        1,
        [(":method", "GET"), (":path", "/x"), (":scheme", "http"), (":authority", "a")],
        end_stream=True,
    )
    data = conn.data_to_send()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if split:
            for i in range(len(data)):
                writer.write(data[i : i + 1])
                await writer.drain()
        else:
            writer.write(data)
        received = await asyncio.wait_for(reader.read(), 10)  # the gateway closes
    finally:
        writer.close()
    return conn.receive_data(received)


@pytest.mark.parametrize("split", [False, True])
async def test_prior_knowledge_http2_gets_goaway_http_1_1_required(upstream, split):
    async with running_gateway(upstream) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        events = await _h2_exchange(port, split)
        assert any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events)
        (goaway,) = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
        assert goaway.error_code == h2.errors.ErrorCodes.HTTP_1_1_REQUIRED
        assert goaway.last_stream_id == 0  # nothing was processed: safe to retry
        assert goaway.additional_data == b"HTTP/2 is not served here; use HTTP/1.1"
        # and HTTP/1.1 on a new connection is served as ever
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /ok HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.1 200")
        writer.close()
