"""What one client writing costly Store items does to another client (the parse budget).

    .venv/bin/python benchmarks/parse_fairness_bench.py [--seconds 10] \
        [--gateway-src LABEL=DIR ...] [--out DIR]

For each checkout (default: this one), ``python -m gateway serve`` runs with its built-in
upstreams and in-process counters, pinned to core 0 (``taskset``), with a rule table that
never limits (so only the parse budget acts); this script, on core 1, runs two clients:

* the attacker, bound to 127.0.0.2: ``PUT /store/items`` of a 200 KB item of 49,000
  one-element arrays (the costliest shape to parse and walk, SECURITY.md), back to back,
  one at a time;
* the served client, bound to 127.0.0.3: ``GET /store/items`` of a small item every 5 ms
  (after its answer), first for 2 s alone, then for ``--seconds`` beside the attacker.

Reported per checkout: the served client's answers, p50 / p99 / max latency, alone and
under attack, and the attacker's answers by status. Everything listens on and sends to
127.0.0.1-3 only, bounded in time; the gateway is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.dataplane_bench import free_port  # noqa: E402
from benchmarks.machine import describe  # noqa: E402

ATTACKER, SERVED = "127.0.0.2", "127.0.0.3"
RULES = """\
rules:
  - id: everyone
    description: never reached, so that only the parse budget refuses
    identity: ip
    limits: {us: 1000000000/60, eu: 1000000000/60, us2: 1000000000/60}
"""
COSTLY = (
    '{"namespace":["fair"],"key":"big","value":{"v":[' + ",".join(["[0]"] * 49_000) + "]}}"
).encode()
SMALL = json.dumps({"namespace": ["fair"], "key": "k", "value": {"a": 1}}).encode()
JSON = {"Content-Type": "application/json"}


def _pin(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if shutil.which("taskset") and os.cpu_count() else []


def start_gateway(src: Path, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    rules = tmp / "rules.yaml"
    rules.write_text(RULES)
    port, admin = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(src), "GATEWAY_IDENTITY_SECRET": "p" * 32}
    args = [*_pin(0), sys.executable, "-m", "gateway", "serve", "--port", str(port),
            "--admin-port", str(admin), "--rules", str(rules), "--data-dir", str(tmp / "data"),
            "--access-log", "off"]  # fmt: skip
    log = open(tmp / "gateway.log", "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(args, cwd=src, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"gateway exited: {(tmp / 'gateway.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/ok", timeout=1):  # noqa: S310 (loopback)
                return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("gateway did not become ready")


async def attacker(url: str, stop: float, statuses: dict[int, int]) -> None:
    connector = aiohttp.TCPConnector(local_addr=(ATTACKER, 0), limit=1)
    async with aiohttp.ClientSession(url, connector=connector) as http:
        while time.monotonic() < stop:
            async with http.put("/store/items", data=COSTLY, headers=JSON) as r:
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1


async def served(url: str, stop: float, latencies: list[float]) -> None:
    connector = aiohttp.TCPConnector(local_addr=(SERVED, 0), limit=1)
    async with aiohttp.ClientSession(url, connector=connector) as http:
        while time.monotonic() < stop:
            started = time.perf_counter()
            async with http.get("/store/items", params={"namespace": "fair", "key": "k"}) as r:
                await r.read()
                if r.status != 200:
                    raise SystemExit(f"the served client got {r.status}")
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.005)


def _summary(latencies: list[float]) -> dict[str, Any]:
    ordered = sorted(latencies)

    def ms(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)

    return {"answers": len(ordered), "p50_ms": ms(0.5), "p99_ms": ms(0.99),
            "max_ms": round(ordered[-1] * 1000, 1)}  # fmt: skip


async def measure(url: str, seconds: float) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(local_addr=(SERVED, 0))
    async with (
        aiohttp.ClientSession(url, connector=connector) as http,
        http.put("/store/items", data=SMALL, headers=JSON) as r,
    ):
        assert r.status == 204, await r.text()
    alone: list[float] = []
    await served(url, time.monotonic() + 2, alone)
    attacked: list[float] = []
    statuses: dict[int, int] = {}
    stop = time.monotonic() + seconds
    await asyncio.gather(attacker(url, stop, statuses), served(url, stop, attacked))
    return {"alone": _summary(alone), "under_attack": _summary(attacked),
            "attacker": {str(k): v for k, v in sorted(statuses.items())}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--gateway-src", action="append", default=[], metavar="LABEL=DIR")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not 1 <= args.seconds <= 120:
        parser.error("--seconds is 1 to 120")
    sources = [("this checkout", ROOT)]
    if args.gateway_src:
        sources = []
        for item in args.gateway_src:
            label, sep, directory = item.partition("=")
            if not sep or not Path(directory, "gateway").is_dir():
                raise SystemExit(f"--gateway-src wants LABEL=DIR with DIR/gateway, not {item!r}")
            sources.append((label, Path(directory).resolve()))
    os.sched_setaffinity(0, {1 % (os.cpu_count() or 1)})
    rows = []
    for label, src in sources:
        with tempfile.TemporaryDirectory() as tmp:
            proc, url = start_gateway(src, Path(tmp))
            try:
                result = asyncio.run(measure(url, args.seconds))
            finally:
                proc.terminate()
                proc.wait(20)
        rows.append({"label": label, **result})
        print(label, json.dumps(result), flush=True)
    lines = [
        f"Machine: {describe()}",
        "",
        "| checkout | served alone: answers, p50 / p99 / max ms | served under attack: answers, "
        "p50 / p99 / max ms | attacker's answers |",
        "|---|---|---|---|",
    ]
    for row in rows:
        a, u = row["alone"], row["under_attack"]
        lines.append(
            f"| {row['label']} | {a['answers']}, {a['p50_ms']} / {a['p99_ms']} / {a['max_ms']} "
            f"| {u['answers']}, {u['p50_ms']} / {u['p99_ms']} / {u['max_ms']} "
            f"| {', '.join(f'{k}: {v}' for k, v in row['attacker'].items())} |"
        )
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "parse_fairness.json").write_text(json.dumps(rows, indent=2) + "\n")
        (args.out / "parse_fairness.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
