"""Writes held to the end of the loop's turn (``gateway.proxy.batched_writes``), over real
loopback sockets, on both event loops the gateway runs on (asyncio's and uvloop's).

The property: whatever is done to a connection, its peer receives what a transport
written at once would have delivered, in the same order, and the same end (EOF or
reset); only *when* changes (at the end of the turn).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import weakref
from typing import Any, cast

import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.proxy.batched_writes import FLUSH_AT, BatchedTransport, WriteBatch, write_batch
from tests.support.loops import RUNNERS, Runner


class Peer:
    """The far end: a plain socket read to its end, all bytes and how it ended."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)

    async def read_all(self, timeout: float = 10.0) -> tuple[bytes, str]:
        loop = asyncio.get_running_loop()
        got = bytearray()
        async with asyncio.timeout(timeout):
            while True:
                try:
                    data = await loop.sock_recv(self.sock, 65536)
                except ConnectionResetError:
                    return bytes(got), "reset"
                if not data:
                    return bytes(got), "eof"
                got += data

    def ready(self) -> bytes:
        """What has arrived so far, without waiting."""
        try:
            return self.sock.recv(65536)
        except BlockingIOError:
            return b""


async def connected() -> tuple[asyncio.Transport, Peer]:
    """A transport of the running loop and a plain socket at its other end."""
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    client = socket.socket()
    client.setblocking(False)
    connecting = loop.sock_connect(client, listener.getsockname())
    accepted, _ = await asyncio.gather(loop.sock_accept(listener), connecting)
    listener.close()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, client)
    return cast(asyncio.Transport, transport), Peer(accepted[0])


async def turn() -> None:
    """Let the loop finish its turn (and run the batch's flush)."""
    for _ in range(3):
        await asyncio.sleep(0)


def test_writes_wait_for_the_end_of_the_turn_and_leave_in_order(run: Runner) -> None:
    async def scenario() -> None:
        raw, peer = await connected()
        batch = write_batch(asyncio.get_running_loop())
        assert write_batch(asyncio.get_running_loop()) is batch  # one per loop
        held = BatchedTransport(raw, batch)
        held.write(b"one ")
        held.write(b"")  # nothing to hold: no flush scheduled for it
        held.write(b"two ")
        assert held.get_write_buffer_size() == 8  # held bytes count as buffered
        await turn()
        assert held.get_write_buffer_size() == raw.get_write_buffer_size()  # all written
        held.write(b"three")
        await turn()
        assert held.get_write_buffer_size() == 0
        held.close()
        data, end = await peer.read_all()
        assert data.endswith(b"three") and end == "eof"

    run(scenario())


def test_nothing_is_written_before_the_turn_ends(run: Runner) -> None:
    async def scenario() -> None:
        raw, peer = await connected()
        held = BatchedTransport(raw, write_batch(asyncio.get_running_loop()))
        held.write(b"x" * 100)
        # The same turn: the bytes are held, not in the transport.
        assert raw.get_write_buffer_size() == 0
        assert held.get_write_buffer_size() == 100
        await turn()
        assert held.get_write_buffer_size() == raw.get_write_buffer_size()
        held.close()
        assert await peer.read_all() == (b"x" * 100, "eof")

    run(scenario())


def test_a_burst_reaches_the_transports_flow_control_within_the_turn(run: Runner) -> None:
    """Past FLUSH_AT held bytes the transport is written at once: a peer that does not
    read makes the transport pause its protocol in the same turn, as a straight write
    would (the data plane stops reading a client whose answers pile up)."""

    class Paused(asyncio.Protocol):
        paused = False

        def pause_writing(self) -> None:
            self.paused = True

    async def scenario() -> None:
        raw, peer = await connected()
        protocol = Paused()
        raw.set_protocol(protocol)
        held = BatchedTransport(raw, write_batch(asyncio.get_running_loop()))
        written = 0
        while not protocol.paused and written < 64 * 1024 * 1024:
            held.write(b"y" * 1000)  # small answers, all in this one turn
            written += 1000
            assert held.get_write_buffer_size() - raw.get_write_buffer_size() < FLUSH_AT
        assert protocol.paused  # (the socket's buffers filled: no read on the other end)
        held.abort()
        peer.sock.close()

    run(scenario())


def test_close_and_write_eof_write_what_is_held_first(run: Runner) -> None:
    async def scenario() -> None:
        raw, peer = await connected()
        held = BatchedTransport(raw, write_batch(asyncio.get_running_loop()))
        held.write(b"answer")
        held.close()  # in the same turn as the write
        assert await peer.read_all() == (b"answer", "eof")

        raw, peer = await connected()
        held = BatchedTransport(raw, write_batch(asyncio.get_running_loop()))
        held.write(b"half")
        held.write_eof()
        await turn()
        assert peer.ready() == b"half"
        assert peer.sock.recv(10) == b""  # EOF after the bytes
        held.close()

    run(scenario())


