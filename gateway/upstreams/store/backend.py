"""The one interface every Store storage implements, and the choice between them.

``SQLiteStorage`` (``storage.py``) keeps items in a file under ``--data-dir``;
``PostgresStorage`` (``pg_storage.py``) keeps them in PostgreSQL when ``--database-url`` is
given, so several gateways share one Store. The app, the sweeper and the benchmarks see
only this Protocol.

Every answer's item values are counted against ``answers`` (``answers.py``): ``get_row``
and ``search_rows`` take the ``AnswerBudget`` of the request (closed by the app once the
answer is sent), or make their own when given none. They answer rows whose values are the
stored JSON text, which the app splices into its answers unparsed (``rows.py``); ``get`` and
``search`` give the same items with their values parsed, for Python callers (tools,
benchmarks, tests).

The embedding index (issue 12) reaches storage through two optional arguments: ``put``'s
``vectors`` (written in the item's transaction) and ``search``'s ``ranker`` (ranks a query by
meaning inside the search's read transaction), and runs its own SQL (re-indexing, leases,
loading the in-memory mirror) through ``read`` and ``write`` on a blocking DB-API connection,
naming the tables of ``vector_dialect``. Both storages implement all of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from gateway.upstreams.store.answers import AnswerBudget, AnswerBytes
from gateway.upstreams.store.config import StoreConfig
from gateway.upstreams.store.hybrid import Ranker
from gateway.upstreams.store.models import (
    Item,
    Namespace,
    SearchItem,
    StoredForms,
    StoreListNamespacesRequest,
    StorePutRequest,
    StoreSearchRequest,
)
from gateway.upstreams.store.rows import _Row
from gateway.upstreams.store.vector_dialect import IndexConnection, VectorDialect
from gateway.upstreams.store.vectors import ItemVectors
from gateway.urls import display_url

T = TypeVar("T")


class StoreStorage(Protocol):
    """Items in namespaces: put, get, delete, listing and search, namespaces, TTL sweep."""

    # The embedding index's tables and parameter mark on this backend.
    vector_dialect: VectorDialect
    # The bytes of item values the answers being built hold (store.max_answer_bytes*).
    answers: AnswerBytes

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def put(
        self,
        request: StorePutRequest,
        vectors: ItemVectors | None = None,
        forms: StoredForms | None = None,
    ) -> None: ...

    async def get(
        self,
        namespace: Namespace,
        key: str,
        refresh_ttl: bool | None,
        budget: AnswerBudget | None = None,
    ) -> Item | None:
        """``get_row``'s item with its value parsed (for Python callers)."""
        ...

    async def get_row(
        self,
        namespace: Namespace,
        key: str,
        refresh_ttl: bool | None,
        budget: AnswerBudget | None = None,
    ) -> _Row | None:
        """The live item's row, its value the stored JSON text (the GET answer splices it)."""
        ...

    async def delete(self, namespace: Namespace, key: str) -> None: ...

    async def search(
        self,
        request: StoreSearchRequest,
        ranker: Ranker | None = None,
        budget: AnswerBudget | None = None,
    ) -> list[SearchItem]:
        """``search_rows``' items with their values parsed (for Python callers)."""
        ...

    async def search_rows(
        self,
        request: StoreSearchRequest,
        ranker: Ranker | None = None,
        budget: AnswerBudget | None = None,
    ) -> list[tuple[_Row, float | None]]:
        """The page's rows, best first, and their scores (null in listing mode); the
        search answer splices their stored value text (``rows.search_answer``)."""
        ...

    async def list_namespaces(self, request: StoreListNamespacesRequest) -> list[list[str]]: ...

    async def sweep_expired(self) -> int: ...

    async def count_items(self) -> int: ...

    async def read(self, call: Callable[[IndexConnection, float], T]) -> T:
        """``call(connection, now)`` in one read snapshot (the embedding index's reads)."""
        ...

    async def write(self, call: Callable[[IndexConnection], T]) -> T:
        """``call(connection)`` in one committed transaction (the embedding index's writes)."""
        ...


def create_storage(config: StoreConfig, clock: Callable[[], float] = time.time) -> StoreStorage:
    """PostgreSQL when the config names a database URL, else the SQLite file."""
    if config.database_url is not None:
        from gateway.upstreams.store.pg_storage import PostgresStorage

        return PostgresStorage(config, clock)
    from gateway.upstreams.store.storage import SQLiteStorage

    return SQLiteStorage(config, clock)


def describe(config: StoreConfig) -> str:
    """Where the items live, for the start-up log (never a password)."""
    if config.database_url is not None:
        return f"PostgreSQL {display_url(config.database_url)}"
    return f"SQLite {config.database_path}"
