"""Store search-by-meaning latency: exact (numpy) against approximate (usearch HNSW) search,
vector and hybrid ranking, whole store and one namespace, at 10k and 100k items.

Items are preloaded straight into SQLite (the Store's own schema, triggers and vector tables)
with random unit vectors; each search then runs through the Store's storage and ranking code
in-process with a precomputed query vector, so the figures leave out HTTP and the embedding
provider's own time (a hosted provider adds its round trip, ~100-300 ms, on a query that is
not cached).

    .venv/bin/python benchmarks/store_vector_bench.py                   # 10k and 100k, 384 dims
    .venv/bin/python benchmarks/store_vector_bench.py --sizes 10000 --dims 1536
    .venv/bin/python benchmarks/store_vector_bench.py --postgres        # PostgreSQL Store too

``--postgres`` starts a throwaway PostgreSQL (tests/support/postgres_server.py: initdb and
pg_ctl in a temporary directory, on a free port) and runs the same rows on the PostgreSQL
Store, preloaded with the same items and vectors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.machine import machine_info  # noqa: E402
from gateway.upstreams.postgres.migrations import migrate  # noqa: E402
from gateway.upstreams.store import pg_schema  # noqa: E402
from gateway.upstreams.store.backend import StoreStorage, create_storage  # noqa: E402
from gateway.upstreams.store.config import StoreConfig  # noqa: E402
from gateway.upstreams.store.index_config import IndexConfig  # noqa: E402
from gateway.upstreams.store.models import StoreSearchRequest  # noqa: E402
from gateway.upstreams.store.schema import SCHEMA  # noqa: E402
from gateway.upstreams.store.semantic import SemanticIndex  # noqa: E402
from gateway.upstreams.store.vectors import VECTOR_SCHEMA, encode, signature  # noqa: E402

WORDS = [f"w{n}" for n in range(2000)]
NAMESPACES = 100  # items spread over users/u0 .. users/u99: one namespace holds 1%


def preload(path: Path, count: int, dims: int, index: IndexConfig) -> None:
    rng = np.random.default_rng(7)
    words = random.Random(7)
    connection = sqlite3.connect(path)
    connection.executescript(SCHEMA)
    connection.executescript(VECTOR_SCHEMA)
    sig = signature(index, None)
    with connection:
        for start in range(0, count, 5000):
            n = min(5000, count - start)
            vectors = rng.standard_normal((n, dims)).astype(np.float32)
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
            items = []
            for offset in range(n):
                i = start + offset
                text = " ".join(words.choices(WORDS, k=10))
                items.append(
                    (i + 1, f"users.u{i % NAMESPACES}", f"k{i}", json.dumps({"text": text}), text)
                )
            connection.executemany(
                "INSERT INTO items (id, namespace, key, value, search_text, created_at, "
                "updated_at) VALUES (?, ?, ?, ?, ?, 0, 0)",
                items,
            )
            connection.executemany(
                "INSERT INTO item_vectors (item_id, path, vector) VALUES (?, 'text', ?)",
                [(start + o + 1, encode(vectors[o])) for o in range(n)],
            )
            connection.executemany(
                "INSERT INTO item_embeddings (item_id, paths, signature) VALUES (?, NULL, ?)",
                [(start + o + 1, sig) for o in range(n)],
            )
    connection.close()


def preload_postgres(url: str, count: int, dims: int, index: IndexConfig) -> None:
    """The same items and vectors as ``preload``, in the PostgreSQL Store's schema."""
    import psycopg

    migrate(url, pg_schema.COMPONENT, pg_schema.STEPS)
    rng = np.random.default_rng(7)
    words = random.Random(7)
    sig = signature(index, None)
    with psycopg.connect(url) as conn, conn.cursor() as cursor:
        for start in range(0, count, 5000):
            n = min(5000, count - start)
            vectors = rng.standard_normal((n, dims)).astype(np.float32)
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
            with cursor.copy(
                "COPY store_items (namespace, key, value, search_text, created_at, updated_at) "
                "FROM STDIN"
            ) as copy:
                for offset in range(n):
                    i = start + offset
                    text = " ".join(words.choices(WORDS, k=10))
                    copy.write_row(
                        (
                            f"users.u{i % NAMESPACES}",
                            f"k{i}",
                            json.dumps({"text": text}),
                            text,
                            0,
                            0,
                        )
                    )
            # A fresh table's identity hands out 1, 2, ... as preload's explicit ids.
            with cursor.copy("COPY store_item_vectors (item_id, path, vector) FROM STDIN") as copy:
                for o in range(n):
                    copy.write_row((start + o + 1, "text", encode(vectors[o])))
            with cursor.copy(
                "COPY store_item_embeddings (item_id, paths, signature) FROM STDIN"
            ) as copy:
                for o in range(n):
                    copy.write_row((start + o + 1, None, sig))
        conn.commit()
        conn.execute("ANALYZE store_items")
        conn.commit()


