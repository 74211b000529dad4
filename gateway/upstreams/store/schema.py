"""The Store's SQLite schema: one table of items and an FTS5 index over their text."""

from __future__ import annotations

SCHEMA_VERSION = 3

# Namespaces are stored dot-joined (labels cannot contain '.'), so "every namespace under
# a.b" is the index range ['a.b.', 'a.b/') plus 'a.b' itself.
# `id` is an explicit INTEGER PRIMARY KEY because the FTS index refers to it: implicit
# rowids may change on VACUUM.
# `items_by_namespace_recency` carries `expires_at` so that walking a namespace newest first
# (a listing page, a deep offset, the set of ids a scoped search ranks) checks liveness from
# the index alone, without reading each table row.
# `items_unsearchable` (by namespace) and `items_unsearchable_by_updated` (the whole store)
# hold just the items no query can match (no searchable text: put with `index: false`, or
# nothing under their paths), which follow a search's matches when those end within the
# page: finding them costs their number, not a walk of every item.
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS items (
    id INTEGER PRIMARY KEY,
    namespace TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    search_text TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    ttl_minutes REAL,
    expires_at REAL,
    UNIQUE (namespace, key)
);
CREATE INDEX IF NOT EXISTS items_by_namespace_recency
    ON items (namespace, updated_at, id, expires_at);
CREATE INDEX IF NOT EXISTS items_by_updated ON items (updated_at, id);
CREATE INDEX IF NOT EXISTS items_by_expiry ON items (expires_at) WHERE expires_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS items_unsearchable
    ON items (namespace, updated_at, id, expires_at) WHERE search_text IS NULL;
CREATE INDEX IF NOT EXISTS items_unsearchable_by_updated
    ON items (updated_at, id) WHERE search_text IS NULL;

CREATE VIRTUAL TABLE IF NOT EXISTS items_fts USING fts5(
    search_text,
    content='items',
    content_rowid='id',
    tokenize='porter unicode61 remove_diacritics 2'
);

CREATE TRIGGER IF NOT EXISTS items_fts_insert AFTER INSERT ON items BEGIN
    INSERT INTO items_fts (rowid, search_text) VALUES (new.id, new.search_text);
END;
CREATE TRIGGER IF NOT EXISTS items_fts_delete AFTER DELETE ON items BEGIN
    INSERT INTO items_fts (items_fts, rowid, search_text)
    VALUES ('delete', old.id, old.search_text);
END;
CREATE TRIGGER IF NOT EXISTS items_fts_update AFTER UPDATE OF search_text ON items BEGIN
    INSERT INTO items_fts (items_fts, rowid, search_text)
    VALUES ('delete', old.id, old.search_text);
    INSERT INTO items_fts (rowid, search_text) VALUES (new.id, new.search_text);
END;

PRAGMA user_version = {SCHEMA_VERSION};
"""

# Run, in one transaction before SCHEMA, on a file written by an older schema version (its
# user_version). Every step is idempotent, so two processes opening the file at once are safe.
MIGRATIONS: dict[int, str] = {
    # 1 -> 2: the namespace index gained expires_at (see above).
    1: "DROP INDEX IF EXISTS items_by_namespace_updated;",
    # 2 -> 3: items_unsearchable (see above), created by SCHEMA's IF NOT EXISTS.
}


def upgrade_script(from_version: int) -> str:
    """SQL (no transaction control) bringing a file at ``from_version`` to SCHEMA_VERSION."""
    steps = [MIGRATIONS[v] for v in range(max(from_version, 1), SCHEMA_VERSION) if v in MIGRATIONS]
    return "".join(steps) + SCHEMA
