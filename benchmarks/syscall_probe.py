"""System calls, CPU and sleeps per request of the gateway and the reference relay, read
from ``/proc`` while ``dataplane_load.py`` drives them: what a profile cannot say per
request.

    .venv/bin/python benchmarks/syscall_probe.py --gateway-src /tmp/build/src \\
        [--rows gateway,gateway-redis,relay,relay-redis] [--seconds 5] [--perf DIR]

Each row starts its server on core 0 (nginx, redis-server and the load generator on core
1, as ``dataplane_bench.py`` pins them), warms it up for two seconds, then reads the
server's ``/proc/PID/io`` (``syscr``/``syscw``: read and write system calls),
``/proc/PID/stat`` (CPU) and ``/proc/PID/status`` (voluntary context switches: how often
it slept in ``epoll_wait``) before and after ``--seconds`` of load, and prints them per
request. Redis rows also print Redis's own ``EVALSHA`` count and time a call (warm-up
included). ``--perf DIR`` records each row's measured window with ``perf record -g``
(cpu-clock, from core 1) into ``DIR/<row>.perf``.

The shipped rules, default settings, 50 connections from 50 loopback addresses, 1,000 API
keys, ``GET /auth/bench``: ``dataplane_bench.py``'s proxied rows. Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.dataplane_bench import (  # noqa: E402
    IDENTITY_SECRET,
    LOADGEN,
    NGINX_CONF,
    PYTHON,
    RELAY,
    SHIPPED_PROXY_PATH,
    body_104,
    free_port,
    serve_command,
    tcp_open,
)
from benchmarks.machine import describe  # noqa: E402

ROWS = ("gateway", "gateway-redis", "relay", "relay-redis")


def wait_open(port: int, what: str) -> None:
    deadline = time.monotonic() + 20
    while not tcp_open(port):
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not listen on 127.0.0.1:{port}")
        time.sleep(0.05)


def readings(pid: int) -> tuple[int, int, float, int]:
    """Read and write system calls, CPU seconds and voluntary context switches so far."""
    io = dict(
        line.split(": ", 1) for line in Path(f"/proc/{pid}/io").read_text().splitlines() if line
    )
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    switches = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("voluntary_ctxt_switches")
    )
    return int(io["syscr"]), int(io["syscw"]), cpu, switches


def redis_cli(port: int, *args: str) -> str:
    done = subprocess.run(
        ["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=10
    )
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gateway-src", required=True, help="a build's directory (pip wheel, unpacked)"
    )
    parser.add_argument(
        "--rows", default=",".join(ROWS), help=f"comma-separated: {', '.join(ROWS)}"
    )
    parser.add_argument("--seconds", type=int, default=5, help="measured seconds a row")
    parser.add_argument("--perf", type=Path, help="record each row with perf record -g here")
    args = parser.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    for row in rows:
        if row not in ROWS:
            parser.error(f"unknown row {row!r} ({', '.join(ROWS)})")
    if not 1 <= args.seconds <= 60:
        parser.error("--seconds: 1 to 60")
    src = Path(args.gateway_src).resolve()
    if not (src / "gateway" / "__init__.py").exists():
        parser.error(f"--gateway-src {src}: no gateway/ there")
    if args.perf and not shutil.which("perf"):
        parser.error("--perf needs perf (Debian: linux-perf)")
    rules = src / "rules" if (src / "rules").is_dir() else ROOT / "rules"
    print(describe())

    tmp = Path(tempfile.mkdtemp(prefix="syscall-probe-"))
    procs: list[subprocess.Popen[bytes]] = []

    def start(cmd: list[str], cpu: int, **kw: object) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            ["taskset", "-c", str(cpu), *cmd],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            **kw,  # type: ignore[call-overload]
        )
        procs.append(proc)
        return proc

    try:
        (tmp / "nginx").mkdir()
        nginx_port = free_port()
        conf = tmp / "nginx" / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=tmp / "nginx", port=nginx_port, body=body_104()))
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        start([nginx, "-p", str(tmp / "nginx"), "-c", str(conf)], 1)
        wait_open(nginx_port, "nginx")
        upstream = f"http://127.0.0.1:{nginx_port}"
        redis_port = free_port()
        if any(r.endswith("redis") for r in rows):
            start(
                [
                    "redis-server",
                    "--port",
                    str(redis_port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ],
                1,
            )
            wait_open(redis_port, "redis-server")
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env["GATEWAY_IDENTITY_SECRET"] = IDENTITY_SECRET
        env["PYTHONPATH"] = str(src)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"

        commands: dict[str, Callable[[int], list[str]]] = {
            "gateway": lambda port: gateway_cmd(port, upstream, rules, tmp, []),
            "gateway-redis": lambda port: gateway_cmd(
                port, upstream, rules, tmp, ["--redis-url", redis_url]
            ),
            "relay": lambda port: [PYTHON, str(RELAY), str(port), upstream, "memory"],
            "relay-redis": lambda port: [
                PYTHON,
                str(RELAY),
                str(port),
                upstream,
                "redis-pipelined",
                redis_url,
            ],
        }
        print(
            "| row | req/s | read calls/req | write calls/req | CPU µs/req | sleeps/req | Redis |"
        )
        print("|---|---:|---:|---:|---:|---:|---|")
        for row in rows:
            port = free_port()
            is_gateway = row.startswith("gateway")
            server = start(
                commands[row](port),
                0,
                env=env if is_gateway else None,
                cwd=src if is_gateway else None,
            )
            wait_open(port, row)
            if row.endswith("redis"):
                redis_cli(redis_port, "FLUSHALL")

            def load(seconds: int, row: str = row, port: int = port) -> dict[str, float]:
                done = subprocess.run(
                    [
                        "taskset",
                        "-c",
                        "1",
                        PYTHON,
                        str(LOADGEN),
                        f"http://127.0.0.1:{port}{SHIPPED_PROXY_PATH}",
                        str(seconds),
                        "50",
                        f"probe-{row}-{int(time.time())}",
                        "1000",
                        "0",
                        "sources=50",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=seconds + 60,
                    check=True,
                )
                result: dict[str, float] = json.loads(done.stdout)
                return result

            load(2)
            recorder = None
            if args.perf:
                args.perf.mkdir(parents=True, exist_ok=True)
                recorder = subprocess.Popen(
                    [
                        "taskset",
                        "-c",
                        "1",
                        "perf",
                        "record",
                        "-g",
                        "-F",
                        "2000",
                        "-p",
                        str(server.pid),
                        "-o",
                        str(args.perf / f"{row}.perf"),
                        "--",
                        "sleep",
                        str(max(1, args.seconds - 1)),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            before = readings(server.pid)
            out = load(args.seconds)
            after = readings(server.pid)
            if recorder is not None:
                recorder.wait(30)
            n = out["requests"]
            reads, writes, cpu, sleeps = (b - a for a, b in zip(before, after, strict=True))
            evalsha = ""
            if row.endswith("redis"):
                stats = redis_cli(redis_port, "INFO", "commandstats")
                evalsha = next(
                    (
                        line.split(":", 1)[1]
                        for line in stats.split()
                        if line.startswith("cmdstat_evalsha")
                    ),
                    "",
                )
                redis_cli(redis_port, "CONFIG", "RESETSTAT")
            print(
                f"| {row} | {n / args.seconds:,.0f} | {reads / n:.2f} | {writes / n:.2f} | "
                f"{cpu * 1e6 / n:.1f} | {sleeps / n:.3f} | {evalsha} |",
                flush=True,
            )
            server.terminate()
            server.wait(10)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def gateway_cmd(port: int, upstream: str, rules: Path, tmp: Path, extra: list[str]) -> list[str]:
    data = tmp / f"data-{port}"
    return [
        *serve_command(PYTHON, upstream, port, free_port(), data),
        "--rules",
        str(rules),
        *extra,
    ]


if __name__ == "__main__":
    main()
