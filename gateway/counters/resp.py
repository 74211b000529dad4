"""A lean Redis connection for the counter path: an asyncio Protocol, replies parsed by hiredis.

Why not redis-py here: for standalone servers (``redis://``, ``rediss://``, ``unix://``)
and each master of a Redis Cluster, the counter path sends pre-packed EVALSHA pipelines
and reads back flat integer arrays, and redis-py's asyncio connection wraps each reply
in a stream read, a parser call and its bookkeeping, and each round trip in a pool
checkout and a retry wrapper: ~67 us of CPU per round trip and ~1.8 us per reply,
against ~31 and ~0.3 here (``benchmarks/README.md``, "Counter wire"; the Redis rows of
``dataplane_bench.py``). Sentinel keeps redis-py, which knows its topology; so does a
Cluster's slot map.

One connection carries every round trip: Redis answers in the order it was asked, so
the replies are handed back in order (pipelining), and a round trip costs one write
and the reads its replies arrive in. A Redis Cluster gets one per master
(``gateway/counters/cluster.py``). What redis-py's pool did for the counter path is
kept:

* a connection that died (a restarted server) is replaced once within the same call
  when the call had been sent on a connection made before it, so the first calls after
  a restart succeed;
* a call given up while its replies are outstanding (its caller's hard bound ran out
  on a hung server) drops the connection: the next call starts on a fresh one rather
  than behind a reply that may never come;
* connecting (TCP or Unix socket, TLS, ``AUTH``, ``SELECT``) is bounded by
  ``connect_timeout``; reads are bounded by the caller around the whole round trip.

Errors are redis-py's, so the resilience wrapper classifies them as before: a lost or
refused connection is ``ConnectionError``, an error reply is ``ResponseError`` (``NoScriptError``
for ``NOSCRIPT``), a failed ``AUTH`` is ``AuthenticationError``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import hiredis
from redis.exceptions import (
    AuthenticationError,
    ConnectionError,
    NoScriptError,
    ResponseError,
)

from gateway.counters.base import hand_over
from gateway.counters.errors import GivenUpError, seconds_text

__all__ = [
    "GivenUpError",
    "Replied",
    "RespClient",
    "RespConnection",
    "pack",
    "reply_error",
    "tls_context",
]


def pack(args: tuple[str | int | bytes, ...]) -> bytes:
    """One command in RESP, packed by hiredis (C)."""
    # Any: hiredis's stub types the argument as a 1-tuple.
    packed: bytes = hiredis.pack_command(cast(Any, args))
    return packed


def reply_error(exc: ResponseError) -> Exception:
    """The redis-py class for an error reply, by its code (only ``NOSCRIPT`` matters here)."""
    text = str(exc)
    error: Exception = exc  # typed here: the build sees redis's classes as Any
    if text.startswith("NOSCRIPT"):
        error = NoScriptError(text)
    elif text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
        error = AuthenticationError(text)
    return error


# What a round trip sent by ``send_now`` hands back: its replies, or why it failed.
Replied = Callable[[list[Any] | Exception], None]


class _Waiter:
    """One round trip: how many replies it expects, what has arrived, and who gets them
    (a future for ``call``, a callback for ``send_now``)."""

    __slots__ = ("callback", "count", "future", "replies")

    def __init__(
        self, count: int, future: asyncio.Future[list[Any]] | None, callback: Replied | None
    ) -> None:
        self.count = count
        self.future = future
        self.callback = callback
        self.replies: list[Any] = []

    def finish(self, outcome: list[Any] | Exception) -> None:
        hand_over(self.future, self.callback, outcome)  # never raises: the read goes on


class RespConnection(asyncio.Protocol):
    """One connection to a Redis server; ``request`` writes packed commands and returns
    a future of their replies, ``request_cb`` hands them to a callback (error replies as
    ``ResponseError`` values, in place, either way)."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader(replyError=ResponseError)
        self._waiting: deque[_Waiter] = deque()
        self._transport: asyncio.Transport | None = None
        self.closed = False
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        waiting = self._waiting
        while True:
            try:
                reply = reader.gets()
            except hiredis.ProtocolError:
                # given up: the server may have run the commands; not sent again
                self.abort("the counter store sent a reply that is not RESP", given_up=True)
                return
            if reply is False:
                return
            if not waiting:
                self.abort("the counter store sent a reply no one asked for", given_up=True)
                return
            waiter = waiting[0]
            waiter.replies.append(reply)
            if len(waiter.replies) == waiter.count:
                waiting.popleft()
                waiter.finish(waiter.replies)

    def eof_received(self) -> bool | None:
        return False  # close: the server hung up

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError("lost the connection to the counter store"))

    def request(self, data: bytes, count: int) -> asyncio.Future[list[Any]]:
        """Send ``data`` (``count`` packed commands); the future gets their replies."""
        if count < 1:
            raise ValueError("a round trip carries at least one command")
        future: asyncio.Future[list[Any]] = self._loop.create_future()
        if self.closed or self._transport is None:
            future.set_exception(ConnectionError("the connection to the counter store is closed"))
            return future
        self._waiting.append(_Waiter(count, future, None))
        self._transport.write(data)
        return future

    def request_cb(self, data: bytes, count: int, callback: Replied) -> bool:
        """Send ``data``; ``callback`` gets the replies (or the failure) later, from the
        read that completes them. False, and nothing sent, on a closed connection."""
        if count < 1:
            raise ValueError("a round trip carries at least one command")
        transport = self._transport
        if self.closed or transport is None:
            return False
        self._waiting.append(_Waiter(count, None, callback))
        transport.write(data)
        return True

    @property
    def local_address(self) -> str:
        """This end's address (``host:port``, as the server's ``CLIENT LIST`` shows it;
        "" for a Unix socket)."""
        transport = self._transport
        name = transport.get_extra_info("sockname") if transport is not None else None
        if isinstance(name, tuple) and len(name) >= 2:
            return f"{name[0]}:{name[1]}"
        return ""

    def abort(self, why: str, given_up: bool = False) -> None:
        """Drop the connection now; every round trip in flight fails with ``why``."""
        transport = self._transport
        self._fail(GivenUpError(why) if given_up else ConnectionError(why))
        if transport is not None:
            transport.abort()

    def _fail(self, error: Exception) -> None:
        self.closed = True
        waiting = self._waiting
        while waiting:
            waiting.popleft().finish(error)


