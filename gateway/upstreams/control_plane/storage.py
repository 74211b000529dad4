"""SQLite persistence of the control plane.

All methods of :class:`ControlPlaneStore` are synchronous and run on the single thread of
:class:`Database`, so the event loop never waits on disk and one process never contends with
itself. Several worker processes may share the file (WAL mode); every lifecycle transition is
a compare-and-set on the revision's current status so two drivers never apply the same step.
Secret values are never written: only their names are kept.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Generic, TypeVar

import psycopg

from .lifecycle import IN_FLIGHT, next_step
from .models import Deployment, Listener, Provider, Revision, RevisionConfigView

T = TypeVar("T")
R = TypeVar("R")
# A violated unique constraint, as SQLite and PostgreSQL (pg_storage.py) report it.
INTEGRITY_ERRORS: tuple[type[Exception], ...] = (sqlite3.IntegrityError, psycopg.IntegrityError)
Row = dict[str, Any]
Clock = Callable[[], float]

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS deployments (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant_id TEXT NOT NULL,
    name TEXT NOT NULL,
    source TEXT NOT NULL,
    source_config TEXT NOT NULL,
    source_revision_config TEXT NOT NULL,
    secret_names TEXT NOT NULL,
    status TEXT NOT NULL,
    latest_revision_id TEXT,
    active_revision_id TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS deployments_tenant ON deployments (tenant_id, created_at);
CREATE TABLE IF NOT EXISTS revisions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    deployment_id TEXT NOT NULL REFERENCES deployments (id) ON DELETE CASCADE,
    tenant_id TEXT NOT NULL,
    status TEXT NOT NULL,
    status_message TEXT,
    source TEXT NOT NULL,
    source_config TEXT NOT NULL,
    source_revision_config TEXT NOT NULL,
    secret_names TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    status_changed_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS revisions_deployment ON revisions (deployment_id, created_at);
CREATE INDEX IF NOT EXISTS revisions_status ON revisions (status);
CREATE TABLE IF NOT EXISTS listeners (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant_id TEXT NOT NULL,
    compute_type TEXT NOT NULL,
    compute_id TEXT NOT NULL,
    compute_config TEXT NOT NULL,
    version TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    UNIQUE (tenant_id, compute_id)
);
CREATE TABLE IF NOT EXISTS auth_providers (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant_id TEXT NOT NULL,
    provider_id TEXT NOT NULL,
    name TEXT NOT NULL,
    client_id TEXT NOT NULL,
    has_client_secret INTEGER NOT NULL,
    auth_url TEXT NOT NULL,
    token_url TEXT NOT NULL,
    uses_pkce INTEGER NOT NULL,
    code_challenge_method TEXT,
    token_endpoint_auth_method TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    UNIQUE (tenant_id, provider_id)
);
CREATE TABLE IF NOT EXISTS auth_flows (
    auth_id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    provider_id TEXT NOT NULL,
    user_id TEXT NOT NULL,
    scopes TEXT NOT NULL,
    state_sha256 TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL,
    token TEXT,
    created_at REAL NOT NULL,
    completed_at REAL,
    expires_at REAL NOT NULL
);
"""


def _dumps(value: object) -> str:
    # allow_nan=False: a non-finite number must never be stored (it is not JSON); request
    # validation refuses them first, so this only guards against a bug.
    return json.dumps(value, sort_keys=True, allow_nan=False)


class Conflict(Exception):
    """A unique constraint of the API was violated (answered with 409)."""


def iso(ts: float) -> str:
    """An epoch timestamp as ISO 8601 UTC."""
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def _revision_config_out(config: Row) -> RevisionConfigView:
    # Both names of the field are shown so clients written against either spelling work.
    return {
        "repo_ref": config.get("repo_ref"),
        "langgraph_config_path": config.get("langgraph_config_path"),
        "graph_config_path": config.get("langgraph_config_path"),
        "image_uri": config.get("image_uri"),
    }


