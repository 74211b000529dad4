"""Which PostgreSQL driver for the built-in upstreams: psycopg 3 (+ psycopg_pool) or asyncpg.

The Store's two hottest statements, each on a pooled connection, from one asyncio process
with bounded concurrency: an upsert (the Store's put) and a primary-key read (its get).
A throwaway PostgreSQL (fsync on) is started here and removed afterwards.

    .venv/bin/python benchmarks/pg_driver_bench.py [--ops 5000] [--concurrency 16]

asyncpg is not a dependency of the gateway; install it to run this (pip install asyncpg).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.machine import machine_info  # noqa: E402
from tests.support.postgres_server import postgres_server  # noqa: E402

SCHEMA = """
CREATE TABLE items (namespace text COLLATE "C", key text, value json NOT NULL,
                    updated_at double precision, PRIMARY KEY (namespace, key))
"""
PUT = (
    "INSERT INTO items (namespace, key, value, updated_at) VALUES ({}, {}, {}, {}) "
    "ON CONFLICT (namespace, key) DO UPDATE SET value = excluded.value, "
    "updated_at = excluded.updated_at"
)
GET = "SELECT value::text, updated_at FROM items WHERE namespace = {} AND key = {}"


async def timed(ops: int, concurrency: int, call: Callable[[int], Awaitable[None]]) -> dict:
    latencies: list[float] = []
    counter = iter(range(ops))

    async def worker() -> None:
        for i in counter:
            t = time.perf_counter()
            await call(i)
            latencies.append(time.perf_counter() - t)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "ops_per_s": ops / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
    }


async def bench_psycopg(url: str, ops: int, concurrency: int) -> dict[str, Any]:
    from psycopg_pool import AsyncConnectionPool

    put = PUT.format("%s", "%s", "%s", "%s")
    get = GET.format("%s", "%s")
    async with AsyncConnectionPool(
        url, min_size=concurrency, max_size=concurrency, kwargs={"autocommit": True}
    ) as pool:

        async def do_put(i: int) -> None:
            async with pool.connection() as conn:
                await conn.execute(put, ("ns", f"k{i}", json.dumps({"i": i}), time.time()))

        async def do_get(i: int) -> None:
            async with pool.connection() as conn:
                cursor = await conn.execute(get, ("ns", f"k{i}"))
                assert await cursor.fetchone() is not None

        return {"put": await timed(ops, concurrency, do_put),
                "get": await timed(ops, concurrency, do_get)}  # fmt: skip


async def bench_asyncpg(url: str, ops: int, concurrency: int) -> dict[str, Any]:
    import asyncpg

    put = PUT.format("$1", "$2", "$3", "$4")
    get = GET.format("$1", "$2")
    pool = await asyncpg.create_pool(url, min_size=concurrency, max_size=concurrency)
    try:

        async def do_put(i: int) -> None:
            async with pool.acquire() as conn:
                await conn.execute(put, "ns", f"k{i}", json.dumps({"i": i}), time.time())

        async def do_get(i: int) -> None:
            async with pool.acquire() as conn:
                assert await conn.fetchrow(get, "ns", f"k{i}") is not None

        return {"put": await timed(ops, concurrency, do_put),
                "get": await timed(ops, concurrency, do_get)}  # fmt: skip
    finally:
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; best kept")
    args = parser.parse_args()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in machine_info().items()))
    best: dict[tuple[str, str], dict[str, float]] = {}
    with postgres_server(durable=True) as server:
        for _ in range(args.rounds):
            for name, bench in (("psycopg", bench_psycopg), ("asyncpg", bench_asyncpg)):
                url = server.create_database()
                import psycopg

                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute(SCHEMA)
                result = asyncio.run(bench(url, args.ops, args.concurrency))
                for op, figures in result.items():
                    kept = best.get((name, op))
                    if kept is None or figures["ops_per_s"] > kept["ops_per_s"]:
                        best[(name, op)] = figures
    print(f"\n| driver | operation | ops/s | p50 ms | p99 ms |  (c={args.concurrency}, "
          f"n={args.ops}, best of {args.rounds})")  # fmt: skip
    print("|---|---|---:|---:|---:|")
    for (name, op), f in sorted(best.items()):
        print(f"| {name} | {op} | {f['ops_per_s']:,.0f} | {f['p50_ms']:.2f} | {f['p99_ms']:.2f} |")


if __name__ == "__main__":
    main()
