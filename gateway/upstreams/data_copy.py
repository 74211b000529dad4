"""``gateway data copy --to postgresql://...``: a one-shot copy of the SQLite Store and
control plane (the files in ``--data-dir``) into PostgreSQL.

It loses nothing and can run twice: every row is upserted by its natural key (an item by
namespace and key, every control-plane row by its id), so a second run adds no row and
rewrites only rows whose values changed in SQLite since. The report counts what each run
did (added, updated, already up to date), not what it read: a second run that said
"120 row(s) copied" read as if it had added 120 more. Rows keep their ids and timestamps;
identity sequences are moved past the copied ids. The SQLite files are opened read-only, so a
running gateway may keep serving from them (what it writes after a table was copied is in
the next run). The target is migrated first, as at gateway start.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from gateway.upstreams.control_plane import pg_storage as cp_pg
from gateway.upstreams.control_plane.config import DATABASE_FILE_NAME as CP_FILE
from gateway.upstreams.postgres.migrations import migrate
from gateway.upstreams.store import pg_schema
from gateway.upstreams.store.config import StoreConfig

# A batch (one transaction, and what is held in memory at once) ends at BATCH rows or
# once its values reach BATCH_BYTES, whichever comes first: a Store item may hold up to
# max_body_bytes (1 MiB by default) of value and as much search text, so 1,000 rows alone
# could be gigabytes.
BATCH = 1000
BATCH_BYTES = 8 * 1024 * 1024
# A line of progress at least this often (rows copied of the table), on long copies.
PROGRESS_EVERY = 50_000
_ITEM_COLUMNS = (
    "namespace", "key", "value", "search_text", "created_at", "updated_at",
    "ttl_minutes", "expires_at",
)  # fmt: skip
# Control-plane tables in foreign-key order, with the column a row is known by.
_CP_TABLES = (
    ("deployments", "id"),
    ("revisions", "id"),
    ("listeners", "id"),
    ("auth_providers", "id"),
    ("auth_flows", "auth_id"),
)


@dataclass
class TableCopy:
    """What one table's copy did."""

    read: int = 0  # rows in SQLite
    added: int = 0  # not in PostgreSQL before: inserted
    updated: int = 0  # in PostgreSQL with other values: overwritten
    in_target: int = 0  # rows in PostgreSQL afterwards

    @property
    def unchanged(self) -> int:
        """Already in PostgreSQL with the same values: left alone."""
        return self.read - self.added - self.updated


@dataclass
class CopyReport:
    """Per table: rows read from SQLite, what became of them, rows in PostgreSQL after."""

    tables: dict[str, TableCopy] = field(default_factory=dict)
    missing_files: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"skipped (no such file): {path}" for path in self.missing_files]
        for table, c in self.tables.items():
            out.append(
                f"{table}: {c.added + c.updated} row(s) copied, {c.in_target} in PostgreSQL "
                f"({c.added} added, {c.updated} updated, {c.unchanged} already up to date)"
            )
        return out


def _upsert_sql(table: str, columns: Sequence[str], key: Sequence[str]) -> str:
    """Insert a row, or overwrite the row of the same key when any value differs.

    A row whose values are all the same is not written (its old version stays, no dead
    tuple) and returns nothing; a written one returns whether it was inserted (``xmax``
    is 0 in a freshly inserted row version, the locking transaction's id in one written
    by ``DO UPDATE``). Values are compared as text: ``json`` (the Store's ``value``) has
    no equality operator, and float8's text form is exact (shortest round trip)."""
    updated = [c for c in columns if c not in key]
    names = ", ".join(columns)
    marks = ", ".join(["%s"] * len(columns))
    assignments = ", ".join(f"{c} = excluded.{c}" for c in updated)
    old = ", ".join(f"{table}.{c}::text" for c in updated)
    new = ", ".join(f"excluded.{c}::text" for c in updated)
    return (
        f"INSERT INTO {table} ({names}) VALUES ({marks}) "
        f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET {assignments} "
        f"WHERE ({old}) IS DISTINCT FROM ({new}) "
        "RETURNING (xmax = 0)"
    )


def _upsert(
    target: psycopg.Connection[Any], sql: str, rows: Sequence[sqlite3.Row], count: TableCopy
) -> None:
    """One batch in one transaction, counted into ``count``."""
    with target.transaction(), target.cursor() as out:
        out.executemany(sql, [tuple(row) for row in rows], returning=True)
        while True:  # one result per row: empty when the row was already up to date
            for (inserted,) in out.fetchall():
                if inserted:
                    count.added += 1
                else:
                    count.updated += 1
            if not out.nextset():
                break
    count.read += len(rows)


