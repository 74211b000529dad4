"""Schema migrations on PostgreSQL: versioned, applied once under an advisory lock even when
ten instances start at once, and a database newer than the code is refused."""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg
import pytest

from gateway.upstreams.control_plane import pg_storage as cp_pg
from gateway.upstreams.postgres.migrations import SchemaTooNew, migrate
from gateway.upstreams.store import pg_schema
from gateway.upstreams.store.config import StoreConfig
from gateway.upstreams.store.pg_storage import PostgresStorage


def test_ten_instances_starting_at_once_migrate_once(pg_database_url: str) -> None:
    applied: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(10)

    def instance() -> None:
        try:
            start.wait()
            applied.append(migrate(pg_database_url, "store", pg_schema.STEPS))
            applied.append(migrate(pg_database_url, "control_plane", cp_pg.STEPS))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=instance) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    # Every step ran exactly once across the ten instances (a second run of a step would
    # have failed: CREATE TABLE without IF NOT EXISTS, and the ledger's primary key).
    assert sum(applied) == len(pg_schema.STEPS) + len(cp_pg.STEPS)
    with psycopg.connect(pg_database_url) as conn:
        ledger = conn.execute(
            "SELECT component, version FROM gateway_schema_migrations ORDER BY 1, 2"
        ).fetchall()
    assert ledger == [("control_plane", n + 1) for n in range(len(cp_pg.STEPS))] + [
        ("store", n + 1) for n in range(len(pg_schema.STEPS))
    ]


def test_a_database_newer_than_the_code_is_refused(pg_database_url: str) -> None:
    migrate(pg_database_url, "store", pg_schema.STEPS)
    with psycopg.connect(pg_database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO gateway_schema_migrations (component, version) VALUES ('store', %s)",
            (len(pg_schema.STEPS) + 1,),
        )
    with pytest.raises(SchemaTooNew, match="written by a newer gateway"):
        migrate(pg_database_url, "store", pg_schema.STEPS)


async def test_the_store_refuses_to_open_a_newer_schema(
    pg_database_url: str, tmp_path: Path
) -> None:
    migrate(pg_database_url, "store", pg_schema.STEPS)
    with psycopg.connect(pg_database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO gateway_schema_migrations (component, version) VALUES ('store', 99)"
        )
    storage = PostgresStorage(StoreConfig(data_dir=tmp_path, database_url=pg_database_url))
    with pytest.raises(SchemaTooNew, match="version 99"):
        await storage.open()
