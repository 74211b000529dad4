"""Instructions Redis runs per request inside the sliding-window script, counted by
callgrind: the same figure on every run, whatever else the machine is doing.

``script_cost.py`` times the script in CPU ticks and microseconds, which this VM moves by
a fifth from one minute to the next; a change of a microsecond or two a request is lost
in that. This runs each script in a ``redis-server`` of its own under
``valgrind --tool=callgrind``, counting only inside ``EVALSHA`` (``--toggle-collect``),
and sends every script the same calls at the same simulated times: the script reads its
clock from an argument instead of ``TIME`` (as ``tests/counters/test_script_model.py``
does), so windows, buckets and the values written are the same on every run. First
``--window`` seconds of simulated traffic fill the windows, uninstrumented; then
``--measured`` requests are counted.

The load is ``script_cost.py``'s: each request a rule's key (one of ``--keys``, round
robin) and its ceiling's (one of ``--addresses``), ``--rate`` requests a simulated second,
``label@N`` sending N requests a script call (as the gateway's pipelines do; without it,
one). ``--shared`` instead gives every request of a call the same rule key and ceiling
(one client's burst).

    .venv/bin/python benchmarks/script_instructions.py \\
        --script before@50=HEAD~1 --script after@50=gateway/counters/lua/sliding_window.lua
"""

from __future__ import annotations

import argparse
import re
import shutil
import struct
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
from gateway.counters.redis_backend import (  # noqa: E402
    CROSS_SLOT_MARKER,
    CROSS_SLOT_RESOURCE,
    CROSS_SLOT_SHEBANG,
)
from tests.support.redis_servers import free_port  # noqa: E402

CLOCK_LINES = (
    "local t = redis.call('TIME')\n"
    "local now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)\n"
)
PIPELINE = 50  # requests a pipeline (of one or several script calls)
START_MS = 1_764_000_000_000


def clocked(text: str) -> str:
    """The script with ``now`` taken from its last argument (either form)."""
    if text.count(CLOCK_LINES) != 1:
        raise SystemExit("the script's clock lines changed: update CLOCK_LINES")
    text = text.replace(CLOCK_LINES, "local now = tonumber(ARGV[#ARGV])\n")
    if text.startswith(CROSS_SLOT_SHEBANG):  # its prelude reads ARGV, the rest its limits
        return text.replace("local last = #ARGV\n", "local last = #ARGV - 1\n")
    return text.replace("local nargs = #ARGV\n", "local nargs = #ARGV - 1\n")


def cross_slot(text: str) -> str:
    """``text``'s cross-slot form, made as the gateway makes its own (``x`` labels)."""
    if text.count(CROSS_SLOT_MARKER) != 1:
        raise SystemExit("this script has no cross-slot form (no marker line)")
    prelude = (ROOT / "gateway/counters/lua" / CROSS_SLOT_RESOURCE).read_text()
    return CROSS_SLOT_SHEBANG + text.replace(CROSS_SLOT_MARKER, prelude)


# One request's limits (a rule's, its ceiling's): four values a key, and ``PACKED`` as
# the script takes them since issue 27's fifth step (one string of doubles a request).
LIMITS = [2000, 10_000, 167, 1, 36_000, 10_000, 167, 1]
PACKED = struct.pack("<8d", *LIMITS)
# --cluster: a Redis Cluster's calls, the rule's and the ceiling's apart (other slots).
PACKED_APART = [struct.pack("<4d", *LIMITS[:4]), struct.pack("<4d", *LIMITS[4:])]


def add_load_options(parser: argparse.ArgumentParser, rate_help: str) -> None:
    """The options both script benchmarks share: which scripts, and the load's shape."""
    parser.add_argument("--script", action="append", default=[], help="label[@N]=FILE|COMMIT")
    parser.add_argument("--rate", type=int, default=8000, help=rate_help)
    parser.add_argument("--keys", type=int, default=10_000, help="rule keys (default 10000)")
    parser.add_argument("--addresses", type=int, default=50, help="ceiling keys (default 50)")


def packed_limits(text: str) -> bool:
    """Whether the script reads a request's limits as one packed string."""
    return "unpack('<dddd'" in text


