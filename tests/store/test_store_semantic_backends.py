"""The embedding index and the two Store backends: the index runs on the SQLite Store only,
so `store.index` together with a PostgreSQL database URL is refused before anything starts
(by `gateway serve` and `gateway store reindex` alike), with a message naming what to remove
and never the URL's password."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from pathlib import Path

import pytest

from gateway.upstreams.store import StoreConfig
from gateway.upstreams.store.app import SEMANTIC_KEY, STORAGE_KEY, create_store_app
from gateway.upstreams.store.index_config import IndexConfig
from gateway.upstreams.store.storage import SQLiteStorage

# Nothing listens there: the refusal must come before any connection attempt.
URL = "postgresql://gw:s3cret-pw@127.0.0.1:1/gateway"
REFUSAL = "store.index needs the SQLite Store for now"
# An index on an endpoint nobody serves: nothing here embeds.
INDEX = IndexConfig(model="test-embed", dims=64, url="http://127.0.0.1:1/v1")


def _index_yaml(server_url: str) -> str:
    return f"store:\n  index:\n    embed: openai:test-embed\n    dims: 64\n    url: {server_url}\n"


def test_an_index_with_a_database_url_is_refused_naming_both_settings(tmp_path: Path) -> None:
    index = INDEX
    with pytest.raises(ValueError, match=REFUSAL) as caught:
        StoreConfig(data_dir=tmp_path, index=index, database_url=URL)
    message = str(caught.value)
    assert "--database-url" in message and "store.index" in message
    assert "s3cret-pw" not in message
    # The way the gateway builds it: the URL is added to a config read from the file.
    plain = StoreConfig(data_dir=tmp_path, index=index)
    with pytest.raises(ValueError, match=REFUSAL):
        dataclasses.replace(plain, database_url=URL)
    # Either one alone is accepted.
    assert StoreConfig(data_dir=tmp_path, database_url=URL).index is None
    assert plain.database_url is None


def test_an_indexed_store_app_runs_on_sqlite_storage(tmp_path: Path) -> None:
    config = StoreConfig(data_dir=tmp_path, index=INDEX)
    app = create_store_app(config)
    assert isinstance(app[STORAGE_KEY], SQLiteStorage)
    assert app[SEMANTIC_KEY].storage is app[STORAGE_KEY]


async def _run_gateway(*args: str, env: dict[str, str]) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **env},
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, stdout.decode() + stderr.decode()


async def test_gateway_serve_refuses_an_index_with_a_database_url(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(_index_yaml("http://127.0.0.1:1/v1"))
    code, output = await _run_gateway(
        "serve", "--config", str(config), "--data-dir", str(tmp_path / "data"),
        "--port", "0", "--admin-port", "0", "--database-url", URL,
        env={},
    )  # fmt: skip
    assert code != 0
    assert REFUSAL in output
    assert "s3cret-pw" not in output


async def test_gateway_store_reindex_refuses_an_index_with_a_database_url(
    tmp_path: Path,
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(_index_yaml("http://127.0.0.1:1/v1"))
    code, output = await _run_gateway(
        "store", "reindex", "--config", str(config), "--data-dir", str(tmp_path),
        env={"GATEWAY_DATABASE_URL": URL},
    )  # fmt: skip
    assert code == 2
    assert REFUSAL in output
    assert "s3cret-pw" not in output