def _deployment_out(row: sqlite3.Row) -> Deployment:
    return {
        "id": row["id"],
        "tenant_id": row["tenant_id"],
        "name": row["name"],
        "source": row["source"],
        "source_config": json.loads(row["source_config"]),
        "source_revision_config": _revision_config_out(json.loads(row["source_revision_config"])),
        "secrets": [{"name": name} for name in json.loads(row["secret_names"])],
        "status": row["status"],
        "latest_revision_id": row["latest_revision_id"],
        "active_revision_id": row["active_revision_id"],
        "created_at": iso(row["created_at"]),
        "updated_at": iso(row["updated_at"]),
    }


def _revision_out(row: sqlite3.Row) -> Revision:
    return {
        "id": row["id"],
        "deployment_id": row["deployment_id"],
        "status": row["status"],
        "status_message": row["status_message"],
        "source": row["source"],
        "source_config": json.loads(row["source_config"]),
        "source_revision_config": _revision_config_out(json.loads(row["source_revision_config"])),
        "secrets": [{"name": name} for name in json.loads(row["secret_names"])],
        "created_at": iso(row["created_at"]),
        "updated_at": iso(row["updated_at"]),
    }


def _listener_out(row: sqlite3.Row) -> Listener:
    return {
        "id": row["id"],
        "tenant_id": row["tenant_id"],
        "compute_type": row["compute_type"],
        "compute_id": row["compute_id"],
        "compute_config": json.loads(row["compute_config"]),
        "version": row["version"],
        "created_at": iso(row["created_at"]),
        "updated_at": iso(row["updated_at"]),
    }


def _provider_out(row: sqlite3.Row) -> Provider:
    return {
        "id": row["id"],
        "organization_id": row["tenant_id"],
        "provider_id": row["provider_id"],
        "name": row["name"],
        "client_id": row["client_id"],
        "auth_url": row["auth_url"],
        "token_url": row["token_url"],
        "uses_pkce": bool(row["uses_pkce"]),
        "code_challenge_method": row["code_challenge_method"],
        "token_endpoint_auth_method": row["token_endpoint_auth_method"],
        "has_client_secret": bool(row["has_client_secret"]),
        "provider_type": None,
        "created_at": iso(row["created_at"]),
        "updated_at": iso(row["updated_at"]),
    }


def _same(value: object) -> object:
    return value


@dataclass(frozen=True)
class _Table(Generic[R]):
    """A tenant-scoped table: its name, the column a request names a row by and how a row is
    shown. Table and column names come from the fixed instances below, never from a request."""

    name: str
    key: str
    out: Callable[[sqlite3.Row], R]


_DEPLOYMENTS = _Table("deployments", "id", _deployment_out)
_LISTENERS = _Table("listeners", "id", _listener_out)
_PROVIDERS = _Table("auth_providers", "provider_id", _provider_out)


