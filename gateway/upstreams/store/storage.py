"""SQLite storage of Store items, run on worker threads so the event loop never blocks.

One writer thread per process owns the write connection; a small pool of reader threads has
one connection each. Writes queue up and the writer commits whatever has accumulated in one
short transaction (group commit: one fsync for many writes), then acknowledges each; nothing
is acknowledged before its commit. Several processes may share the file: WAL lets readers
proceed beside the writer and the busy timeout makes writers of different processes take
turns.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import json
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from gateway.upstreams.store.config import StoreConfig
from gateway.upstreams.store.errors import StoreRequestError
from gateway.upstreams.store.filters import (
    CANONICAL_JSON_SQL_FUNCTION,
    canonical_json_text,
    compile_filter,
)

# Hook (issue 12): `hybrid` and `vectors` are the embedding index's modules.
from gateway.upstreams.store.hybrid import Ranker
from gateway.upstreams.store.models import (
    Item,
    Namespace,
    SearchItem,
    StoreListNamespacesRequest,
    StorePutRequest,
    StoreSearchRequest,
)
from gateway.upstreams.store.schema import SCHEMA_VERSION, upgrade_script
from gateway.upstreams.store.text_index import match_expression, searchable_text
from gateway.upstreams.store.vector_dialect import SQLITE, IndexConnection, VectorDialect
from gateway.upstreams.store.vectors import VECTOR_SCHEMA, ItemVectors, item_id

T = TypeVar("T")

SWEEP_BATCH = 500
# Upper bound on writes committed together, so one transaction stays short.
MAX_GROUP_COMMIT = 256
_ITEM_COLUMNS = "i.namespace, i.key, i.value, i.created_at, i.updated_at, i.id, i.ttl_minutes"
_LIVE = "(i.expires_at IS NULL OR i.expires_at > ?)"
_LIVE_S = "(s.expires_at IS NULL OR s.expires_at > ?)"
# A search under a namespace prefix holding at most this many live items ranks only those
# items (see SQLiteStorage._search); above it, the prefix is checked on each match instead.
# Crossover measured at 1M items: ~0.8 us per prefix item against ~1.8 us per store-wide match.
SCOPED_SEARCH_MAX_ITEMS = 10_000
# Keeps a rewritten item strictly newer than before, so "last updated first" holds even
# when two writes land within the clock's resolution.
_UPDATED_AT_STEP = 0.000001


@dataclass(frozen=True, slots=True)
class _Row:
    namespace: str
    key: str
    value: str
    created_at: float
    updated_at: float
    id: int
    ttl_minutes: float | None

    def as_item(self) -> Item:
        return {
            "namespace": self.namespace.split("."),
            "key": self.key,
            "value": json.loads(self.value),
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
        }

    def as_search_item(self, score: float | None) -> SearchItem:
        return {**self.as_item(), "score": score}


def _iso(epoch_seconds: float) -> str:
    return datetime.fromtimestamp(epoch_seconds, tz=UTC).isoformat()


def _dotted(namespace: Namespace) -> str:
    return ".".join(namespace)


def _prefix_bounds(connection: sqlite3.Connection, prefix: Namespace) -> list[str] | None:
    """Which namespaces ``prefix`` covers: None (all), ``[p]`` (one) or ``[p, low, high]``."""
    if not prefix:
        return None
    dotted = _dotted(prefix)
    # '/' is the character after '.', so [p + '.', p + '/') is every namespace below p.
    below = [dotted + ".", dotted + "/"]
    has_children = connection.execute(
        "SELECT 1 FROM items WHERE namespace >= ? AND namespace < ? LIMIT 1", below
    ).fetchone()
    if has_children is None:
        # One namespace: the (namespace, updated_at) index yields rows already in order,
        # so a page costs its own size instead of a sort of the whole namespace.
        return [dotted]
    return [dotted, *below]


def _prefix_sql(column: str, bounds: list[str] | None) -> str:
    """The condition on ``column`` for ``bounds`` from ``_prefix_bounds`` (same parameters)."""
    if bounds is None:
        return "1"
    if len(bounds) == 1:
        return f"{column} = ?"
    return f"({column} = ? OR ({column} >= ? AND {column} < ?))"


def _holds_at_most(
    connection: sqlite3.Connection, bounds: list[str], now: float, limit: int
) -> bool:
    """Whether at most ``limit`` live items are under ``bounds`` (walks at most limit + 1)."""
    found = connection.execute(
        f"SELECT count(*) FROM (SELECT 1 FROM items AS s "
        f"WHERE {_prefix_sql('s.namespace', bounds)} AND {_LIVE_S} LIMIT ?)",
        (*bounds, now, limit + 1),
    ).fetchone()[0]
    return int(found) <= limit


@contextlib.contextmanager
def _snapshot(connection: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """A read transaction, so several SELECTs see one state of the database."""
    connection.execute("BEGIN")
    try:
        yield connection
    finally:
        connection.execute("COMMIT")


def _namespaces_from(
    connection: sqlite3.Connection, start: str, high: str | None, now: float
) -> sqlite3.Cursor:
    """Distinct live namespaces ``>= start`` (and ``< high``) in order, one seek per row.

    The rows come lazily: stop iterating and the rest of the walk never runs.
    """
    upper = "" if high is None else "AND namespace < :high"
    return connection.execute(
        f"""
        WITH RECURSIVE walk(namespace) AS (
            SELECT (SELECT namespace FROM items
                    WHERE namespace >= :start {upper}
                      AND (expires_at IS NULL OR expires_at > :now)
                    ORDER BY namespace LIMIT 1)
            UNION ALL
            SELECT (SELECT namespace FROM items
                    WHERE namespace > walk.namespace {upper}
                      AND (expires_at IS NULL OR expires_at > :now)
                    ORDER BY namespace LIMIT 1)
            FROM walk WHERE walk.namespace IS NOT NULL
        )
        SELECT namespace FROM walk WHERE namespace IS NOT NULL
        """,
        {"start": start, "high": high, "now": now},
    )


def _walk_is_done(last_wanted: str, walked: str, depth: int | None, seen: set[str]) -> bool:
    """Whether no namespace after ``walked`` can show a new value sorting before
    ``last_wanted`` (the offset + limit-th value shown so far).

    A later namespace N > walked shows N itself or, cut to ``depth`` labels, a prefix of N.
    Such a value V sorts before ``walked`` only if V is a proper prefix of ``walked``: then V
    holds exactly ``depth`` labels, ends inside the depth-th label of ``walked`` (at its end,
    or where ``walked`` has a character below '.', e.g. '-' in ``a-b`` for ``a.x``), and
    N continues V with '.'. Every other later value sorts after ``walked``.
    """
    if last_wanted >= walked:
        return False
    if depth is None:
        return True
    labels = walked.split(".")
    if len(labels) < depth:
        return True
    label_start = sum(len(label) + 1 for label in labels[: depth - 1])
    label_end = label_start + len(labels[depth - 1])
    for end in range(label_start + 1, min(label_end + 1, len(walked))):
        if walked[end] <= ".":
            candidate = walked[:end]
            if candidate not in seen and candidate < last_wanted:
                return False
    return True


def _namespace_matches(labels: list[str], request: StoreListNamespacesRequest) -> bool:
    for pattern, from_end in ((request.prefix, False), (request.suffix, True)):
        if pattern is None:
            continue
        if len(pattern) > len(labels):
            return False
        window = labels[len(labels) - len(pattern) :] if from_end else labels[: len(pattern)]
        if any(p not in ("*", label) for p, label in zip(pattern, window, strict=True)):
            return False
    return True


class StoreBusyError(StoreRequestError):
    """The database stayed locked by other writers for longer than the busy timeout."""

    def __init__(self) -> None:
        super().__init__(503, "the store is busy (database locked); retry the request")


class SQLiteStorage:
    """Items in one SQLite file; async methods, each one a short statement on a thread."""

    # Hook (issue 12): the embedding index's SQL names these tables.
    vector_dialect: VectorDialect = SQLITE

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
            initializer=self._attach_connection,
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

    # -- operations ---------------------------------------------------------------

    async def put(self, request: StorePutRequest, vectors: ItemVectors | None = None) -> None:
        """Insert or replace an item; ``created_at`` survives replacement.

        ``vectors`` (issue 12 hook): the item's embeddings, written in the same transaction.
        """
        now = self._clock()
        ttl = request.ttl
        if ttl is None:
            ttl = self._config.default_ttl_minutes
        expires_at = None if ttl is None else now + ttl * 60.0
        text = searchable_text(request.value, request.index_paths())
        # The model refused non-finite numbers; allow_nan=False is the backstop.
        value_json = json.dumps(
            request.value, ensure_ascii=False, separators=(",", ":"), allow_nan=False
        )
        params = (
            _dotted(tuple(request.namespace)),
            request.key,
            value_json,
            text,
            now,
            now,
            ttl,
            expires_at,
        )
        await self._write(functools.partial(_put, params=params, vectors=vectors))

    async def get(self, namespace: Namespace, key: str, refresh_ttl: bool | None) -> Item | None:
        """The live item, or None; optionally pushes its expiry forward."""
        now = self._clock()
        row = await self._run(
            self._readers, functools.partial(self._get, _dotted(namespace), key, now)
        )
        if row is None:
            return None
        if self._refresh(refresh_ttl) and row.ttl_minutes is not None:
            await self._write(functools.partial(_refresh_rows, ids=[row.id], now=now))
        return row.as_item()

    def _get(self, namespace: str, key: str, now: float) -> _Row | None:
        found = (
            self._connection()
            .execute(
                f"SELECT {_ITEM_COLUMNS} FROM items AS i "
                f"WHERE i.namespace = ? AND i.key = ? AND {_LIVE}",
                (namespace, key, now),
            )
            .fetchone()
        )
        return None if found is None else _Row(*found)

    def _refresh(self, requested: bool | None) -> bool:
        return self._config.refresh_ttl_on_read if requested is None else requested

    async def delete(self, namespace: Namespace, key: str) -> None:
        """Remove an item; removing an absent item is not an error."""
        await self._write(functools.partial(_delete, namespace=_dotted(namespace), key=key))

    async def search(
        self, request: StoreSearchRequest, ranker: Ranker | None = None
    ) -> list[SearchItem]:
        """Listing (newest update first) or, with a query, BM25-ranked matches (best first)
        followed by the items no query can match (score null, newest update first).

        ``ranker`` (issue 12 hook): ranks a query by meaning (vectors or hybrid) instead.
        """
        now = self._clock()
        rows = await self._run(self._readers, functools.partial(self._search, request, now, ranker))
        if self._refresh(request.refresh_ttl):
            expiring = [row.id for row, _ in rows if row.ttl_minutes is not None]
            if expiring:
                await self._write(functools.partial(_refresh_rows, ids=expiring, now=now))
        # Listing mode reports score null, as the API schema has it.
        return [row.as_search_item(score) for row, score in rows]

    def _search(
        self, request: StoreSearchRequest, now: float, ranker: Ranker | None = None
    ) -> list[tuple[_Row, float | None]]:
        with _snapshot(self._connection()) as connection:
            bounds = _prefix_bounds(connection, request.prefix())
            prefix_sql = _prefix_sql("i.namespace", bounds)
            prefix_params = bounds or []
            filter_sql, filter_params = compile_filter(request.clauses(), "i.value")
            scope = f"{prefix_sql} AND {_LIVE} AND {filter_sql}"
            scope_params = [*prefix_params, now, *filter_params]
            if request.search_query() is None:
                return _unscored(
                    connection, scope, scope_params, "1", request.offset, request.limit
                )
            if ranker is not None:
                # Hook (issue 12): the ranker gets the scope as SQL over `items AS i` and
                # the BM25 ranking (id, score) to any depth, and answers (id, score) best
                # first, to the depth of the page's end.
                def bm25(depth: int) -> list[tuple[int, float]]:
                    ranked = self._bm25(connection, request, bounds, now, depth, 0)
                    return [(row.id, score or 0.0) for row, score in ranked]

                depth = request.offset + request.limit
                ranking = ranker(connection, scope, scope_params, bm25, depth)
                page = _rows_by_id(connection, ranking[request.offset :])
                if len(ranking) == depth:
                    return page
                ranked = len(ranking)
                unscored = ranker.unscored(SQLITE)
            else:
                page = self._bm25(connection, request, bounds, now, request.limit, request.offset)
                if len(page) == request.limit:
                    return page
                # Matches before the page: all of them when it holds some, else up to offset.
                if page:
                    ranked = request.offset + len(page)
                else:
                    ranked = self._bm25_count(connection, request, bounds, now, request.offset)
                unscored = "i.search_text IS NULL"
            # The ranking ended within the page: the items no query can score follow it.
            return page + _unscored(
                connection,
                scope,
                scope_params,
                unscored,
                max(0, request.offset - ranked),
                request.limit - len(page),
            )

    def _bm25(
        self,
        connection: sqlite3.Connection,
        request: StoreSearchRequest,
        bounds: list[str] | None,
        now: float,
        limit: int,
        offset: int,
    ) -> list[tuple[_Row, float | None]]:
        """BM25-ranked matches of the request's query, page [offset, offset + limit)."""
        matches = self._bm25_matches(connection, request, bounds, now)
        if matches is None:
            return []
        sql, params = matches
        cursor = connection.execute(
            f"SELECT {_ITEM_COLUMNS}, bm25(items_fts) AS rank {sql} "
            "ORDER BY rank, i.updated_at DESC, i.id DESC LIMIT ? OFFSET ?",
            (*params, limit, offset),
        )
        # FTS5's bm25() is lower-is-better; the API's score is higher-is-better.
        return [(_Row(*found[:-1]), -float(found[-1])) for found in cursor]

    def _bm25_count(
        self,
        connection: sqlite3.Connection,
        request: StoreSearchRequest,
        bounds: list[str] | None,
        now: float,
        at_most: int,
    ) -> int:
        """How many items the request's query matches, counting no further than ``at_most``."""
        matches = self._bm25_matches(connection, request, bounds, now)
        if matches is None or at_most == 0:
            return 0
        sql, params = matches
        found = connection.execute(
            f"SELECT count(*) FROM (SELECT 1 {sql} LIMIT ?)", (*params, at_most)
        ).fetchone()
        return int(found[0])

    def _bm25_matches(
        self,
        connection: sqlite3.Connection,
        request: StoreSearchRequest,
        bounds: list[str] | None,
        now: float,
    ) -> tuple[str, list[Any]] | None:
        """``FROM … WHERE …`` of the request's query matches in scope and its parameters;
        None when the query has no searchable term (it matches nothing)."""
        query = request.search_query()
        if query is None:
            return None
        expression = match_expression(query)
        if expression is None:
            return None
        prefix_sql = _prefix_sql("i.namespace", bounds)
        prefix_params = bounds or []
        filter_sql, filter_params = compile_filter(request.clauses(), "i.value")
        if bounds is not None and _holds_at_most(connection, bounds, now, SCOPED_SEARCH_MAX_ITEMS):
            # A small prefix: collect its live ids off the namespace index into a
            # temporary set, and let FTS5 keep only the matches in that set before any
            # item row is read. FTS5 still walks the query terms' match lists (bm25 needs
            # their store-wide statistics anyway), but that walk is cheap; the costly part,
            # reading the item row of every match in the store, now happens only for
            # matches under the prefix. Scores are unchanged: bm25() depends on the row and
            # the whole index, not on which rows a query visits. CROSS JOIN keeps FTS5
            # as the outer loop and '+' keeps the set from becoming a rowid lookup, which
            # would restart FTS5 (and its bm25 statistics) once per id.
            scope_sql = (
                "+items_fts.rowid IN (SELECT s.id FROM items AS s "
                f"WHERE {_prefix_sql('s.namespace', bounds)} AND {_LIVE_S}) AND "
            )
            scope_params: list[Any] = [*bounds, now]
            join = "CROSS JOIN"
        else:
            scope_sql, scope_params, join = "", [], "JOIN"
        sql = (
            f"FROM items_fts {join} items AS i ON i.id = items_fts.rowid "
            f"WHERE items_fts MATCH ? AND {scope_sql}{prefix_sql} AND {_LIVE} "
            f"AND {filter_sql}"
        )
        return sql, [expression, *scope_params, *prefix_params, now, *filter_params]

    async def list_namespaces(self, request: StoreListNamespacesRequest) -> list[list[str]]:
        """Distinct live namespaces matching prefix/suffix, cut to max_depth, sorted."""
        now = self._clock()
        shown = await self._run(
            self._readers, functools.partial(self._list_namespaces, request, now)
        )
        page = shown[request.offset : request.offset + request.limit]
        return [namespace.split(".") for namespace in page]

    def _list_namespaces(self, request: StoreListNamespacesRequest, now: float) -> list[str]:
        """The sorted dotted namespaces to show, at least the first offset + limit of them.

        Walks the distinct live namespaces under the literal part of the prefix in index
        order, one index seek each, and stops early:

        * once a namespace cut to ``max_depth`` labels has been shown, every namespace below
          the cut one shows the same, so the walk seeks past them (to ``cut + '/'``);
        * once offset + limit namespaces are shown and nothing the rest of the walk could
          show sorts before them (see ``_walk_is_done``), it stops.
        """
        literal: list[str] = []
        for label in request.prefix or ():
            if label == "*":
                break
            literal.append(label)
        low = _dotted(tuple(literal))
        high = low + "/" if literal else None
        wanted = request.offset + request.limit
        depth = request.max_depth
        shown: list[str] = []  # sorted
        seen: set[str] = set()
        with _snapshot(self._connection()) as connection:
            start: str | None = low
            while start is not None:
                skip_to: str | None = None
                restart: str | None = None
                for (namespace,) in _namespaces_from(connection, start, high, now):
                    if skip_to is not None:
                        if namespace < skip_to:
                            restart = skip_to  # in a subtree already shown: seek past it
                            break
                        skip_to = None
                    labels = namespace.split(".")
                    cut = depth is not None and len(labels) > depth
                    dotted = ".".join(labels[:depth]) if cut else namespace
                    if dotted not in seen and _namespace_matches(labels, request):
                        seen.add(dotted)
                        bisect.insort(shown, dotted)
                    if len(shown) >= wanted and _walk_is_done(
                        shown[wanted - 1], namespace, depth, seen
                    ):
                        return shown
                    if cut and dotted in seen:
                        skip_to = dotted + "/"
                start = restart
        return shown

    async def sweep_expired(self) -> int:
        """Delete expired items in short batches; returns how many were removed."""
        now = self._clock()
        removed = 0
        while True:
            batch = await self._write(functools.partial(_sweep_batch, now=now))
            removed += batch
            if batch < SWEEP_BATCH:
                return removed

    async def count_items(self) -> int:
        """How many rows the table holds, expired or not (for tests and benchmarks)."""
        return await self._run(
            self._readers,
            lambda: int(self._connection().execute("SELECT count(*) FROM items").fetchone()[0]),
        )


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


