"""Versioned, forward-only schema migrations, applied at start under an advisory lock.

Each component (the Store, the control plane) has its own numbered steps. At start, every
instance takes one session-level advisory lock, reads the versions already applied from
``gateway_schema_migrations``, applies the missing steps in order (each in its own
transaction, recorded in the same transaction) and releases the lock. Ten instances
starting at once therefore migrate once: the first applies the steps, the others wait on
the lock and then find nothing to do. A database whose version is newer than the code's is
refused, with a message saying so, instead of being used by code that does not know it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import psycopg

log = logging.getLogger("gateway.postgres.migrations")

# pg_advisory_lock key: any fixed 64-bit number; this one spells "gw-migr" in ASCII.
MIGRATION_LOCK_KEY = 0x67772D6D696772

LEDGER = """
CREATE TABLE IF NOT EXISTS gateway_schema_migrations (
    component text NOT NULL,
    version integer NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (component, version)
)
"""


class SchemaTooNew(RuntimeError):
    """The database was migrated by a newer version of the gateway."""


def current_version(conn: psycopg.Connection[object], component: str) -> int:
    row = conn.execute(
        "SELECT max(version) FROM gateway_schema_migrations WHERE component = %s", (component,)
    ).fetchone()
    return 0 if row is None or row[0] is None else int(row[0])  # type: ignore[index]


def migrate(conninfo: str, component: str, steps: Sequence[str], **kwargs: object) -> int:
    """Bring ``component`` to version ``len(steps)``; returns how many steps were applied.

    ``steps[n]`` is the SQL taking the schema from version n to n + 1.
    """
    applied = 0
    with psycopg.connect(conninfo, **kwargs) as conn:  # type: ignore[arg-type]
        conn.autocommit = True
        conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        try:
            conn.execute(LEDGER)
            version = current_version(conn, component)
            if version > len(steps):
                raise SchemaTooNew(
                    f"the {component} schema in this database is at version {version}, but "
                    f"this gateway knows versions up to {len(steps)}: it was written by a "
                    "newer gateway. Run that version (or newer), or point --database-url at "
                    "another database."
                )
            for number in range(version, len(steps)):
                with conn.transaction():
                    conn.execute(steps[number])
                    conn.execute(
                        "INSERT INTO gateway_schema_migrations (component, version) "
                        "VALUES (%s, %s)",
                        (component, number + 1),
                    )
                applied += 1
                log.info("%s schema migrated to version %d", component, number + 1)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
    return applied