class ControlPlaneStore:
    """Synchronous data access; every call must come from the :class:`Database` thread."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(
            path, timeout=10.0, isolation_level=None, check_same_thread=False
        )
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._conn.execute("PRAGMA busy_timeout=10000")
        self._conn.executescript(SCHEMA)
        self._conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        self._conn.close()

    def _tx(self) -> _Transaction:
        return _Transaction(self._conn)

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

    def _revision_stamp(self, clock: Clock, deployment_id: str) -> float:
        return self._stamp(
            clock, "SELECT MAX(created_at) FROM revisions WHERE deployment_id = ?", deployment_id
        )

    # ---- tenant-scoped rows: every statement names the tenant --------------------------

    def _row(self, table: _Table[Any], tenant_id: str, key: str) -> sqlite3.Row | None:
        row: sqlite3.Row | None = self._conn.execute(
            f"SELECT * FROM {table.name} WHERE {table.key} = ? AND tenant_id = ?",
            (key, tenant_id),
        ).fetchone()
        return row

    def _get(self, table: _Table[R], tenant_id: str, key: str) -> R | None:
        row = self._row(table, tenant_id, key)
        return None if row is None else table.out(row)

    def _list(
        self,
        table: _Table[R],
        tenant_id: str,
        limit: int,
        offset: int,
        where: str = "",
        args: Sequence[object] = (),
    ) -> list[R]:
        """Newest first; ``where`` is a fixed ``" AND …"`` filter whose parameters are ``args``."""
        rows = self._conn.execute(
            f"SELECT * FROM {table.name} WHERE tenant_id = ?{where} "
            "ORDER BY created_at DESC, seq DESC LIMIT ? OFFSET ?",
            (tenant_id, *args, limit, offset),
        )
        return [table.out(row) for row in rows]

    def _insert(self, table: _Table[R], values: Row, conflict: str) -> R:
        """Insert ``values`` (fixed column names → values); a violated unique constraint
        becomes :class:`Conflict` with the message ``conflict``. Returns the new row."""
        columns = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        try:
            with self._tx():
                self._conn.execute(
                    f"INSERT INTO {table.name} ({columns}) VALUES ({marks})",
                    tuple(values.values()),
                )
        except INTEGRITY_ERRORS:
            raise Conflict(conflict) from None
        out = self._get(table, values["tenant_id"], values[table.key])
        assert out is not None
        return out

    def _patch(
        self,
        table: _Table[R],
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

    def _delete(self, table: _Table[Any], tenant_id: str, key: str) -> bool:
        with self._tx():
            cursor = self._conn.execute(
                f"DELETE FROM {table.name} WHERE {table.key} = ? AND tenant_id = ?",
                (key, tenant_id),
            )
        return cursor.rowcount > 0

    # ---- deployments ---------------------------------------------------------------------

    def _insert_revision(self, deployment: sqlite3.Row | Row, now: float) -> str:
        revision_id = str(uuid.uuid4())
        # A newer revision supersedes older ones still in flight, as on the hosted service.
        placeholders = ",".join("?" for _ in IN_FLIGHT)
        self._conn.execute(
            f"UPDATE revisions SET status = 'INTERRUPTED', status_message = ?, updated_at = ?, "
            f"status_changed_at = ? WHERE deployment_id = ? AND status IN ({placeholders})",
            (f"superseded by revision {revision_id}", now, now, deployment["id"], *IN_FLIGHT),
        )
        self._conn.execute(
            "INSERT INTO revisions (id, deployment_id, tenant_id, status, status_message, source, "
            "source_config, source_revision_config, secret_names, created_at, updated_at, "
            "status_changed_at) VALUES (?, ?, ?, 'CREATING', NULL, ?, ?, ?, ?, ?, ?, ?)",
            (
                revision_id,
                deployment["id"],
                deployment["tenant_id"],
                deployment["source"],
                deployment["source_config"],
                deployment["source_revision_config"],
                deployment["secret_names"],
                now,
                now,
                now,
            ),
        )
        self._conn.execute(
            "UPDATE deployments SET latest_revision_id = ?, updated_at = ? WHERE id = ?",
            (revision_id, now, deployment["id"]),
        )
        return revision_id

    def create_deployment(self, tenant_id: str, data: Row, clock: Clock) -> Deployment:
        """Insert a deployment and its first revision; returns the deployment."""
        deployment: Row = {
            "id": str(uuid.uuid4()),
            "tenant_id": tenant_id,
            "source": data["source"],
            "source_config": _dumps(data["source_config"]),
            "source_revision_config": _dumps(data["source_revision_config"]),
            "secret_names": _dumps([name for name, _ in data["secrets"]]),
        }
        with self._tx():
            now = self._stamp(
                clock, "SELECT MAX(created_at) FROM deployments WHERE tenant_id = ?", tenant_id
            )
            self._conn.execute(
                "INSERT INTO deployments (id, tenant_id, name, source, source_config, "
                "source_revision_config, secret_names, status, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, 'AWAITING_DATABASE', ?, ?)",
                (
                    deployment["id"],
                    tenant_id,
                    data["name"],
                    deployment["source"],
                    deployment["source_config"],
                    deployment["source_revision_config"],
                    deployment["secret_names"],
                    now,
                    now,
                ),
            )
            self._insert_revision(deployment, now)
        out = self._get(_DEPLOYMENTS, tenant_id, deployment["id"])
        assert out is not None
        return out

    def get_deployment(self, tenant_id: str, deployment_id: str) -> Deployment | None:
        return self._get(_DEPLOYMENTS, tenant_id, deployment_id)

    def list_deployments(
        self, tenant_id: str, limit: int, offset: int, name_contains: str | None
    ) -> list[Deployment]:
        if name_contains:
            return self._list(
                _DEPLOYMENTS,
                tenant_id,
                limit,
                offset,
                " AND instr(lower(name), lower(?)) > 0",
                (name_contains,),
            )
        return self._list(_DEPLOYMENTS, tenant_id, limit, offset)

    def patch_deployment(
        self,
        tenant_id: str,
        deployment_id: str,
        patch: Row,
        clock: Clock,
    ) -> tuple[Deployment, bool] | None:
        """Apply a validated PATCH; returns (deployment, whether a revision was created)."""
        with self._tx():
            row = self._row(_DEPLOYMENTS, tenant_id, deployment_id)
            if row is None:
                return None
            source_config = json.loads(row["source_config"])
            source_config.update(patch.get("source_config", {}))
            revision_config = json.loads(row["source_revision_config"])
            revision_config.update(patch.get("source_revision_config", {}))
            secret_names = json.loads(row["secret_names"])
            if "secrets" in patch:
                secret_names = [name for name, _ in patch["secrets"]]
            now = self._revision_stamp(clock, deployment_id)
            updated = dict(row)
            updated.update(
                source_config=_dumps(source_config),
                source_revision_config=_dumps(revision_config),
                secret_names=_dumps(secret_names),
            )
            self._conn.execute(
                "UPDATE deployments SET source_config = ?, source_revision_config = ?, "
                "secret_names = ?, updated_at = ? WHERE id = ?",
                (
                    updated["source_config"],
                    updated["source_revision_config"],
                    updated["secret_names"],
                    now,
                    deployment_id,
                ),
            )
            new_revision = "source_revision_config" in patch or "secrets" in patch
            if new_revision:
                self._insert_revision(updated, now)
        out = self.get_deployment(tenant_id, deployment_id)
        assert out is not None
        return out, new_revision

    def delete_deployment(self, tenant_id: str, deployment_id: str) -> bool:
        return self._delete(_DEPLOYMENTS, tenant_id, deployment_id)

    def list_revisions(
        self, tenant_id: str, deployment_id: str, limit: int, offset: int
    ) -> list[Revision] | None:
        if self._row(_DEPLOYMENTS, tenant_id, deployment_id) is None:
            return None
        rows = self._conn.execute(
            "SELECT * FROM revisions WHERE deployment_id = ? "
            "ORDER BY created_at DESC, seq DESC LIMIT ? OFFSET ?",
            (deployment_id, limit, offset),
        )
        return [_revision_out(row) for row in rows]

    def get_revision(self, tenant_id: str, deployment_id: str, revision_id: str) -> Revision | None:
        row = self._conn.execute(
            "SELECT * FROM revisions WHERE id = ? AND deployment_id = ? AND tenant_id = ?",
            (revision_id, deployment_id, tenant_id),
        ).fetchone()
        return None if row is None else _revision_out(row)

    def redeploy(
        self, tenant_id: str, deployment_id: str, revision_id: str, clock: Clock
    ) -> Deployment | None:
        """Start a new revision from a past revision's configuration; returns the deployment.

        The deployment takes that configuration too (``source_config``,
        ``source_revision_config`` and the secret names), so it describes what its latest
        revision runs and a later PATCH starts from the redeployed configuration.
        """
        with self._tx():
            deployment = self._row(_DEPLOYMENTS, tenant_id, deployment_id)
            if deployment is None:
                return None
            past = self._conn.execute(
                "SELECT * FROM revisions WHERE id = ? AND deployment_id = ?",
                (revision_id, deployment_id),
            ).fetchone()
            if past is None:
                return None
            now = self._revision_stamp(clock, deployment_id)
            self._conn.execute(
                "UPDATE deployments SET source_config = ?, source_revision_config = ?, "
                "secret_names = ?, updated_at = ? WHERE id = ?",
                (
                    past["source_config"],
                    past["source_revision_config"],
                    past["secret_names"],
                    now,
                    deployment_id,
                ),
            )
            self._insert_revision(
                {
                    "id": deployment_id,
                    "tenant_id": tenant_id,
                    "source": past["source"],
                    "source_config": past["source_config"],
                    "source_revision_config": past["source_revision_config"],
                    "secret_names": past["secret_names"],
                },
                now,
            )
        return self.get_deployment(tenant_id, deployment_id)

    # ---- lifecycle -----------------------------------------------------------------------

    def advance_revisions(self, now: float, step_seconds: float) -> tuple[int, float | None]:
        """Move every in-flight revision whose step is due one status on.

        Returns how many moved and when the next one is due (None when none is in flight).
        """
        placeholders = ",".join("?" for _ in IN_FLIGHT)
        rows = self._conn.execute(
            f"SELECT * FROM revisions WHERE status IN ({placeholders}) ORDER BY seq", IN_FLIGHT
        ).fetchall()
        moved = 0
        next_due: float | None = None
        for row in rows:
            due = row["status_changed_at"] + step_seconds
            if due > now:
                next_due = due if next_due is None else min(next_due, due)
                continue
            status, message = next_step(
                row["status"],
                row["source"],
                json.loads(row["source_config"]),
                json.loads(row["source_revision_config"]),
            )
            with self._tx():
                cursor = self._conn.execute(
                    "UPDATE revisions SET status = ?, status_message = ?, updated_at = ?, "
                    "status_changed_at = ? WHERE id = ? AND status = ?",
                    (status, message, now, now, row["id"], row["status"]),
                )
                if cursor.rowcount and status == "DEPLOYED":
                    self._conn.execute(
                        "UPDATE deployments SET active_revision_id = ?, status = 'READY', "
                        "updated_at = ? WHERE id = ?",
                        (row["id"], now, row["deployment_id"]),
                    )
            if cursor.rowcount:
                moved += 1
                if status in IN_FLIGHT:
                    due = now + step_seconds
                    next_due = due if next_due is None else min(next_due, due)
        return moved, next_due

    # ---- listeners -----------------------------------------------------------------------

    def create_listener(self, tenant_id: str, data: Row, now: float) -> Listener:
        return self._insert(
            _LISTENERS,
            {
                "id": str(uuid.uuid4()),
                "tenant_id": tenant_id,
                "compute_type": data["compute_type"],
                "compute_id": data["compute_id"],
                "compute_config": json.dumps(data["compute_config"]),
                "version": data["version"],
                "created_at": now,
                "updated_at": now,
            },
            f"A listener with compute_id {data['compute_id']} already exists.",
        )

    def list_listeners(self, tenant_id: str, limit: int, offset: int) -> list[Listener]:
        return self._list(_LISTENERS, tenant_id, limit, offset)

    def get_listener(self, tenant_id: str, listener_id: str) -> Listener | None:
        return self._get(_LISTENERS, tenant_id, listener_id)

    def patch_listener(
        self, tenant_id: str, listener_id: str, patch: Row, now: float
    ) -> Listener | None:
        columns: dict[str, Callable[[Any], object]] = {
            "compute_config": json.dumps,
            "version": _same,
        }
        return self._patch(_LISTENERS, tenant_id, listener_id, patch, columns, now)

    def delete_listener(self, tenant_id: str, listener_id: str) -> bool:
        return self._delete(_LISTENERS, tenant_id, listener_id)

    # ---- auth service --------------------------------------------------------------------

    def create_provider(self, tenant_id: str, data: Row, now: float) -> Provider:
        return self._insert(
            _PROVIDERS,
            {
                "id": str(uuid.uuid4()),
                "tenant_id": tenant_id,
                "provider_id": data["provider_id"],
                "name": data["name"],
                "client_id": data["client_id"],
                "has_client_secret": int(data["has_client_secret"]),
                "auth_url": data["auth_url"],
                "token_url": data["token_url"],
                "uses_pkce": int(data["uses_pkce"]),
                "code_challenge_method": data["code_challenge_method"],
                "token_endpoint_auth_method": data["token_endpoint_auth_method"],
                "created_at": now,
                "updated_at": now,
            },
            f"OAuth provider {data['provider_id']} already exists.",
        )

    def list_providers(self, tenant_id: str, limit: int, offset: int) -> list[Provider]:
        return self._list(_PROVIDERS, tenant_id, limit, offset)

    def get_provider(self, tenant_id: str, provider_id: str) -> Provider | None:
        return self._get(_PROVIDERS, tenant_id, provider_id)

    def patch_provider(
        self, tenant_id: str, provider_id: str, patch: Row, now: float
    ) -> Provider | None:
        columns = {
            "name": str,
            "client_id": str,
            "auth_url": str,
            "token_url": str,
            "has_client_secret": int,
            "uses_pkce": int,
            "code_challenge_method": str,
            "token_endpoint_auth_method": str,
        }
        return self._patch(_PROVIDERS, tenant_id, provider_id, patch, columns, now)

    def delete_provider(self, tenant_id: str, provider_id: str) -> bool:
        with self._tx():
            deleted = self._delete(_PROVIDERS, tenant_id, provider_id)
            self._conn.execute(
                "DELETE FROM auth_flows WHERE provider_id = ? AND tenant_id = ?",
                (provider_id, tenant_id),
            )
        return deleted

    def completed_token(
        self, tenant_id: str, provider_id: str, user_id: str, scopes: list[str], now: float
    ) -> Row | None:
        """A completed flow of this user and provider whose scopes cover ``scopes``."""
        rows = self._conn.execute(
            "SELECT * FROM auth_flows WHERE tenant_id = ? AND provider_id = ? AND user_id = ? "
            "AND status = 'completed' ORDER BY completed_at DESC",
            (tenant_id, provider_id, user_id),
        )
        for row in rows:
            if set(scopes) <= set(json.loads(row["scopes"])):
                return {"auth_id": row["auth_id"], "token": row["token"]}
        return None

    def create_flow(
        self,
        tenant_id: str,
        provider_id: str,
        user_id: str,
        scopes: list[str],
        state_sha256: str,
        now: float,
        expires_at: float,
    ) -> str:
        auth_id = str(uuid.uuid4())
        with self._tx():
            self._conn.execute(
                "DELETE FROM auth_flows WHERE status = 'pending' AND expires_at < ?", (now,)
            )
            self._conn.execute(
                "INSERT INTO auth_flows (auth_id, tenant_id, provider_id, user_id, scopes, "
                "state_sha256, status, created_at, expires_at) "
                "VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
                (
                    auth_id,
                    tenant_id,
                    provider_id,
                    user_id,
                    json.dumps(scopes),
                    state_sha256,
                    now,
                    expires_at,
                ),
            )
        return auth_id

    def get_flow(self, tenant_id: str, auth_id: str) -> Row | None:
        row = self._conn.execute(
            "SELECT * FROM auth_flows WHERE auth_id = ? AND tenant_id = ?", (auth_id, tenant_id)
        ).fetchone()
        if row is None:
            return None
        return {
            "auth_id": row["auth_id"],
            "status": row["status"],
            "token": row["token"],
            "expires_at": row["expires_at"],
        }

    def complete_flow(
        self, provider_id: str, state_sha256: str, token: str, now: float
    ) -> str | None:
        """Complete the pending, unexpired flow started with this state; returns its id."""
        with self._tx():
            row = self._conn.execute(
                "SELECT auth_id FROM auth_flows WHERE provider_id = ? AND state_sha256 = ? "
                "AND status = 'pending' AND expires_at >= ?",
                (provider_id, state_sha256, now),
            ).fetchone()
            if row is None:
                return None
            self._conn.execute(
                "UPDATE auth_flows SET status = 'completed', token = ?, completed_at = ? "
                "WHERE auth_id = ?",
                (token, now, row["auth_id"]),
            )
        auth_id: str = row["auth_id"]
        return auth_id


class _Transaction:
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


class Database:
    """Runs :class:`ControlPlaneStore` calls on one dedicated thread."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="control-plane-db")
        self._store: ControlPlaneStore | None = None

    @property
    def store(self) -> ControlPlaneStore:
        if self._store is None:
            raise RuntimeError("database is not open")
        return self._store

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        self._store = await loop.run_in_executor(self._executor, ControlPlaneStore, self._path)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        if self._store is not None:
            await loop.run_in_executor(self._executor, self._store.close)
            self._store = None
        self._executor.shutdown(wait=True)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Call ``fn(*args)`` on the database thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)
