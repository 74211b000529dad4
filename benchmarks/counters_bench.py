"""Limit checks per second against Redis, with and without coalescing, side by side.

Starts its own redis-server on a free loopback port, then for each concurrency level
runs the same closed loop (N tasks, each checking a limit for its own identity, every
check admitted) through:

* ``direct``    -- ``RedisBackend.hit``: one EVALSHA round trip per check, pooled
                   connections (at most 32);
* ``coalesced`` -- ``CoalescingBackend(RedisBackend)``: checks that arrive while a
                   pipeline is in flight go out together in the next one;
* ``stack``     -- what ``open_counter_backend`` builds: deny cache, breaker with a
                   50 ms timeout, coalescing.

Reports checks/s, ratio to ``direct``, round trips per check, EVALSHA calls and all
Redis commands per check (``INFO commandstats`` counts the commands the script runs
inside Redis too: TIME, then per limit GET and, when counted, SETRANGE), and call
latency percentiles; ``local %`` is the share of answers the stack took locally
(fallback after a 50 ms timeout) instead of from Redis. Bounded: about 35 s.

    .venv/bin/python benchmarks/counters_bench.py [--seconds 3] [--concurrency 16,256]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from redis.asyncio import BlockingConnectionPool, Redis  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402
from gateway.counters.base import CounterBackend, LimitCheck  # noqa: E402
from gateway.counters.coalesce import CoalescingBackend  # noqa: E402
from gateway.counters.factory import (  # noqa: E402
    open_counter_backend,
    parse_counter_url,
    redis_client,
)
from gateway.counters.redis_backend import RedisBackend  # noqa: E402
from tests.support.redis_servers import RedisServer  # noqa: E402


def machine_info(server: RedisServer) -> str:
    cpu = cpu_model()
    version = next(
        (
            line.split(":", 1)[1].strip()
            for line in server.cli("INFO", "server").splitlines()
            if line.startswith("redis_version")
        ),
        "?",
    )
    return (
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs ({cpu})\n"
        f"python {platform.python_version()}, event loop {asyncio.get_event_loop_policy()!r}\n"
        f"redis-server {version} on 127.0.0.1 (same machine, loopback)"
    )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_loop(backend: CounterBackend, concurrency: int, seconds: float) -> dict[str, Any]:
    stop = False
    latencies: list[float] = []
    counted = 0
    not_admitted = 0
    not_redis = 0

    async def worker(n: int) -> None:
        nonlocal counted, not_admitted, not_redis
        check = LimitCheck(
            f"rl:{{us:bench:{n:08x}}}:60s", limit=10**9, window_ms=60_000, bucket_ms=1_000
        )
        while not stop:
            started = time.perf_counter()
            result = await backend.hit([check])
            latencies.append(time.perf_counter() - started)
            counted += 1
            not_admitted += not result.admitted
            not_redis += result.source != "redis"
            # Local answers (fallback, deny cache) complete without suspending; yield
            # so the loop stays fair, as a server's request handling would.
            await asyncio.sleep(0)

    tasks = [asyncio.create_task(worker(n)) for n in range(concurrency)]
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    stop = True
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - started
    return {
        "checks": counted,
        "rate": counted / elapsed,
        "p50_ms": percentile(latencies, 0.5) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "mean_ms": statistics.fmean(latencies) * 1000 if latencies else 0.0,
        "refused": not_admitted,
        "not_redis": not_redis / max(1, counted),
    }


def commands(server: RedisServer) -> tuple[int, int]:
    """(EVALSHA calls, all commands including those the script runs inside Redis)."""
    stats = server.commandstats()
    total = sum(calls for name, calls in stats.items() if name not in ("info", "config|resetstat"))
    return stats.get("evalsha", 0), total


async def measure(
    server: RedisServer, mode: str, concurrency: int, seconds: float
) -> dict[str, Any]:
    store = RedisBackend(redis_client(parse_counter_url(server.url)), name="bench")
    backend: CounterBackend
    if mode == "direct":
        # Without coalescing every check in flight needs its own connection.
        await store.close()
        pool = BlockingConnectionPool(
            host="127.0.0.1", port=server.port, max_connections=concurrency, timeout=10
        )
        store = RedisBackend(Redis.from_pool(pool), name="bench")
        backend = store
    elif mode == "coalesced":
        backend = CoalescingBackend(store)
    else:
        backend = open_counter_backend(server.url, region="us")
        store = backend.inner.inner.inner  # type: ignore[attr-defined]
    await store.load_script()
    await run_loop(backend, concurrency, min(0.5, seconds / 4))  # warm connections
    server.cli("CONFIG", "RESETSTAT")
    trips = store.round_trips
    result = await run_loop(backend, concurrency, seconds)
    result["round_trips_per_check"] = (store.round_trips - trips) / max(1, result["checks"])
    evalsha, total = commands(server)
    result["evalsha_per_check"] = evalsha / max(1, result["checks"])
    result["commands_per_check"] = total / max(1, result["checks"])
    await backend.close()
    return result


async def main_async(seconds: float, levels: list[int]) -> None:
    base = Path(tempfile.mkdtemp(prefix="counters-bench-"))
    server = RedisServer(base / "redis").start()
    try:
        print(machine_info(server))
        print(f"{seconds:g} s per run; one limit per check; every check admitted\n")
        header = (
            f"{'concurrency':>11} {'mode':>10} {'checks/s':>10} {'x direct':>9} "
            f"{'trips/check':>12} {'evalsha/chk':>11} {'cmds/check':>11} {'p50 ms':>8} "
            f"{'p99 ms':>8} {'local %':>8}"
        )
        print(header)
        print("-" * len(header))
        for concurrency in levels:
            direct_rate = 0.0
            for mode in ("direct", "coalesced", "stack"):
                r = await measure(server, mode, concurrency, seconds)
                if mode == "direct":
                    direct_rate = r["rate"]
                ratio = r["rate"] / direct_rate if direct_rate else 0.0
                print(
                    f"{concurrency:>11} {mode:>10} {r['rate']:>10.0f} {ratio:>9.2f} "
                    f"{r['round_trips_per_check']:>12.3f} {r['evalsha_per_check']:>11.3f} "
                    f"{r['commands_per_check']:>11.3f} "
                    f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {100 * r['not_redis']:>8.2f}",
                    flush=True,
                )
                assert r["refused"] == 0
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each run")
    parser.add_argument("--concurrency", default="1,16,256", help="comma-separated levels")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not 0 < args.seconds <= 10 or not levels or any(not 0 < n <= 2048 for n in levels):
        parser.error("--seconds must be in (0, 10] and each concurrency in 1..2048")
    asyncio.run(main_async(args.seconds, levels))


if __name__ == "__main__":
    main()
