"""Abuse figures (issue 10, step 4): what floods of hostile clients do to a legitimate one.

    .venv/bin/python benchmarks/abuse_bench.py [--quick] [--pool 16] [--seconds 12]
        [--identities 100000] [--header-flood 1000] [--out benchmarks/results]

The gateway runs as ``python -m gateway serve`` with in-process counters in front of a tiny
aiohttp upstream (its own process), with its upstream pool lowered to ``--pool``
(``GATEWAY_UPSTREAM_POOL_SIZE``) so that 10x the pool is a small flood, and
``GATEWAY_UPSTREAM_TIMEOUT=5`` so a request starved of an upstream connection shows as a
504 inside the window instead of after the default 60 s. Every other limit is the
default (``header_timeout`` 10 s, ``client_idle_timeout`` 75 s, ``body_read_timeout``
60 s, ``max_connections`` 10,000, 64 KiB of a body read before an upstream connection
is taken). Pinning: the gateway on core 0 (``taskset -c 0``), the upstream and this
script (attackers and the legitimate client) on core 1.

Each flood row opens 10x ``--pool`` attacking connections, waits until they are all in
place, then runs a legitimate client for ``--seconds``: a new connection and one
``GET`` every 100 ms (open loop, so a stalled answer does not slow the sampling), each
given 10 s. Reported: its success rate (200), p50 / p99 / max latency, the share answered
within 1 s (the goal), and the gateway's RSS before and at its peak.

* slow body <= 64 KiB: ``POST`` with ``Content-Length: 32768``, then 1 byte/s;
* slow body > 64 KiB: ``Content-Length: 1 MiB``, the first 64 KiB at once, then 1 byte/s
  (a body over 64 KiB streams, so it holds an upstream connection while it trickles);
* slow headers: a request line, then one header byte per second, never the blank line
  (reconnecting whenever the gateway closes);
* idle connections: connect and send nothing;
* header flood (``--header-flood`` connections): ~60 KiB of headers each, never the blank
  line: the RSS this costs;
* distinct identities: ``--identities`` requests each with a new ``x-api-key`` against a
  gateway with the default ``memory_max_keys`` (1,000,000) and one with 10,000: RSS before
  and after (the cap is what bounds counter memory, about 400 bytes per identity).

Output: a Markdown table on stdout; ``abuse.json`` and ``abuse.md`` in ``--out``.
Everything listens on and sends to 127.0.0.1 only; every loop is bounded in count and
time; every process started is stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.dataplane_bench import (  # noqa: E402
    Processes,
    descendants,
    fmt,
    free_port,
    http_ok,
    read_stat,
)
from benchmarks.machine import describe, machine_info  # noqa: E402

PYTHON = sys.executable
IDENTITY_SECRET = "abuse-bench-identity-secret-0123"
UPSTREAM_TIMEOUT = 5  # s: a request starved of an upstream connection answers 504 then
LEGIT_EVERY = 0.1  # s between the legitimate client's requests
LEGIT_TIMEOUT = 10.0  # s a legitimate request is given
GOAL_SECONDS = 1.0
SMALL_BODY = 32 * 1024
LARGE_BODY = 1024 * 1024
PREREAD = 64 * 1024  # what the gateway reads of a body before taking an upstream connection
HEADER_FILL = 60 * 1024  # per header-flood connection, under the 64 KiB head limit
PAGE = os.sysconf("SC_PAGE_SIZE")
RULES = """\
rules:
  - id: per-key
    description: the identity rows (one counter per x-api-key), never reached
    identity: api_key
    limits: {default: 1000000/60}
  - id: everyone
    description: "the attackers and the legitimate client share 127.0.0.1; never reached"
    identity: ip
    limits: {default: 1000000000/60}
"""


# --------------------------------------------------------------------------- the upstream


def serve_upstream(port: int) -> None:
    """The tiny upstream: reads any request body whole, answers a small JSON body."""
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        size = len(await request.read()) if request.body_exists else 0
        return web.json_response({"ok": True, "read": size})

    app = web.Application(client_max_size=LARGE_BODY * 2)
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# --------------------------------------------------------------------------- measurements


def rss_bytes(pid: int) -> int:
    """Resident set size of pid's process tree."""
    total = 0
    for member in descendants(pid):
        if read_stat(member) is None:
            continue
        with contextlib.suppress(OSError):
            pages = int(Path(f"/proc/{member}/statm").read_text().split()[1])
            total += pages * PAGE
    return total