def _drop(conn: RespConnection | None, why: str) -> None:
    if conn is not None:
        conn.abort(why, given_up=True)


def tls_context(
    *,
    ca_certs: str | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    cert_reqs: str = "required",
    check_hostname: bool = True,
) -> ssl.SSLContext:
    """The client TLS context, with the same defaults and options as redis-py's."""
    context = ssl.create_default_context()
    verify = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
    mode = verify[cert_reqs]
    context.check_hostname = check_hostname and mode != ssl.CERT_NONE
    context.verify_mode = mode
    if certfile or keyfile:
        context.load_cert_chain(certfile=certfile or "", keyfile=keyfile)
    if ca_certs:
        context.load_verify_locations(cafile=ca_certs)
    return context


class RespClient:
    """The connection to one standalone server, made on first use and replaced when lost.

    ``host``/``port`` or ``path`` (a Unix socket); ``tls`` for ``rediss://``.
    """

    def __init__(
        self,
        *,
        host: str = "",
        port: int = 6379,
        path: str = "",
        tls: ssl.SSLContext | None = None,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        connect_timeout: float = 1.0,
    ) -> None:
        if not host and not path:
            raise ValueError("a host or a socket path is needed")
        self._host = host
        self._port = port
        self._path = path
        self._tls = tls
        self._username = username
        self._password = password
        self._db = db
        self._connect_timeout = connect_timeout
        self._conn: RespConnection | None = None
        self._connecting: asyncio.Task[RespConnection] | None = None
        self._closed = False
        # Connections made, for tests and /info-style checks.
        self.connects = 0

    @property
    def local_address(self) -> str:
        """The open connection's own address (``RespConnection.local_address``), "" when
        none is open: which of the server's clients it is, for tests."""
        conn = self._conn
        return conn.local_address if conn is not None and not conn.closed else ""

    @property
    def where(self) -> str:
        """The address, for messages (never the credentials)."""
        return f"unix://{self._path}" if self._path else f"{self._host}:{self._port}"

    async def call(self, data: bytes, count: int) -> list[Any]:
        """Send ``count`` packed commands and return their replies, in order.

        An error reply is that command's entry (a ``ResponseError``); a lost connection
        raises ``ConnectionError``, once more only when it also fails on a new one.
        """
        conn = self._conn
        fresh = conn is None or conn.closed
        if fresh:
            conn = await self._connection()
        assert conn is not None
        replies: list[Any] | None = None
        try:
            replies = await self._await(conn, conn.request(data, count))
        except ConnectionError:
            if fresh or self._closed:
                raise
        if replies is not None:
            return replies
        # A connection made before this call died under it (a restarted server):
        # one more try on a new one, as redis-py's pool retries once.
        conn = await self._connection()
        return await self._await(conn, conn.request(data, count))

    async def _await(self, conn: RespConnection, future: asyncio.Future[list[Any]]) -> list[Any]:
        try:
            return await future
        except asyncio.CancelledError:
            # Given up with replies outstanding: they would come, if ever, before any
            # later call's. A fresh connection for the next call instead.
            conn.abort("a call to the counter store was given up", given_up=True)
            raise

    def send_now(self, data: bytes, count: int, callback: Replied) -> bool:
        """``call`` without a coroutine, on the connection already open: ``callback``
        gets the replies or the failure later, from the read that completes them (no
        retry: a failed round trip is the caller's to send again). False, and nothing
        sent, when no connection is open (then ``call``, which connects)."""
        conn = self._conn
        if conn is None or self._closed:
            return False
        return conn.request_cb(data, count, callback)

    async def ping(self) -> bool:
        """Whether the server answers PING. A caller's timeout only stops the wait: the
        reply is still read when it comes, so the connection every counter round shares
        is not dropped because a health check gave up."""
        conn = await self._connection()
        answered: asyncio.Future[list[Any] | Exception] = asyncio.get_running_loop().create_future()

        def got(outcome: list[Any] | Exception) -> None:
            if not answered.done():
                answered.set_result(outcome)

        if not conn.request_cb(pack(("PING",)), 1, got):
            return False
        outcome = await answered
        return isinstance(outcome, list) and outcome[0] == b"PONG"

    def drop(self, why: str) -> None:
        """Drop the open connection (a round trip on it was given up); the next call
        connects anew."""
        conn = self._conn
        if conn is not None:
            conn.abort(why, given_up=True)

    async def command(self, *args: str | int | bytes) -> Any:
        """One command; an error reply raises."""
        reply = (await self.call(pack(args), 1))[0]
        if isinstance(reply, ResponseError):
            raise reply_error(reply)
        return reply

    async def _connection(self) -> RespConnection:
        if self._closed:
            raise ConnectionError("the counter store client is closed")
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        task = self._connecting
        if task is None or task.done():
            task = self._connecting = asyncio.ensure_future(self._connect())
        # Shielded: one caller giving up does not stop the connect the others wait for.
        return await asyncio.shield(task)

    async def _connect(self) -> RespConnection:
        loop = asyncio.get_running_loop()
        # Held outside the try: a connection made but not set up in time (a server that
        # accepts and then does not answer AUTH) is closed, not left open and unowned.
        made: RespConnection | None = None
        try:
            async with asyncio.timeout(self._connect_timeout):
                if self._path:
                    _, made = await loop.create_unix_connection(RespConnection, self._path)
                else:
                    _, made = await loop.create_connection(
                        RespConnection,
                        self._host,
                        self._port,
                        ssl=self._tls,
                        server_hostname=self._host if self._tls is not None else None,
                    )
                await self._handshake(made)
        except TimeoutError:
            _drop(made, "the connection setup ran out of time")
            raise ConnectionError(
                f"no connection to the counter store at {self.where} "
                f"within {seconds_text(self._connect_timeout)}s"
            ) from None
        except OSError as exc:
            _drop(made, "the connection setup failed")
            raise ConnectionError(
                f"cannot connect to the counter store at {self.where}: {exc.strerror or str(exc)}"
            ) from None
        except BaseException:  # a refused handshake, a cancelled connect
            _drop(made, "the connection setup failed")
            raise
        conn = made
        self.connects += 1
        if self._closed:
            conn.abort("the counter store client is closed", given_up=True)
            raise ConnectionError("the counter store client is closed")
        self._conn = conn
        return conn

    async def _handshake(self, conn: RespConnection) -> None:
        commands: list[tuple[str | int, ...]] = []
        # As redis-py: AUTH only with a user or a non-empty password ("redis://:@host"
        # means none), and a user without a password sends an empty one.
        if self._username:
            commands.append(("AUTH", self._username, self._password or ""))
        elif self._password:
            commands.append(("AUTH", self._password))
        if self._db:
            commands.append(("SELECT", self._db))
        if not commands:
            return
        data = b"".join(pack(c) for c in commands)
        replies = await conn.request(data, len(commands))
        for reply in replies:
            if isinstance(reply, ResponseError):
                conn.abort("the handshake with the counter store failed")
                error = reply_error(reply)
                if isinstance(error, AuthenticationError) or "AUTH" in str(error):
                    raise AuthenticationError(f"the counter store refused the credentials: {error}")
                raise ConnectionError(f"the counter store refused the connection setup: {error}")

    async def close(self) -> None:
        self._closed = True
        task = self._connecting
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        conn = self._conn
        self._conn = None
        if conn is not None:
            conn.abort("the counter store client is closed", given_up=True)
