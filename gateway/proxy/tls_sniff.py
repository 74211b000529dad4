"""The TLS port's connections: TLS on top of the loop's plain TCP transport, with a look
at the first byte so that a plain-HTTP request gets a readable 400 instead of a failed
handshake.

Why not ``loop.create_server(ssl=ctx)``: a plain ``http://`` request to such a port just
fails the handshake (the client sees a reset or garbage, not a reason), and the
application protocol only learns of a connection once its handshake is done, so sockets
that stall in the handshake are neither counted against the gateway's connection caps
nor closed by its header deadline. Why not ``loop.start_tls``: it cannot be given the
bytes already read to decide between TLS and plain HTTP.

So each accepted socket gets a ``TlsServerConnection``. It is the TCP transport's
protocol and, to the application protocol (the gateway's ``ClientConnection``, or any
``asyncio.Protocol``), the transport:

* the application protocol is made and told ``connection_made`` at once, on accept, as
  on plain TCP (so its connection caps and deadlines cover the handshake too);
* the first byte 0x16 (a TLS handshake record) starts TLS with an ``ssl.SSLObject`` over
  memory BIOs, with the context current at that moment (so a certificate rotation
  applies to new connections and never touches open ones); the handshake has its own
  deadline;
* anything else is answered ``400`` (JSON ``detail``) and the connection closes;
* after the handshake the application reads decrypted bytes (``data_received``), writes
  plaintext, and sees the TCP transport's flow control (pause/resume reading and
  writing, write buffer size and limits), ``peername``/``socket``, plus ``peercert``,
  ``ssl_object``, ``cipher`` and ``sslcontext``.

Only the loop's public transport API is used, so this runs the same on asyncio's own
loop and on uvloop (whose transports are not ``asyncio.Transport`` subclasses).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final, cast

from cryptography import x509

from gateway.proxy.wire import Answer

log = logging.getLogger("gateway.tls")

TLS_HANDSHAKE_RECORD: Final = 0x16  # the content type of the record carrying a ClientHello
DEFAULT_HANDSHAKE_TIMEOUT: Final = 10.0
# At most this much plaintext goes to one data_received call (as a plain TCP read gives
# at most 256 KiB); the rest follows once the loop has turned.
MAX_DELIVERY: Final = 256 * 1024
READ_SIZE: Final = 64 * 1024
# After the plain-HTTP 400: how long, and how many bytes, the client's request is read
# and dropped before closing (closing with unread bytes makes the kernel send a reset
# that can destroy the answer before the client reads it).
PLAIN_LINGER_SECONDS: Final = 2.0
PLAIN_LINGER_BYTES: Final = 256 * 1024
PLAIN_HTTP_DETAIL: Final = "this port speaks HTTPS; use https://"

# Connection states.
SNIFF: Final = 0  # accepted, nothing read yet
HANDSHAKE: Final = 1  # a ClientHello started arriving
OPEN: Final = 2  # the handshake is done: application data flows
PLAIN: Final = 3  # not TLS: answered 400, lingering before the close
CLOSED: Final = 4  # the TCP connection is gone

ContextGetter = Callable[[], ssl.SSLContext]


def subject_of(ssl_object: ssl.SSLObject | ssl.SSLSocket) -> str | None:
    """The subject (RFC 4514) of the client certificate ``ssl_object`` verified, or None:
    no certificate, or none was asked for (CERT_NONE: nothing was verified), or one
    with an empty subject (no identity to count by)."""
    if ssl_object.context.verify_mode == ssl.CERT_NONE:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        return None
    return x509.load_der_x509_certificate(der).subject.rfc4514_string() or None


def plain_http_answer() -> bytes:
    """The whole answer to a plain-HTTP request on the TLS port."""
    return Answer.error(400, PLAIN_HTTP_DETAIL).encode(keep_alive=False, head_only=False)


@dataclass(slots=True)
class TlsStats:
    """Counts of one TLS listener (or several sharing it), for metrics and /info."""

    handshakes: int = 0  # completed
    handshake_failures: int = 0  # refused by TLS (protocol version, client certificate...)
    handshake_timeouts: int = 0  # not completed within the handshake timeout
    plain_http: int = 0  # answered 400: not TLS


class TlsServerConnection(asyncio.Transport, asyncio.Protocol):
    """One accepted TLS-port connection: the TCP transport's protocol, and the transport
    of the application protocol (see the module's docstring)."""

    def __init__(
        self,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        contexts: ContextGetter,
        loop: asyncio.AbstractEventLoop,
        handshake_timeout: float,
        stats: TlsStats,
    ) -> None:
        super().__init__()
        self._factory = protocol_factory
        self._contexts = contexts
        self._loop = loop
        self._handshake_timeout = handshake_timeout
        self._stats = stats
        self._raw: asyncio.Transport | None = None
        self._app: asyncio.Protocol | None = None
        self._state = SNIFF
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._sslobj: ssl.SSLObject | None = None
        self._context: ssl.SSLContext | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._error: Exception | None = None  # why the connection ended, for the app
        self._closing = False  # the app closed or aborted, or we did
        self._app_paused = False  # the app asked not to read
        self._raw_paused = False  # we paused the TCP transport for it
        self._app_writing_paused = False
        self._eof_sent = False  # write_eof(): close_notify and the TCP FIN are out
        self._peer_eof_pending = False  # the peer's EOF waits behind paused reading
        self._peer_eof_told = False
        self._drain_scheduled = False
        self._lost = False
        self._early: list[bytes] = []  # the app's writes before the handshake ended
        self._early_size = 0
        self._dropped = 0  # bytes read and dropped after the plain-HTTP 400
        self._opened = False  # the handshake completed (its peer certificate is known)
        self._subject: str | None = None
        self._subject_known = False

    def __repr__(self) -> str:
        states = ("sniff", "handshake", "open", "plain", "closed")
        return f"<TlsServerConnection {states[self._state]} peer={self._peer()}>"

    # --- the TCP transport's protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        raw = self._raw = cast(asyncio.Transport, transport)
        try:
            app = self._factory()
        except BaseException:
            # As when create_server's own factory call fails: the socket is closed.
            self._closing = True
            raw.abort()
            raise
        self._app = cast(asyncio.Protocol, app)
        # Told at once, as on plain TCP: the application's connection caps and its
        # header deadline cover a client that never sends a byte or stalls mid-handshake.
        app.connection_made(self)

    def data_received(self, data: bytes) -> None:
        state = self._state
        if state == OPEN:
            self._incoming.write(data)
            self._drain()
        elif state == HANDSHAKE:
            self._incoming.write(data)
            self._handshake()
        elif state == SNIFF:
            if self._closing:
                return
            if data[0] != TLS_HANDSHAKE_RECORD:
                self._refuse_plain(len(data))
                return
            self._start_tls(data)
        elif state == PLAIN:
            self._dropped += len(data)
            if self._dropped > PLAIN_LINGER_BYTES and self._raw is not None:
                self._raw.close()

    def eof_received(self) -> bool | None:
        if self._state != OPEN or self._closing:
            return False  # the TCP transport closes itself; connection_lost follows
        self._drain()  # (nothing while the app has reading paused)
        if self._app_paused or self._drain_scheduled:
            # After the data still waiting, as on plain TCP, where the EOF is only read
            # once reading resumes.
            self._peer_eof_pending = True
        else:
            self._peer_eof()
        return True  # closing is ours (after the app's eof_received), not the transport's

    def connection_lost(self, exc: Exception | None) -> None:
        self._state = CLOSED
        self._closing = True
        self._cancel_timer()
        self._early.clear()
        self._early_size = 0
        if self._lost:
            return
        self._lost = True
        app = self._app
        if app is not None:
            app.connection_lost(exc if exc is not None else self._error)

    def pause_writing(self) -> None:
        if not self._app_writing_paused and self._app is not None and not self._lost:
            self._app_writing_paused = True
            self._app.pause_writing()

    def resume_writing(self) -> None:
        if self._app_writing_paused and self._app is not None and not self._lost:
            self._app_writing_paused = False
            self._app.resume_writing()

    # --- sniff and handshake

    def _refuse_plain(self, size: int) -> None:
        raw = self._raw
        assert raw is not None
        self._state = PLAIN
        self._stats.plain_http += 1
        self._dropped = size
        log.debug("%s: plain HTTP on the TLS port: answered 400", self._peer())
        raw.write(plain_http_answer())
        if raw.can_write_eof():
            raw.write_eof()
        self._timer = self._loop.call_later(PLAIN_LINGER_SECONDS, raw.close)

    def _start_tls(self, data: bytes) -> None:
        # The context current now: a rotation applies to every handshake started after
        # it, while open connections keep the SSLObject (and context) they started with.
        context = self._context = self._contexts()
        self._sslobj = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._state = HANDSHAKE
        self._timer = self._loop.call_later(self._handshake_timeout, self._handshake_timed_out)
        self._incoming.write(data)
        self._handshake()

    def _handshake(self) -> None:
        sslobj = self._sslobj
        assert sslobj is not None
        try:
            sslobj.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return
        except (ssl.SSLError, OSError) as exc:
            self._handshake_failed(exc)
            return
        self._flush()  # the server's last flight (and TLS 1.3 session tickets)
        self._cancel_timer()
        self._state = OPEN
        self._opened = True
        self._stats.handshakes += 1
        if self._closing:
            return
        early, self._early = self._early, []
        self._early_size = 0
        if early:
            self.writelines(early)
        if self._app_paused:
            self._pause_raw()
        else:
            # A TLS 1.3 client may send its first request with its last handshake flight.
            self._drain()

    def _handshake_failed(self, exc: Exception) -> None:
        self._stats.handshake_failures += 1
        self._error = exc
        self._cancel_timer()
        reason = getattr(exc, "reason", None) or type(exc).__name__
        log.debug("%s: TLS handshake failed: %s", self._peer(), reason)
        self._flush()  # the alert tells the client why
        self._closing = True
        if self._raw is not None:
            self._raw.close()

    def _handshake_timed_out(self) -> None:
        self._timer = None
        if self._state != HANDSHAKE:
            return
        self._stats.handshake_timeouts += 1
        self._error = ConnectionAbortedError(
            f"the TLS handshake did not complete within {self._handshake_timeout} s"
        )
        log.debug("%s: TLS handshake timed out", self._peer())
        self._closing = True
        if self._raw is not None:
            self._raw.abort()

    # --- reading

    def _drain(self) -> None:
        """Decrypt what has arrived and hand it to the app (unless it paused reading)."""
        if self._app_paused or self._state != OPEN or self._closing:
            return
        sslobj = self._sslobj
        app = self._app
        assert sslobj is not None and app is not None
        chunks: list[bytes] = []
        size = 0
        peer_eof = more = False
        try:
            while True:
                chunk = sslobj.read(READ_SIZE)
                if not chunk:  # the peer's close_notify
                    peer_eof = True
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size >= MAX_DELIVERY:
                    more = True
                    break
                if not self._incoming.pending and not sslobj.pending():
                    break  # all read: spare the SSLWantReadError another read would raise
        except ssl.SSLWantReadError:
            pass
        except (ssl.SSLError, OSError) as exc:
            if self._eof_sent:
                # Lingering after our close_notify: what the client sends now is dropped.
                self._incoming.read()
            else:
                self._fail(exc)
                return
        self._flush()  # reading can produce output (a TLS 1.3 key update's answer)
        if chunks and not self._lost:
            app.data_received(chunks[0] if len(chunks) == 1 else b"".join(chunks))
        if peer_eof:
            if self.is_reading():
                self._peer_eof()
            else:  # paused by the data just delivered: told once it resumes
                self._peer_eof_pending = True
        elif more:
            self._schedule_drain()

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon(self._scheduled_drain)

    def _scheduled_drain(self) -> None:
        self._drain_scheduled = False
        if self._app_paused or self._state != OPEN:
            return
        try:
            self._drain()
            if self._peer_eof_pending and not self._app_paused and not self._drain_scheduled:
                self._peer_eof_pending = False
                self._peer_eof()
        except Exception as exc:
            # On plain TCP an exception in data_received closes the connection (the
            # transport catches it); here the loop called us, so the same is done here.
            log.error("%s: the protocol failed on received data", self._peer(), exc_info=exc)
            self._fail(exc)

    def _peer_eof(self) -> None:
        if self._peer_eof_told or self._closing:
            return
        self._peer_eof_told = True
        app = self._app
        assert app is not None
        keep_open = app.eof_received()
        if not keep_open:
            self.close()

    def _fail(self, exc: Exception) -> None:
        self._error = exc
        self._closing = True
        if self._raw is not None:
            self._raw.abort()

    def _pause_raw(self) -> None:
        if not self._raw_paused and self._raw is not None and not self._lost:
            self._raw_paused = True
            self._raw.pause_reading()

    # --- writing

    def _flush(self) -> None:
        out = self._outgoing.read()
        if out and self._raw is not None and not self._lost:
            self._raw.write(out)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _peer(self) -> str:
        peer = self._raw.get_extra_info("peername") if self._raw is not None else None
        return str(peer[0]) if isinstance(peer, tuple) else "-"

    # --- the application's transport

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "sslcontext":
            return self._context if self._context is not None else default
        if name in ("peercert", "ssl_object", "cipher", "compression"):
            sslobj = self._sslobj
            if sslobj is None or not self._opened:
                return default
            if name == "ssl_object":
                return sslobj
            if name == "peercert":
                return sslobj.getpeercert()
            if name == "cipher":
                return sslobj.cipher()
            return sslobj.compression()
        raw = self._raw
        return raw.get_extra_info(name, default) if raw is not None else default

    def is_closing(self) -> bool:
        return self._closing or self._raw is None or self._raw.is_closing()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        raw = self._raw
        if raw is None:
            return
        if self._state == OPEN and not self._eof_sent:
            self._send_close_notify()
        # Buffered ciphertext is sent before the TCP close, as on plain TCP. The peer's
        # close_notify is not waited for (nothing more is read from a closed transport).
        raw.close()

    def abort(self) -> None:
        self._closing = True
        if self._raw is not None:
            self._raw.abort()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._app = cast(asyncio.Protocol, protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self._app is not None
        return self._app

    def is_reading(self) -> bool:
        return not self._app_paused and not self._closing

    def pause_reading(self) -> None:
        if self._app_paused or self._closing:
            return
        self._app_paused = True
        if self._state == OPEN:
            # Decrypted bytes are not taken from the SSLObject while paused, and the TCP
            # transport stops reading: at most one read waits, as on plain TCP.
            self._pause_raw()
        # (sniffing or mid-handshake: the handshake goes on; the pause applies once the
        # connection is open)

    def resume_reading(self) -> None:
        if not self._app_paused or self._closing:
            return
        self._app_paused = False
        if self._raw_paused and self._raw is not None:
            self._raw_paused = False
            self._raw.resume_reading()
        if self._state == OPEN:
            # What was read before the pause may wait in the BIO: deliver it once the
            # loop turns (never from inside the app's own call).
            self._schedule_drain()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        # Ciphertext goes straight to the TCP transport: its buffer is the only one.
        if self._raw is not None:
            self._raw.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        if self._raw is None:
            return (0, 0)
        return self._raw.get_write_buffer_limits()

    def get_write_buffer_size(self) -> int:
        raw = self._raw
        size = self._early_size + self._outgoing.pending
        return size + (raw.get_write_buffer_size() if raw is not None and not self._lost else 0)

    def write(self, data: bytes | bytearray | memoryview[Any]) -> None:
        if self._eof_sent:
            raise RuntimeError("Cannot call write() after write_eof()")
        if not data or self._closing:
            return
        state = self._state
        if state == OPEN:
            sslobj = self._sslobj
            assert sslobj is not None
            try:
                written = sslobj.write(data)
                if written < len(data):  # (memory BIOs take it all; kept general)
                    rest = memoryview(data)[written:]
                    while rest and written > 0:
                        written = sslobj.write(rest)
                        rest = rest[written:]
            except (ssl.SSLError, OSError) as exc:
                self._fail(exc)
                return
            self._flush()
        elif state in (SNIFF, HANDSHAKE):
            # Kept until the handshake is done (an app rarely writes before it has read).
            self._early.append(bytes(data))
            self._early_size += len(data)
        # (PLAIN: the 400 is the whole answer; CLOSED: nothing to write to)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview[Any]]) -> None:
        self.write(b"".join(list_of_data))

    def can_write_eof(self) -> bool:
        raw = self._raw
        return self._state == OPEN and raw is not None and raw.can_write_eof()

    def write_eof(self) -> None:
        """Send close_notify and half-close TCP; the peer's bytes are still read (and
        delivered) after it, as on plain TCP. Only while open (``can_write_eof``)."""
        if self._eof_sent or self._closing:
            return
        self._eof_sent = True
        raw = self._raw
        if raw is None:
            return
        if self._state == OPEN:
            self._send_close_notify()
        if raw.can_write_eof():
            raw.write_eof()

    def _send_close_notify(self) -> None:
        sslobj = self._sslobj
        if sslobj is None:
            return
        # SSLWantReadError: ours is out, the peer's is not waited for
        with contextlib.suppress(ssl.SSLError, OSError):
            sslobj.unwrap()
        self._flush()

    # --- identity

    def peer_subject(self) -> str | None:
        """The verified client certificate's subject (RFC 4514), once parsed."""
        if not self._subject_known and self._opened and self._sslobj is not None:
            self._subject = subject_of(self._sslobj)
            self._subject_known = True
        return self._subject


async def serve_tls(
    loop: asyncio.AbstractEventLoop,
    protocol_factory: Callable[[], asyncio.BaseProtocol],
    contexts: ContextGetter,
    host: str | None = None,
    port: int = 0,
    *,
    sock: Any = None,
    reuse_port: bool = False,
    backlog: int = 1024,
    ssl_handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    stats: TlsStats | None = None,
) -> asyncio.Server:
    """Listen on host:port (or the bound socket ``sock``) and serve TLS there, each new
    handshake with ``contexts()``; see ``gateway.proxy.tls.start_tls_server``."""
    if ssl_handshake_timeout <= 0:
        raise ValueError(f"ssl_handshake_timeout must be positive, not {ssl_handshake_timeout}")
    counts = stats if stats is not None else TlsStats()

    def accepted() -> TlsServerConnection:
        return TlsServerConnection(protocol_factory, contexts, loop, ssl_handshake_timeout, counts)

    if sock is not None:
        return await loop.create_server(accepted, sock=sock, backlog=backlog)
    return await loop.create_server(
        accepted, host, port, reuse_port=reuse_port or None, backlog=backlog
    )