@dataclass
class Row:
    name: str
    attackers: int = 0
    seconds: float = 0.0
    legit_sent: int = 0
    legit_ok: int = 0
    legit_statuses: dict[str, int] = field(default_factory=dict)
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    within_goal: float | None = None  # share of legitimate requests answered 200 within 1 s
    rss_before_mb: float = 0.0
    rss_peak_mb: float = 0.0
    rss_after_mb: float = 0.0
    attacker_notes: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def success(self) -> float | None:
        return None if not self.legit_sent else self.legit_ok / self.legit_sent


async def legit_request(port: int) -> tuple[str, float]:
    """One GET on a new connection: (status or 'timeout'/'error', seconds)."""
    started = time.perf_counter()
    writer = None
    try:
        async with asyncio.timeout(LEGIT_TIMEOUT):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /legit HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            head = await reader.readuntil(b"\r\n")
            status = head.split(b" ", 2)[1].decode()
            await reader.read()
    except TimeoutError:
        status = "timeout"
    except (OSError, asyncio.IncompleteReadError, IndexError):
        status = "error"
    finally:
        if writer is not None:
            writer.close()
    return status, time.perf_counter() - started


async def legit_client(port: int, seconds: float, row: Row) -> None:
    """A request every LEGIT_EVERY seconds for ``seconds``, then wait for the last ones."""
    tasks = []
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        tasks.append(asyncio.create_task(legit_request(port)))
        await asyncio.sleep(LEGIT_EVERY)
    results = await asyncio.gather(*tasks)
    latencies = sorted(t for _, t in results)
    row.legit_sent = len(results)
    for status, _ in results:
        row.legit_statuses[status] = row.legit_statuses.get(status, 0) + 1
    row.legit_ok = row.legit_statuses.get("200", 0)
    row.within_goal = sum(1 for s, t in results if s == "200" and t <= GOAL_SECONDS) / len(results)
    row.p50_ms = statistics.median(latencies) * 1000
    row.p99_ms = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000
    row.max_ms = latencies[-1] * 1000


# --------------------------------------------------------------------------- attackers


