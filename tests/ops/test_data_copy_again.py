"""``gateway data copy`` run again: its report says what each run added, updated or left
alone (a second run used to say "N row(s) copied" for rows it only read again)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import psycopg
import pytest

from gateway.upstreams import data_copy
from gateway.upstreams.store.config import StoreConfig
from tests.control_plane.support import (
    deployment_body,
    headers,
    make_config,
    running_control_plane,
)
from tests.store.store_support import REPO_ROOT, start_store

LINE = re.compile(
    r"^(?P<table>[a-z_ ]+): (?P<copied>\d+) row\(s\) copied, (?P<total>\d+) in PostgreSQL "
    r"\((?P<added>\d+) added, (?P<updated>\d+) updated, (?P<same>\d+) already up to date\)$"
)


def _copy(data_dir: Path, url: str) -> dict[str, tuple[int, int, int, int, int]]:
    """Run the command; per table (copied, in PostgreSQL, added, updated, up to date)."""
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "data", "copy", "--to", url, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    counts = {}
    for line in done.stdout.splitlines()[1:]:  # after "copying ... into ..."
        match = LINE.match(line)
        assert match, f"unexpected report line {line!r} in:\n{done.stdout}"
        numbers = (match["copied"], match["total"], match["added"], match["updated"], match["same"])
        counts[match["table"]] = tuple(int(n) for n in numbers)
    return counts  # type: ignore[return-value]


async def _put(http: aiohttp.ClientSession, store_url: str, key: str, n: int) -> None:
    item = {"namespace": ["notes"], "key": key, "value": {"text": f"note {n}", "n": n}}
    async with http.put(store_url + "/store/items", json=item) as r:
        assert r.status == 204


async def test_a_second_copy_adds_nothing_and_a_third_counts_only_the_changes(
    pg_database_url: str, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    store_config = StoreConfig(data_dir=data_dir, refresh_ttl_on_read=False)
    cp_config = make_config(data_dir, step=3600)  # revisions stay where they are
    store = await start_store(store_config)
    try:
        async with running_control_plane(cp_config) as cp, aiohttp.ClientSession() as http:
            for n in range(5):
                await _put(http, store.url, f"k{n}", n)
            for n in range(2):
                async with http.post(
                    cp.url + "/v2/deployments", json=deployment_body(f"d{n}"), headers=headers()
                ) as r:
                    assert r.status == 201

            first = _copy(data_dir, pg_database_url)
            assert first["store items"] == (5, 5, 5, 0, 0)
            assert first["deployments"] == (2, 2, 2, 0, 0)
            assert first["listeners"] == (0, 0, 0, 0, 0)

            # Nothing changed in SQLite: nothing is added, nothing rewritten.
            second = _copy(data_dir, pg_database_url)
            assert second["store items"] == (0, 5, 0, 0, 5)
            assert second["deployments"] == (0, 2, 0, 0, 2)
            assert {table: c[0] for table, c in second.items()} == dict.fromkeys(second, 0)
            assert {table: c[1] for table, c in second.items()} == {
                table: c[1] for table, c in first.items()
            }

            # One item changed, one new item, one new deployment: exactly those.
            await _put(http, store.url, "k1", 100)
            await _put(http, store.url, "k-new", 6)
            async with http.post(
                cp.url + "/v2/deployments", json=deployment_body("d-new"), headers=headers()
            ) as r:
                assert r.status == 201
    finally:
        await store.runner.cleanup()

    third = _copy(data_dir, pg_database_url)
    assert third["store items"] == (2, 6, 1, 1, 4)
    assert third["deployments"] == (1, 3, 1, 0, 2)

    # The changed item carries its new value in PostgreSQL.
    with psycopg.connect(pg_database_url) as db:
        row = db.execute("SELECT value::text FROM store_items WHERE key = 'k1'").fetchone()
    assert row is not None and json.loads(row[0]) == {"text": "note 100", "n": 100}


async def test_a_long_copy_says_how_far_it_got(
    pg_database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small batches and a progress line every two rows stand in for a large Store.
    monkeypatch.setattr(data_copy, "BATCH", 2)
    monkeypatch.setattr(data_copy, "PROGRESS_EVERY", 2)
    data_dir = tmp_path / "data"
    store = await start_store(StoreConfig(data_dir=data_dir, refresh_ttl_on_read=False))
    try:
        async with aiohttp.ClientSession() as http:
            for n in range(5):
                await _put(http, store.url, f"k{n}", n)
        said: list[str] = []
        report = data_copy.copy_to_postgres(data_dir, pg_database_url, said.append)
    finally:
        await store.runner.cleanup()
    assert said == ["store items: 2 row(s) read so far", "store items: 4 row(s) read so far"]
    items = report.tables["store items"]
    assert (items.read, items.added, items.in_target) == (5, 5, 5)