def test_abort_writes_what_is_held_first_as_a_straight_write_would(run: Runner) -> None:
    """A straight write had reached the socket before an abort (a partial answer cut
    off by a broken upstream): held, it is written first too."""

    async def scenario() -> None:
        raw, peer = await connected()
        held = BatchedTransport(raw, write_batch(asyncio.get_running_loop()))
        held.write(b"partial answer")
        held.abort()
        await turn()  # the flush finds nothing held
        data, end = await peer.read_all()
        assert data == b"partial answer" and end in ("reset", "eof")

    run(scenario())


def test_a_loop_is_not_kept_alive_by_its_batch() -> None:
    """The batches are kept per loop, weakly: a loop that has run is collected (a process
    that starts loops one after another, as the tests do, keeps none of them)."""
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def used() -> None:
        loop = asyncio.get_running_loop()
        raw, peer = await connected()
        held = BatchedTransport(raw, write_batch(loop))
        held.write(b"x")
        await turn()
        held.close()
        await peer.read_all()
        peer.sock.close()
        loops.append(weakref.ref(loop))

    for runner in (asyncio.run, uvloop.run, asyncio.run, uvloop.run):
        runner(used())
    gc.collect()
    assert [ref() for ref in loops] == [None] * 4


def test_a_detached_transport_is_written_straight_and_in_order(run: Runner) -> None:
    """A tunnel takes the transport over: what was held goes first, and later writes
    through either object go straight, so neither overtakes the other."""

    async def scenario() -> None:
        raw, peer = await connected()
        held = BatchedTransport(raw, write_batch(asyncio.get_running_loop()))
        held.write(b"101 ")
        taken = held.detach()
        assert taken is raw
        taken.write(b"tunnel ")
        held.write(b"late ")
        taken.write(b"bytes")
        assert held.get_write_buffer_size() == raw.get_write_buffer_size()
        taken.close()
        assert await peer.read_all() == (b"101 tunnel late bytes", "eof")

    run(scenario())


def test_one_failing_transport_does_not_keep_the_others_bytes(
    run: Runner, caplog: pytest.LogCaptureFixture
) -> None:
    """A write the transport refuses (after its write_eof) is logged and that connection
    aborted; the other connections of the batch are still written."""

    async def scenario() -> None:
        batch = WriteBatch(asyncio.get_running_loop())
        pairs = [await connected() for _ in range(3)]
        helds = [BatchedTransport(raw, batch) for raw, _ in pairs]
        helds[1].write_eof()
        for i, held in enumerate(helds):
            held.write(b"to %d" % i)
        await turn()
        assert helds[1].is_closing()  # aborted
        for i in (0, 2):
            helds[i].close()
            assert await pairs[i][1].read_all() == (b"to %d" % i, "eof")

    with caplog.at_level(logging.ERROR, logger="gateway.proxy"):
        run(scenario())
    assert "a held write failed" in caplog.text


def test_a_write_after_the_connection_closed_is_dropped(run: Runner) -> None:
    async def scenario() -> None:
        raw, peer = await connected()
        held = BatchedTransport(raw, write_batch(asyncio.get_running_loop()))
        held.close()
        held.write(b"too late")  # e.g. an answer finished after the client left
        await turn()  # no error: the closed transport is not written
        assert await peer.read_all() == (b"", "eof")

    run(scenario())


OPS = st.lists(
    st.one_of(
        st.binary(min_size=1, max_size=300).map(lambda data: ("write", data)),
        st.just(("turn", b"")),
        st.just(("detach", b"")),
    ),
    max_size=30,
).flatmap(lambda ops: st.sampled_from(("close", "write_eof")).map(lambda end: [*ops, (end, b"")]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_the_peer_receives_what_direct_writes_deliver(ops: list[tuple[str, bytes]]) -> None:
    """Differential: any sequence of writes, turns, a hand-over and an ending (close,
    half-close, abort), done to a batched transport and to a plain one: both peers
    receive the same bytes and the same end."""

    async def scenario() -> None:
        raw_a, peer_a = await connected()
        raw_b, peer_b = await connected()
        held = BatchedTransport(raw_a, write_batch(asyncio.get_running_loop()))
        straight: Any = raw_a  # writes after a hand-over go to the transport itself too
        detached = False
        for op, data in ops:
            if op == "write":
                (straight if detached else held).write(data)
                raw_b.write(data)
            elif op == "turn":
                await turn()
            elif op == "detach":
                straight = held.detach()
                detached = True
            elif op == "close":
                held.close()
                raw_b.close()
            elif op == "abort":
                held.abort()
                raw_b.abort()
            else:
                held.write_eof()
                raw_b.write_eof()
                await turn()
                held.close()
                raw_b.close()
        assert await peer_a.read_all() == await peer_b.read_all()

    for runner in RUNNERS.values():
        runner(scenario())