@contextlib.contextmanager
def database(backend: str) -> Iterator[str | None]:
    """None for SQLite, else a fresh database on a throwaway PostgreSQL server."""
    if backend == "sqlite":
        yield None
        return
    from tests.support.postgres_server import postgres_server

    with postgres_server() as server:
        yield server.create_database()


async def measure(
    storage: StoreStorage, index: SemanticIndex, request: StoreSearchRequest, rounds: int
) -> tuple[float, float]:
    rng = np.random.default_rng(11)
    timings = []
    for _ in range(rounds):
        query = rng.standard_normal(index.config.dims).astype(np.float32)
        query /= np.linalg.norm(query)
        started = time.perf_counter()
        await storage.search(request, index._ranker(query))
        timings.append((time.perf_counter() - started) * 1000)
    timings.sort()
    return statistics.median(timings), timings[int(len(timings) * 0.99) - 1]


async def run(
    count: int, dims: int, rounds: int, wanted_modes: set[str], backend: str
) -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, database(backend) as url:
        base_index = IndexConfig(model="bench", dims=dims, url="http://127.0.0.1:9/v1")
        config = StoreConfig(data_dir=Path(tmp), index=base_index, database_url=url)
        started = time.perf_counter()
        if url is None:
            preload(config.database_path, count, dims, base_index)
        else:
            preload_postgres(url, count, dims, base_index)
        print(f"  preloaded {count} items in {time.perf_counter() - started:.1f} s", flush=True)
        whole = StoreSearchRequest(query="w5 w17", limit=10)
        scoped = StoreSearchRequest(query="w5 w17", limit=10, namespace_prefix=["users", "u3"])
        modes = (("SQL scan", 10**9), ("exact, in memory", 10**9), ("approximate", 0))
        for mode, exact_max in modes:
            if mode not in wanted_modes:
                continue
            # The approximate index serves the vector half of hybrid the same way: one build.
            rankings = ("vector",) if mode == "approximate" else ("vector", "hybrid")
            for ranking in rankings:
                index_config = replace(
                    base_index, ranking=ranking, exact_search_max_vectors=exact_max
                )
                storage = create_storage(replace(config, index=index_config))
                await storage.open()
                index = SemanticIndex(index_config, storage)
                note = ""
                if mode == "SQL scan":
                    index.mirror.catch_up = lambda connection: False  # the fallback path
                else:
                    started = time.perf_counter()
                    await index.load_mirror()
                    note = f" (loaded in {time.perf_counter() - started:.1f} s"
                    if mode == "approximate":
                        # The HNSW index builds on a background thread (one core).
                        assert index.mirror.build_thread is not None
                        await asyncio.to_thread(index.mirror.build_thread.join)
                        note += f", HNSW built in {time.perf_counter() - started:.0f} s"
                    note += ")"
                    assert index.mirror.approximate == (mode == "approximate")
                for scope, request in (("whole store", whole), ("one namespace (1%)", scoped)):
                    p50, p99 = await measure(storage, index, request, rounds)
                    rows.append(
                        f"| {backend} | {count:,} | {mode}{note} | {ranking} | {scope} "
                        f"| {p50:.2f} | {p99:.2f} |"
                    )
                    print(rows[-1], flush=True)
                await storage.close()
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--dims", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument(
        "--modes",
        default="SQL scan,exact, in memory,approximate",
        help="comma-separated subset of: SQL scan / exact, in memory / approximate",
    )
    parser.add_argument(
        "--postgres", action="store_true", help="also run on a throwaway PostgreSQL Store"
    )
    args = parser.parse_args()
    print(machine_info())
    print(f"dims {args.dims}, {args.rounds} searches per row, limit 10")
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        modes = {m.strip() for m in args.modes.replace("exact, in", "exact_in").split(",")}
        modes = {m.replace("exact_in", "exact, in") for m in modes}
        for backend in ("sqlite", "postgresql") if args.postgres else ("sqlite",):
            rows += await run(size, args.dims, args.rounds, modes, backend)
    print()
    print("| store | items | search | ranking | scope | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    asyncio.run(main())
