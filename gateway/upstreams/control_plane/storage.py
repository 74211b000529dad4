"""The control plane's queries: :class:`ControlPlaneStore` creates, reads, patches and
deletes deployments and their revisions, advances the revision lifecycle, and keeps
listeners, OAuth providers and auth flows.

All methods are synchronous and run on the single thread of ``Database`` (``database.py``).
Several worker processes may share the SQLite file (WAL mode); every lifecycle transition
is a compare-and-set on the revision's current status so two drivers never apply the same
step. Secret values are never written: only their names are kept.

The rest of the storage has a file each: the tables and opening the file (``schema.py``),
rows as the API's models (``rows.py``), the statements every table shares and write
transactions (``tables.py``), the database thread (``database.py``), and PostgreSQL
(``pg_storage.py``).
"""

from __future__ import annotations

import json
import sqlite3
import unicodedata
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from .lifecycle import IN_FLIGHT, next_step
from .limits import Refused, answer_too_large, quota_reached, retry_after
from .models import Deployment, Listener, Provider, Revision
from .rows import (
    DEPLOYMENTS,
    LISTENERS,
    PROVIDERS,
    Row,
    canonical_json,
    deployment_view,
    revision_out,
    revision_view,
    row_json,
)
from .tables import Clock, TenantTables


def _folded(text: str) -> str:
    """``text`` for case-insensitive matching in any script: composed (NFC, so a typed
    "é" and "e" + combining accent agree) and case-folded (Unicode's full folding, so
    "Å" is "å" and "ß" is "ss")."""
    return unicodedata.normalize("NFC", text).casefold()


def _same(value: object) -> object:
    return value


def _page(rows: Iterable[Any], view: Callable[[Any, Any], Any], offset: int, limit: int) -> bytes:
    """The list answer ``{"resources": [...], "offset": n}`` of ``rows`` (deployments or
    revisions) as compact UTF-8 JSON, each ``source_config`` copied as its stored text
    (``row_json``). Past ``limit`` bytes the page is refused (``answer_too_large``), unless
    it holds one resource only: a resource is always readable."""
    parts: list[bytes] = []
    size = 0
    for row in rows:
        text = row_json(view(row, None), {"source_config": row["source_config"]}).encode()
        size += len(text) + 1
        parts.append(text)
        if size > limit and len(parts) > 1:
            raise answer_too_large(limit)
    next_offset = str(offset + len(parts)).encode()
    return b'{"resources":[' + b",".join(parts) + b'],"offset":' + next_offset + b"}"


