"""SQLite storage of Store items: the SQL of each operation (put, get, delete, search by
words, the namespaces listing, the TTL sweep) and the plans that keep them cheap.

``SQLiteStorage`` runs these statements on the worker threads of ``SQLiteConnections``
(``sqlite_connections.py``): reads on a reader thread, writes in the writer's group commit.

Reads of item rows go through ``_read_rows``: the cursor is walked row by row and each
value's bytes are taken from the answer's ``AnswerBudget`` as it is read, so a search over
``store.max_answer_bytes`` stops at the first row past it (422) with no more than that in
memory, and the bytes answers hold in all stay within ``store.max_answer_bytes_in_flight``.
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import Any

from gateway.upstreams.store.answers import AnswerBudget, AnswerBytes, answer_budget, value_bytes
from gateway.upstreams.store.config import StoreConfig
from gateway.upstreams.store.filters import compile_filter

# Hook (issue 12): `hybrid` and `vectors` are the embedding index's modules.
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
from gateway.upstreams.store.rows import (
    _UPDATED_AT_STEP,
    SWEEP_BATCH,
    NamespaceWalk,
    _dotted,
    _Row,
    answer_items,
    check_search_depth,
)
from gateway.upstreams.store.sqlite_connections import SQLiteConnections, _snapshot
from gateway.upstreams.store.text_index import match_expression
from gateway.upstreams.store.vector_dialect import SQLITE, VectorDialect
from gateway.upstreams.store.vectors import ItemVectors, item_id

_ITEM_COLUMNS = "i.namespace, i.key, i.value, i.created_at, i.updated_at, i.id, i.ttl_minutes"
_LIVE = "(i.expires_at IS NULL OR i.expires_at > ?)"
_LIVE_S = "(s.expires_at IS NULL OR s.expires_at > ?)"
# BM25 order: FTS5's bm25() is lower-is-better (the API's score, its negation, higher).
_BY_RANK = "ORDER BY rank, i.updated_at DESC, i.id DESC"
# A search under a namespace prefix holding at most this many live items ranks only those
# items (see SQLiteStorage._search); above it, the prefix is checked on each match instead.
# Crossover measured at 1M items: ~0.8 us per prefix item against ~1.8 us per store-wide match.
SCOPED_SEARCH_MAX_ITEMS = 10_000


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


class SQLiteStorage(SQLiteConnections):
    """Items in one SQLite file; async methods, each one a short statement on a thread."""

    # Hook (issue 12): the embedding index's SQL names these tables.
    vector_dialect: VectorDialect = SQLITE

    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.time) -> None:
        super().__init__(config, clock)
        self.answers = AnswerBytes(config.max_answer_bytes, config.answer_bytes_in_flight)

    # -- operations ---------------------------------------------------------------

    async def put(
        self,
        request: StorePutRequest,
        vectors: ItemVectors | None = None,
        forms: StoredForms | None = None,
    ) -> None:
        """Insert or replace an item; ``created_at`` survives replacement.

        ``vectors`` (issue 12 hook): the item's embeddings, written in the same transaction.
        """
        now = self._clock()
        ttl = request.ttl
        if ttl is None:
            ttl = self._config.default_ttl_minutes
        expires_at = None if ttl is None else now + ttl * 60.0
        # ``forms``: made with the parse, within its budget (store/app.py's put_item)
        value_json, text = forms or request.stored_forms()
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
        now = self._clock()
        with answer_budget(self.answers, budget) as held:
            rows = await self._run(
                self._readers, functools.partial(self._get, _dotted(namespace), key, now, held)
            )
            if not rows:
                return None
            row = rows[0][0]
            if self._refresh(refresh_ttl) and row.ttl_minutes is not None:
                await self._write(functools.partial(_refresh_rows, ids=[row.id], now=now))
            return row

    def _get(
        self, namespace: str, key: str, now: float, budget: AnswerBudget
    ) -> list[tuple[_Row, float | None]]:
        cursor = self._connection().execute(
            f"SELECT {_ITEM_COLUMNS} FROM items AS i "
            f"WHERE i.namespace = ? AND i.key = ? AND {_LIVE}",
            (namespace, key, now),
        )
        return _read_rows(cursor, budget)

    def _refresh(self, requested: bool | None) -> bool:
        return self._config.refresh_ttl_on_read if requested is None else requested

    async def delete(self, namespace: Namespace, key: str) -> None:
        """Remove an item; removing an absent item is not an error."""
        await self._write(functools.partial(_delete, namespace=_dotted(namespace), key=key))

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
        """Listing (newest update first) or, with a query, BM25-ranked matches (best first)
        followed by the items no query can match (score null, newest update first): rows
        and scores (null in listing mode, as the API schema has it).

        ``ranker`` (issue 12 hook): ranks a query by meaning (vectors or hybrid) instead.
        ``budget``: what the answer's values may hold (``AnswerTooLargeError``, 422, past
        store.max_answer_bytes; ``AnswersBusyError``, 503, past the bytes in flight);
        without it, the search makes its own. A query whose page ends past
        store.max_search_depth is refused (422, ``check_search_depth``).
        """
        check_search_depth(request, self._config.max_search_depth)
        now = self._clock()
        with answer_budget(self.answers, budget) as held:
            rows = await self._run(
                self._readers, functools.partial(self._search, request, now, held, ranker)
            )
            if self._refresh(request.refresh_ttl):
                expiring = [row.id for row, _ in rows if row.ttl_minutes is not None]
                if expiring:
                    await self._write(functools.partial(_refresh_rows, ids=expiring, now=now))
            return rows

    def _search(
        self,
        request: StoreSearchRequest,
        now: float,
        budget: AnswerBudget,
        ranker: Ranker | None = None,
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
                    connection, scope, scope_params, "1", request.offset, request.limit, budget
                )
            if ranker is not None:
                # Hook (issue 12): the ranker gets the scope as SQL over `items AS i` and
                # the BM25 ranking (id, score) to any depth, and answers (id, score) best
                # first, to the depth of the page's end. Only ids and scores: the values
                # are read for the page alone.
                def bm25(depth: int) -> list[tuple[int, float]]:
                    return self._bm25_ranking(connection, request, bounds, now, depth)

                depth = request.offset + request.limit
                ranking = ranker(connection, scope, scope_params, bm25, depth)
                page = _rows_by_id(connection, ranking[request.offset :], budget)
                if len(ranking) == depth:
                    return page
                ranked = len(ranking)
                unscored = ranker.unscored(SQLITE)
            else:
                page = self._bm25(
                    connection, request, bounds, now, request.limit, request.offset, budget
                )
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
                budget,
            )

    def _bm25(
        self,
        connection: sqlite3.Connection,
        request: StoreSearchRequest,
        bounds: list[str] | None,
        now: float,
        limit: int,
        offset: int,
        budget: AnswerBudget,
    ) -> list[tuple[_Row, float | None]]:
        """BM25-ranked matches of the request's query, page [offset, offset + limit).

        The ranking's sort holds ids and scores only, and the page's rows are read after
        it: a sort of full rows would hold (or spill) the value of every match up to the
        page's end (up to store.max_search_depth of them), and read every match's value."""
        matches = self._bm25_matches(connection, request, bounds, now)
        if matches is None:
            return []
        sql, params = matches
        cursor = connection.execute(
            f"SELECT i.id, bm25(items_fts) AS rank {sql} {_BY_RANK} LIMIT ? OFFSET ?",
            (*params, limit, offset),
        )
        # FTS5's bm25() is lower-is-better; the API's score is higher-is-better.
        ranking = [(int(item), -float(rank)) for item, rank in cursor]
        return _rows_by_id(connection, ranking, budget)

    def _bm25_ranking(
        self,
        connection: sqlite3.Connection,
        request: StoreSearchRequest,
        bounds: list[str] | None,
        now: float,
        depth: int,
    ) -> list[tuple[int, float]]:
        """The first ``depth`` (item id, score) of the BM25 ranking, without the values."""
        matches = self._bm25_matches(connection, request, bounds, now)
        if matches is None:
            return []
        sql, params = matches
        cursor = connection.execute(
            f"SELECT i.id, bm25(items_fts) AS rank {sql} {_BY_RANK} LIMIT ?", (*params, depth)
        )
        # -0.0 (a bm25 of 0) becomes 0.0, as the score of a row read whole.
        return [(int(item), -float(rank) or 0.0) for item, rank in cursor]

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
        walk = await self._run(
            self._readers, functools.partial(self._list_namespaces, request, now)
        )
        return walk.page()

    def _list_namespaces(self, request: StoreListNamespacesRequest, now: float) -> NamespaceWalk:
        """The walk (``rows.NamespaceWalk``) over the distinct live namespaces under the
        literal part of the prefix, in index order, one index seek each, in one snapshot.
        The cursor's rows come lazily: once the walk stops a seek, the rest never runs (so
        there are no batches here, and every seek includes ``walk.start``)."""
        walk = NamespaceWalk(request)
        with _snapshot(self._connection()) as connection:
            while walk.start is not None:
                for (namespace,) in _namespaces_from(connection, walk.start, walk.high, now):
                    walk.fetched += 1
                    if not walk.visit(namespace):
                        break
                else:
                    walk.exhausted()
        return walk

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


# Write operations: each runs inside the writer's group-commit transaction.


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


def _read_rows(cursor: sqlite3.Cursor, budget: AnswerBudget) -> list[tuple[_Row, float | None]]:
    """The item rows ``cursor`` yields (``_ITEM_COLUMNS``), each value's bytes taken from
    ``budget`` as its row is read: over the answer's bound (or the bytes in flight) the read
    stops there, with that error."""
    rows: list[tuple[_Row, float | None]] = []
    with contextlib.closing(cursor):
        for found in cursor:
            budget.take(value_bytes(found[2]))  # i.value
            rows.append((_Row(*found), None))
    return rows


def _rows_by_id(
    connection: sqlite3.Connection, page: Sequence[tuple[int, float]], budget: AnswerBudget
) -> list[tuple[_Row, float | None]]:
    """The item rows of a ranked page of ids, in the page's order (word ranking, and the
    issue 12 hook's)."""
    if not page:
        return []
    marks = ",".join("?" * len(page))
    cursor = connection.execute(
        f"SELECT {_ITEM_COLUMNS} FROM items AS i WHERE i.id IN ({marks})",
        [item for item, _ in page],
    )
    found = {row.id: row for row, _ in _read_rows(cursor, budget)}
    return [(found[item], score) for item, score in page if item in found]


def _unscored(
    connection: sqlite3.Connection,
    scope: str,
    scope_params: list[Any],
    condition: str,
    offset: int,
    limit: int,
    budget: AnswerBudget,
) -> list[tuple[_Row, float | None]]:
    """Items in ``scope`` meeting ``condition``, newest update first, score null: the
    listing (condition ``1``), or the items a query cannot score after its ranking."""
    cursor = connection.execute(
        f"SELECT {_ITEM_COLUMNS} FROM items AS i WHERE {scope} AND {condition} "
        "ORDER BY i.updated_at DESC, i.id DESC LIMIT ? OFFSET ?",
        (*scope_params, limit, offset),
    )
    return _read_rows(cursor, budget)


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
