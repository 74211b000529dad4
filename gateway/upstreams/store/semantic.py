"""Search by meaning: what a write embeds, how a query is ranked, and re-indexing.

The Store app owns one ``SemanticIndex`` when ``store.index`` is configured. A write embeds
the item's fields *before* it is queued, so a provider that is down fails the write with 503
and nothing is stored; the vectors then commit in the same transaction as the item. A search
embeds the query (cached), and ranks by cosine similarity (``ranking: vector``) or by
BM25 and cosine fused (``ranking: hybrid``, see ``hybrid.py``).

When the model, the dims or the default fields change, the items whose vectors belong to the
old configuration are re-embedded in the background, in id order and small batches, with
progress in the log and in ``/info``; ``gateway store reindex`` does the same on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.upstreams.store.backend import StoreStorage
from gateway.upstreams.store.embeddings import EmbeddingClient, EmbeddingUnavailable, Vector
from gateway.upstreams.store.hybrid import Ranker, convex_fusion, reciprocal_rank_fusion
from gateway.upstreams.store.index_config import IndexConfig
from gateway.upstreams.store.mirror import VectorMirror
from gateway.upstreams.store.models import StorePutRequest, StoreSearchRequest
from gateway.upstreams.store.vector_dialect import IndexConnection, VectorDialect
from gateway.upstreams.store.vectors import (
    ItemVectors,
    claim_lease,
    exact_ranking,
    release_lease,
    signature,
    stale_items_sql,
    texts_to_embed,
)

log = logging.getLogger("gateway.store.index")

REINDEX_BATCH = 64
REINDEX_RETRY_SECONDS = 30.0
PROGRESS_LOG_SECONDS = 10.0
# The background re-index holds this lease; renewed after every batch, so a process that
# died leaves it to others after this long.
LEASE_SECONDS = 120.0
_LEASE = "reindex"
# Hybrid ranking takes this many times the requested depth from each ranking, so an item
# a little further down one list can still be lifted by the other.
HYBRID_POOL_FACTOR = 2


@dataclass
class ReindexProgress:
    """Where a re-index stands (shown in ``/info`` and by the CLI)."""

    # idle | running | waiting (provider down) | elsewhere (another process runs it) | done
    state: str = "idle"
    done: int = 0
    total: int = 0
    last_error: str | None = None
    started_at: float | None = None

    def describe(self) -> dict[str, object]:
        return {
            "state": self.state,
            "done": self.done,
            "total": self.total,
            "last_error": self.last_error,
        }


class SemanticIndex:
    """The Store's embedding index: write-path embedding, query ranking, re-indexing."""

    def __init__(
        self,
        config: IndexConfig,
        storage: StoreStorage,
        client: EmbeddingClient | None = None,
    ) -> None:
        self.config = config
        self.storage = storage
        self.client = client or EmbeddingClient(config)
        self.progress = ReindexProgress()
        self.dialect: VectorDialect = storage.vector_dialect
        self.mirror = VectorMirror(config.dims, config.exact_limit, self.dialect)
        self._reindex_task: asyncio.Task[None] | None = None
        self._build_task: asyncio.Task[None] | None = None
        self._owner = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._lease_renewals: set[asyncio.Future[bool]] = set()

    async def open(self, *, reindex_in_background: bool = True) -> None:
        await self.client.open()
        if reindex_in_background:
            # Load the vectors into memory now rather than in the first search.
            self._build_task = asyncio.create_task(self.load_mirror(), name="store-vectors-load")
            self._reindex_task = asyncio.create_task(
                self._reindex_until_done(), name="store-reindex"
            )

    async def close(self) -> None:
        for task in (self._reindex_task, self._build_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._reindex_task = self._build_task = None
        await self.client.close()

    def describe(self) -> dict[str, object]:
        """The index's configuration and re-index progress, without secrets."""
        stats = self.client.stats
        return {
            **self.config.describe(),
            "reindex": self.progress.describe(),
            "embedding_requests": stats.requests,
            "embedding_failures": stats.failures,
            "query_cache_hits": stats.cache_hits,
        }

    # -- writes -------------------------------------------------------------------

    def item_texts(self, request: StorePutRequest) -> list[tuple[str, str]]:
        """The item's ``(path, text)`` pairs to embed. They walk the value: the handler
        makes them with the body's parse, within the loop's parse budget."""
        # request.index None: the configured fields; []: not embedded (index=false)
        return texts_to_embed(request.value, request.index, self.config)

    async def embed_item(
        self, request: StorePutRequest, pairs: list[tuple[str, str]] | None = None
    ) -> ItemVectors:
        """The item's vectors (raises ``EmbeddingUnavailable``, a 503, when the provider
        cannot answer); ``pairs``: its ``item_texts``, when already made."""
        if pairs is None:
            pairs = self.item_texts(request)
        embedded = await self.client.embed([text for _, text in pairs])
        return ItemVectors.build(self.config, request.index, pairs, embedded)

    # -- search -------------------------------------------------------------------

    async def ranker(self, request: StoreSearchRequest) -> Ranker | None:
        """How to rank ``request``'s query, or None in listing mode."""
        query = request.search_query()
        if query is None:
            return None
        vector = await self.client.embed_query(query)
        return self._ranker(vector)

    async def load_mirror(self) -> None:
        """Load every vector into memory (and the HNSW index, for a large store)."""
        await self.storage.read(lambda connection, _: self.mirror.catch_up(connection))

    def _ranker(self, query: Vector) -> Ranker:
        return _MeaningRanker(self, query)

    def by_meaning(
        self,
        connection: IndexConnection,
        scope_sql: str,
        scope_params: list[Any],
        query: Vector,
        depth: int,
    ) -> list[tuple[int, float]]:
        # The mirror replays the change log inside this read transaction first, so it holds
        # at least every vector this search's snapshot can see.
        if self.mirror.catch_up(connection):
            return self.mirror.ranking(connection, scope_sql, scope_params, query, depth)
        # Only while another thread loads the mirror: read the vectors from the table.
        return exact_ranking(
            connection, self.dialect, scope_sql, scope_params, query, self.config.dims, depth
        )

    # -- re-indexing --------------------------------------------------------------

    async def _claim_reindex_lease(self) -> bool:
        now = time.time()
        return await self.storage.write(
            lambda connection: claim_lease(
                connection, self.dialect, _LEASE, self._owner, now, LEASE_SECONDS
            )
        )

    def _renew_lease(self, progress: ReindexProgress) -> None:
        # A batch finished: keep the lease (a renewal that fails only risks a second
        # process joining in, which is wasteful but safe).
        task = asyncio.ensure_future(self._claim_reindex_lease())
        self._lease_renewals.add(task)
        task.add_done_callback(self._lease_renewals.discard)

    async def stale_count(self, *, everything: bool = False) -> int:
        """How many live items need (re-)embedding under the current configuration."""
        sql, params = self._stale_sql(everything)
        return await self.storage.read(
            lambda connection, now: int(
                connection.execute(f"SELECT count(*) {sql}", (*params, now)).fetchone()[0]
            )
        )

    def _stale_sql(self, everything: bool) -> tuple[str, list[Any]]:
        if everything:
            d = self.dialect
            joined = f"FROM {d.items} AS i LEFT JOIN {d.embeddings} AS e ON e.item_id = i.id"
            return f"{joined} WHERE {d.live()}", []
        return stale_items_sql(self.dialect), [
            signature(self.config, None),
            signature(self.config, []),
        ]

    async def reindex(
        self,
        *,
        everything: bool = False,
        on_progress: Callable[[ReindexProgress], None] | None = None,
    ) -> ReindexProgress:
        """Re-embed every stale item (every item with ``everything``); raises
        ``EmbeddingUnavailable`` when the provider fails past its retries."""
        progress = self.progress
        progress.state = "running"
        progress.done = 0
        progress.last_error = None
        progress.started_at = time.monotonic()
        progress.total = await self.stale_count(everything=everything)
        sql, params = self._stale_sql(everything)
        last_id = 0
        last_log = time.monotonic()
        while True:
            batch = await self.storage.read(
                functools.partial(_stale_batch, self.dialect, sql, params, last_id)
            )
            if not batch:
                break
            await self._reembed(batch)
            last_id = batch[-1][0]
            progress.done += len(batch)
            progress.total = max(progress.total, progress.done)
            if on_progress is not None:
                on_progress(progress)
            if time.monotonic() - last_log >= PROGRESS_LOG_SECONDS:
                last_log = time.monotonic()
                log.info("store re-index: %d of %d item(s)", progress.done, progress.total)
        progress.state = "done"
        return progress

    async def _reembed(self, batch: list[tuple[int, str, str | None, float]]) -> None:
        items = []
        texts: list[str] = []
        for item_id, value_json, paths_json, updated_at in batch:
            paths = None if paths_json is None else list(json.loads(paths_json))
            pairs = texts_to_embed(json.loads(value_json), paths, self.config)
            items.append((item_id, paths, pairs, updated_at))
            texts.extend(text for _, text in pairs)
        embedded = await self.client.embed(texts)
        writes = []
        start = 0
        for item_id, paths, pairs, updated_at in items:
            vectors = ItemVectors.build(
                self.config, paths, pairs, embedded[start : start + len(pairs)]
            )
            start += len(pairs)
            writes.append((item_id, updated_at, vectors))

        d = self.dialect

        def write_unchanged(connection: IndexConnection) -> None:
            for item_id, updated_at, vectors in writes:
                # A put that landed since the read embedded the item itself: keep its vectors.
                found = connection.execute(
                    f"SELECT updated_at FROM {d.items} WHERE id = {d.mark}", (item_id,)
                ).fetchone()
                if found is not None and found[0] == updated_at:
                    vectors.write(connection, item_id, d)

        await self.storage.write(write_unchanged)

    async def _reindex_until_done(self) -> None:
        """The background re-index at start-up: one process at a time (a lease in the
        database), waiting out provider outages."""
        while True:
            try:
                stale = await self.stale_count()
                if stale == 0:
                    self.progress.state = "idle"
                    return
                if not await self._claim_reindex_lease():
                    # Another worker or gateway on this file is on it; look again later.
                    self.progress.state = "elsewhere"
                    await asyncio.sleep(REINDEX_RETRY_SECONDS)
                    continue
                log.info(
                    "store index (%s, %d dims) changed: re-embedding %d item(s) in the background",
                    self.config.model,
                    self.config.dims,
                    stale,
                )
                try:
                    progress = await self.reindex(on_progress=self._renew_lease)
                finally:
                    await self.storage.write(
                        functools.partial(
                            release_lease, dialect=self.dialect, name=_LEASE, owner=self._owner
                        )
                    )
                log.info("store re-index done: %d item(s)", progress.done)
                return
            except EmbeddingUnavailable as exc:
                self.progress.state = "waiting"
                self.progress.last_error = exc.reason
                log.warning(
                    "store re-index paused (%s); retrying in %.0f s",
                    exc.reason,
                    REINDEX_RETRY_SECONDS,
                )
                await asyncio.sleep(REINDEX_RETRY_SECONDS)


class _MeaningRanker:
    """A query ranked by meaning (``ranking: vector``) or by words and meaning fused
    (``hybrid``), for one search."""

    def __init__(self, index: SemanticIndex, query: Vector) -> None:
        self._index = index
        self._query = query

    def __call__(
        self,
        connection: IndexConnection,
        scope_sql: str,
        scope_params: list[Any],
        bm25: Callable[[int], list[tuple[int, float]]],
        depth: int,
    ) -> list[tuple[int, float]]:
        index, query = self._index, self._query
        if index.config.ranking == "vector":
            return index.by_meaning(connection, scope_sql, scope_params, query, depth)
        pool = depth * HYBRID_POOL_FACTOR
        by_words = bm25(pool)
        by_meaning = index.by_meaning(connection, scope_sql, scope_params, query, pool)
        if index.config.fusion == "rrf":
            fused = reciprocal_rank_fusion(
                [[item for item, _ in by_words], [item for item, _ in by_meaning]]
            )
        else:
            fused = convex_fusion(by_words, by_meaning, index.config.hybrid_weight)
        # Shorter than depth only when both rankings ran out (each took twice the depth).
        return fused[:depth]

    def unscored(self, dialect: VectorDialect) -> str:
        # Every item with vectors is a candidate of the vector ranking; in hybrid, an item
        # with searchable text is judged by its words too (no match: not returned).
        no_vectors = f"NOT EXISTS (SELECT 1 FROM {dialect.vectors} AS v WHERE v.item_id = i.id)"
        if self._index.config.ranking == "vector":
            return no_vectors
        return f"i.search_text IS NULL AND {no_vectors}"


def _stale_batch(
    dialect: VectorDialect,
    sql: str,
    params: list[Any],
    after: int,
    connection: IndexConnection,
    now: float,
) -> list[tuple[int, str, str | None, float]]:
    m = dialect.mark
    rows = connection.execute(
        f"SELECT i.id, {dialect.value_text}, e.paths, i.updated_at {sql} "
        f"AND i.id > {m} ORDER BY i.id LIMIT {m}",
        (*params, now, after, REINDEX_BATCH),
    ).fetchall()
    return [(int(r[0]), str(r[1]), r[2], float(r[3])) for r in rows]