class Attack:
    """``count`` attacking connections, each running ``behave`` until ``stop``; those
    the gateway closes reconnect (counted), so the flood keeps its size."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.count = count
        self.stop = asyncio.Event()
        self.connected = 0
        self.notes: dict[str, int] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def note(self, what: str) -> None:
        self.notes[what] = self.notes.get(what, 0) + 1

    def start(self, behave: Callable[[asyncio.StreamWriter], Awaitable[None]]) -> None:
        self.tasks = [asyncio.create_task(self._one(behave)) for _ in range(self.count)]

    async def _one(self, behave: Callable[[asyncio.StreamWriter], Awaitable[None]]) -> None:
        first = True
        while not self.stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                self.note("connect failed")
                await asyncio.sleep(0.2)
                continue
            if first:
                self.connected += 1
                first = False
            else:
                self.note("reconnected")
            sender = asyncio.create_task(behave(writer))
            answer = asyncio.create_task(reader.read(200))
            stopper = asyncio.create_task(self.stop.wait())
            await asyncio.wait({sender, answer, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if answer.done() and not answer.exception():
                data = answer.result()
                self.note(f"answered {data[9:12].decode()}" if data else "closed by gateway")
            elif sender.done() and sender.exception() is not None:
                self.note("write failed")
            for task in (sender, answer, stopper):
                task.cancel()
            await asyncio.gather(sender, answer, stopper, return_exceptions=True)
            writer.close()

    async def ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.connected < self.count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # let the last ones send what they send at once

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def trickle(writer: asyncio.StreamWriter, first: bytes, byte: bytes = b"a") -> None:
    """Send ``first`` at once, then one byte per second (for as long as allowed)."""
    writer.write(first)
    await writer.drain()
    for _ in range(3600):
        await asyncio.sleep(1)
        writer.write(byte)
        await writer.drain()


def slow_body_small(writer: asyncio.StreamWriter) -> Awaitable[None]:
    head = f"POST /upload HTTP/1.1\r\nHost: bench\r\nContent-Length: {SMALL_BODY}\r\n\r\n"
    return trickle(writer, head.encode())


def slow_body_large(writer: asyncio.StreamWriter) -> Awaitable[None]:
    head = f"POST /upload HTTP/1.1\r\nHost: bench\r\nContent-Length: {LARGE_BODY}\r\n\r\n"
    return trickle(writer, head.encode() + b"b" * (PREREAD + 1024))


def slow_headers(writer: asyncio.StreamWriter) -> Awaitable[None]:
    return trickle(writer, b"GET /slow HTTP/1.1\r\nHost: bench\r\nX-Slow: ")


async def idle(writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(3600)


async def header_flood(writer: asyncio.StreamWriter) -> None:
    block = b"GET /h HTTP/1.1\r\nHost: bench\r\n"
    line = b"X-Fill-%d: " + b"f" * 7900 + b"\r\n"
    n = 0
    while len(block) + len(line) < HEADER_FILL:
        block += line.replace(b"%d", str(n).encode())
        n += 1
    writer.write(block)  # and never the blank line that ends the head
    await writer.drain()
    await asyncio.sleep(3600)


# --------------------------------------------------------------------------- the run


def can_pin() -> bool:
    """Cores 0 and 1 are both ours and taskset is there: the gateway gets core 0."""
    return {0, 1} <= os.sched_getaffinity(0) and shutil.which("taskset") is not None


class Bench(contextlib.AbstractContextManager["Bench"]):
    """One run: its processes and files, all stopped and removed when the block ends
    (also on Ctrl-C or SIGTERM)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.pin = can_pin()
        self.tmp = Path(tempfile.mkdtemp(prefix="abuse-bench-"))
        self.procs = Processes(self.tmp, self.pin)
        self.rules = self.tmp / "rules.yaml"
        self.rules.write_text(RULES)
        self.upstream_port = 0
        self.done: list[Row] = []

    def __exit__(self, *exc_info: object) -> None:
        self.procs.stop_all()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def start_upstream(self) -> None:
        self.upstream_port = free_port()
        proc = self.procs.start(
            "upstream", [PYTHON, __file__, "--serve-upstream", str(self.upstream_port)], "1"
        )
        url = f"http://127.0.0.1:{self.upstream_port}/ok"
        self.procs.wait_ready(proc, lambda: http_ok(url), "upstream")

    def start_gateway(self, name: str, upstream: bool, **env: str) -> tuple[Any, int]:
        port, admin = free_port(), free_port()
        cmd = [PYTHON, "-m", "gateway", "serve", "--no-embedded", "--rules", str(self.rules),
               "--data-dir", str(self.tmp / name), "--port", str(port),
               "--admin-port", str(admin), "--access-log", "off"]  # fmt: skip
        if upstream:
            cmd += ["--upstream", f"http://127.0.0.1:{self.upstream_port}"]
        full_env = {
            **os.environ,
            "GATEWAY_IDENTITY_SECRET": IDENTITY_SECRET,
            "GATEWAY_UPSTREAM_POOL_SIZE": str(self.args.pool),
            "GATEWAY_UPSTREAM_TIMEOUT": str(UPSTREAM_TIMEOUT),
            "GATEWAY_WATCH_RULES": "false",
            **env,
        }
        proc = self.procs.start(name, cmd, "0", env=full_env, cwd=ROOT)
        self.procs.wait_ready(proc, lambda: http_ok(f"http://127.0.0.1:{port}/ok"), name)
        return proc, port

    async def flood_row(
        self,
        name: str,
        behave: Callable[[asyncio.StreamWriter], Awaitable[None]] | None,
        count: int,
    ) -> Row:
        proc, port = self.start_gateway(f"flood-{len(self.done)}", upstream=True)
        row = Row(name, attackers=count if behave else 0, seconds=self.args.seconds)
        try:
            row.rss_before_mb = rss_bytes(proc.pid) / 2**20
            attack = Attack(port, count)
            if behave is not None:
                attack.start(behave)
                await attack.ready()
            peak = 0
            sampling = True

            async def sample() -> None:
                nonlocal peak
                while sampling:
                    peak = max(peak, rss_bytes(proc.pid))
                    await asyncio.sleep(0.2)

            sampler = asyncio.create_task(sample())
            await legit_client(port, self.args.seconds, row)
            sampling = False
            await sampler
            if behave is not None:
                if attack.connected < count:
                    row.notes.append(f"only {attack.connected} of {count} attackers connected")
                await attack.close()
            row.attacker_notes = attack.notes
            row.rss_peak_mb = peak / 2**20
            row.rss_after_mb = rss_bytes(proc.pid) / 2**20
        finally:
            self.procs.stop(proc)
        return row

    async def identities_row(self, max_keys: int | None) -> Row:
        """``--identities`` requests, each with its own x-api-key, on 64 keep-alive
        connections, against a gateway with no upstream (it answers 404 itself after
        counting, so the cost measured is the gateway's)."""
        env = {} if max_keys is None else {"GATEWAY_MEMORY_MAX_KEYS": str(max_keys)}
        label = "default 1,000,000" if max_keys is None else f"{max_keys:,}"
        tag = "ids-default" if max_keys is None else f"ids-{max_keys}"
        proc, port = self.start_gateway(tag, upstream=False, **env)
        row = Row(f"{self.args.identities:,} distinct identities (memory_max_keys {label})")
        try:
            row.rss_before_mb = rss_bytes(proc.pid) / 2**20
            total = self.args.identities
            per_connection = -(-total // 64)
            statuses: dict[str, int] = {}
            marks = {total * q // 4 for q in (1, 2, 3)}
            by_mark: list[str] = []  # RSS after each quarter of the identities
            sent = 0
            started = time.monotonic()

            async def connection(n: int) -> None:
                nonlocal sent
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                try:
                    for i in range(n * per_connection, min(total, (n + 1) * per_connection)):
                        writer.write(
                            b"GET /id HTTP/1.1\r\nHost: bench\r\nx-api-key: key-%d\r\n\r\n" % i
                        )
                        head = await reader.readuntil(b"\r\n\r\n")
                        status = head[9:12].decode()
                        statuses[status] = statuses.get(status, 0) + 1
                        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                        await reader.readexactly(length)
                        sent += 1
                        if sent in marks:
                            by_mark.append(f"{sent:,}: {rss_bytes(proc.pid) / 2**20:.0f}")
                finally:
                    writer.close()

            async with asyncio.timeout(600):
                await asyncio.gather(*(connection(n) for n in range(64)))
            row.seconds = time.monotonic() - started
            row.legit_sent = total
            row.legit_statuses = statuses
            row.legit_ok = statuses.get("404", 0)  # counted, then "no upstream serves /id"
            row.rss_after_mb = rss_bytes(proc.pid) / 2**20
            row.rss_peak_mb = row.rss_after_mb
            by_mark.append(f"{total:,}: {row.rss_after_mb:.0f}")
            grown = (row.rss_after_mb - row.rss_before_mb) * 2**20
            row.notes.append(f"RSS MiB after {', '.join(by_mark)}")
            row.notes.append(f"{grown / total:.0f} bytes of RSS per identity")
        finally:
            self.procs.stop(proc)
        return row

    async def run(self) -> list[Row]:
        count = 10 * self.args.pool
        self.start_upstream()
        plan: list[tuple[str, Any, int]] = [
            ("baseline: no attack", None, 0),
            ("slow body <= 64 KiB (32 KiB at 1 B/s)", slow_body_small, count),
            ("slow body > 64 KiB (64 KiB, then 1 B/s)", slow_body_large, count),
            ("slow headers (1 B/s, never ending)", slow_headers, count),
            ("idle connections", idle, count),
            ("header flood (~60 KiB heads, never ending)", header_flood, self.args.header_flood),
        ]
        for name, behave, attackers in plan:
            print(f"- {name} ...", file=sys.stderr, flush=True)
            self.done.append(await self.flood_row(name, behave, attackers))
        for max_keys in (None, 10_000):
            print(f"- identities, memory_max_keys={max_keys} ...", file=sys.stderr, flush=True)
            self.done.append(await self.identities_row(max_keys))
        return self.done


# --------------------------------------------------------------------------- output


def markdown(rows: list[Row]) -> str:
    lines = [
        "| row | attackers | legit OK | p50 ms | p99 ms | max ms | within 1 s "
        "| RSS before → peak → after (MiB) | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = "—" if r.success is None else f"{r.success:.0%} of {r.legit_sent:,}"
        others = {k: v for k, v in r.legit_statuses.items() if k not in ("200",)}
        notes = list(r.notes)
        if others and not r.name.startswith(f"{r.legit_sent:,}"):
            notes.append("legit answers: " + ", ".join(f"{k}: {v}" for k, v in others.items()))
        if r.attacker_notes:
            told = r.attacker_notes.items()
            notes.append("attackers: " + ", ".join(f"{k}: {v}" for k, v in told))
        within = "—" if r.within_goal is None else f"{r.within_goal:.0%}"
        lines.append(
            f"| {r.name} | {r.attackers or '—'} | {ok} | {fmt(r.p50_ms, '.1f')} "
            f"| {fmt(r.p99_ms, '.1f')} | {fmt(r.max_ms, ',.0f')} | {within} "
            f"| {r.rss_before_mb:.0f} → {r.rss_peak_mb:.0f} → {r.rss_after_mb:.0f} "
            f"| {'; '.join(notes)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short windows, 20k identities")
    parser.add_argument("--pool", type=int, default=16, help="upstream pool size (attackers: 10x)")
    parser.add_argument("--seconds", type=float, default=None, help="legit window per row")
    parser.add_argument("--identities", type=int, default=None, help="distinct API keys")
    parser.add_argument("--header-flood", type=int, default=None, help="header-flood connections")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream)
        return
    args.seconds = args.seconds or (4.0 if args.quick else 12.0)
    args.identities = args.identities or (20_000 if args.quick else 100_000)
    args.header_flood = args.header_flood or (300 if args.quick else 1000)
    if not (1 <= args.pool <= 1000 and 0 < args.seconds <= 120 and 0 < args.identities <= 10**6):
        parser.error("--pool 1..1000, --seconds up to 120, --identities up to 1,000,000")
    # Thousands of sockets here and in the gateway (which inherits the limit).
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # ends the run as Ctrl-C does
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    started = time.monotonic()
    with Bench(args) as bench:
        if bench.pin:  # attackers and the legitimate client stay off the gateway's core
            os.sched_setaffinity(0, {1})
        else:
            print("warning: not pinned (cores 0 and 1 not both ours, or no taskset)",
                  file=sys.stderr)  # fmt: skip
        try:
            rows = asyncio.run(bench.run())
        except KeyboardInterrupt:
            print("interrupted: every process started here is stopped", file=sys.stderr)
            raise SystemExit(130) from None
    elapsed = time.monotonic() - started
    pinning = (
        "gateway on core 0; upstream, attackers and client on core 1"
        if bench.pin
        else ("not pinned")
    )
    header = [
        f"machine: {describe()}",
        f"pinning: {pinning}",
        f"gateway: in-process counters, upstream pool {args.pool}, upstream_timeout "
        f"{UPSTREAM_TIMEOUT} s, other limits default; attackers per flood row: "
        f"{10 * args.pool} (10x the pool), header flood: {args.header_flood}",
        f"legit client: a new connection and GET every {LEGIT_EVERY * 1000:.0f} ms for "
        f"{args.seconds:g} s, {LEGIT_TIMEOUT:g} s each; goal: answered within "
        f"{GOAL_SECONDS:g} s; run took {elapsed:.0f} s{' (--quick)' if args.quick else ''}",
        f"machine load average when it started: {' '.join(load_before)} (other work shares "
        "these cores: read the latencies as an upper bound)",
    ]
    table = markdown(rows)
    print("\n".join(header) + "\n\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "abuse.md").write_text("\n".join(f"* {h}" for h in header) + "\n\n" + table + "\n")
    payload = {
        "machine": describe(),
        "machine_info": machine_info(),
        "pinning": pinning,
        "settings": {
            "quick": args.quick,
            "pool": args.pool,
            "attackers": 10 * args.pool,
            "header_flood": args.header_flood,
            "seconds": args.seconds,
            "identities": args.identities,
            "upstream_timeout": UPSTREAM_TIMEOUT,
            "legit_every_s": LEGIT_EVERY,
            "legit_timeout_s": LEGIT_TIMEOUT,
        },
        "rows": [asdict(r) | {"success": r.success} for r in rows],
    }
    (args.out / "abuse.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.out}/abuse.{{json,md}}", file=sys.stderr)


if __name__ == "__main__":
    main()
