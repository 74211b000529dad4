"""The PostgreSQL Store's indexes serve its queries: the GIN jsonb index the equality
filters, the GIN tsvector index the text search (checked on the plans PostgreSQL chooses)."""

from __future__ import annotations

from pathlib import Path

import psycopg

from gateway.upstreams.store.config import StoreConfig
from gateway.upstreams.store.filters import filter_clauses
from gateway.upstreams.store.models import StorePutRequest
from gateway.upstreams.store.pg_filters import compile_pg_filter
from gateway.upstreams.store.pg_schema import TEXT_SEARCH_CONFIG
from gateway.upstreams.store.pg_storage import _DOC, PostgresStorage


async def test_equality_filters_and_search_use_their_gin_indexes(
    pg_database_url: str, tmp_path: Path
) -> None:
    storage = PostgresStorage(StoreConfig(data_dir=tmp_path, database_url=pg_database_url))
    await storage.open()
    try:
        for n in range(3000):
            value = {"owner": f"user{n}", "text": f"word{n} common", "n": n}
            await storage.put(
                StorePutRequest.model_validate({"namespace": ["x"], "key": f"k{n}", "value": value})
            )
    finally:
        await storage.close()
    sql, params = compile_pg_filter(filter_clauses({"owner": "user42"}), _DOC)
    with psycopg.connect(pg_database_url, autocommit=True) as conn:
        conn.execute("ANALYZE store_items")
        # At 3,000 rows a scan may cost as little as the index; what is checked here is that
        # the index can serve these predicates (its expression matches the queries').
        conn.execute("SET enable_seqscan = off")
        plan = "\n".join(
            row[0]
            for row in conn.execute(
                f"EXPLAIN SELECT i.id FROM store_items AS i WHERE {sql}", params
            )
        )
        assert "store_items_value" in plan, plan
        found = conn.execute(f"SELECT i.key FROM store_items AS i WHERE {sql}", params).fetchall()
        assert found == [("k42",)]
        plan = "\n".join(
            row[0]
            for row in conn.execute(
                "EXPLAIN SELECT id FROM store_items "
                f"WHERE search_tsv @@ to_tsquery('{TEXT_SEARCH_CONFIG}', 'word17')"
            )
        )
        assert "store_items_search" in plan, plan
