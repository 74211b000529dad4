"""``gateway data copy`` reads SQLite in batches bounded by rows AND bytes: a Store of
large items must not be held a thousand rows at a time (up to gigabytes)."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from gateway.upstreams import data_copy


def _table(path: Path, sizes: list[int]) -> sqlite3.Cursor:
    connection = sqlite3.connect(path)
    connection.row_factory = sqlite3.Row
    connection.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, value TEXT, blob BLOB)")
    connection.executemany(
        "INSERT INTO t (id, value, blob) VALUES (?, ?, ?)",
        [(i, "v" * (size // 2), b"b" * (size - size // 2)) for i, size in enumerate(sizes)],
    )
    connection.commit()
    return connection.execute("SELECT id, value, blob FROM t ORDER BY id")


@pytest.mark.parametrize("seed", range(30))
def test_batches_keep_every_row_in_order_within_both_bounds(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice([0, 10, 100, 5_000, 40_000]) for _ in range(rng.randrange(0, 400))]
    max_rows = rng.randrange(1, 50)
    max_bytes = rng.randrange(1, 120_000)
    batches = list(data_copy._batches(_table(tmp_path / "t.db", sizes), max_rows, max_bytes))

    assert [row["id"] for batch in batches for row in batch] == list(range(len(sizes)))
    for batch in batches:
        assert 1 <= len(batch) <= max_rows
        held = [len(row["value"]) + len(row["blob"]) for row in batch]
        # The batch ended as soon as it reached either bound, not later.
        assert sum(held[:-1]) < max_bytes
        assert len(batch) == max_rows or sum(held) >= max_bytes or batch is batches[-1]


def test_a_thousand_one_mebibyte_rows_are_not_one_batch(tmp_path: Path) -> None:
    sizes = [1024 * 1024] * 40  # what 40 items of the default max_body_bytes hold
    batches = list(data_copy._batches(_table(tmp_path / "t.db", sizes)))
    assert max(len(batch) for batch in batches) == data_copy.BATCH_BYTES // (1024 * 1024)
    assert sum(len(batch) for batch in batches) == 40


def test_text_is_counted_in_bytes_not_characters(tmp_path: Path) -> None:
    connection = sqlite3.connect(tmp_path / "t.db")
    connection.row_factory = sqlite3.Row
    connection.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, value TEXT)")
    emoji = "\U0001f600" * 1000  # 1,000 characters, 4,000 bytes of UTF-8
    connection.executemany("INSERT INTO t VALUES (?, ?)", [(i, emoji) for i in range(10)])
    cursor = connection.execute("SELECT id, value FROM t ORDER BY id")
    batches = list(data_copy._batches(cursor, max_rows=100, max_bytes=8000))
    assert [len(b) for b in batches] == [2, 2, 2, 2, 2]  # 2 rows are 8,000 bytes
