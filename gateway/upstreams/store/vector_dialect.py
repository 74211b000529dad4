"""What the embedding index's SQL needs to know about the database it runs on.

The index (``vectors.py``, ``mirror.py``, ``semantic.py``) runs the same statements on both
Store backends, through a synchronous DB-API connection: ``sqlite3`` on the SQLite Store's
threads, psycopg's blocking driver on worker threads for PostgreSQL (see ``pg_storage.py``).
Only the table names and the parameter mark differ; a ``VectorDialect`` holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class IndexConnection(Protocol):
    """The part of a DB-API connection the index uses (``sqlite3`` and psycopg alike)."""

    def execute(self, sql: Any, params: Any = ..., /) -> Any: ...


@dataclass(frozen=True)
class VectorDialect:
    """Table names and the parameter mark of one backend."""

    mark: str  # "?" (sqlite3) or "%s" (psycopg)
    items: str
    vectors: str
    embeddings: str
    changes: str
    leases: str
    # The item's JSON text (PostgreSQL's json column would otherwise arrive parsed).
    value_text: str = "i.value"
    # PostgreSQL: the transaction-level advisory lock every change-log writer takes first.
    change_lock_key: int | None = None

    def marks(self, count: int) -> str:
        """``count`` comma-separated parameter marks, for ``IN (...)``."""
        return ",".join([self.mark] * count)

    def live(self) -> str:
        """The liveness condition over ``items AS i`` (one parameter: now)."""
        return f"(i.expires_at IS NULL OR i.expires_at > {self.mark})"

    def lock_changes(self, connection: IndexConnection) -> None:
        """Serialise change-log writers until commit (PostgreSQL; SQLite has one writer).

        A sequence hands out numbers in call order, not commit order: without the lock, a
        mirror could read seq 6 committed while seq 5 is still in flight, move its cursor
        past 5 and never see it. Held until commit, the lock makes seq order commit order.
        """
        if self.change_lock_key is not None:
            connection.execute("SELECT pg_advisory_xact_lock(%s)", (self.change_lock_key,))


SQLITE = VectorDialect(
    mark="?",
    items="items",
    vectors="item_vectors",
    embeddings="item_embeddings",
    changes="vector_changes",
    leases="vector_leases",
)
POSTGRES = VectorDialect(
    mark="%s",
    items="store_items",
    vectors="store_item_vectors",
    embeddings="store_item_embeddings",
    changes="store_vector_changes",
    leases="store_vector_leases",
    value_text="i.value::text",
    # Any fixed 64-bit number; this one spells "gw-vchg" in ASCII (pg_schema's trigger
    # takes the same lock).
    change_lock_key=0x67772D76636867,
)
