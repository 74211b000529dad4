"""An in-memory copy of the Store's vectors, searched exactly (numpy) or approximately (HNSW).

Reading every candidate vector out of SQLite costs microseconds per row (measured: ~8 us,
so ~0.8 s for a 100k-item store); one matrix product over vectors already in memory costs
~0.1 us per row. So each Store process keeps a mirror of ``item_vectors`` (on PostgreSQL
``store_item_vectors``, the same SQL through ``vector_dialect``): a float32 matrix (4 bytes
per dimension per vector) and the item id of each row.

The database table stays the only truth. The mirror loads it at start, and before each search
replays ``vector_changes`` (a log that every vector write and item delete appends to in the
same transaction), inside the search's own read transaction. So it is consistent with the
table through restarts (reloaded), crashes (nothing to repair: the log is transactional) and
writes by other worker processes (their changes are in the same log). A mirror that fell
further behind than the log keeps reloads.

The HNSW index is built on a background thread (one core) once the store outgrows exact
search, from a copy of the matrix; writes during the build are replayed into it before it
is used. Until then searches are exact.

A search whose scope (namespace prefix, filter, liveness) holds few items scores just those
items' vectors. A broader one scores every vector (exact) or asks the HNSW index
(approximate, once the store holds more than ``exact_search_max_vectors`` vectors and the
optional ``usearch`` package is installed), then walks the results best first, keeping the
items the scope allows, checked in SQL a chunk at a time; when the walk finds too few (a
selective filter), it ranks the scope's own items after all.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.upstreams.store.vector_dialect import IndexConnection, VectorDialect
from gateway.upstreams.store.vectors import best_per_item, decode_many

log = logging.getLogger("gateway.store.vectors")

FIRST_WALK_FACTOR = 4
# A scope (namespace prefix, filter) of at most this many live items is ranked by scoring
# just its items' vectors: their ids come from SQL (ints, ~1 us each), the vectors from
# memory. A larger scope is ranked by walking the whole store's best vectors instead.
SMALL_SCOPE_ITEMS = 2000
# Past this many vectors walked, too few were in scope (a selective filter): rank the
# scope's own items instead.
MAX_WALK = 1024
_INITIAL_CAPACITY = 1024


def _usearch_index_class() -> Any:
    try:  # optional: exact search covers everything without it
        from usearch.index import Index
    except ImportError:  # pragma: no cover - depends on the installation
        return None
    return Index


_UsearchIndex: Any = _usearch_index_class()


def approximate_available() -> bool:
    """Whether the approximate index can be used here (usearch installed)."""
    return _UsearchIndex is not None


class VectorMirror:
    """Every vector of the Store in one matrix; slot = row of the matrix."""

    def __init__(self, dims: int, exact_max: int, dialect: VectorDialect) -> None:
        self.dims = dims
        self.dialect = dialect
        self.exact_max = exact_max
        self._lock = threading.Lock()
        self._matrix = np.zeros((0, dims), dtype=np.float32)
        self._item_at = np.zeros(0, dtype=np.int64)  # item id per slot, -1 when free
        self._used = 0  # slots [0, used) have been handed out
        self._free: list[int] = []
        self._slots_of: dict[int, list[int]] = {}  # item id -> slots
        self._cursor = -1  # last vector_changes.seq applied; -1: not loaded
        self._approximate: Any = None
        self._loading = False
        self._dirty: set[int] | None = None  # slots changed during a background build
        self._generation = 0  # bumped by every (re)load
        self.build_thread: threading.Thread | None = None

    @property
    def loaded(self) -> bool:
        return self._cursor >= 0

    @property
    def approximate(self) -> bool:
        return self._approximate is not None

    @property
    def vectors(self) -> int:
        return self._used - len(self._free)

    # -- keeping up with the table ------------------------------------------------

    def catch_up(self, connection: IndexConnection) -> bool:
        """Load or replay the change log up to what ``connection`` sees; False while another
        thread is loading (the caller then scans SQL)."""
        changes = self.dialect.changes
        latest = int(connection.execute(f"SELECT max(seq) FROM {changes}").fetchone()[0] or 0)
        with self._lock:
            if self._loading:
                return False
            if self.loaded and latest <= self._cursor:
                return True
            oldest = connection.execute(f"SELECT min(seq) FROM {changes}").fetchone()[0]
            behind = oldest is not None and oldest > self._cursor + 1
            if self.loaded and not behind:
                changed = connection.execute(
                    f"SELECT DISTINCT item_id FROM {changes} "
                    f"WHERE seq > {self.dialect.mark} AND seq <= {self.dialect.mark}",
                    (self._cursor, latest),
                ).fetchall()
                self._replace([int(item) for (item,) in changed], connection)
                self._cursor = latest
                return True
            self._loading = True
        try:
            self._load(connection, latest)
        finally:
            with self._lock:
                self._loading = False
        return True

    def _load(self, connection: IndexConnection, latest: int) -> None:
        rows = connection.execute(f"SELECT item_id, vector FROM {self.dialect.vectors}").fetchall()
        count = len(rows)
        matrix = np.zeros((max(count, _INITIAL_CAPACITY), self.dims), dtype=np.float32)
        item_at = np.full(len(matrix), -1, dtype=np.int64)
        slots_of: dict[int, list[int]] = {}
        for start in range(0, count, 10_000):
            chunk = rows[start : start + 10_000]
            items, blobs = zip(*chunk, strict=True)
            matrix[start : start + len(chunk)] = decode_many(blobs, self.dims)
            item_at[start : start + len(chunk)] = items
        for slot in range(count):
            slots_of.setdefault(int(item_at[slot]), []).append(slot)
        with self._lock:
            self._matrix, self._item_at, self._used = matrix, item_at, count
            self._free, self._slots_of = [], slots_of
            self._approximate = None
            self._cursor = latest
            self._generation += 1  # a build from the old matrix must not be installed
            self._dirty = None
            self._start_build_if_due()
        log.info("store vectors loaded: %d vector(s), exact search", count)

    def _start_build_if_due(self) -> None:
        """Build the HNSW index on a background thread once the store outgrew exact search;
        searches stay exact (in memory) until it is ready. Called with the lock held."""
        if (
            self._approximate is not None
            or self._dirty is not None  # a build is under way
            or self.vectors <= self.exact_max
            or not approximate_available()
        ):
            return
        live = np.flatnonzero(self._item_at[: self._used] >= 0)
        vectors = self._matrix[live].copy()
        self._dirty = set()
        thread = threading.Thread(
            target=self._build_approximate,
            args=(live, vectors, self._generation),
            name="store-hnsw",
            daemon=True,
        )
        thread.start()
        self.build_thread = thread

    def _build_approximate(
        self, slots: npt.NDArray[np.int64], vectors: npt.NDArray[np.float32], generation: int
    ) -> None:
        try:
            index = _UsearchIndex(ndim=self.dims, metric="ip", dtype="f32")
            # One thread: the build shares the machine with the gateway's own work.
            index.add(slots.astype(np.uint64), vectors, threads=1)
        except Exception:
            log.exception("building the approximate vector index failed; search stays exact")
            with self._lock:
                if generation == self._generation:
                    self._dirty = None
            return
        with self._lock:
            if generation != self._generation:
                return  # the mirror was reloaded meanwhile; that load starts its own build
            # Slots that changed while the index was built: bring them up to date.
            for slot in self._dirty or ():
                if slot in index:
                    index.remove(slot)
                if self._item_at[slot] >= 0:
                    index.add(slot, self._matrix[slot])
            self._dirty = None
            self._approximate = index
        log.info("store approximate vector index ready: %d vector(s)", len(index))

    def _replace(self, items: list[int], connection: IndexConnection) -> None:
        """Swap in the current vectors of ``items`` (called with the lock held)."""
        for item in items:
            for slot in self._slots_of.pop(item, []):
                self._item_at[slot] = -1
                self._free.append(slot)
                if self._approximate is not None:
                    self._approximate.remove(slot)
                if self._dirty is not None:
                    self._dirty.add(slot)
        if not items:
            return
        rows = connection.execute(
            f"SELECT item_id, vector FROM {self.dialect.vectors} "
            f"WHERE item_id IN ({self.dialect.marks(len(items))})",
            items,
        ).fetchall()
        for item, blob in rows:
            slot = self._free.pop() if self._free else self._grow()
            vector = np.frombuffer(blob, dtype="<f4")
            self._matrix[slot] = vector
            self._item_at[slot] = item
            self._slots_of.setdefault(int(item), []).append(slot)
            if self._approximate is not None:
                self._approximate.add(slot, vector)
            if self._dirty is not None:
                self._dirty.add(slot)
        self._start_build_if_due()

    def _grow(self) -> int:
        if self._used == len(self._matrix):
            capacity = max(_INITIAL_CAPACITY, 2 * len(self._matrix))
            matrix = np.zeros((capacity, self.dims), dtype=np.float32)
            matrix[: self._used] = self._matrix[: self._used]
            item_at = np.full(capacity, -1, dtype=np.int64)
            item_at[: self._used] = self._item_at[: self._used]
            self._matrix, self._item_at = matrix, item_at
        self._used += 1
        return self._used - 1

    # -- search ---------------------------------------------------------------------

    def ranking(
        self,
        connection: IndexConnection,
        scope_sql: str,
        scope_params: list[Any],
        query: npt.NDArray[np.float32],
        depth: int,
    ) -> list[tuple[int, float]]:
        """The best ``depth`` items in scope (cosine, best first)."""
        scoped = connection.execute(
            f"SELECT i.id FROM {self.dialect.items} AS i WHERE {scope_sql} "
            f"LIMIT {self.dialect.mark}",
            (*scope_params, SMALL_SCOPE_ITEMS + 1),
        ).fetchall()
        if len(scoped) <= SMALL_SCOPE_ITEMS:
            return self._rank_items([item for (item,) in scoped], query, depth)
        walk = max(depth * FIRST_WALK_FACTOR, 64)
        while True:
            with self._lock:
                slots, scores = self._top(query, walk)
                items = self._item_at[slots]
                total = self.vectors
            best: dict[int, float] = {}
            for item, score in zip(items.tolist(), scores.tolist(), strict=True):
                if item >= 0 and item not in best:
                    best[item] = score
            allowed = _in_scope(connection, self.dialect, list(best), scope_sql, scope_params)
            ranked = [(item, score) for item, score in best.items() if item in allowed]
            if len(ranked) >= depth or walk >= total:
                return ranked[:depth]
            if walk >= MAX_WALK:
                every = connection.execute(
                    f"SELECT i.id FROM {self.dialect.items} AS i WHERE {scope_sql}", scope_params
                ).fetchall()
                return self._rank_items([item for (item,) in every], query, depth)
            walk = min(walk * 4, MAX_WALK)

    def _rank_items(
        self, items: list[int], query: npt.NDArray[np.float32], depth: int
    ) -> list[tuple[int, float]]:
        """Exact ranking of just ``items`` by their best vector."""
        with self._lock:
            slots = [slot for item in items for slot in self._slots_of.get(item, ())]
            if not slots:
                return []
            chosen = np.asarray(slots, dtype=np.int64)
            scores = self._matrix[chosen] @ query
            owners = self._item_at[chosen]
        return best_per_item(owners, scores, depth)

    def _top(
        self, query: npt.NDArray[np.float32], count: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """The ``count`` best slots and their scores, best first (lock held)."""
        if self._approximate is not None:
            found = self._approximate.search(query, count)
            slots = np.asarray(found.keys, dtype=np.int64)
            return slots, (1.0 - np.asarray(found.distances, dtype=np.float32))
        used = self._used
        if used == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        scores = self._matrix[:used] @ query
        scores[self._item_at[:used] < 0] = -np.inf
        count = min(count, used)
        top = np.argpartition(-scores, count - 1)[:count]
        top = top[np.argsort(-scores[top], kind="stable")]
        keep = np.isfinite(scores[top])
        return top[keep].astype(np.int64), scores[top][keep]


def _in_scope(
    connection: IndexConnection,
    dialect: VectorDialect,
    items: list[int],
    scope_sql: str,
    scope_params: list[Any],
) -> set[int]:
    if not items:
        return set()
    rows = connection.execute(
        f"SELECT i.id FROM {dialect.items} AS i "
        f"WHERE i.id IN ({dialect.marks(len(items))}) AND {scope_sql}",
        (*items, *scope_params),
    )
    return {int(item) for (item,) in rows}
