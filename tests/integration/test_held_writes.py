"""Answers held to the end of the loop's turn (``gateway.proxy.batched_writes``) are never
lost to a close the held transport does not see: a client's end (FIN) read in the same
turn as its answer makes the transport close itself when nothing is left to answer,
and the answer must leave first. On both event loops, through a running gateway.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

from tests.support.gateway import running_app, running_gateway
from tests.support.loops import Runner
from tests.support.upstream import create_upstream_app


def _port(gw: Any) -> int:
    return int(gw.url.rsplit(":", 1)[1])


def _read_to_end(sock: socket.socket) -> bytes:
    got = b""
    while data := sock.recv(65536):
        got += data
    return got


def request_then_end(port: int, target: bytes) -> bytes:
    """One request and the client's FIN in one flight; the answer read till EOF."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: gw\r\n\r\n")
        sock.shutdown(socket.SHUT_WR)
        return _read_to_end(sock)


def test_a_client_that_ends_with_its_request_reads_the_answer(run: Runner) -> None:
    """The gateway's own answers (/ok; a 400) are made in the read that also brings
    the FIN: the connection then has nothing left to answer and closes, after writing."""

    async def scenario() -> None:
        async with running_app(create_upstream_app()) as upstream, running_gateway(upstream) as gw:
            for target, status in ((b"/ok", b"200"), (b"/x", b"200"), (b"/bad path", b"400")):
                for _ in range(5):
                    answer = await asyncio.to_thread(request_then_end, _port(gw), target)
                    assert answer.startswith(b"HTTP/1.1 " + status), (target, answer)
                    assert answer.endswith(b"}"), (target, answer)  # the whole JSON body

    run(scenario())


def test_an_upstream_answer_and_the_clients_end_in_one_turn_both_arrive(run: Runner) -> None:
    """The upstream's answer and the client's FIN become readable while the gateway's
    loop is busy, so one turn relays the answer (held), ends the request and reads the
    end (the connection closes): the answer still reaches the client."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    answered = threading.Event()
    loops: list[asyncio.AbstractEventLoop] = []

    def upstream() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    data = conn.recv(65536)
                    if not data:
                        break
                    head += data
                if not head:
                    continue
                # Keep the gateway's loop busy while the answer and the FIN arrive.
                loops[0].call_soon_threadsafe(time.sleep, 0.5)
                time.sleep(0.1)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
                answered.set()
                time.sleep(1.0)  # (not closed before the gateway has read the answer)

    def client(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"GET /x HTTP/1.1\r\nHost: gw\r\n\r\n")
            assert answered.wait(10)
            answered.clear()
            time.sleep(0.05)  # (well inside the gateway's busy 0.5 s)
            sock.shutdown(socket.SHUT_WR)
            return _read_to_end(sock)

    async def scenario() -> None:
        loops.append(asyncio.get_running_loop())
        thread = threading.Thread(target=upstream, daemon=True)
        thread.start()
        try:
            port = listener.getsockname()[1]
            async with running_gateway(f"http://127.0.0.1:{port}") as gw:
                for _ in range(3):
                    answer = await asyncio.to_thread(client, _port(gw))
                    assert answer.startswith(b"HTTP/1.1 200"), answer
                    assert answer.endswith(b"\r\n\r\nhello"), answer
        finally:
            listener.close()

    run(scenario())
