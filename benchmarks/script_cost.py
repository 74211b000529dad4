"""Redis's own CPU per sliding-window call, for two versions of the script side by side.

What a gateway with Redis counters costs the store: each request is one ``EVALSHA`` of
``gateway/counters/lua/sliding_window.lua`` over a rule's key and the per-address
ceiling's. This starts its own ``redis-server`` pinned to core 1 (the client on core 0),
and for each script offers the same paced load: ``--rate`` calls a second, each over
one of ``--keys`` rule keys (2000 per 10 s, round-robin: a few calls a second per key,
so its window holds a few buckets) and one of ``--addresses`` ceiling keys (36000 per
10 s: every bucket of the window in use), as the shipped table does under the data-plane
benchmark. It reports the server's CPU µs per call (``/proc/<pid>/stat``) in 2-second
rounds: the first round is a fresh window, the rounds after ``--window`` seconds are
what a running gateway sees, each window holding its buckets. Also Redis's own timing
of the script calls (``INFO commandstats``, ``usec`` of ``evalsha``: microseconds, finer
than the CPU ticks, for steps of a microsecond or two) and the commands the script runs
per call. Bounded: ``--seconds`` per script.

    .venv/bin/python benchmarks/script_cost.py      # HEAD's script and the working tree's
    .venv/bin/python benchmarks/script_cost.py --script before=72e7b48 \
        --script after=gateway/counters/lua/sliding_window.lua

A ``--script`` is ``label=FILE`` or ``label=COMMIT`` (the script as it was at that commit);
``label@N=...`` sends N requests in each script call (a script that takes several, as
the gateway's pipelines to one server do), else one.
The key names are the benchmark's own (``bench:{...}``), the same for every script.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402
from benchmarks.script_instructions import (  # noqa: E402
    LIMITS,
    PACKED,
    add_load_options,
    packed_limits,
)
from tests.support.redis_servers import free_port  # noqa: E402

SCRIPT = "gateway/counters/lua/sliding_window.lua"
ROUND_SECONDS = 2.0
PIPELINE = 50  # calls per pipeline, as the gateway's coalescer sends them under load
EMPTY = "return {1, 0, 1, 1999, 10000, 1, 35999, 10000}"


def load_script(spec: str) -> tuple[str, str]:
    label, _, where = spec.partition("=")
    if not where:
        raise SystemExit(f"--script {spec!r}: want label=FILE or label=COMMIT")
    path = Path(where)
    if path.is_file():
        return label, path.read_text()
    shown = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{where}:{SCRIPT}"], capture_output=True, text=True
    )
    if shown.returncode != 0:
        raise SystemExit(
            f"--script {spec!r}: no file {where} and no commit: {shown.stderr.strip()}"
        )
    return label, shown.stdout


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_script(
    client: redis.Redis, pid: int, label: str, text: str, args: argparse.Namespace
) -> list[dict[str, float]]:
    # Three generations of the script's ARGV: today's, one string of packed doubles a
    # request (``packed``); before it, each request's key count then four decimal values
    # a key (``counted_args``); the first, one request a call, four values a key.
    # "label@N": N requests a call.
    counted_args = "local nargs = #ARGV" in text
    packed = packed_limits(text)  # one string of doubles a request (since issue 27)
    per_call = int(label.partition("@")[2] or 1)
    if per_call > 1 and not counted_args:
        raise SystemExit(f"{label}: this script takes one request a call")
    client.flushall()
    client.config_resetstat()
    sha = client.script_load(text)
    rounds: list[dict[str, float]] = []
    started = time.monotonic()
    sent = 0
    while time.monotonic() - started < args.seconds:
        cpu0, round_start, calls0 = cpu_seconds(pid), time.monotonic(), sent
        while time.monotonic() - round_start < ROUND_SECONDS:
            # Paced: the same calls a second for every script, so the windows fill alike.
            due = int((time.monotonic() - started) * args.rate)
            if due - sent < PIPELINE:
                time.sleep(0.0005)
                continue
            pipe = client.pipeline(transaction=False)
            todo = min(PIPELINE, due - sent)
            while todo > 0:
                # ``per_call`` requests in one call (a script that takes several), each
                # a rule's key and its ceiling's
                keys: list[str] = []
                argv: list[int | bytes] = []
                for _ in range(min(per_call, todo)):
                    keys += [f"bench:{{k{sent % args.keys}}}:rule",
                             f"bench:{{a{sent % args.addresses}}}:ceiling"]  # fmt: skip
                    if packed:
                        argv.append(PACKED)
                    else:
                        argv += [2] if counted_args else []
                        argv += LIMITS
                    sent += 1
                    todo -= 1
                pipe.evalsha(sha, len(keys), *keys, *argv)
            pipe.execute()
        calls = sent - calls0
        elapsed = time.monotonic() - round_start
        stats = client.info("commandstats")
        client.config_resetstat()
        evals = stats.get("cmdstat_evalsha", {}).get("calls", 0) or 1
        # Redis's own timing of the script calls (their run, not the protocol around
        # them): microseconds, so far finer than the process's CPU ticks above.
        script_us = stats.get("cmdstat_evalsha", {}).get("usec", 0)
        inner = {
            name.removeprefix("cmdstat_"): round(value["calls"] / evals, 2)
            for name, value in stats.items()
            if name not in ("cmdstat_evalsha", "cmdstat_info", "cmdstat_config|resetstat")
        }
        rounds.append(
            {
                "at": round(time.monotonic() - started, 1),
                "rate": calls / elapsed,
                "us": (cpu_seconds(pid) - cpu0) / max(calls, 1) * 1e6,
                "script_us": script_us / max(calls, 1),
                "inner": inner,  # type: ignore[dict-item]
            }
        )
        print(
            f"  {label}: {rounds[-1]['at']:5.1f} s  {rounds[-1]['rate']:7.0f} calls/s  "
            f"{rounds[-1]['us']:6.1f} us/call ({rounds[-1]['script_us']:5.2f} in the script)  "
            f"{inner}",
            flush=True,
        )
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_options(parser, "calls a second (default 8000)")
    parser.add_argument("--seconds", type=float, default=20.0, help="per script (default 20)")
    parser.add_argument("--window", type=float, default=10.0, help="the limits' window, s")
    args = parser.parse_args()
    specs = args.script or ["HEAD=HEAD", f"tree={ROOT / SCRIPT}"]
    # The floor: a script that only answers in the same shape. What a script costs
    # beyond it is its own work; the rest is Redis reading and answering the pipeline.
    scripts = [("empty", EMPTY), *(load_script(spec) for spec in specs)]
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("redis-server not found (benchmarks/setup.sh)")
    port = free_port()
    work = tempfile.mkdtemp(prefix="script-cost-")
    proc = subprocess.Popen(
        ["taskset", "-c", "1", server, "--port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--dir", work],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    os.sched_setaffinity(0, {0})
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        print(f"machine: {describe()}")
        print(
            f"redis: {client.info('server')['redis_version']}, pinned to core 1; client on core 0"
        )
        print(
            f"load: {args.rate} calls/s paced, pipelines of {PIPELINE}, {args.keys} rule keys "
            f"(2000/10 s), {args.addresses} ceiling keys (36000/10 s), "
            f"{args.seconds:.0f} s a script"
        )
        results = {
            label: run_script(client, proc.pid, label, text, args) for label, text in scripts
        }
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    print()
    floor = sorted(r["us"] for r in results["empty"])[len(results["empty"]) // 2]
    print(f"server CPU per call, µs; the script's own = beyond the empty script's {floor:.1f}")
    print()
    print(
        "| script | fresh window | its own | full window (after "
        f"{args.window:.0f} s, median) | its own | in the script, full window (Redis's "
        "timing, median) | offered rate held |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for label, rounds in results.items():
        if label == "empty":
            continue
        full = sorted(r["us"] for r in rounds if r["at"] > args.window + ROUND_SECONDS)
        median = full[len(full) // 2] if full else float("nan")
        timed = sorted(r["script_us"] for r in rounds if r["at"] > args.window + ROUND_SECONDS)
        inside = timed[len(timed) // 2] if timed else float("nan")
        held = all(r["rate"] > 0.95 * args.rate for r in rounds[1:])
        print(
            f"| {label} | {rounds[0]['us']:.1f} | {rounds[0]['us'] - floor:.1f} | {median:.1f} "
            f"| {median - floor:.1f} | {inside:.2f} | {'yes' if held else 'no'} |"
        )


if __name__ == "__main__":
    main()