class ControlPlaneStore(TenantTables):
    """Synchronous data access; every call must come from the :class:`Database` thread."""

    def _revision_stamp(self, clock: Clock, deployment_id: str) -> float:
        return self._stamp(
            clock, "SELECT MAX(created_at) FROM revisions WHERE deployment_id = ?", deployment_id
        )

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
        self._prune_revisions(deployment["id"])
        return revision_id

    def _prune_revisions(self, deployment_id: str) -> None:
        """Keep the newest ``max_revisions_per_deployment`` revisions of the deployment, and
        always its active revision and any in progress: older ones are deleted. Runs in the
        write transaction that inserted a revision."""
        active = self._conn.execute(
            "SELECT active_revision_id FROM deployments WHERE id = ?", (deployment_id,)
        ).fetchone()
        placeholders = ",".join("?" for _ in IN_FLIGHT)
        self._conn.execute(
            "DELETE FROM revisions WHERE deployment_id = ? AND id <> ? "
            f"AND status NOT IN ({placeholders}) AND id NOT IN ("
            "SELECT id FROM revisions WHERE deployment_id = ? "
            "ORDER BY created_at DESC, seq DESC LIMIT ?)",
            (
                deployment_id,
                (active[0] if active is not None else None) or "",
                *IN_FLIGHT,
                deployment_id,
                self.limits.max_revisions_per_deployment,
            ),
        )

    def create_deployment(self, tenant_id: str, data: Row, clock: Clock) -> Deployment:
        """Insert a deployment and its first revision; returns the deployment."""
        deployment: Row = {
            "id": str(uuid.uuid4()),
            "tenant_id": tenant_id,
            "source": data["source"],
            "source_config": canonical_json(data["source_config"]),
            "source_revision_config": canonical_json(data["source_revision_config"]),
            "secret_names": canonical_json([name for name, _ in data["secrets"]]),
        }
        with self._tx():
            count = self._count(DEPLOYMENTS, tenant_id)
            if count >= self.limits.max_deployments_per_tenant:
                raise quota_reached(
                    count,
                    "deployments",
                    "max_deployments_per_tenant",
                    "delete a deployment before creating another",
                )
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
            # Read in the same transaction: after its commit, another gateway on the same
            # database may already have deleted the row (review: 500s under a race).
            out = self._get(DEPLOYMENTS, tenant_id, deployment["id"])
        assert out is not None  # (written by this transaction)
        return out

    def get_deployment(self, tenant_id: str, deployment_id: str) -> Deployment | None:
        return self._get(DEPLOYMENTS, tenant_id, deployment_id)

    def list_deployments(
        self, tenant_id: str, limit: int, offset: int, name_contains: str | None
    ) -> bytes:
        """A page of deployments, newest first, as the answer's JSON (``_page``)."""
        max_bytes = self.limits.max_answer_bytes
        if not name_contains:
            rows = self._rows(DEPLOYMENTS, tenant_id, limit, offset)
            return _page(rows, deployment_view, offset, max_bytes)
        # Matched here, not in SQL: SQLite's lower() folds ASCII only and PostgreSQL's
        # depends on the database's locale, so "école" found "Ågent-ÉCOLE" on one backend
        # and not on the other. One Python fold serves both. The cost is what the SQL
        # filter had (one pass over the tenant's deployments, no index serves a substring),
        # reading only ids and names; the page itself is then read by id.
        needle = _folded(name_contains)
        rows = self._conn.execute(
            "SELECT id, name FROM deployments WHERE tenant_id = ? "
            "ORDER BY created_at DESC, seq DESC",
            (tenant_id,),
        )
        matching = [row[0] for row in rows if needle in _folded(row[1])]
        page = matching[offset : offset + limit]
        marks = ", ".join("?" * len(page))
        found = (
            self._rows(DEPLOYMENTS, tenant_id, limit, 0, f" AND id IN ({marks})", page)
            if page
            else ()
        )
        return _page(found, deployment_view, offset, max_bytes)

    def patch_deployment(
        self,
        tenant_id: str,
        deployment_id: str,
        patch: Row,
        clock: Clock,
    ) -> tuple[Deployment, bool] | None:
        """Apply a validated PATCH; returns (deployment, whether a revision was created)."""
        with self._tx():
            row = self._row(DEPLOYMENTS, tenant_id, deployment_id)
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
                source_config=canonical_json(source_config),
                source_revision_config=canonical_json(revision_config),
                secret_names=canonical_json(secret_names),
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
            out = self.get_deployment(tenant_id, deployment_id)  # (in the transaction)
        assert out is not None  # (updated by this transaction)
        return out, new_revision

    def delete_deployment(self, tenant_id: str, deployment_id: str) -> bool:
        return self._delete(DEPLOYMENTS, tenant_id, deployment_id)

    def list_revisions(
        self, tenant_id: str, deployment_id: str, limit: int, offset: int
    ) -> bytes | None:
        """A page of the deployment's revisions, latest first, as the answer's JSON
        (``_page``); None when the tenant has no such deployment."""
        if self._row(DEPLOYMENTS, tenant_id, deployment_id) is None:
            return None
        rows = self._conn.execute(
            "SELECT * FROM revisions WHERE deployment_id = ? "
            "ORDER BY created_at DESC, seq DESC LIMIT ? OFFSET ?",
            (deployment_id, limit, offset),
        )
        return _page(rows, revision_view, offset, self.limits.max_answer_bytes)

    def get_revision(self, tenant_id: str, deployment_id: str, revision_id: str) -> Revision | None:
        row = self._conn.execute(
            "SELECT * FROM revisions WHERE id = ? AND deployment_id = ? AND tenant_id = ?",
            (revision_id, deployment_id, tenant_id),
        ).fetchone()
        return None if row is None else revision_out(row)

    def redeploy(
        self, tenant_id: str, deployment_id: str, revision_id: str, clock: Clock
    ) -> Deployment | None:
        """Start a new revision from a past revision's configuration; returns the deployment.

        The deployment takes that configuration too (``source_config``,
        ``source_revision_config`` and the secret names), so it describes what its latest
        revision runs and a later PATCH starts from the redeployed configuration.
        """
        with self._tx():
            deployment = self._row(DEPLOYMENTS, tenant_id, deployment_id)
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
            LISTENERS,
            {
                "id": str(uuid.uuid4()),
                "tenant_id": tenant_id,
                "compute_type": data["compute_type"],
                "compute_id": data["compute_id"],
                "compute_config": canonical_json(data["compute_config"]),
                "version": data["version"],
                "created_at": now,
                "updated_at": now,
            },
            f"A listener with compute_id {data['compute_id']} already exists.",
            self._quota(
                self.limits.max_listeners_per_tenant,
                "listeners",
                "max_listeners_per_tenant",
                "delete a listener before creating another",
            ),
        )

    @staticmethod
    def _quota(most: int, noun: str, setting: str, remedy: str) -> Callable[[int], Refused | None]:
        def check(count: int) -> Refused | None:
            return quota_reached(count, noun, setting, remedy) if count >= most else None

        return check

    def list_listeners(self, tenant_id: str, limit: int, offset: int) -> list[Listener]:
        return self._list(LISTENERS, tenant_id, limit, offset)

    def get_listener(self, tenant_id: str, listener_id: str) -> Listener | None:
        return self._get(LISTENERS, tenant_id, listener_id)

    def patch_listener(
        self, tenant_id: str, listener_id: str, patch: Row, now: float
    ) -> Listener | None:
        columns: dict[str, Callable[[Any], object]] = {
            "compute_config": canonical_json,
            "version": _same,
        }
        return self._patch(LISTENERS, tenant_id, listener_id, patch, columns, now)

    def delete_listener(self, tenant_id: str, listener_id: str) -> bool:
        return self._delete(LISTENERS, tenant_id, listener_id)

    # ---- auth service --------------------------------------------------------------------

    def create_provider(self, tenant_id: str, data: Row, now: float) -> Provider:
        return self._insert(
            PROVIDERS,
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
            self._quota(
                self.limits.max_auth_providers_per_tenant,
                "OAuth providers",
                "max_auth_providers_per_tenant",
                "delete a provider before creating another",
            ),
        )

    def list_providers(self, tenant_id: str, limit: int, offset: int) -> list[Provider]:
        return self._list(PROVIDERS, tenant_id, limit, offset)

    def get_provider(self, tenant_id: str, provider_id: str) -> Provider | None:
        return self._get(PROVIDERS, tenant_id, provider_id)

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
        return self._patch(PROVIDERS, tenant_id, provider_id, patch, columns, now)

    def delete_provider(self, tenant_id: str, provider_id: str) -> bool:
        with self._tx():
            deleted = self._delete(PROVIDERS, tenant_id, provider_id)
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
            pending = self._conn.execute(
                "SELECT COUNT(*), MIN(expires_at) FROM auth_flows "
                "WHERE tenant_id = ? AND status = 'pending'",
                (tenant_id,),
            ).fetchone()
            most = self.limits.max_pending_auth_flows_per_tenant
            if pending[0] >= most:
                raise Refused(
                    429,
                    f"quota reached: this tenant has {pending[0]} pending authentication "
                    f"flows, the most allowed (control_plane.max_pending_auth_flows_per_tenant)"
                    "; complete one, or retry once one expires (Retry-After)",
                    retry_after(float(pending[1]) - now),
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
                "SELECT auth_id, tenant_id FROM auth_flows WHERE provider_id = ? "
                "AND state_sha256 = ? AND status = 'pending' AND expires_at >= ?",
                (provider_id, state_sha256, now),
            ).fetchone()
            if row is None:
                return None
            self._conn.execute(
                "UPDATE auth_flows SET status = 'completed', token = ?, completed_at = ? "
                "WHERE auth_id = ?",
                (token, now, row["auth_id"]),
            )
            # The completed flows are a cache of tokens: the tenant's oldest beyond
            # max_completed_auth_flows_per_tenant are forgotten (their users authenticate
            # again).
            self._conn.execute(
                "DELETE FROM auth_flows WHERE tenant_id = ? AND status = 'completed' "
                "AND auth_id NOT IN (SELECT auth_id FROM auth_flows WHERE tenant_id = ? "
                "AND status = 'completed' ORDER BY completed_at DESC, auth_id LIMIT ?)",
                (
                    row["tenant_id"],
                    row["tenant_id"],
                    self.limits.max_completed_auth_flows_per_tenant,
                ),
            )
        auth_id: str = row["auth_id"]
        return auth_id
