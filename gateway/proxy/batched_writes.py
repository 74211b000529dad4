"""Writes held until the end of the event loop's turn, then written together.

The data plane answers many connections in one turn of the loop (every read the poll
returned). Written at once, each answer and each request sent upstream wakes its
reader (the client, the upstream server) on its own: the reader, asleep on the other
core, is woken for one message, handles it and sleeps again, and every wake-up costs
the writing core too (an inter-processor interrupt; on a virtual machine, an exit to
the hypervisor). Held to the end of the turn, a turn's writes leave back to back and a
reader woken by the first finds the others waiting. Measured (benchmarks/README.md,
"Third round, eighteenth step"): the upstream's wake-ups a request fell about 5x and
the gateway's CPU a proxied request by about a third.

Nothing is reordered or lost: every operation on a connection's transport goes through
its ``BatchedTransport``, which writes what it holds before closing, half-closing,
aborting or handing the transport over (a tunnel), so the transport sees the same calls
in the same order as before, only later. The one close that does not pass through it is
the transport's own when its protocol's ``eof_received`` returns false: those protocols
(``ClientConnection``, ``UpstreamConnection``) call ``flush`` first. Writes wait at most
until the loop runs its next callbacks (the flush is scheduled with ``call_soon`` by the
turn's first write).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, Final

log = logging.getLogger("gateway.proxy")

# Held bytes past which a transport is written at once: asyncio's default high-water
# mark, so a burst reaches the transport's flow control as soon as it would have.
FLUSH_AT: Final = 64 * 1024


class WriteBatch:
    """The transports of one event loop holding writes, flushed by one callback."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # (weakly: the registry below is keyed by the loop, which must stay collectable)
        self._loop = weakref.ref(loop)
        self._held: list[BatchedTransport] = []
        self._scheduled = False

    def hold(self, transport: BatchedTransport) -> None:
        self._held.append(transport)
        if not self._scheduled:
            loop = self._loop()
            if loop is not None:
                self._scheduled = True
                loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        held = self._held
        self._held = []
        done = 0
        try:
            for transport in held:
                try:
                    transport.flush()
                except Exception:  # one transport's failure must not keep the others' bytes
                    log.exception("a held write failed; closing that connection")
                    transport.drop()
                done += 1
        finally:
            # (a BaseException: the rest are held again, or their next write would not
            # schedule a flush, their list not being empty)
            for transport in held[done + 1 :]:
                self.hold(transport)


# One batch per loop (a process may run loops in several threads, as tests do).
_BATCHES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, WriteBatch] = (
    weakref.WeakKeyDictionary()
)


def write_batch(loop: asyncio.AbstractEventLoop) -> WriteBatch:
    """The loop's batch, made on first use (once per connection, not per write)."""
    batch = _BATCHES.get(loop)
    if batch is None:
        batch = _BATCHES[loop] = WriteBatch(loop)
    return batch


class BatchedTransport:
    """A transport whose writes wait for the end of the loop's turn (see the module)."""

    def __init__(self, raw: asyncio.Transport, batch: WriteBatch) -> None:
        self.raw = raw
        # Bound once: compiled code calls a method of an object it knows only by its
        # interface (here uvloop's transport) by looking the name up on every call
        # (benchmarks/README.md, "Third round, twenty-first step").
        self._raw_write = raw.write
        self._raw_is_closing = raw.is_closing
        self._batch = batch
        self._out: list[bytes] = []
        self._held = 0  # bytes in _out
        self._direct = False  # handed over: writes go straight to ``raw``

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self._direct:
            self._raw_write(data)
            return
        out = self._out
        if not out:
            self._batch.hold(self)
        out.append(data)
        self._held += len(data)
        if self._held >= FLUSH_AT:
            # Much for one turn (a pipelined burst, a download): written now, so the
            # transport's flow control (pause_writing) acts within the turn, as it did
            # when every write went straight to it.
            self.flush()

    def flush(self) -> None:
        """Write what is held now (the batch's callback, or before another operation)."""
        out = self._out
        if not out:
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        self._held = 0
        if not self._raw_is_closing():
            self._raw_write(data)

    def detach(self) -> asyncio.Transport:
        """Write what is held and hand the transport over: from now on writes through
        this object go straight to it too, so none can overtake the new owner's."""
        self.flush()
        self._direct = True
        return self.raw

    def close(self) -> None:
        self.flush()  # (the transport closes after writing its buffer, held bytes first)
        self.raw.close()

    def abort(self) -> None:
        # Written first, as a straight write would have been before the abort (a partial
        # answer cut off by a broken upstream still reaches the client before the end).
        self.flush()
        self.raw.abort()

    def drop(self) -> None:
        """Abort, dropping what is held (its write has just failed)."""
        self._out.clear()
        self._held = 0
        self.raw.abort()

    def write_eof(self) -> None:
        self.flush()
        self.raw.write_eof()

    def can_write_eof(self) -> bool:
        return self.raw.can_write_eof()

    def is_closing(self) -> bool:
        return self._raw_is_closing()

    def get_write_buffer_size(self) -> int:
        return self._held + self.raw.get_write_buffer_size()

    def pause_reading(self) -> None:
        self.raw.pause_reading()

    def resume_reading(self) -> None:
        self.raw.resume_reading()

    def is_reading(self) -> bool:
        return self.raw.is_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.raw.get_extra_info(name, default)
