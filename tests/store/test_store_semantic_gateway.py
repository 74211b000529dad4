"""The embedding index through `gateway serve`: search by meaning through the proxy, the
admin port's /info showing the index (never its key), and the key in no log line; on the
SQLite Store and with --database-url on PostgreSQL."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from tests.support.embedding_server import EmbeddingServer
from tests.support.gateway import GatewayProcess


async def test_gateway_serves_search_by_meaning_and_shows_the_index_in_admin_info(
    tmp_path: Path, embedding_server: EmbeddingServer, store_database_url: str | None
) -> None:
    secret = "sk-never-shown-4b1f9"
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "store:\n"
        "  index:\n"
        "    embed: openai:test-embed\n"
        "    dims: 64\n"
        f"    url: {embedding_server.url}\n"
        "    api_key_env: TEST_EMBED_KEY\n"
        "    fields: [text]\n"
    )
    log = tmp_path / "gateway.log"
    args = ["--config", str(config), "--data-dir", str(tmp_path / "data"), "--log-level", "debug"]
    if store_database_url is not None:
        args += ["--database-url", store_database_url]
    gateway = GatewayProcess(
        args,
        env={"TEST_EMBED_KEY": secret},
        log_path=log,
    )
    try:
        await asyncio.to_thread(gateway.wait_ready)
        async with aiohttp.ClientSession() as http:
            put = {"namespace": ["u"], "key": "m1", "value": {"text": "dark roast coffee"}}
            async with http.put(gateway.url + "/store/items", json=put) as response:
                assert response.status == 204
            search = {"namespace_prefix": ["u"], "query": "espresso"}
            async with http.post(gateway.url + "/store/items/search", json=search) as response:
                found = await response.json()
            assert [item["key"] for item in found["items"]] == ["m1"]
            admin = f"http://127.0.0.1:{gateway.admin_port}/info"
            async with http.get(admin) as response:
                info = await response.json()
        index = info["store_index"]
        assert (index["model"], index["dims"], index["fields"]) == ("test-embed", 64, ["text"])
        assert index["api_key_set"] is True
        assert index["reindex"]["state"] in ("idle", "done")
        assert secret not in str(info)
        assert embedding_server.authorizations[-1] == f"Bearer {secret}"
    finally:
        gateway.stop()
    assert secret not in log.read_text()
