"""``gateway data copy --to postgresql://...``: a one-shot copy of the SQLite Store and
control plane (the files in ``--data-dir``) into PostgreSQL.

It loses nothing and can run twice: every row is upserted by its natural key (an item by
namespace and key, every control-plane row by its id), so a second run rewrites the same
rows with the same values and adds none. Rows keep their ids and timestamps; identity
sequences are moved past the copied ids. The SQLite files are opened read-only, so a
running gateway may keep serving from them (what it writes after a table was copied is in
the next run). The target is migrated first, as at gateway start.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from gateway.upstreams.control_plane import pg_storage as cp_pg
from gateway.upstreams.control_plane.config import DATABASE_FILE_NAME as CP_FILE
from gateway.upstreams.postgres.migrations import migrate
from gateway.upstreams.store import pg_schema
from gateway.upstreams.store.config import StoreConfig

BATCH = 1000
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
class CopyReport:
    """Rows read from SQLite and present in PostgreSQL afterwards, per table."""

    copied: dict[str, int] = field(default_factory=dict)
    in_target: dict[str, int] = field(default_factory=dict)
    missing_files: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"skipped (no such file): {path}" for path in self.missing_files]
        for table, count in self.copied.items():
            out.append(f"{table}: {count} row(s) copied, {self.in_target[table]} in PostgreSQL")
        return out


def _read_only(path: Path) -> sqlite3.Connection:
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    connection.row_factory = sqlite3.Row
    return connection


def _batches(cursor: sqlite3.Cursor) -> Iterator[list[sqlite3.Row]]:
    while rows := cursor.fetchmany(BATCH):
        yield rows


def copy_to_postgres(data_dir: Path, url: str) -> CopyReport:
    """Copy both SQLite databases under ``data_dir`` into ``url``; returns the counts."""
    report = CopyReport()
    migrate(url, pg_schema.COMPONENT, pg_schema.STEPS)
    migrate(url, cp_pg.COMPONENT, cp_pg.STEPS)
    store_file = StoreConfig(data_dir=data_dir).database_path
    cp_file = data_dir / CP_FILE
    with psycopg.connect(url) as target:
        if store_file.is_file():
            _copy_items(_read_only(store_file), target, report)
        else:
            report.missing_files.append(str(store_file))
        if cp_file.is_file():
            _copy_control_plane(_read_only(cp_file), target, report)
        else:
            report.missing_files.append(str(cp_file))
    return report


def _copy_items(
    source: sqlite3.Connection, target: psycopg.Connection[Any], report: CopyReport
) -> None:
    columns = ", ".join(_ITEM_COLUMNS)
    marks = ", ".join(["%s"] * len(_ITEM_COLUMNS))
    updates = ", ".join(f"{c} = excluded.{c}" for c in _ITEM_COLUMNS[2:])
    sql = (
        f"INSERT INTO store_items ({columns}) VALUES ({marks}) "
        f"ON CONFLICT (namespace, key) DO UPDATE SET {updates}"
    )
    copied = 0
    with source:
        source.execute("BEGIN")  # one snapshot of the file
        cursor = source.execute(f"SELECT {columns} FROM items ORDER BY id")
        for rows in _batches(cursor):
            with target.transaction(), target.cursor() as out:
                out.executemany(sql, [tuple(row) for row in rows])
            copied += len(rows)
    source.close()
    report.copied["store items"] = copied
    row = target.execute("SELECT count(*) FROM store_items").fetchone()
    report.in_target["store items"] = int(row[0]) if row else 0
    target.commit()


def _copy_control_plane(
    source: sqlite3.Connection, target: psycopg.Connection[Any], report: CopyReport
) -> None:
    with source:
        source.execute("BEGIN")
        for table, key in _CP_TABLES:
            columns = [r[1] for r in source.execute(f"PRAGMA table_info({table})")]
            names = ", ".join(columns)
            marks = ", ".join(["%s"] * len(columns))
            updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c != key)
            sql = (
                f"INSERT INTO {table} ({names}) VALUES ({marks}) "
                f"ON CONFLICT ({key}) DO UPDATE SET {updates}"
            )
            copied = 0
            cursor = source.execute(f"SELECT {names} FROM {table}")
            for rows in _batches(cursor):
                with target.transaction(), target.cursor() as out:
                    out.executemany(sql, [tuple(row) for row in rows])
                copied += len(rows)
            if "seq" in columns:
                # New rows must get ids after the copied ones.
                target.execute(
                    f"SELECT setval(pg_get_serial_sequence('{table}', 'seq'), "
                    f"greatest((SELECT max(seq) FROM {table}), 1))"
                )
            report.copied[table] = copied
            row = target.execute(f"SELECT count(*) FROM {table}").fetchone()
            report.in_target[table] = int(row[0]) if row else 0
            target.commit()
    source.close()
