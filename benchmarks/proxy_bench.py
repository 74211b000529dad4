"""Proxy throughput side by side: direct, gateway without limiting, in-process counters,
Redis counters — one run, same machine, reported as ratios; plus Redis commands per
proxied request.

    .venv/bin/python benchmarks/proxy_bench.py [--seconds 5] [--concurrency 32]

Everything runs on 127.0.0.1: an upstream process, the gateway process under test and a
load-generator process (aiohttp, keep-alive connections). Traffic is bounded by time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402
from tests.support.redis_servers import RedisServer, free_port  # noqa: E402

UPSTREAM = textwrap.dedent(
    """
    import sys
    from aiohttp import web
    async def ok(request):
        return web.Response(body=b'{"ok":true}', content_type="application/json")
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", ok)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
    """
)

LOAD = textwrap.dedent(
    """
    import asyncio, json, sys, time
    import aiohttp
    url, seconds, concurrency, key = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    async def main():
        latencies, statuses = [], {}
        stop = time.perf_counter() + seconds
        conn = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=conn) as http:
            async def worker(n):
                headers = {"x-api-key": f"{key}-{n}"}
                while time.perf_counter() < stop:
                    t = time.perf_counter()
                    async with http.get(url, headers=headers) as r:
                        await r.read()
                    latencies.append(time.perf_counter() - t)
                    statuses[r.status] = statuses.get(r.status, 0) + 1
            start = time.perf_counter()
            await asyncio.gather(*(worker(n) for n in range(concurrency)))
            elapsed = time.perf_counter() - start
        latencies.sort()
        print(json.dumps({
            "requests": len(latencies), "rps": len(latencies) / elapsed,
            "p50_ms": 1000 * latencies[len(latencies) // 2],
            "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
            "statuses": statuses,
        }))
    asyncio.run(main())
    """
)

UNLIMITED = "rules:\n  - {id: everything, unlimited: true}\n"
LIMITED = "rules:\n  - {id: per-key, identity: api_key, limits: {default: 100000000/60}}\n"


def wait_ok(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):  # noqa: S310 - loopback only
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def run_load(url: str, seconds: float, concurrency: int, key: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", LOAD, url, str(seconds), str(concurrency), key],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def start_gateway(tmp: Path, upstream: str, rules: str, redis_url: str | None):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "gateway",
        "serve",
        "--no-embedded",
        "--upstream",
        upstream,
        "--rules",
        str(tmp / rules),
        "--port",
        str(port),
        "--admin-port",
        "0",
        "--data-dir",
        str(tmp / "data"),
        "--access-log",
        "off",
        "--log-level",
        "WARNING",
    ]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    wait_ok(f"http://127.0.0.1:{port}/ok")
    return proc, f"http://127.0.0.1:{port}/bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; configurations alternate")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    redis = RedisServer(tmp / "redis").start()
    try:
        up_port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-c", UPSTREAM, str(up_port)]))
        upstream = f"http://127.0.0.1:{up_port}"
        wait_ok(upstream + "/ok")
        (tmp / "unlimited.yaml").write_text(UNLIMITED)
        (tmp / "limited.yaml").write_text(LIMITED)
        configs = [("direct to upstream (no gateway)", upstream + "/bench")]
        for name, rules, redis_url in [
            ("gateway, no limiting (unlimited rule)", "unlimited.yaml", None),
            ("gateway, in-process counters", "limited.yaml", None),
            ("gateway, Redis counters", "limited.yaml", redis.url),
        ]:
            proc, url = start_gateway(tmp, upstream, rules, redis_url)
            procs.append(proc)
            configs.append((name, url))
        # Rounds alternate the configurations so that a burst of load from elsewhere on a
        # shared machine hits all of them alike; the median round is reported.
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in configs}
        for _ in range(args.rounds):
            for name, url in configs:
                before = redis.commandstats()
                result = run_load(url, args.seconds, args.concurrency, name[:8])
                after = redis.commandstats()
                # INFO commandstats also counts the commands a script runs inside Redis;
                # the round trips are the EVALSHA calls, one per request at most.
                n = max(1, int(result["requests"]))
                result["redis_commands_per_request"] = (
                    sum(after.values()) - sum(before.values())
                ) / n
                result["scripts_per_request"] = (
                    sum(after.get(c, 0) - before.get(c, 0) for c in ("evalsha", "eval")) / n
                )
                runs[name].append(result)
        results = [
            (name, sorted(runs[name], key=lambda r: r["rps"])[len(runs[name]) // 2])
            for name, _ in configs
        ]
        base = results[1][1]["rps"]
        print(f"machine: {describe()}")
        print(
            f"load: {args.concurrency} keep-alive connections; {args.rounds} rounds of "
            f"{args.seconds:.0f} s per configuration, alternating, median round shown; "
            "upstream, gateways and load generator on one host"
        )
        print(
            f"{'configuration':42} {'req/s':>8} {'vs no-limit':>11} {'p50 ms':>7} "
            f"{'p99 ms':>7} {'EVALSHA/req':>11} {'cmds/req':>8}"
        )
        for name, r in results:
            print(
                f"{name:42} {r['rps']:8.0f} {r['rps'] / base:11.2f} {r['p50_ms']:7.2f} "
                f"{r['p99_ms']:7.2f} {r['scripts_per_request']:11.2f} "
                f"{r['redis_commands_per_request']:8.2f}"
            )
    finally:
        for proc in procs:
            proc.terminate()
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
