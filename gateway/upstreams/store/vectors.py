"""Item vectors in the Store's SQLite file: what is embedded, how it is stored, exact search.

Each indexed field path of an item is embedded on its own (as the reference does); a path
that selects several values (``items[*].text``) gives one vector per value. An item's score
is its best vector's cosine similarity to the query.

Tables (created next to ``items`` when an index is configured; the trigger removes an
item's vectors in the same transaction as the item, whether deleted, replaced or swept):

* ``item_vectors``: one row per vector, a compact float32 blob (4 bytes per dimension).
* ``item_embeddings``: per item, the paths it was embedded with (NULL: the configured
  default fields) and the signature (model, dims, fields) its vectors belong to, so a
  changed configuration finds exactly the items to re-embed.
* ``vector_leases``: which process runs the background re-index, so the workers of one
  gateway (or several gateways on one file) do not all embed the same items.
* ``vector_changes``: a log of items whose vectors changed, which the in-memory mirror
  (mirror.py) replays to stay consistent with the table across processes and restarts.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.upstreams.store.index_config import IndexConfig
from gateway.upstreams.store.text_index import PathStep, index_steps, nodes_at
from gateway.upstreams.store.vector_dialect import IndexConnection, VectorDialect

Vector = npt.NDArray[np.float32]

# Entries the change log keeps (see mirror.py: a mirror further behind reloads).
CHANGE_LOG_KEEP = 100_000

VECTOR_SCHEMA = """
CREATE TABLE IF NOT EXISTS item_vectors (
    id INTEGER PRIMARY KEY,
    item_id INTEGER NOT NULL,
    path TEXT NOT NULL,
    vector BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS item_vectors_by_item ON item_vectors (item_id);
CREATE TABLE IF NOT EXISTS item_embeddings (
    item_id INTEGER PRIMARY KEY,
    paths TEXT,
    signature TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS vector_changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    item_id INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS vector_leases (
    name TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    expires_at REAL NOT NULL
);
CREATE TRIGGER IF NOT EXISTS items_vectors_delete AFTER DELETE ON items BEGIN
    DELETE FROM item_vectors WHERE item_id = old.id;
    DELETE FROM item_embeddings WHERE item_id = old.id;
    INSERT INTO vector_changes (item_id) VALUES (old.id);
END;
"""


def encode(vector: Vector) -> bytes:
    """The blob form: little-endian float32, 4 bytes per dimension."""
    return np.ascontiguousarray(vector, dtype="<f4").tobytes()


def decode_many(blobs: Sequence[bytes], dims: int) -> npt.NDArray[np.float32]:
    """A (len(blobs), dims) matrix from blobs written by ``encode``."""
    return np.frombuffer(b"".join(blobs), dtype="<f4").reshape(len(blobs), dims)


def signature(config: IndexConfig, paths: list[str] | None) -> str:
    """What an item's vectors depend on: the model, and the configured fields when the
    item uses the default (explicit paths do not change with the configuration)."""
    if paths is None:
        return f"{config.signature}|{json.dumps(list(config.fields))}"
    return config.signature


def texts_to_embed(
    value: dict[str, Any], paths: list[str] | None, config: IndexConfig
) -> list[tuple[str, str]]:
    """``(path, text)`` pairs to embed: one per value each path selects, as the reference
    does (``$`` is the whole value as JSON, strings as they are, anything else as JSON)."""
    # A path given twice would embed (and pay the provider for) the same texts again.
    chosen = list(dict.fromkeys(config.fields if paths is None else paths))
    steps = index_steps(chosen) or ()
    pairs: list[tuple[str, str]] = []
    for path, path_steps in zip(chosen, steps, strict=True):
        for text in _texts(value, path_steps):
            if text.strip():
                pairs.append((path, text))
    return pairs


def _texts(value: Any, steps: tuple[PathStep, ...]) -> Iterator[str]:
    for node in nodes_at(value, steps):
        if isinstance(node, str):
            yield node
        elif node is not None:
            yield json.dumps(node, sort_keys=True, ensure_ascii=False)


@dataclass(frozen=True)
class ItemVectors:
    """An item's vectors, ready to be written in the same transaction as the item."""

    paths_json: str | None
    signature: str
    vectors: tuple[tuple[str, bytes], ...]

    @classmethod
    def build(
        cls,
        config: IndexConfig,
        paths: list[str] | None,
        pairs: Sequence[tuple[str, str]],
        embedded: Sequence[Vector],
    ) -> ItemVectors:
        blobs = tuple(
            (path, encode(vector)) for (path, _), vector in zip(pairs, embedded, strict=True)
        )
        return cls(None if paths is None else json.dumps(paths), signature(config, paths), blobs)

    def write(self, connection: IndexConnection, item_id: int, dialect: VectorDialect) -> None:
        """Replace the item's vectors (inside the caller's transaction).

        On PostgreSQL it first takes the change-log lock (``VectorDialect.lock_changes``), so
        change-log sequence numbers are handed out in commit order, as SQLite's one writer
        does.
        """
        d, m = dialect, dialect.mark
        d.lock_changes(connection)
        connection.execute(f"DELETE FROM {d.vectors} WHERE item_id = {m}", (item_id,))
        for path, blob in self.vectors:
            connection.execute(
                f"INSERT INTO {d.vectors} (item_id, path, vector) VALUES ({m}, {m}, {m})",
                (item_id, path, blob),
            )
        connection.execute(
            f"INSERT INTO {d.embeddings} (item_id, paths, signature) VALUES ({m}, {m}, {m}) "
            "ON CONFLICT (item_id) DO UPDATE SET paths = excluded.paths, "
            "signature = excluded.signature",
            (item_id, self.paths_json, self.signature),
        )
        seq = connection.execute(
            f"INSERT INTO {d.changes} (item_id) VALUES ({m}) RETURNING seq", (item_id,)
        ).fetchone()[0]
        # Bounded log: a reader further behind than this rebuilds from the table instead.
        connection.execute(
            f"DELETE FROM {d.changes} WHERE seq <= {m}", (int(seq or 0) - CHANGE_LOG_KEEP,)
        )


def item_id(connection: sqlite3.Connection, namespace: str, key: str) -> int:
    """The row id of an item just written in this transaction."""
    found = connection.execute(
        "SELECT id FROM items WHERE namespace = ? AND key = ?", (namespace, key)
    ).fetchone()
    return int(found[0])


def best_per_item(
    item_ids: npt.NDArray[np.int64], scores: npt.NDArray[np.float32], depth: int
) -> list[tuple[int, float]]:
    """The ``depth`` items with the best score of any of their vectors, best first."""
    if len(scores) == 0:
        return []
    order = np.argsort(-scores, kind="stable")
    # The first position of each item in best-first order is its best vector.
    _, first = np.unique(item_ids[order], return_index=True)
    first.sort()
    top = order[first[:depth]]
    return list(zip(item_ids[top].tolist(), scores[top].tolist(), strict=True))


def exact_ranking(
    connection: IndexConnection,
    dialect: VectorDialect,
    where_sql: str,
    params: Sequence[Any],
    query: Vector,
    dims: int,
    depth: int,
) -> list[tuple[int, float]]:
    """Cosine similarity of ``query`` against every vector of the items ``where_sql`` (over
    ``items AS i``) keeps, best item first; numpy does the arithmetic in one product."""
    rows = connection.execute(
        f"SELECT v.item_id, v.vector FROM {dialect.items} AS i "
        f"JOIN {dialect.vectors} AS v ON v.item_id = i.id WHERE {where_sql}",
        params,
    ).fetchall()
    if not rows:
        return []
    ids, blobs = zip(*rows, strict=True)
    matrix = decode_many(blobs, dims)
    scores = matrix @ query
    return best_per_item(np.asarray(ids, dtype=np.int64), scores, depth)


def stale_items_sql(dialect: VectorDialect) -> str:
    """Items whose vectors are missing or belong to another configuration (parameters:
    default signature, explicit signature, then now for liveness), over ``items AS i``."""
    m = dialect.mark
    return (
        f"FROM {dialect.items} AS i LEFT JOIN {dialect.embeddings} AS e ON e.item_id = i.id "
        "WHERE (e.item_id IS NULL OR e.signature != "
        f"CASE WHEN e.paths IS NULL THEN {m} ELSE {m} END) "
        f"AND {dialect.live()}"
    )


def claim_lease(
    connection: IndexConnection,
    dialect: VectorDialect,
    name: str,
    owner: str,
    now: float,
    seconds: float,
) -> bool:
    """Take or renew the lease ``name`` for ``owner`` unless another owner holds it unexpired."""
    d, m = dialect, dialect.mark
    connection.execute(
        f"INSERT INTO {d.leases} AS l (name, owner, expires_at) VALUES ({m}, {m}, {m}) "
        "ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, "
        "expires_at = excluded.expires_at "
        f"WHERE l.owner = excluded.owner OR l.expires_at <= {m}",
        (name, owner, now + seconds, now),
    )
    found = connection.execute(f"SELECT owner FROM {d.leases} WHERE name = {m}", (name,)).fetchone()
    return found is not None and bool(found[0] == owner)


def release_lease(
    connection: IndexConnection, dialect: VectorDialect, name: str, owner: str
) -> None:
    m = dialect.mark
    connection.execute(
        f"DELETE FROM {dialect.leases} WHERE name = {m} AND owner = {m}", (name, owner)
    )