def _put(
    connection: sqlite3.Connection,
    *,
    params: tuple[Any, ...],
    vectors: ItemVectors | None = None,
) -> None:
    connection.execute(
        f"""
        INSERT INTO items (namespace, key, value, search_text, created_at, updated_at,
                           ttl_minutes, expires_at)
        VALUES (?, ?, ?, ?, ?, ?, ?, ?)
        ON CONFLICT (namespace, key) DO UPDATE SET
            value = excluded.value,
            search_text = excluded.search_text,
            created_at = CASE
                WHEN items.expires_at IS NOT NULL AND items.expires_at <= excluded.created_at
                THEN excluded.created_at ELSE items.created_at END,
            updated_at = CASE
                WHEN items.updated_at >= excluded.updated_at
                THEN items.updated_at + {_UPDATED_AT_STEP} ELSE excluded.updated_at END,
            ttl_minutes = excluded.ttl_minutes,
            expires_at = excluded.expires_at
        """,
        params,
    )
    if vectors is not None:  # Hook (issue 12): the item's vectors, same transaction.
        vectors.write(connection, item_id(connection, params[0], params[1]), SQLITE)


def _rows_by_id(
    connection: sqlite3.Connection, page: Sequence[tuple[int, float]]
) -> list[tuple[_Row, float | None]]:
    """The item rows of a ranked page of ids, in the page's order (issue 12 hook)."""
    if not page:
        return []
    marks = ",".join("?" * len(page))
    found = {
        row.id: row
        for row in (
            _Row(*values)
            for values in connection.execute(
                f"SELECT {_ITEM_COLUMNS} FROM items AS i WHERE i.id IN ({marks})",
                [item for item, _ in page],
            )
        )
    }
    return [(found[item], score) for item, score in page if item in found]


