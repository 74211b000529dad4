"""Generic access to the control plane's SQLite connection: write transactions, the
commit-order timestamp, and reading, listing, inserting, patching and deleting one tenant's
row of a :class:`~.rows.Table` by its key.

:class:`TenantTables` is the base of ``ControlPlaneStore`` (``storage.py``), which holds the
queries; every statement built here names the tenant, and table and column names come from
fixed ``Table`` instances, never from a request.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from .limits import Limits, Refused
from .rows import Row, Table
from .schema import connect

R = TypeVar("R")
# A violated unique constraint, as SQLite and PostgreSQL (pg_storage.py) report it.
INTEGRITY_ERRORS: tuple[type[Exception], ...] = (sqlite3.IntegrityError, psycopg.IntegrityError)
Clock = Callable[[], float]


class Conflict(Exception):
    """A unique constraint of the API was violated (answered with 409)."""


class Transaction:
    """``BEGIN IMMEDIATE`` … ``COMMIT`` (rollback on error); re-entrant within one thread."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._owner = False

    def __enter__(self) -> None:
        self._owner = not self._conn.in_transaction
        if self._owner:
            self._conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not self._owner:
            return
        if exc_type is None:
            self._conn.execute("COMMIT")
        else:
            self._conn.execute("ROLLBACK")


class TenantTables:
    """The connection and the statements every table shares; calls come from one thread."""

    def __init__(self, path: Path, limits: Limits | None = None) -> None:
        self._conn = connect(path)
        self.limits = limits or Limits()

    def close(self) -> None:
        self._conn.close()

    def _tx(self) -> Transaction:
        return Transaction(self._conn)

    def _stamp(self, clock: Clock, sql: str, key: str) -> float:
        """The time for a record written in the current write transaction.

        Read only once the write lock is held (never before ``BEGIN IMMEDIATE``, which may
        wait for another process), and never earlier than the newest stamp ``sql`` (a
        ``SELECT MAX(created_at) …`` with one parameter, ``key``) finds, so ``created_at``
        order is commit order even if the wall clock steps back. Equal stamps are ordered
        by ``seq``, which SQLite assigns at insert time, i.e. also in commit order.
        """
        assert self._conn.in_transaction
        now = clock()
        newest = self._conn.execute(sql, (key,)).fetchone()[0]
        return now if newest is None else max(now, float(newest))

    # ---- tenant-scoped rows: every statement names the tenant --------------------------

    def _row(self, table: Table[Any], tenant_id: str, key: str) -> sqlite3.Row | None:
        row: sqlite3.Row | None = self._conn.execute(
            f"SELECT * FROM {table.name} WHERE {table.key} = ? AND tenant_id = ?",
            (key, tenant_id),
        ).fetchone()
        return row

    def _get(self, table: Table[R], tenant_id: str, key: str) -> R | None:
        row = self._row(table, tenant_id, key)
        return None if row is None else table.out(row)

    def _rows(
        self,
        table: Table[Any],
        tenant_id: str,
        limit: int,
        offset: int,
        where: str = "",
        args: Sequence[object] = (),
    ) -> Iterable[sqlite3.Row]:
        """Newest first; ``where`` is a fixed ``" AND …"`` filter whose parameters are ``args``."""
        rows: Iterable[sqlite3.Row] = self._conn.execute(
            f"SELECT * FROM {table.name} WHERE tenant_id = ?{where} "
            "ORDER BY created_at DESC, seq DESC LIMIT ? OFFSET ?",
            (tenant_id, *args, limit, offset),
        )
        return rows

    def _list(
        self,
        table: Table[R],
        tenant_id: str,
        limit: int,
        offset: int,
        where: str = "",
        args: Sequence[object] = (),
    ) -> list[R]:
        """Newest first; ``where`` is a fixed ``" AND …"`` filter whose parameters are ``args``."""
        return [table.out(row) for row in self._rows(table, tenant_id, limit, offset, where, args)]

    def _count(self, table: Table[Any], tenant_id: str, where: str = "") -> int:
        """How many rows of ``table`` the tenant has (``where``: a fixed ``" AND …"``)."""
        count: int = self._conn.execute(
            f"SELECT COUNT(*) FROM {table.name} WHERE tenant_id = ?{where}", (tenant_id,)
        ).fetchone()[0]
        return count

    def _insert(
        self,
        table: Table[R],
        values: Row,
        conflict: str,
        quota: Callable[[int], Refused | None] | None = None,
    ) -> R:
        """Insert ``values`` (fixed column names → values); a violated unique constraint
        becomes :class:`Conflict` with the message ``conflict``. ``quota`` is given the
        tenant's count of rows in the same write transaction (so concurrent inserts cannot
        exceed it) and answers the refusal to raise, or None. Returns the new row."""
        columns = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        try:
            with self._tx():
                if quota is not None:
                    refused = quota(self._count(table, values["tenant_id"]))
                    if refused is not None:
                        raise refused
                self._conn.execute(
                    f"INSERT INTO {table.name} ({columns}) VALUES ({marks})",
                    tuple(values.values()),
                )
                # Read in the same transaction: after its commit, another gateway on the
                # same database may already have deleted the row.
                out = self._get(table, values["tenant_id"], values[table.key])
        except INTEGRITY_ERRORS:
            raise Conflict(conflict) from None
        assert out is not None  # (written by this transaction)
        return out

    def _patch(
        self,
        table: Table[R],
        tenant_id: str,
        key: str,
        patch: Row,
        columns: Mapping[str, Callable[[Any], object]],
        now: float,
    ) -> R | None:
        """Set each of ``columns`` (fixed names → conversion) present in ``patch``, and
        ``updated_at``, on this tenant's row; None when there is no such row."""
        with self._tx():
            if self._row(table, tenant_id, key) is None:
                return None
            values = {
                column: convert(patch[column])
                for column, convert in columns.items()
                if column in patch
            }
            values["updated_at"] = now
            assignments = ", ".join(f"{column} = ?" for column in values)
            self._conn.execute(
                f"UPDATE {table.name} SET {assignments} WHERE {table.key} = ? AND tenant_id = ?",
                (*values.values(), key, tenant_id),
            )
        return self._get(table, tenant_id, key)

    def _delete(self, table: Table[Any], tenant_id: str, key: str) -> bool:
        with self._tx():
            cursor = self._conn.execute(
                f"DELETE FROM {table.name} WHERE {table.key} = ? AND tenant_id = ?",
                (key, tenant_id),
            )
        return cursor.rowcount > 0
