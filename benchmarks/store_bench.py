"""Store benchmark: put and search throughput and latency, and listing cost as a namespace grows.

Runs the Store in a child process (``python -m gateway.upstreams.store``) on a loopback port
and drives it over HTTP with aiohttp, so the numbers include HTTP, JSON and SQLite.

    .venv/bin/python benchmarks/store_bench.py                 # 10k items
    .venv/bin/python benchmarks/store_bench.py --million       # also at 1M items (slow)
    .venv/bin/python benchmarks/store_bench.py --large 200000  # also at another scale
    .venv/bin/python benchmarks/store_bench.py --synchronous normal
    # SQLite and PostgreSQL side by side (PostgreSQL started here: initdb in a temp dir)
    .venv/bin/python benchmarks/store_bench.py --backends sqlite,postgresql --no-growth
    # another source tree's Store (before/after), the server on core 0, this client on 1:
    taskset -c 1 .venv/bin/python benchmarks/store_bench.py --store-src /tmp/before \
        --server-cpus 0 --no-growth

Large stores are preloaded straight into SQLite (same schema, same triggers) or PostgreSQL
(COPY into the migrated table; the database computes the tsvector) because putting a million
items over HTTP would take most of the run; the measured puts and searches then run against
that store over HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.machine import machine_info  # noqa: E402
from gateway.upstreams.store.schema import SCHEMA  # noqa: E402
from gateway.upstreams.store.text_index import searchable_text  # noqa: E402

_SYLLABLES = tuple("kalominuperasitovuwexayozibacodefugahijo"[i : i + 2] for i in range(0, 40, 2))
# A 5,000-word synthetic vocabulary; documents draw words with Zipf weights (a few very
# common words, a long tail), queries draw "content words" uniformly from ranks 20-2000.
VOCABULARY = [a + b + c for a in _SYLLABLES for b in _SYLLABLES for c in _SYLLABLES][:5000]
_ZIPF_CUMULATIVE = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(VOCABULARY))))
QUERY_WORDS = VOCABULARY[20:2000]
COLORS = ["red", "green", "blue", "black", "white"]


def make_value(rng: random.Random, index: int) -> dict[str, Any]:
    return {
        "text": " ".join(rng.choices(VOCABULARY, cum_weights=_ZIPF_CUMULATIVE, k=12)),
        "n": index,
        "color": COLORS[index % len(COLORS)],
    }


def preload(db_path: Path, count: int, namespaces: int, prefix: str, seed: int) -> None:
    """Insert ``count`` items directly (one transaction per 10k rows)."""
    rng = random.Random(seed)
    connection = sqlite3.connect(db_path, isolation_level=None)
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute("PRAGMA synchronous = NORMAL")
    if connection.execute("PRAGMA user_version").fetchone()[0] == 0:
        connection.executescript(f"BEGIN IMMEDIATE;{SCHEMA}COMMIT;")
    now = time.time()
    batch: list[tuple[Any, ...]] = []
    for index in range(count):
        value = make_value(rng, index)
        # Strictly increasing updated_at, like items written one after another.
        stamp = now - count + index
        batch.append(
            (
                f"{prefix}.u{index % namespaces}",
                f"k{index}",
                json.dumps(value),
                searchable_text(value, None),
                stamp,
                stamp,
            )
        )
        if len(batch) == 10_000 or index == count - 1:
            connection.execute("BEGIN")
            connection.executemany(
                "INSERT OR REPLACE INTO items "
                "(namespace, key, value, search_text, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                batch,
            )
            connection.execute("COMMIT")
            batch.clear()
    connection.close()


class StoreServer:
    """The Store in a child process."""

    def __init__(
        self, data_dir: Path, args: argparse.Namespace, database_url: str | None = None
    ) -> None:
        source = args.store_src.resolve()
        database = ["--database-url", database_url] if database_url else []
        pinning = ["taskset", "-c", args.server_cpus] if args.server_cpus else []
        self.process = subprocess.Popen(
            [
                *pinning,
                sys.executable,
                "-m",
                "gateway.upstreams.store",
                "--data-dir",
                str(data_dir),
                "--synchronous",
                args.synchronous,
                *database,
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=source,
            env={**os.environ, "PYTHONPATH": str(source)},
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        match = re.search(r"(http://\S+)", line)
        if match is None:
            self.process.kill()
            raise RuntimeError(f"store did not start: {line!r}")
        self.url = match.group(1)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


async def measure(
    name: str,
    operations: int,
    concurrency: int,
    call: Callable[[int], Awaitable[None]],
) -> dict[str, Any]:
    """Run ``call(i)`` for i in range(operations) with bounded concurrency; time each call."""
    latencies: list[float] = []
    counter = iter(range(operations))

    async def worker() -> None:
        for index in counter:
            started = time.perf_counter()
            await call(index)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    result = {
        "name": name,
        "ops": operations,
        "concurrency": concurrency,
        "ops_per_s": operations / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
    }
    print(
        f"  {name:<44} {result['ops_per_s']:>9.0f} ops/s   p50 {result['p50_ms']:>7.2f} ms"
        f"   p99 {result['p99_ms']:>7.2f} ms   (n={operations}, c={concurrency})",
        flush=True,
    )
    return result


async def _post(session: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> Any:
    async with session.post(path, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{path}: {response.status} {await response.text()}")
        return await response.json()


def preload_postgres(url: str, count: int, namespaces: int, prefix: str, seed: int) -> None:
    """COPY ``count`` items into the migrated PostgreSQL table."""
    import psycopg

    from gateway.upstreams.postgres.migrations import migrate
    from gateway.upstreams.store import pg_schema

    migrate(url, pg_schema.COMPONENT, pg_schema.STEPS)
    rng = random.Random(seed)
    now = time.time()
    columns = "namespace, key, value, search_text, created_at, updated_at"
    with psycopg.connect(url) as conn, conn.cursor() as cursor:
        with cursor.copy(f"COPY store_items ({columns}) FROM STDIN") as copy:
            for index in range(count):
                value = make_value(rng, index)
                stamp = now - count + index
                copy.write_row(
                    (
                        f"{prefix}.u{index % namespaces}",
                        f"k{index}",
                        json.dumps(value, separators=(",", ":")),
                        searchable_text(value, None),
                        stamp,
                        stamp,
                    )
                )
        conn.commit()
        conn.execute("ANALYZE store_items")


async def run_scale(
    items: int,
    args: argparse.Namespace,
    work_dir: Path,
    rng: random.Random,
    database_url: str | None = None,
) -> list[dict[str, Any]]:
    """Fill a store to ``items`` items, then measure puts, gets, searches, listings."""
    backend = "postgresql" if database_url else "sqlite"
    data_dir = work_dir / f"store-{backend}-{items}"
    data_dir.mkdir()
    results: list[dict[str, Any]] = []
    print(
        f"\n== {backend} store with {items:,} items (synchronous={args.synchronous}) ==",
        flush=True,
    )
    preloaded = 0
    if items > args.http_fill_limit:
        started = time.perf_counter()
        if database_url:
            preload_postgres(database_url, items, 1000, "bench", args.seed)
        else:
            preload(data_dir / "store.sqlite3", items, 1000, "bench", args.seed)
        preloaded = items
        print(f"  preloaded {items:,} items in {time.perf_counter() - started:.1f} s", flush=True)
    server = StoreServer(data_dir, args, database_url)
    try:
        timeout = aiohttp.ClientTimeout(total=60)
        connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
        async with aiohttp.ClientSession(server.url, timeout=timeout, connector=connector) as s:

            async def put(index: int) -> None:
                key = index + preloaded
                body = {
                    "namespace": ["bench", f"u{key % 1000}"],
                    "key": f"k{key}",
                    "value": make_value(rng, key),
                }
                async with s.put("/store/items", json=body) as response:
                    if response.status != 204:
                        raise RuntimeError(f"put: {response.status} {await response.text()}")

            fill = items if not preloaded else args.puts
            reads, conc = args.reads, args.concurrency
            results.append(await measure("put (new items)", fill, conc, put))

            async def get(index: int) -> None:
                key = rng.randrange(items)
                params = {"namespace": f"bench.u{key % 1000}", "key": f"k{key}"}
                async with s.get("/store/items", params=params) as response:
                    if response.status != 200 or await response.json() is None:
                        raise RuntimeError(f"get k{key}: {response.status}")

            results.append(await measure("get (existing)", reads, conc, get))

            async def search(index: int) -> None:
                query = " ".join(rng.sample(QUERY_WORDS, 2))
                await _post(s, "/store/items/search", {"query": query, "limit": 10})

            results.append(await measure("search: 2-word query, whole store", reads, conc, search))

            async def search_ns(index: int) -> None:
                query = " ".join(rng.sample(QUERY_WORDS, 2))
                body = {"namespace_prefix": ["bench", f"u{index % 1000}"], "query": query}
                await _post(s, "/store/items/search", body)

            results.append(await measure("search: query in one namespace", reads, conc, search_ns))

            async def search_filtered(index: int) -> None:
                query = " ".join(rng.sample(QUERY_WORDS, 2))
                body = {"query": query, "filter": {"color": "red", "n": {"$gte": items // 2}}}
                await _post(s, "/store/items/search", body)

            results.append(
                await measure(
                    "search: query + filter, whole store",
                    args.reads,
                    args.concurrency,
                    search_filtered,
                )
            )

            async def listing(index: int) -> None:
                body = {"namespace_prefix": ["bench", f"u{index % 1000}"], "limit": 10}
                await _post(s, "/store/items/search", body)

            results.append(await measure("listing: one namespace, limit 10", reads, conc, listing))
    finally:
        server.stop()
    for result in results:
        result["items"] = items
        result["backend"] = backend
    return results


def side_by_side(results: list[dict[str, Any]]) -> str:
    """A markdown table: one row per operation and size, one column pair per backend."""
    backends = sorted({r["backend"] for r in results if "backend" in r}, reverse=True)
    rows: dict[tuple[int, str], dict[str, dict[str, Any]]] = {}
    for r in results:
        if "backend" in r:
            rows.setdefault((r["items"], r["name"]), {})[r["backend"]] = r
    head = "| items | operation | " + " | ".join(f"{b} ops/s (p50 ms)" for b in backends)
    lines = [head + " |", "|---:|---|" + "---:|" * len(backends)]
    for (items, name), by_backend in rows.items():
        cells = []
        for b in backends:
            r = by_backend.get(b)
            cells.append("" if r is None else f"{r['ops_per_s']:,.0f} ({r['p50_ms']:.2f})")
        lines.append(f"| {items:,} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def run_listing_growth(args: argparse.Namespace, work_dir: Path) -> list[dict[str, Any]]:
    """Listing latency in one namespace of growing size (preloaded), and list_namespaces."""
    data_dir = work_dir / "growth"
    data_dir.mkdir()
    sizes = [10, 100, 1_000, 10_000] + ([100_000] if args.million else [])
    for size in sizes:
        preload(data_dir / "store.sqlite3", size, 1, f"grow.s{size}", args.seed)
    print("\n== listing cost as one namespace grows ==", flush=True)
    results: list[dict[str, Any]] = []
    server = StoreServer(data_dir, args)
    try:
        async with aiohttp.ClientSession(server.url) as s:
            for size in sizes:
                namespace = ["grow", f"s{size}", "u0"]

                async def first_page(index: int, namespace: list[str] = namespace) -> None:
                    await _post(s, "/store/items/search", {"namespace_prefix": namespace})

                async def last_page(
                    index: int, namespace: list[str] = namespace, size: int = size
                ) -> None:
                    body = {"namespace_prefix": namespace, "offset": max(0, size - 10)}
                    await _post(s, "/store/items/search", body)

                async def filtered(index: int, namespace: list[str] = namespace) -> None:
                    body = {"namespace_prefix": namespace, "filter": {"color": "red"}}
                    await _post(s, "/store/items/search", body)

                for label, call in (
                    ("first page", first_page),
                    ("last page (deep offset)", last_page),
                    ("first page, filter color=red", filtered),
                ):
                    result = await measure(
                        f"{size:>7,} items: {label}", args.listing_reads, 4, call
                    )
                    result["namespace_items"] = size
                    results.append(result)

            async def namespaces(index: int) -> None:
                await _post(s, "/store/namespaces", {"prefix": ["grow"], "max_depth": 2})

            name = "list_namespaces (prefix, max_depth 2)"
            results.append(await measure(name, 200, 4, namespaces))
    finally:
        server.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--million", action="store_true", help="also run at 1,000,000 items")
    parser.add_argument(
        "--large", type=int, metavar="N", help="also run at N items (preloaded above 50k)"
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--reads", type=int, default=2_000)
    parser.add_argument("--puts", type=int, default=5_000, help="puts measured on preloaded stores")
    parser.add_argument("--listing-reads", type=int, default=300)
    parser.add_argument("--http-fill-limit", type=int, default=50_000)
    parser.add_argument("--synchronous", choices=("full", "normal"), default="full")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument(
        "--store-src",
        type=Path,
        default=REPO_ROOT,
        help="source tree whose Store is measured (default: this one), e.g. a git worktree "
        "of an earlier commit",
    )
    parser.add_argument("--server-cpus", help="pin the Store process to these CPUs (taskset)")
    parser.add_argument("--no-growth", action="store_true", help="skip the listing-growth section")
    parser.add_argument(
        "--backends",
        default="sqlite",
        help="comma-separated: sqlite, postgresql (a throwaway server started by the bench)",
    )
    args = parser.parse_args()

    info = machine_info()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    print(f"store source: {args.store_src.resolve()}")
    rng = random.Random(args.seed)
    results: list[dict[str, Any]] = []
    backends = args.backends.split(",")
    with tempfile.TemporaryDirectory(prefix="store-bench-") as tmp, _postgres(backends) as pg:
        work_dir = Path(tmp)
        sizes = [args.items, *([args.large] if args.large else [])]
        sizes += [1_000_000] if args.million else []
        for items in sizes:
            for backend in backends:
                url = pg.create_database() if backend == "postgresql" else None
                # The same items and queries on each backend.
                rng = random.Random(args.seed)
                results += asyncio.run(run_scale(items, args, work_dir, rng, url))
        if not args.no_growth:
            results += asyncio.run(run_listing_growth(args, work_dir))
    if len(backends) > 1:
        print("\n" + side_by_side(results))
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "results": results}, indent=2))


@contextlib.contextmanager
def _postgres(backends: list[str]) -> Iterator[Any]:
    if "postgresql" not in backends:
        yield None
        return
    from tests.support.postgres_server import postgres_server

    # fsync on, like the SQLite store's synchronous=full: durable commits on both sides.
    with postgres_server(durable=True) as server:
        yield server


if __name__ == "__main__":
    main()
