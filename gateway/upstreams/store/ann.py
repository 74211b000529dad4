"""An approximate (HNSW) index over the Store's vectors, for stores too large to scan.

The SQLite table stays the only truth. This index lives in memory, is built from the table in
the background once the store holds more vectors than ``exact_search_max_vectors``, and
catches up before each search by replaying ``vector_changes`` (a log that every vector
write and item delete appends to, in the same transaction). So it is consistent with the
table through restarts (rebuilt), crashes (nothing to repair: the log is transactional) and
writes by other worker processes (their changes are in the same log).

A search asks the index for a few times the depth it needs, keeps the hits that the
search's scope (namespace prefix, filter, liveness) allows, and widens the ask until it has
enough; when even a wide ask finds too few (a narrow namespace in a big store), it answers
None and the caller scans that namespace exactly, which is cheap precisely then.

Needs the optional ``usearch`` package (``pip install 'ratelimit-gateway[vectors]'``);
without it every search is exact.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.upstreams.store.vectors import decode_many

log = logging.getLogger("gateway.store.ann")


def _usearch_index_class() -> Any:
    try:  # optional: exact search covers everything without it
        from usearch.index import Index
    except ImportError:  # pragma: no cover - depends on the installation
        return None
    return Index


_UsearchIndex: Any = _usearch_index_class()

FIRST_ASK_FACTOR = 4
MAX_ASK = 8192


def available() -> bool:
    """Whether the approximate index can be used here (usearch installed)."""
    return _UsearchIndex is not None


class ApproximateIndex:
    """HNSW over every vector row (key = ``item_vectors.id``), cosine metric."""

    def __init__(self, dims: int) -> None:
        self.dims = dims
        self._lock = threading.Lock()
        self._index: Any = None
        self._cursor = 0  # last vector_changes.seq applied
        self._item_of: dict[int, int] = {}  # vector row id -> item id
        self._keys_of: dict[int, list[int]] = {}  # item id -> vector row ids
        self._building = False
        self._checked_at = -1  # vector_changes.seq at the last size check

    @property
    def ready(self) -> bool:
        return self._index is not None

    def catch_up(self, connection: sqlite3.Connection, exact_max: int) -> None:
        """Apply logged changes; build from scratch once the store outgrew exact search.

        The build runs on the calling thread (a reader, started at open or by the first
        search past the size); searches meanwhile are exact.
        """
        if not available():
            return
        latest = int(connection.execute("SELECT max(seq) FROM vector_changes").fetchone()[0] or 0)
        if self._index is None:
            if self._building or latest == self._checked_at:
                return
            self._checked_at = latest
            count = int(connection.execute("SELECT count(*) FROM item_vectors").fetchone()[0])
            if count <= exact_max:
                return
            self._building = True
            try:
                self._build(connection, latest)
            finally:
                self._building = False
            return
        with self._lock:
            if latest <= self._cursor:
                return
            oldest = connection.execute("SELECT min(seq) FROM vector_changes").fetchone()[0]
            if oldest is not None and oldest > self._cursor + 1:
                log.info("approximate index fell behind the change log; rebuilding")
                self._build(connection, latest)
                return
            changed = connection.execute(
                "SELECT DISTINCT item_id FROM vector_changes WHERE seq > ? AND seq <= ?",
                (self._cursor, latest),
            ).fetchall()
            self._replace([item for (item,) in changed], connection)
            self._cursor = latest

    def _build(self, connection: sqlite3.Connection, latest: int) -> None:
        assert _UsearchIndex is not None
        rows = connection.execute("SELECT id, item_id, vector FROM item_vectors").fetchall()
        index = _UsearchIndex(ndim=self.dims, metric="cos", dtype="f32")
        self._item_of = {}
        self._keys_of = {}
        if rows:
            keys, items, blobs = zip(*rows, strict=True)
            index.add(np.asarray(keys, dtype=np.uint64), decode_many(blobs, self.dims))
            for key, item in zip(keys, items, strict=True):
                self._item_of[key] = item
                self._keys_of.setdefault(item, []).append(key)
        with self._lock:
            self._index = index
            self._cursor = latest
        log.info("approximate index built over %d vector(s)", len(rows))

    def _replace(self, items: Sequence[int], connection: sqlite3.Connection) -> None:
        stale = [key for item in items for key in self._keys_of.pop(item, [])]
        for key in stale:
            self._item_of.pop(key, None)
        if stale:
            self._index.remove(np.asarray(stale, dtype=np.uint64))
        marks = ",".join("?" * len(items))
        rows = connection.execute(
            f"SELECT id, item_id, vector FROM item_vectors WHERE item_id IN ({marks})",
            list(items),
        ).fetchall()
        if rows:
            keys, owners, blobs = zip(*rows, strict=True)
            self._index.add(np.asarray(keys, dtype=np.uint64), decode_many(blobs, self.dims))
            for key, item in zip(keys, owners, strict=True):
                self._item_of[key] = item
                self._keys_of.setdefault(item, []).append(key)

    def ranking(
        self,
        connection: sqlite3.Connection,
        scope_sql: str,
        scope_params: list[Any],
        query: npt.NDArray[np.float32],
        depth: int,
    ) -> list[tuple[int, float]] | None:
        """The best ``depth`` items in scope, or None when the index cannot find enough."""
        with self._lock:
            size = len(self._index)
            ask = min(max(depth * FIRST_ASK_FACTOR, 64), size)
            while True:
                matches = self._index.search(query, ask)
                best: dict[int, float] = {}
                for key, distance in zip(matches.keys, matches.distances, strict=True):
                    item = self._item_of.get(int(key))
                    if item is not None and item not in best:
                        best[item] = 1.0 - float(distance)
                allowed = _in_scope(connection, list(best), scope_sql, scope_params)
                ranked = [(item, score) for item, score in best.items() if item in allowed]
                if len(ranked) >= depth or ask >= size:
                    return ranked[:depth]
                if ask >= MAX_ASK:
                    return None
                ask = min(ask * 4, size, MAX_ASK)


def _in_scope(
    connection: sqlite3.Connection, items: list[int], scope_sql: str, scope_params: list[Any]
) -> set[int]:
    if not items:
        return set()
    marks = ",".join("?" * len(items))
    rows = connection.execute(
        f"SELECT i.id FROM items AS i WHERE i.id IN ({marks}) AND {scope_sql}",
        (*items, *scope_params),
    )
    return {int(item) for (item,) in rows}
