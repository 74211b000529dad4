"""PostgreSQL storage of Store items: several gateways on one database see one Store.

Every operation is one statement (or one short transaction) on a pooled connection of
psycopg 3's async driver, committed before it is acknowledged, so a write acknowledged by
one gateway is read by every other at once. Concurrent puts of one key are one
``INSERT … ON CONFLICT DO UPDATE`` each: the last to commit wins, none fails. The TTL sweep
runs on every instance; it deletes in batches chosen ``FOR UPDATE SKIP LOCKED``, so two
sweepers never wait on (or both count) the same row.

With ``store.index`` (issue 12) the embedding index's statements (vectors.py, mirror.py,
semantic.py) run on a second, small pool of psycopg's blocking connections, on worker
threads: the index's code is synchronous (numpy, the in-memory mirror) and shared with the
SQLite Store through ``vector_dialect``. A put with vectors writes the item and its vectors in
one transaction there; a ranked search runs in one REPEATABLE READ snapshot there, so the
mirror's catch-up, the scope and the word ranking all see the same state.

Answers are built by the same code as SQLite's (``_Row``), from the value's JSON text as
written. libpq receives a statement's whole result before any row can be looked at, so a
page of items is read with ``_within_cutoff``: the database sends the page's values only
when they total at most the bytes the answer reserved beforehand (``answers.PageLoad``); a
larger page is read again once its exact size is reserved, or refused (422 over
``store.max_answer_bytes``, 503 over the bytes in flight). Its rows are ordered, limited and
offset with the value still a reference to its stored (TOASTed) datum; only the page's
values are turned into text.

What differs from SQLite is listed in docs/store.md: the search score (``ts_rank``, not
BM25), and that U+0000 cannot be stored.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from gateway.upstreams.postgres.breaker import DatabaseBreaker, probe_connection
from gateway.upstreams.postgres.connection import (
    UNAVAILABLE_ERRORS,
    DatabaseUnavailable,
    check_url,
    connection_kwargs,
    unavailable,
)
from gateway.upstreams.postgres.migrations import migrate
from gateway.upstreams.store import pg_schema
from gateway.upstreams.store.answers import (
    FIRST_READ_BYTES,
    AnswerBudget,
    AnswerBytes,
    answer_budget,
    aread_page,
    read_page,
    value_bytes,
)
from gateway.upstreams.store.config import StoreConfig
from gateway.upstreams.store.errors import StoreRequestError
from gateway.upstreams.store.hybrid import Ranker
from gateway.upstreams.store.models import (
    Item,
    Namespace,
    SearchItem,
    StoredForms,
    StoreListNamespacesRequest,
    StorePutRequest,
    StoreSearchRequest,
)
from gateway.upstreams.store.pg_filters import compile_pg_filter, json_text_has_nul
from gateway.upstreams.store.rows import (
    _UPDATED_AT_STEP,
    SWEEP_BATCH,
    NamespaceWalk,
    _dotted,
    _Row,
    answer_items,
    check_search_depth,
)
from gateway.upstreams.store.text_index import query_terms
from gateway.upstreams.store.vector_dialect import POSTGRES, IndexConnection, VectorDialect
from gateway.upstreams.store.vectors import ItemVectors

log = logging.getLogger("gateway.store.postgres")
T = TypeVar("T")
# What a call may fail with when the database is away or slow (answered 503).
_FAILURES: tuple[type[BaseException], ...] = (*UNAVAILABLE_ERRORS, TimeoutError)

# The deadline of the ``_run`` in progress in this task: a page read again (answers.PageLoad)
# runs one statement more, and is given one statement's time more (``_more_time``), so that
# a re-read within the statement timeout never turns into a timeout counted as an outage.
_DEADLINE: contextvars.ContextVar[asyncio.Timeout | None] = contextvars.ContextVar(
    "store_pg_deadline", default=None
)

_COLUMNS = "i.namespace, i.key, i.value::text, i.created_at, i.updated_at, i.id, i.ttl_minutes"
# A page's columns before ``_within_cutoff``: the value as stored (json; its text, an I/O
# conversion that reads the whole datum, is made for the page's rows only).
_PAGE_COLUMNS = "i.namespace, i.key, i.value, i.created_at, i.updated_at, i.id, i.ttl_minutes"
_BY_RECENCY = "page.updated_at DESC, page.id DESC"
_BY_RANK = f"page.rank DESC, {_BY_RECENCY}"
_LIVE = "(i.expires_at IS NULL OR i.expires_at > %s)"
_DOC = "(i.value::jsonb)"
# ts_rank normalisation 0 (no length penalty): with 1 (divide by 1 + log(length)) a short
# document mentioning a term once outranks a longer one mentioning it three times, which
# BM25 (SQLite) ranks the other way.
_RANK_NORMALIZATION = 0
# The namespaces listing reads the walk in batches of at least this many namespaces (one
# round trip each) and at most the other (a batch is held whole: namespaces are up to
# about 8 KiB of text each, so at most ~8 MiB).
_NAMESPACE_BATCH_MIN = 8
_NAMESPACE_BATCH_MAX = 1024

_PUT = f"""
INSERT INTO store_items AS items (namespace, key, value, search_text, created_at, updated_at,
                                  ttl_minutes, expires_at)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s)
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
"""


def _nul_field(request: StorePutRequest, value_json: str) -> str | None:
    """The first field of ``request`` that holds U+0000 (as the API names fields), if any:
    PostgreSQL's text and json columns cannot keep it."""
    for index, label in enumerate(request.namespace):
        if "\x00" in label:
            return f"namespace[{index}]"
    if "\x00" in request.key:
        return "key"
    # The value's JSON text, made with the parse: no second walk of the value here.
    return "value" if json_text_has_nul(value_json) else None


