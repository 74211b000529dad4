"""The control plane's SQLite file: its tables and how a connection to it is opened.

PostgreSQL keeps the same tables in its own types: ``STEPS`` in ``pg_storage.py``.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

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


def connect(path: Path) -> sqlite3.Connection:
    """Open (creating it and its directory if need be) the file at ``path``: rows readable by
    name, WAL mode so several worker processes share the file, every commit on disk, foreign
    keys enforced, and the schema in place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA busy_timeout=10000")
    conn.executescript(SCHEMA)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    return conn