def _read_only(path: Path) -> sqlite3.Connection:
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    connection.row_factory = sqlite3.Row
    return connection


def _row_bytes(row: sqlite3.Row) -> int:
    """The row's text and blobs in bytes (text as UTF-8: a character may be 4)."""
    size = 0
    for value in row:
        if isinstance(value, bytes):
            size += len(value)
        elif isinstance(value, str):
            size += len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
    return size


def _batches(
    cursor: sqlite3.Cursor, max_rows: int | None = None, max_bytes: int | None = None
) -> Iterator[list[sqlite3.Row]]:
    """The cursor's rows in batches of at most ``max_rows`` rows (BATCH), each ending once
    its values reach ``max_bytes`` (BATCH_BYTES; a single larger row is a batch of its
    own)."""
    max_rows = BATCH if max_rows is None else max_rows
    max_bytes = BATCH_BYTES if max_bytes is None else max_bytes
    rows: list[sqlite3.Row] = []
    size = 0
    for row in cursor:
        rows.append(row)
        size += _row_bytes(row)
        if len(rows) >= max_rows or size >= max_bytes:
            yield rows
            rows, size = [], 0
    if rows:
        yield rows


Progress = Callable[[str], None]


def _silent(line: str) -> None:
    pass


def _copy_rows(
    cursor: sqlite3.Cursor,
    target: psycopg.Connection[Any],
    sql: str,
    table: str,
    count: TableCopy,
    progress: Progress,
) -> None:
    """Every row of ``cursor`` upserted batch by batch, a progress line every
    PROGRESS_EVERY rows."""
    said = 0
    for rows in _batches(cursor):
        _upsert(target, sql, rows, count)
        if count.read - said >= PROGRESS_EVERY:
            said = count.read
            progress(f"{table}: {count.read:,} row(s) read so far")


def copy_to_postgres(data_dir: Path, url: str, progress: Progress = _silent) -> CopyReport:
    """Copy both SQLite databases under ``data_dir`` into ``url``; returns the counts.
    ``progress`` gets a line now and then on a long copy."""
    report = CopyReport()
    migrate(url, pg_schema.COMPONENT, pg_schema.STEPS)
    migrate(url, cp_pg.COMPONENT, cp_pg.STEPS)
    store_file = StoreConfig(data_dir=data_dir).database_path
    cp_file = data_dir / CP_FILE
    with psycopg.connect(url) as target:
        if store_file.is_file():
            _copy_items(_read_only(store_file), target, report, progress)
        else:
            report.missing_files.append(str(store_file))
        if cp_file.is_file():
            _copy_control_plane(_read_only(cp_file), target, report, progress)
        else:
            report.missing_files.append(str(cp_file))
    return report


def _copy_items(
    source: sqlite3.Connection,
    target: psycopg.Connection[Any],
    report: CopyReport,
    progress: Progress,
) -> None:
    sql = _upsert_sql("store_items", _ITEM_COLUMNS, ("namespace", "key"))
    count = report.tables["store items"] = TableCopy()
    with source:
        source.execute("BEGIN")  # one snapshot of the file
        cursor = source.execute(f"SELECT {', '.join(_ITEM_COLUMNS)} FROM items ORDER BY id")
        _copy_rows(cursor, target, sql, "store items", count, progress)
    source.close()
    row = target.execute("SELECT count(*) FROM store_items").fetchone()
    count.in_target = int(row[0]) if row else 0
    target.commit()


def _copy_control_plane(
    source: sqlite3.Connection,
    target: psycopg.Connection[Any],
    report: CopyReport,
    progress: Progress,
) -> None:
    with source:
        source.execute("BEGIN")
        for table, key in _CP_TABLES:
            columns = [r[1] for r in source.execute(f"PRAGMA table_info({table})")]
            sql = _upsert_sql(table, columns, (key,))
            count = report.tables[table] = TableCopy()
            cursor = source.execute(f"SELECT {', '.join(columns)} FROM {table}")
            _copy_rows(cursor, target, sql, table, count, progress)
            if "seq" in columns:
                # New rows must get ids after the copied ones.
                target.execute(
                    f"SELECT setval(pg_get_serial_sequence('{table}', 'seq'), "
                    f"greatest((SELECT max(seq) FROM {table}), 1))"
                )
            row = target.execute(f"SELECT count(*) FROM {table}").fetchone()
            count.in_target = int(row[0]) if row else 0
            target.commit()
    source.close()