def _prefix_sql(prefix: Namespace) -> tuple[str, list[Any]]:
    if not prefix:
        return "TRUE", []
    dotted = _dotted(prefix)
    # '/' is the character after '.': [p + '.', p + '/') is every namespace below p.
    return (
        "(i.namespace = %s OR (i.namespace >= %s AND i.namespace < %s))",
        [dotted, dotted + ".", dotted + "/"],
    )


class PostgresStorage:
    """Store items in PostgreSQL; the same async interface as ``SQLiteStorage``."""

    # The embedding index's SQL names these tables.
    vector_dialect: VectorDialect = POSTGRES

    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.time) -> None:
        if config.database_url is None:
            raise ValueError("PostgresStorage needs config.database_url")
        self._config = config
        self.answers = AnswerBytes(config.max_answer_bytes, config.answer_bytes_in_flight)
        # What a page read may receive before its size is known (answers.PageLoad): as
        # many reads as the pools run at once then hold at most half the bytes in flight,
        # so that those allowances alone never make the others' exact reservations busy.
        readers = config.database_pool_size + _index_pool_size(config)
        self.first_read_bytes = max(
            1, min(FIRST_READ_BYTES, self.answers.in_flight // (2 * readers))
        )
        self._url = check_url(config.database_url)
        self._clock = clock
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None
        self._timeout = config.database_timeout_seconds
        # Blocking connections for the embedding index (only with store.index).
        self._index_pool: ConnectionPool[psycopg.Connection[Any]] | None = None
        # Once the database is found away, calls are refused at once until a probe (one
        # fresh connection) finds it answering again.
        self.breaker = DatabaseBreaker(
            "store",
            self._url,
            probe=self._probe,
            retry_seconds=config.database_retry_seconds,
            probe_timeout_seconds=2 * self._timeout,
        )

    # -- lifetime -----------------------------------------------------------------

    async def open(self) -> None:
        """Migrate the schema (once, under an advisory lock) and open the pool."""
        kwargs = connection_kwargs(self._timeout, "gateway-store")
        # Migrations wait as long as another instance holds the lock (no statement timeout).
        migrate_kwargs = {**kwargs, "options": ""}
        await asyncio.to_thread(
            migrate, self._url, pg_schema.COMPONENT, pg_schema.STEPS, **migrate_kwargs
        )
        self._pool = AsyncConnectionPool(
            self._url,
            kwargs=kwargs,
            min_size=1,
            max_size=self._config.database_pool_size,
            timeout=self._timeout,
            # A failed reconnection is given up at once; a request asking for a connection
            # starts a new attempt (while the database is away the breaker refuses calls).
            reconnect_timeout=0,
            name="store",
            open=False,
        )
        await self._pool.open(wait=False)
        if self._config.index is not None:
            self._index_pool = ConnectionPool(
                self._url,
                kwargs=kwargs,
                min_size=1,
                max_size=_index_pool_size(self._config),
                timeout=self._timeout,
                reconnect_timeout=0,
                name="store-index",
                open=False,
            )
            await asyncio.to_thread(self._index_pool.open, False)

    async def close(self) -> None:
        await self.breaker.close()
        if self._index_pool is not None:
            index_pool, self._index_pool = self._index_pool, None
            await asyncio.to_thread(index_pool.close)
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    async def _probe(self) -> None:
        """The breaker's probe: one fresh connection answers ``SELECT 1``; then the pool
        drops the connections the outage broke, so the first requests after it get live
        ones."""
        await probe_connection(self._url, connection_kwargs(self._timeout, "gateway-store"))()
        if self._pool is not None:
            await self._pool.check()
        if self._index_pool is not None:
            await asyncio.to_thread(self._index_pool.check)

    def pool_stats(self) -> dict[str, int]:
        """psycopg_pool's counters of the request pool (``requests_num``: connections asked
        for; ``connections_num``: connection attempts)."""
        return {} if self._pool is None else self._pool.get_stats()

    # -- the embedding index's hooks: blocking connections on worker threads ----------

    async def _in_thread(
        self, call: Callable[[psycopg.Connection[Any]], T], *, snapshot: bool
    ) -> T:
        """``call(connection)`` in one transaction on a worker thread: REPEATABLE READ (one
        snapshot for every statement) when ``snapshot``, else READ COMMITTED."""
        pool = self._index_pool
        if pool is None:
            raise RuntimeError("the store is not open with store.index")

        def run() -> T:
            with pool.connection() as conn, conn.transaction():
                if snapshot:
                    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                return call(conn)

        self.breaker.refuse_unless_closed()
        try:
            return await asyncio.to_thread(run)
        except UNAVAILABLE_ERRORS as exc:
            failure = unavailable("store", exc)
            self._failed(failure, exc)
            raise failure from exc

    async def read(self, call: Callable[[IndexConnection, float], T]) -> T:
        """Run ``call(connection, now)`` in one snapshot (the embedding index's reads)."""
        now = self._clock()
        return await self._in_thread(lambda conn: call(conn, now), snapshot=True)

    async def write(self, call: Callable[[IndexConnection], T]) -> T:
        """Run ``call(connection)`` in one transaction (the embedding index's writes)."""
        return await self._in_thread(call, snapshot=False)

    async def _run(self, call: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]) -> T:
        if self._pool is None:
            raise RuntimeError("the store is not open")
        self.breaker.refuse_unless_closed()
        try:
            async with asyncio.timeout(self._timeout * 2) as deadline:
                token = _DEADLINE.set(deadline)
                try:
                    for attempt in (1, 2):
                        async with self._pool.connection() as conn:
                            try:
                                return await call(conn)
                            except psycopg.OperationalError:
                                # A pooled connection the database closed (it restarted):
                                # the pool drops it; try once more on a fresh one. Every
                                # Store statement is idempotent (upsert, delete, refresh,
                                # sweep).
                                if not conn.broken or attempt == 2:
                                    raise
                    raise AssertionError("unreachable")
                finally:
                    _DEADLINE.reset(token)
        except _FAILURES as exc:
            failure = unavailable("store", exc)
            self._failed(failure, exc)
            raise failure from exc

    def _more_time(self) -> None:
        """Give the ``_run`` in progress one statement's time more (a page read again)."""
        deadline = _DEADLINE.get()
        when = None if deadline is None else deadline.when()
        if deadline is not None and when is not None:
            deadline.reschedule(when + self._timeout)

    def _failed(self, failure: DatabaseUnavailable, exc: BaseException) -> None:
        if not failure.outage:
            log.warning("store database call failed: %s", type(exc).__name__)
        failure.__cause__ = exc
        self.breaker.failed(failure)

    async def _execute(self, sql: str, params: list[Any] | tuple[Any, ...]) -> int:
        async def call(conn: psycopg.AsyncConnection[Any]) -> int:
            cursor = await conn.execute(sql, params)
            return cursor.rowcount

        return await self._run(call)

    async def _fetch(self, sql: str, params: list[Any] | tuple[Any, ...]) -> list[tuple[Any, ...]]:
        async def call(conn: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
            cursor = await conn.execute(sql, params)
            return await cursor.fetchall()

        return await self._run(call)

    # -- operations ---------------------------------------------------------------

    async def put(
        self,
        request: StorePutRequest,
        vectors: ItemVectors | None = None,
        forms: StoredForms | None = None,
    ) -> None:
        """Insert or replace an item; ``created_at`` survives replacement.

        ``vectors``: the item's embeddings, written in the same transaction.
        """
        namespace = _dotted(tuple(request.namespace))
        # ``forms``: made with the parse, within its budget (store/app.py's put_item)
        value_json, text = forms or request.stored_forms()
        where = _nul_field(request, value_json)
        if where is not None:
            raise StoreRequestError(
                422, f"{where}: the character U+0000 cannot be stored in the PostgreSQL store"
            )
        now = self._clock()
        ttl = request.ttl
        if ttl is None:
            ttl = self._config.default_ttl_minutes
        expires_at = None if ttl is None else now + ttl * 60.0
        params = (namespace, request.key, value_json, text, now, now, ttl, expires_at)
        if vectors is None:
            await self._execute(_PUT, params)
            return

        def put_with_vectors(conn: IndexConnection) -> None:
            item_id = int(conn.execute(_PUT + " RETURNING id", params).fetchone()[0])
            vectors.write(conn, item_id, POSTGRES)

        await self.write(put_with_vectors)

    async def get(
        self,
        namespace: Namespace,
        key: str,
        refresh_ttl: bool | None,
        budget: AnswerBudget | None = None,
    ) -> Item | None:
        """The live item with its value parsed, or None (``get_row``, for Python callers)."""
        row = await self.get_row(namespace, key, refresh_ttl, budget)
        return None if row is None else row.as_item()

    async def get_row(
        self,
        namespace: Namespace,
        key: str,
        refresh_ttl: bool | None,
        budget: AnswerBudget | None = None,
    ) -> _Row | None:
        """The live item's row (its value as stored JSON text), or None; optionally pushes
        its expiry forward.

        ``budget``: what the answer may hold (one item always fits; 503 when the answers in
        flight hold their bound); without it, the read makes its own.
        """
        dotted = _dotted(namespace)
        if "\x00" in dotted or "\x00" in key:
            return None  # nothing stored can have it
        now = self._clock()
        with answer_budget(self.answers, budget) as held:
            rows = await self._fetch(
                f"SELECT {_COLUMNS} FROM store_items AS i "
                f"WHERE i.namespace = %s AND i.key = %s AND {_LIVE}",
                (dotted, key, now),
            )
            if not rows:
                return None
            row = _Row(*rows[0])
            # One item: it arrived whole (a single row is never more than one value).
            held.take(value_bytes(row.value))
            if self._refresh(refresh_ttl) and row.ttl_minutes is not None:
                await self._refresh_rows([row.id], now)
            return row

    def _refresh(self, requested: bool | None) -> bool:
        return self._config.refresh_ttl_on_read if requested is None else requested

    async def _refresh_rows(self, ids: list[int], now: float) -> None:
        await self._execute(
            "UPDATE store_items SET expires_at = %s + ttl_minutes * 60.0 "
            "WHERE id = ANY(%s) AND ttl_minutes IS NOT NULL AND expires_at > %s",
            (now, ids, now),
        )

    async def delete(self, namespace: Namespace, key: str) -> None:
        """Remove an item; removing an absent item is not an error."""
        dotted = _dotted(namespace)
        if "\x00" in dotted or "\x00" in key:
            return
        await self._execute(
            "DELETE FROM store_items WHERE namespace = %s AND key = %s", (dotted, key)
        )

    async def search(
        self,
        request: StoreSearchRequest,
        ranker: Ranker | None = None,
        budget: AnswerBudget | None = None,
    ) -> list[SearchItem]:
        """``search_rows``' items with their values parsed (for Python callers)."""
        return answer_items(await self.search_rows(request, ranker, budget))

    async def search_rows(
        self,
        request: StoreSearchRequest,
        ranker: Ranker | None = None,
        budget: AnswerBudget | None = None,
    ) -> list[tuple[_Row, float | None]]:
        """Listing (newest update first) or, with a query, ranked matches (best first)
        followed by the items no query can match (score null, newest update first): rows
        and scores.

        ``ranker``: ranks a query by meaning (vectors or hybrid) instead, see ``_ranked``.
        ``budget``: what the answer's values may hold (``AnswerTooLargeError``, 422, past
        store.max_answer_bytes; ``AnswersBusyError``, 503, past the bytes in flight);
        without it, the search makes its own. A query whose page ends past
        store.max_search_depth is refused (422, ``check_search_depth``).
        """
        check_search_depth(request, self._config.max_search_depth)
        now = self._clock()
        prefix = request.prefix()
        if any("\x00" in label for label in prefix):
            return []
        prefix_sql, prefix_params = _prefix_sql(prefix)
        filter_sql, filter_params = compile_pg_filter(request.clauses(), _DOC)
        scope = f"{prefix_sql} AND {_LIVE} AND {filter_sql}"
        scope_params = [*prefix_params, now, *filter_params]
        query = request.search_query()
        rows: list[tuple[_Row, float | None]]
        with answer_budget(self.answers, budget) as held:
            if query is None:
                rows = await self._unscored(
                    scope, scope_params, "TRUE", request.offset, request.limit, held
                )
            elif ranker is not None:  # ranked by meaning even when no word is searchable
                rows = await self.read(
                    functools.partial(
                        self._ranked,
                        request,
                        query_terms(query),
                        prefix_sql,
                        prefix_params,
                        ranker,
                        held,
                    )
                )
            else:
                rows = await self._by_words(request, query_terms(query), scope, scope_params, held)
            if self._refresh(request.refresh_ttl):
                expiring = [row.id for row, _ in rows if row.ttl_minutes is not None]
                if expiring:
                    await self._refresh_rows(expiring, now)
            return rows

    async def _page(
        self, sql: str, params: list[Any], order: str, budget: AnswerBudget
    ) -> list[tuple[Any, ...]]:
        """The rows of the page ``sql`` (``_PAGE_COLUMNS`` [, rank]) with their values, within
        ``budget`` (``_within_cutoff``)."""
        within = _within_cutoff(sql, order)

        async def call(conn: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
            reads = 0

            async def fetch(cutoff: int) -> list[tuple[Any, ...]]:
                nonlocal reads
                reads += 1
                if reads > 1:
                    self._more_time()  # read again: one statement more
                cursor = await conn.execute(within, [cutoff, *params])
                return await cursor.fetchall()

            return await aread_page(budget, fetch, self.first_read_bytes)

        return await self._run(call)

    async def _unscored(
        self,
        scope: str,
        scope_params: list[Any],
        condition: str,
        offset: int,
        limit: int,
        budget: AnswerBudget,
    ) -> list[tuple[_Row, float | None]]:
        """Items in ``scope`` meeting ``condition``, newest update first, score null: the
        listing (condition ``TRUE``), or the items a query cannot score after its ranking."""
        sql, params = _unscored_sql(scope, scope_params, condition, offset, limit)
        return [(_Row(*r[:7]), None) for r in await self._page(sql, params, _BY_RECENCY, budget)]

    async def _by_words(
        self,
        request: StoreSearchRequest,
        terms: list[str],
        scope: str,
        scope_params: list[Any],
        budget: AnswerBudget,
    ) -> list[tuple[_Row, float | None]]:
        """The word ranking's page, then the items without searchable text (score null)."""
        page: list[tuple[_Row, float | None]] = []
        ranked = 0
        if terms:
            sql, params = _word_ranking(terms, scope, scope_params, _PAGE_COLUMNS)
            params_page = [*params, request.limit, request.offset]
            found = await self._page(sql, params_page, _BY_RANK, budget)
            page = [(_Row(*r[:7]), float(r[7])) for r in found]
            if len(page) == request.limit:
                return page
            if page:
                ranked = request.offset + len(page)
            elif request.offset > 0:
                # Matches before the page, counted no further than the offset.
                counted = await self._fetch(
                    f"SELECT count(*) FROM ({sql}) AS matches", (*params, request.offset, 0)
                )
                ranked = int(counted[0][0])
        # The ranking ended within the page: the items no query can score follow it.
        tail = await self._unscored(
            scope,
            scope_params,
            "i.search_text IS NULL",
            max(0, request.offset - ranked),
            request.limit - len(page),
            budget,
        )
        return page + tail

    def _ranked(
        self,
        request: StoreSearchRequest,
        terms: list[str],
        prefix_sql: str,
        prefix_params: list[Any],
        ranker: Ranker,
        budget: AnswerBudget,
        conn: IndexConnection,
        now: float,
    ) -> list[tuple[_Row, float | None]]:
        """A search ranked by meaning, in one snapshot on a blocking connection: the ranker
        gets the scope as SQL over ``store_items AS i`` and the word ranking (ts_rank
        weighted by BM25's idf, as ``search``) as (id, score) to any depth; the items it
        cannot score follow its ranking."""
        filter_sql, filter_params = compile_pg_filter(request.clauses(), _DOC)
        scope = f"{prefix_sql} AND {_LIVE} AND {filter_sql}"
        scope_params = [*prefix_params, now, *filter_params]

        def by_words(depth: int) -> list[tuple[int, float]]:
            # Ids and scores only: the values are read for the page alone.
            if not terms:
                return []
            sql, params = _word_ranking(terms, scope, scope_params, "i.id")
            found = conn.execute(sql, (*params, depth, 0)).fetchall()
            return [(int(r[0]), float(r[-1])) for r in found]

        depth = request.offset + request.limit
        ranking = ranker(conn, scope, scope_params, by_words, depth)
        first_read = self.first_read_bytes
        page = _rows_by_id(conn, ranking[request.offset :], budget, first_read)
        if len(ranking) == depth:
            return page
        sql, params = _unscored_sql(
            scope,
            scope_params,
            ranker.unscored(POSTGRES),
            max(0, request.offset - len(ranking)),
            request.limit - len(page),
        )
        tail = _page_on(conn, sql, params, _BY_RECENCY, budget, first_read)
        return page + [(_Row(*r[:7]), None) for r in tail]

    async def list_namespaces(self, request: StoreListNamespacesRequest) -> list[list[str]]:
        """Distinct live namespaces matching prefix/suffix, cut to max_depth, sorted."""
        walk = await self._list_namespaces(request, self._clock())
        return walk.page()

    async def _list_namespaces(
        self, request: StoreListNamespacesRequest, now: float
    ) -> NamespaceWalk:
        """The walk (``rows.NamespaceWalk``, as SQLite's) over the distinct live namespaces
        under the literal part of the prefix, fed in batches of a loose index scan (one
        seek per namespace), all in one snapshot. libpq receives a statement's whole result
        at once, so a batch is bounded by ``LIMIT`` and doubles while the walk goes on, up
        to ``_NAMESPACE_BATCH_MAX``; once the walk stops (early, or to seek past a subtree
        already shown) no further row is read. The first batch is what the page may need
        (offset + limit, and one more to see that the walk is done); with ``max_depth``,
        and after each seek past a subtree, it is ``_NAMESPACE_BATCH_MIN``, since the walk
        may seek again after a row or two."""
        unwalked = NamespaceWalk(request)
        if "\x00" in unwalked.low:
            return unwalked  # nothing stored can hold U+0000: it shows nothing
        wanted = request.offset + request.limit + 1
        first = _NAMESPACE_BATCH_MIN
        if request.max_depth is None:
            first = min(max(wanted, _NAMESPACE_BATCH_MIN), _NAMESPACE_BATCH_MAX)

        async def call(conn: psycopg.AsyncConnection[Any]) -> NamespaceWalk:
            # A new walk for each attempt (_run tries again on a fresh connection).
            walk = NamespaceWalk(request)
            async with conn.transaction():
                await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                size = first
                while walk.start is not None:
                    sql = _namespaces_sql(walk.high is not None, walk.after)
                    params = {"start": walk.start, "high": walk.high, "now": now, "n": size}
                    cursor = await conn.execute(sql, params)
                    batch = await cursor.fetchall()
                    walk.fetched += len(batch)
                    for (namespace,) in batch:
                        if not walk.visit(namespace):
                            size = _NAMESPACE_BATCH_MIN  # a seek past a subtree
                            break
                    else:
                        if len(batch) < size:
                            walk.exhausted()
                        else:
                            walk.batch_ended(batch[-1][0])
                            # On after the batch (doubled), or a seek past a subtree (small).
                            grown = min(2 * size, _NAMESPACE_BATCH_MAX)
                            size = grown if walk.after else _NAMESPACE_BATCH_MIN
            return walk

        return await self._run(call)

    async def sweep_expired(self) -> int:
        """Delete expired items in batches; returns how many this instance removed."""
        now = self._clock()
        removed = 0
        while True:
            batch = await self._execute(
                "DELETE FROM store_items WHERE id IN (SELECT id FROM store_items "
                "WHERE expires_at IS NOT NULL AND expires_at <= %s "
                "LIMIT %s FOR UPDATE SKIP LOCKED)",
                (now, SWEEP_BATCH),
            )
            removed += batch
            if batch < SWEEP_BATCH:
                return removed

    async def count_items(self) -> int:
        rows = await self._fetch("SELECT count(*) FROM store_items", ())
        return int(rows[0][0])


__all__ = ["DatabaseUnavailable", "PostgresStorage"]


def _namespaces_sql(bounded: bool, after: bool) -> str:
    """Up to ``%(n)s`` distinct live namespaces from ``%(start)s`` (excluded when ``after``)
    and below ``%(high)s`` (when ``bounded``), in order: a loose index scan, one seek per
    namespace, not a scan of every item. The recursive query is evaluated only as far as
    the ``LIMIT`` fetches it."""
    upper = "AND namespace < %(high)s" if bounded else ""
    first = ">" if after else ">="
    return f"""
    WITH RECURSIVE walk(namespace) AS (
        SELECT (SELECT namespace FROM store_items
                WHERE namespace {first} %(start)s {upper}
                  AND (expires_at IS NULL OR expires_at > %(now)s)
                ORDER BY namespace LIMIT 1)
        UNION ALL
        SELECT (SELECT namespace FROM store_items
                WHERE namespace > walk.namespace {upper}
                  AND (expires_at IS NULL OR expires_at > %(now)s)
                ORDER BY namespace LIMIT 1)
        FROM walk WHERE walk.namespace IS NOT NULL
    )
    SELECT namespace FROM walk WHERE namespace IS NOT NULL LIMIT %(n)s
    """


def _word_ranking(
    terms: list[str], scope: str, scope_params: list[Any], columns: str
) -> tuple[str, list[Any]]:
    """The matches of ``terms`` in ``scope`` (SQL over ``store_items AS i``) ranked by
    words, best first: SQL whose last two parameters (LIMIT, OFFSET) the caller appends,
    and the parameters before them. Rows are ``columns`` and the score (``rank``)."""
    # Terms are letters and digits only (text_index._TERM): no tsquery syntax.
    tsquery = " | ".join(terms)
    config = pg_schema.TEXT_SEARCH_CONFIG
    # BM25's inverse document frequency, which ts_rank lacks: each term's ts_rank
    # is weighted by FTS5's idf, max(ln((N - df + 0.5) / (df + 0.5)), 1e-6), df
    # counted on the GIN index and N the planner's row estimate (no table scan).
    # MATERIALIZED: computed once per query, not once per matching row.
    sql = f"""
    WITH term AS (
        SELECT to_tsquery('{config}', t) AS q FROM unnest(%s::text[]) AS t
    ), total AS (
        -- The planner's estimate once (auto)analyze has run; a count before.
        SELECT CASE WHEN reltuples > 0 THEN reltuples
                    ELSE (SELECT count(*) FROM store_items) END AS n
        FROM pg_class WHERE oid = 'store_items'::regclass
    ), weight AS MATERIALIZED (
        SELECT term.q, greatest(
            ln((greatest(total.n, d.df) - d.df + 0.5) / (d.df + 0.5)), 1e-6
        ) AS idf
        FROM term, total, LATERAL (
            SELECT count(*) AS df FROM store_items s WHERE s.search_tsv @@ term.q
        ) AS d
    )
    SELECT {columns},
           (SELECT sum(w.idf * ts_rank(i.search_tsv, w.q, {_RANK_NORMALIZATION}))
            FROM weight AS w) AS rank
    FROM store_items AS i, to_tsquery('{config}', %s) AS q
    WHERE i.search_tsv @@ q AND {scope}
    ORDER BY rank DESC, i.updated_at DESC, i.id DESC LIMIT %s OFFSET %s
    """
    return sql, [terms, tsquery, *scope_params]


def _unscored_sql(
    scope: str, scope_params: list[Any], condition: str, offset: int, limit: int
) -> tuple[str, list[Any]]:
    """Rows (``_PAGE_COLUMNS``) in ``scope`` meeting ``condition``, newest update first."""
    return (
        f"SELECT {_PAGE_COLUMNS} FROM store_items AS i WHERE {scope} AND {condition} "
        "ORDER BY i.updated_at DESC, i.id DESC LIMIT %s OFFSET %s",
        [*scope_params, limit, offset],
    )


def _within_cutoff(page_sql: str, order: str) -> str:
    """The rows of ``page_sql`` (``_PAGE_COLUMNS`` as named there [, ``rank``]) as
    ``_COLUMNS`` [, rank], then the page's values total (UTF-8 bytes of their text), in
    ``order`` (``_BY_RECENCY``, ``_BY_RANK`` with the rank column, or empty: any). Each
    value's text is sent only when that total is at most the first parameter, the cutoff
    (the page's own parameters follow it): a page over what the answer reserved costs the
    database a look at each of its values, not their transfer.

    The page is ordered, limited and offset on the stored datum (for a TOASTed value, a
    reference: neither the scan nor a sort copies the value), and only the page's values
    are turned into text. One query level: the two identical window sums are computed once,
    and ``order``, the page's own, needs no second sort (which would carry the values)."""
    total = "sum(octet_length(page.value::text)) OVER ()"
    rank = ", page.rank" if order == _BY_RANK else ""
    return f"""
    SELECT page.namespace, page.key, CASE WHEN {total} <= %s THEN page.value::text END,
           page.created_at, page.updated_at, page.id, page.ttl_minutes{rank}, {total}
    FROM ({page_sql}) AS page
    {"ORDER BY " + order if order else ""}
    """


def _page_on(
    conn: IndexConnection,
    sql: str,
    params: list[Any],
    order: str,
    budget: AnswerBudget,
    first_read: int,
) -> list[tuple[Any, ...]]:
    """``PostgresStorage._page`` on a blocking connection (the embedding index's pool)."""
    within = _within_cutoff(sql, order)
    return read_page(
        budget,
        lambda cutoff: list(conn.execute(within, [cutoff, *params]).fetchall()),
        first_read,
    )


def _rows_by_id(
    conn: IndexConnection,
    page: Sequence[tuple[int, float]],
    budget: AnswerBudget,
    first_read: int,
) -> list[tuple[_Row, float | None]]:
    """The item rows of a ranked page of ids, in the page's order."""
    if not page:
        return []
    sql = f"SELECT {_PAGE_COLUMNS} FROM store_items AS i WHERE i.id = ANY(%s)"
    rows = _page_on(conn, sql, [[item for item, _ in page]], "", budget, first_read)
    found = {int(values[5]): _Row(*values[:7]) for values in rows}
    return [(found[item], score) for item, score in page if item in found]


def _index_pool_size(config: StoreConfig) -> int:
    """The embedding index's pool of blocking connections (none without ``store.index``)."""
    if config.index is None:
        return 0
    return max(2, config.database_pool_size // 2)