def _unscored(
    connection: sqlite3.Connection,
    scope: str,
    scope_params: list[Any],
    condition: str,
    offset: int,
    limit: int,
) -> list[tuple[_Row, float | None]]:
    """Items in ``scope`` meeting ``condition``, newest update first, score null: the
    listing (condition ``1``), or the items a query cannot score after its ranking."""
    cursor = connection.execute(
        f"SELECT {_ITEM_COLUMNS} FROM items AS i WHERE {scope} AND {condition} "
        "ORDER BY i.updated_at DESC, i.id DESC LIMIT ? OFFSET ?",
        (*scope_params, limit, offset),
    )
    return [(_Row(*found), None) for found in cursor]


def _delete(connection: sqlite3.Connection, *, namespace: str, key: str) -> None:
    connection.execute("DELETE FROM items WHERE namespace = ? AND key = ?", (namespace, key))


def _refresh_rows(connection: sqlite3.Connection, *, ids: Sequence[int], now: float) -> None:
    marks = ",".join("?" * len(ids))
    connection.execute(
        "UPDATE items SET expires_at = ? + ttl_minutes * 60.0 "
        f"WHERE id IN ({marks}) AND ttl_minutes IS NOT NULL AND expires_at > ?",
        (now, *ids, now),
    )


def _sweep_batch(connection: sqlite3.Connection, *, now: float) -> int:
    cursor = connection.execute(
        "DELETE FROM items WHERE id IN "
        "(SELECT id FROM items WHERE expires_at IS NOT NULL AND expires_at <= ? LIMIT ?)",
        (now, SWEEP_BATCH),
    )
    return cursor.rowcount
