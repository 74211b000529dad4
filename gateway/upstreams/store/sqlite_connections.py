"""SQLite connections on worker threads, so the event loop never blocks: opening the file
(WAL, busy timeout, the schema made current), running reads, and committing writes.

One writer thread per process owns the write connection; a small pool of reader threads has
one connection each. Writes queue up and the writer commits whatever has accumulated in one
short transaction (group commit: one fsync for many writes), then acknowledges each; nothing
is acknowledged before its commit. Several processes may share the file: WAL lets readers
proceed beside the writer and the busy timeout makes writers of different processes take
turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.upstreams.store.config import StoreConfig
from gateway.upstreams.store.errors import StoreBusyError, StoreQueryTimeoutError
from gateway.upstreams.store.filters import CANONICAL_JSON_SQL_FUNCTION, canonical_json_text
from gateway.upstreams.store.schema import SCHEMA_VERSION, upgrade_script
from gateway.upstreams.store.vector_dialect import IndexConnection
from gateway.upstreams.store.vectors import VECTOR_SCHEMA

T = TypeVar("T")

# Upper bound on writes committed together, so one transaction stays short.
MAX_GROUP_COMMIT = 256
# How many SQLite VM steps run between two checks of a reader's deadline: about a
# millisecond of work, rare enough that the check (which takes the GIL) costs nothing.
PROGRESS_CHECK_STEPS = 100_000


@contextlib.contextmanager
def _snapshot(connection: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """A read transaction, so several SELECTs see one state of the database."""
    connection.execute("BEGIN")
    try:
        yield connection
    finally:
        # An interrupted statement (a read over its budget) may have ended the transaction.
        if connection.in_transaction:
            connection.execute("COMMIT")


class SQLiteConnections:
    """One SQLite file's connections: a writer thread with group commit, reader threads.

    ``SQLiteStorage`` (``storage.py``) builds the Store's operations on ``_run`` (a read on
    a reader thread) and ``_write`` (a write in the writer's next group commit).
    """

    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.time) -> None:
        self._config = config
        self._clock = clock
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        self._local = threading.local()
        self._writer: ThreadPoolExecutor | None = None
        self._write_queue: queue.SimpleQueue[
            tuple[Callable[[sqlite3.Connection], Any], Future[Any]]
        ] = queue.SimpleQueue()
        self._readers: ThreadPoolExecutor | None = None

    # -- lifetime -----------------------------------------------------------------

    async def open(self) -> None:
        """Create the data directory and schema, and start the worker threads."""
        self._writer = ThreadPoolExecutor(
            1, thread_name_prefix="store-writer", initializer=self._attach_connection
        )
        self._readers = ThreadPoolExecutor(
            self._config.read_threads,
            thread_name_prefix="store-reader",
            initializer=self._attach_reader_connection,
        )
        await self._run(self._writer, self._migrate)
        if self._config.index is not None:
            # Hook (issue 12): vector tables, only when an index is configured.
            await self._run(self._writer, self._create_vector_tables)

    def _create_vector_tables(self) -> None:
        connection = self._connection()
        script = f"BEGIN IMMEDIATE;{VECTOR_SCHEMA}COMMIT;"
        self._retry_locked(lambda: connection.executescript(script))

    async def close(self) -> None:
        """Stop the worker threads and close every connection."""
        executors = [e for e in (self._writer, self._readers) if e is not None]
        self._writer = self._readers = None
        loop = asyncio.get_running_loop()
        for executor in executors:
            await loop.run_in_executor(None, functools.partial(executor.shutdown, wait=True))
        with self._connections_lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            connection.close()

    def _connect(self) -> sqlite3.Connection:
        self._config.data_dir.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(
            self._config.database_path,
            timeout=self._config.busy_timeout_seconds,
            isolation_level=None,  # autocommit: each write statement commits on its own
            check_same_thread=False,  # created on its worker thread, closed at shutdown
        )
        connection.execute(f"PRAGMA busy_timeout = {int(self._config.busy_timeout_seconds * 1000)}")
        self._retry_locked(lambda: connection.execute("PRAGMA journal_mode = WAL"))
        connection.execute(f"PRAGMA synchronous = {self._config.sqlite_synchronous.upper()}")
        connection.create_function(
            CANONICAL_JSON_SQL_FUNCTION, 1, canonical_json_text, deterministic=True
        )
        return connection

    def _attach_connection(self) -> None:
        connection = self._connect()
        self._local.connection = connection
        with self._connections_lock:
            self._connections.append(connection)

    def _attach_reader_connection(self) -> None:
        """A reader's connection, whose statements stop once the running read is past its
        deadline (``_budgeted``): SQLite calls the handler every ``PROGRESS_CHECK_STEPS``
        steps and aborts the statement ("interrupted") when it answers non-zero."""
        self._attach_connection()
        local = self._local
        local.deadline = math.inf

        def past_deadline() -> int:
            return 1 if time.monotonic() > local.deadline else 0

        self._connection().set_progress_handler(past_deadline, PROGRESS_CHECK_STEPS)

    def _budgeted(self, call: Callable[[], T]) -> Callable[[], T]:
        """``call`` run on a reader under the per-query budget; over it, the statement is
        interrupted and the caller gets ``StoreQueryTimeoutError`` (503)."""
        budget = self._config.query_timeout_seconds

        def run() -> T:
            self._local.deadline = time.monotonic() + budget
            try:
                return call()
            except sqlite3.OperationalError as exc:
                if str(exc) == "interrupted":
                    raise StoreQueryTimeoutError(budget) from exc
                raise
            finally:
                self._local.deadline = math.inf

        return run

    def _retry_locked(self, action: Callable[[], object]) -> None:
        # Switching to WAL takes an exclusive lock that the busy handler does not cover
        # when several processes open a fresh file at once.
        deadline = time.monotonic() + self._config.busy_timeout_seconds
        while True:
            try:
                action()
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _migrate(self) -> None:
        connection = self._connection()
        version = connection.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{self._config.database_path} has store schema {version}; "
                f"this version understands up to {SCHEMA_VERSION}"
            )
        script = upgrade_script(version)
        self._retry_locked(lambda: connection.executescript(f"BEGIN IMMEDIATE;{script}COMMIT;"))

    def _connection(self) -> sqlite3.Connection:
        connection: sqlite3.Connection = self._local.connection
        return connection

    async def _run(self, executor: ThreadPoolExecutor | None, call: Callable[[], T]) -> T:
        if executor is None:
            raise RuntimeError("the store is not open")
        if executor is self._readers:
            call = self._budgeted(call)
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, call)
        except sqlite3.OperationalError as exc:
            raise _busy_or_same(exc) from exc

    async def _write(self, operation: Callable[[sqlite3.Connection], T]) -> T:
        """Queue a write; it returns once the transaction holding it has committed."""
        if self._writer is None:
            raise RuntimeError("the store is not open")
        done: Future[Any] = Future()
        self._write_queue.put((operation, done))
        self._writer.submit(self._commit_queued_writes)
        try:
            result: T = await asyncio.wrap_future(done)
        except sqlite3.OperationalError as exc:
            raise _busy_or_same(exc) from exc
        return result

    def _commit_queued_writes(self) -> None:
        batch: list[tuple[Callable[[sqlite3.Connection], Any], Future[Any]]] = []
        while len(batch) < MAX_GROUP_COMMIT:
            try:
                operation, done = self._write_queue.get_nowait()
            except queue.Empty:
                break
            if done.set_running_or_notify_cancel():  # False: the caller gave up
                batch.append((operation, done))
        if not batch:
            return  # an earlier call already committed these writes
        connection = self._connection()
        outcomes: list[tuple[Future[Any], Any, BaseException | None]] = []
        try:
            connection.execute("BEGIN IMMEDIATE")
            for operation, done in batch:
                outcomes.append((done, *_isolated(connection, operation)))
            connection.execute("COMMIT")
        except Exception as exc:  # the transaction itself failed: every waiter hears so
            if connection.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    connection.execute("ROLLBACK")
            for _, done in batch:
                done.set_exception(exc)
            return
        for done, result, error in outcomes:
            if error is None:
                done.set_result(result)
            else:
                done.set_exception(error)

    # -- hooks for the embedding index (issue 12): its own SQL, on these threads -------

    async def read(self, call: Callable[[IndexConnection, float], T]) -> T:
        """Run ``call(connection, now)`` in one read transaction on a reader thread."""
        now = self._clock()

        def in_snapshot() -> T:
            with _snapshot(self._connection()) as connection:
                return call(connection, now)

        return await self._run(self._readers, in_snapshot)

    async def write(self, call: Callable[[IndexConnection], T]) -> T:
        """Run ``call(connection)`` inside the writer's next group commit."""
        return await self._write(call)


def _busy_or_same(exc: sqlite3.OperationalError) -> Exception:
    if "locked" in str(exc) or "busy" in str(exc):
        return StoreBusyError()
    return exc


# Write operations: each runs inside the writer's group-commit transaction.


def _isolated(
    connection: sqlite3.Connection, operation: Callable[[sqlite3.Connection], Any]
) -> tuple[Any, Exception | None]:
    """Run one queued write under its own savepoint: if it fails, for whatever reason, only
    its own changes are undone and only its caller hears of it; the batch still commits.

    A failure to roll back to the savepoint (the transaction is gone) propagates, and then
    the whole batch fails, as it must.
    """
    connection.execute("SAVEPOINT store_write")
    try:
        result = operation(connection)
    except Exception as exc:
        connection.execute("ROLLBACK TO store_write")
        connection.execute("RELEASE store_write")
        return None, exc
    connection.execute("RELEASE store_write")
    return result, None
