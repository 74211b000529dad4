"""The embedding index on both Store backends: each backend's app gets its own storage under
the index, a Store that grows an index embeds what it already holds, and on PostgreSQL the
change log stays in commit order (a mirror never skips a write that committed late) and a
database the reindex command cannot reach is reported without its password.

The index's behaviour over HTTP runs on both backends in test_store_semantic.py and
test_store_sdk_indexed.py."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import psycopg
from langgraph_sdk import get_client

from gateway.upstreams.store import StoreConfig
from gateway.upstreams.store.app import SEMANTIC_KEY, STORAGE_KEY, create_store_app
from gateway.upstreams.store.index_config import IndexConfig
from gateway.upstreams.store.models import StorePutRequest
from gateway.upstreams.store.pg_storage import PostgresStorage
from gateway.upstreams.store.storage import SQLiteStorage
from gateway.upstreams.store.vector_dialect import POSTGRES
from tests.support.embedding_server import EmbeddingServer

from .semantic_support import indexed_store_config
from .store_support import start_store

# Nothing listens there.
URL = "postgresql://gw:s3cret-pw@127.0.0.1:1/gateway"
# An index on an endpoint nobody serves: nothing here embeds.
INDEX = IndexConfig(model="test-embed", dims=64, url="http://127.0.0.1:1/v1")


def test_each_backend_runs_the_index_on_its_own_storage(tmp_path: Path) -> None:
    on_file = create_store_app(StoreConfig(data_dir=tmp_path, index=INDEX))
    assert isinstance(on_file[STORAGE_KEY], SQLiteStorage)
    assert on_file[SEMANTIC_KEY].storage is on_file[STORAGE_KEY]
    on_postgres = create_store_app(StoreConfig(data_dir=tmp_path, index=INDEX, database_url=URL))
    assert isinstance(on_postgres[STORAGE_KEY], PostgresStorage)
    assert on_postgres[SEMANTIC_KEY].storage is on_postgres[STORAGE_KEY]
    assert on_postgres[SEMANTIC_KEY].dialect is POSTGRES


async def test_a_store_that_grows_an_index_embeds_the_items_it_holds(
    tmp_path: Path, embedding_server: EmbeddingServer, store_database_url: str | None
) -> None:
    plain = await start_store(StoreConfig(data_dir=tmp_path / "d", database_url=store_database_url))
    try:
        client = get_client(url=plain.url, api_key=None)
        await client.store.put_item(["m"], key="coffee", value={"text": "dark roast"})
        await client.store.put_item(["m"], key="car", value={"text": "sedan tyres"})
        await client.aclose()
    finally:
        await plain.runner.cleanup()
    config = indexed_store_config(tmp_path / "d", embedding_server, store_database_url)
    indexed = await start_store(config)
    try:
        semantic = indexed.app[SEMANTIC_KEY]
        for _ in range(200):
            if semantic.progress.state == "done":
                break
            await asyncio.sleep(0.05)
        assert semantic.progress.describe()["done"] == 2
        client = get_client(url=indexed.url, api_key=None)
        found = await client.store.search_items(["m"], query="espresso")
        await client.aclose()
        assert found["items"][0]["key"] == "coffee"
    finally:
        await indexed.runner.cleanup()


async def test_a_write_that_commits_late_is_not_skipped_by_the_mirror(
    tmp_path: Path, embedding_server: EmbeddingServer, pg_database_url: str
) -> None:
    """A change-log number taken before another write's but committed after it: the writers
    take turns (an advisory lock), so no search moves past the late one."""
    config = indexed_store_config(
        tmp_path / "d", embedding_server, pg_database_url, ranking="vector"
    )
    store = await start_store(config)
    client = get_client(url=store.url, api_key=None)
    try:
        semantic = store.app[SEMANTIC_KEY]
        request = StorePutRequest(
            namespace=["s"], key="slow", value={"text": "espresso"}, index=["text"]
        )
        vectors = await semantic.embed_item(request)
        with psycopg.connect(pg_database_url) as slow:  # one transaction until commit()
            now = time.time()
            item_id = slow.execute(
                "INSERT INTO store_items (namespace, key, value, search_text, created_at, "
                "updated_at) VALUES ('s', 'slow', '{\"text\": \"espresso\"}', 'espresso', "
                "%s, %s) RETURNING id",
                (now, now),
            ).fetchone()[0]
            vectors.write(slow, item_id, POSTGRES)  # takes its change-log number
            fast = asyncio.create_task(
                client.store.put_item(["s"], key="fast", value={"text": "latte"}, index=["text"])
            )
            await asyncio.sleep(0.5)
            # A search now: were "fast" committed already (it is not: it waits for the slow
            # writer's turn to end), the mirror would move past the slow write's number.
            found = await client.store.search_items(["s"], query="coffee")
            assert "slow" not in [item["key"] for item in found["items"]]
            slow.commit()
        await asyncio.wait_for(fast, 10)
        found = await client.store.search_items(["s"], query="coffee")
        assert sorted(item["key"] for item in found["items"]) == ["fast", "slow"]
        assert semantic.mirror.vectors == 2
    finally:
        await client.aclose()
        await store.runner.cleanup()


async def test_gateway_store_reindex_names_an_unreachable_database_without_its_password(
    tmp_path: Path,
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "store:\n  index:\n    embed: openai:test-embed\n    dims: 64\n"
        "    url: http://127.0.0.1:1/v1\n"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "store", "reindex", "--config", str(config),
        "--data-dir", str(tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "GATEWAY_DATABASE_URL": URL},
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    output = stdout.decode() + stderr.decode()
    assert process.returncode == 1, output
    assert "cannot reach the Store database at postgresql://***@127.0.0.1:1/gateway" in output
    assert "s3cret-pw" not in output
    assert "Traceback" not in output