def traffic(
    client: redis.Redis,
    sha: str,
    per_call: int,
    first: int,
    count: int,
    args: argparse.Namespace,
    packed: bool,
    cross: bool = False,
) -> None:
    """Requests ``first`` to ``first + count``, ``per_call`` to a call, in pipelines.
    With ``args.cluster`` each request is two of the script's, the rule's key and the
    ceiling's (a cluster's calls); ``cross`` sends the cross-slot form's layout."""
    sent = first
    end = first + count
    while sent < end:
        pipe = client.pipeline(transaction=False)
        todo = min(PIPELINE, end - sent)
        while todo > 0:
            requests: list[tuple[list[str], list[int | bytes]]] = []
            now = START_MS + sent * 1000 // args.rate
            lead = sent
            for _ in range(min(per_call, todo)):
                which = lead if args.shared else sent
                rule = f"bench:{{k{which % args.keys}}}:rule"
                ceiling = f"bench:{{a{which % args.addresses}}}:ceiling"
                if args.cluster:
                    requests.append(([rule], [PACKED_APART[0]]))
                    requests.append(([ceiling], [PACKED_APART[1]]))
                else:
                    requests.append(([rule, ceiling], [PACKED] if packed else [2, *LIMITS]))
                sent += 1
                todo -= 1
            for start in range(0, len(requests), per_call):
                part = requests[start : start + per_call]
                if cross:
                    rest = [key for keys, _ in part[1:] for key in keys]
                    limits = [limit for _, argv in part for limit in argv]
                    head = part[0][0]
                    pipe.evalsha(sha, len(head), *head, len(part), *limits, *rest, now)
                else:
                    keys = [key for keys, _ in part for key in keys]
                    argv = [value for _, values in part for value in values]
                    pipe.evalsha(sha, len(keys), *keys, *argv, now)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, Exception):
                raise SystemExit(f"the script failed: {reply}")


def control(pid: int, *options: str) -> None:
    subprocess.run(["callgrind_control", *options, str(pid)], check=True, capture_output=True)


def measure(label: str, text: str, args: argparse.Namespace, work: Path) -> int:
    """Instructions inside EVALSHA over the measured requests."""
    calls = label.partition("@")[2]
    cross = calls.endswith("x")  # the cross-slot form
    per_call = int(calls.rstrip("x") or 1)
    if cross:
        text = cross_slot(text)
    port = free_port()
    out = work / f"callgrind.{label.replace('@', '-')}.out"
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
         "--toggle-collect=evalShaCommand", f"--callgrind-out-file={out}",
         shutil.which("redis-server") or "redis-server", "--port", str(port),
         "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(work),
         *(["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
           if args.cluster else [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=600)
    try:
        for _ in range(600):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        if args.cluster:  # one master that serves every slot
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            while client.execute_command("CLUSTER", "INFO").find(b"cluster_state:ok") < 0:
                time.sleep(0.1)
        sha = client.script_load(clocked(text))
        filled = int(args.window * args.rate)
        packed = packed_limits(text)
        traffic(client, sha, per_call, 0, filled, args, packed, cross)  # the windows filled
        control(proc.pid, "--instr=on")
        traffic(client, sha, per_call, filled, args.measured, args, packed, cross)
        client.shutdown(nosave=True)
    except redis.ConnectionError:
        pass  # the shutdown's
    finally:
        client.close()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:  # a run that failed before its shutdown
            proc.kill()
            proc.wait(10)
    found = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.M)
    if found is None:
        raise SystemExit(f"{label}: no totals in {out}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_options(parser, "requests a simulated second (default 8000)")
    parser.add_argument("--window", type=float, default=10.0, help="simulated seconds first")
    parser.add_argument("--measured", type=int, default=4000, help="requests counted")
    parser.add_argument(
        "--shared", action="store_true", help="the requests of a call share their keys"
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="a Redis Cluster's calls: each request is two script requests (the rule's key, "
        "the ceiling's: other slots), on a server in cluster mode that serves every slot; "
        "label@Nx sends N of them a call in the cross-slot form",
    )
    parser.add_argument(
        "--keep", type=Path, help="keep callgrind's files here (for callgrind_annotate)"
    )
    args = parser.parse_args()
    from benchmarks.script_cost import load_script  # (it imports this module)

    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind not found (Debian: apt-get install valgrind)")
    specs = args.script or ["HEAD=HEAD", f"tree={ROOT / 'gateway/counters/lua/sliding_window.lua'}"]
    scripts = [load_script(spec) for spec in specs]
    print(f"machine: {describe()}")
    shared = ", shared within a call" if args.shared else ""
    print(
        f"load: {args.rate} requests a simulated second, {args.keys} rule keys (2000/10 s), "
        f"{args.addresses} ceiling keys (36000/10 s){shared}; "
        f"{args.window:.0f} simulated s first, then {args.measured} requests counted"
    )
    work = Path(tempfile.mkdtemp(prefix="script-instr-"))
    try:
        print()
        print("| script | instructions a request, inside EVALSHA |")
        print("|---|---:|")
        for label, text in scripts:
            total = measure(label, text, args, work)
            print(f"| {label} | {total / args.measured:,.0f} |", flush=True)
    finally:
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for found in work.glob("callgrind.*.out"):
                shutil.copy(found, args.keep / found.name)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
