"""The data plane's own cost per request, without sockets: instructions (callgrind) or CPU.

    .venv/bin/python benchmarks/dataplane_instructions.py [--kinds proxied,flood]
        [--gateway-src before=/tmp/old-checkout ...] [--cpu]

Why this exists: on a 2-core VM shared with other work, wrk figures move by 15 % and more
between runs, which hides the 2-5 % steps that speed work on the request path is made of.
This drives the real data plane (``gateway.proxy.server.ClientConnection`` and an
``UpstreamConnection`` from the real pool, the real rule table, limiter, metrics and JSON
access log) through in-memory transports: the client transport records what is written,
and the upstream transport answers every request at once with a fixed 104-byte nginx-like
response. So it measures the Python work per request and nothing of the kernel or of the
load generator.

By default each checkout is run twice under ``valgrind --tool=callgrind`` (N1 and N2
requests after the same warm-up) and the difference of the two instruction totals over
N2 - N1 is reported: start-up cancels out, and the count is the same whatever else the
machine is doing (callgrind counts instructions, not time). ``--cpu`` instead reports
process CPU time per request (quick, but as noisy as the machine). Kinds:

* ``proxied``: ``GET /x`` with one of 1,000 API keys (each seen once in the warm-up),
  counted in memory and forwarded (the in-process proxied row of ``dataplane_bench.py``);
* ``flood``: ``GET /flood`` with one key already over its limit (the flood rows);
* ``redis``: ``GET /x`` as ``proxied`` but counted in Redis (the Redis proxied row): a
  ``redis-server`` of its own on a free loopback port, and 50 client connections with one
  request each in flight, as ``wrk -c50`` keeps them, so checks are coalesced into
  pipelines as under load. Only the gateway process is measured, not Redis.
* ``known-key``: ``proxied`` with every key known (``identity.api_key.keys``, 10
  consumers): the key's hash is looked up and the consumer counted;
* ``user``: ``GET /u/x`` with one of 1,000 ``x-user-id`` values (a ``user_ip`` rule,
  identities as claimed), the row ``token`` is compared with;
* ``token``: ``user`` with the user taken from one of 1,000 Ed25519-signed JWTs instead
  (``identity.user.jwt``), each verified once in the warm-up: the measured requests are
  cache hits, as a client repeating its token gets;
* ``ceiling`` / ``flood-ceiling``: ``proxied`` / ``flood`` with a per-address ceiling
  beside the rule (counted in the same call, all or nothing).

Needs valgrind (Debian: ``apt-get install valgrind``) unless ``--cpu`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RULES = """\
rules:
  - id: flood
    match: {prefix: /flood}
    identity: api_key
    limits: {default: 1/600}
  - id: bench
    identity: api_key
    limits: {default: 1000000000/60}
"""
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Mon, 23 Nov 2026 15:00:00 GMT\r\n"
    b"Content-Type: application/json\r\nContent-Length: 104\r\nConnection: keep-alive\r\n\r\n"
    + b"x"
    * 104
)
# Distinct API keys of the proxied and redis kinds: more than a connection's identity memo
# holds (each request hashes its key, as under wrk's 10,000), few enough that the warm-up
# (every key once) stays short under callgrind. The measured requests then meet known
# identities, as in dataplane_bench.py, where wrk rotates over the same keys for seconds.
KEYS = 1_000
WARM = KEYS
CONNECTIONS = 50  # the redis kind: requests in flight at once, one per connection
KINDS = ("proxied", "flood", "redis", "known-key", "user", "token", "ceiling", "flood-ceiling")
USER_RULE = """\
  - id: bench-user
    match: {prefix: /u}
    identity: user_ip
    limits: {default: 1000000000/60}
"""
CEILING = """\
ceilings:
  - id: per-address
    identity: ip
    limits: {default: 1000000000/60}
"""


class Round:
    """Answers still awaited in one round of the redis kind; ``done`` resolves at zero
    (awaited, not polled: a polling loop would burn the CPU being measured)."""

    def __init__(self, count: int) -> None:
        self.left = count
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def answered(self) -> None:
        self.left -= 1
        if self.left == 0 and not self.done.done():
            self.done.set_result(None)


class ClientTransport:
    """What the data plane writes to a client, dropped; enough of a transport for it."""

    def __init__(self) -> None:
        self.written = 0
        self.last = b""
        self.closing = False
        self.round: Round | None = None

    def write(self, data: bytes) -> None:
        self.written += 1
        self.last = data
        if self.round is not None:
            self.round.answered()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def abort(self) -> None:
        self.closing = True

    def close(self) -> None:
        self.closing = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass


class UpstreamTransport(ClientTransport):
    """An upstream that answers each request the moment it is written."""

    def __init__(self) -> None:
        super().__init__()
        self.protocol: Any = None

    def write(self, data: bytes) -> None:
        self.written += 1
        self.protocol.data_received(RESPONSE)


def requests(kind: str, count: int, tokens: list[str] | None = None) -> list[bytes]:
    if kind.startswith("flood"):
        one = b"GET /flood HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nx-api-key: flood-0\r\n\r\n"
        return [one] * count
    if kind == "user":
        return [
            b"GET /u/x HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nx-user-id: user-%d\r\n\r\n" % (i % KEYS)
            for i in range(count)
        ]
    if kind == "token":
        assert tokens is not None
        return [
            b"GET /u/x HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nAuthorization: Bearer %s\r\n\r\n"
            % tokens[i % KEYS].encode()
            for i in range(count)
        ]
    return [
        b"GET /x HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nx-api-key: bench-%d\r\n\r\n" % (i % KEYS)
        for i in range(count)
    ]


async def drive(kind: str, count: int) -> dict[str, float]:
    """Warm up, then feed ``count`` requests; returns CPU seconds and responses written."""
    from gateway.app import Proxy, Upstreams
    from gateway.metrics import Metrics
    from gateway.proxy.reload import RuleSource
    from gateway.proxy.server import ClientConnection
    from gateway.proxy.upstream_pool import UpstreamConnection
    from gateway.settings import load_settings

    access = logging.getLogger("gateway.access")
    access.setLevel(logging.INFO)
    access.addHandler(logging.NullHandler())  # formatted and batched as in production
    access.propagate = False
    with tempfile.TemporaryDirectory() as tmp:
        rules = Path(tmp) / "rules.yaml"
        ceiling = CEILING if kind.endswith("ceiling") else ""
        rules.write_text(RULES.replace("rules:\n", "rules:\n" + USER_RULE) + ceiling)
        tokens = identity_config(kind, Path(tmp))
        flags: dict[str, Any] = {
            "rules": [str(rules)],
            "upstream": "http://127.0.0.1:9",
            "embedded": False,
            "watch_rules": False,
            # --access-log, passed down to the child run through the environment
            "access_log": os.environ.get("INSTRUCTIONS_ACCESS_LOG", "json"),
            "data_dir": tmp,
        }
        if kind == "redis":
            flags["redis_url"] = os.environ["INSTRUCTIONS_REDIS_URL"]
        config = Path(tmp) / "gateway.yaml"
        settings = load_settings(
            flags, env={}, config_file=str(config) if config.exists() else None
        )
        metrics = Metrics()
        source = RuleSource.load(settings.rules, [r.name for r in settings.region_table()], metrics)
        proxy = Proxy(settings, Upstreams({}), metrics, source, b"instructions-bench-secret-0123")
        await proxy.start("127.0.0.1", 0)
        try:
            plane = proxy.plane
            assert plane is not None
            pool = plane.pool
            key = ("127.0.0.1", 9, False)
            upstream = UpstreamConnection(pool, key)
            utransport = UpstreamTransport()
            utransport.protocol = upstream
            upstream.connection_made(utransport)  # type: ignore[arg-type]
            upstream.idle_since = time.monotonic()
            pool._all.add(upstream)
            pool.open += 1
            pool._idle[key] = deque([upstream])
            width = CONNECTIONS if kind == "redis" else 1
            conns: list[tuple[Any, ClientTransport]] = []
            for _ in range(width):
                conn = ClientConnection(plane)
                transport = ClientTransport()
                conn.connection_made(transport)  # type: ignore[arg-type]
                conns.append((conn, transport))

            async def feed(batch: list[bytes]) -> None:
                if width == 1:
                    conn = conns[0][0]
                    for i, data in enumerate(batch):
                        conn.data_received(data)
                        if i % 64 == 63:
                            await asyncio.sleep(0)  # a loop turn: the access log is written
                    await asyncio.sleep(0)
                    return
                # One request per connection in flight, as wrk -c50 keeps them; the next
                # round starts when every answer of this one is written.
                for start in range(0, len(batch), width):
                    chunk = batch[start : start + width]
                    waiting = Round(len(chunk))
                    for (conn, transport), data in zip(conns, chunk, strict=False):
                        transport.round = waiting
                        conn.data_received(data)
                    try:
                        await asyncio.wait_for(waiting.done, 60)
                    except TimeoutError:
                        missing = f"{kind}: {waiting.left} answers missing after 60 s"
                        raise SystemExit(missing) from None

            await feed(requests(kind, WARM, tokens))
            batch = requests(kind, count, tokens)
            before = sum(t.written for _, t in conns)
            started = time.process_time()
            await feed(batch)
            await asyncio.sleep(0)
            cpu = time.process_time() - started
            answered = sum(t.written for _, t in conns) - before
            want = b"HTTP/1.1 429" if kind.startswith("flood") else b"HTTP/1.1 200"
            last = conns[0][1].last
            if answered != count or not last.startswith(want):
                raise SystemExit(f"{kind}: {answered} of {count} answered, last {last!r}")
            return {"cpu_s": cpu, "answered": answered}
        finally:
            await proxy.stop(1)


def identity_config(kind: str, tmp: Path) -> list[str] | None:
    """Write ``gateway.yaml`` (and what it names) for the identity kinds; the tokens of
    the ``token`` kind."""
    if kind == "known-key":
        import hashlib

        entries = [
            {"sha256": hashlib.sha256(b"bench-%d" % i).hexdigest(), "consumer": f"c{i % 10}"}
            for i in range(KEYS)
        ]
        (tmp / "keys.yaml").write_text(json.dumps({"keys": entries}))
        (tmp / "gateway.yaml").write_text(
            json.dumps({"identity": {"api_key": {"keys": "keys.yaml", "unknown": "reject"}}})
        )
        return None
    if kind != "token":
        return None
    import jwt
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    public = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (tmp / "idp.pem").write_bytes(public)
    (tmp / "gateway.yaml").write_text(
        json.dumps(
            {
                "identity": {
                    "user": {
                        "jwt": {
                            "public_key_file": "idp.pem",
                            "issuer": "https://idp.bench",
                            "audience": "bench",
                            "algorithms": ["EdDSA"],
                        },
                        "invalid": "reject",
                    }
                }
            }
        )
    )
    expires = int(time.time()) + 3600
    claims = {"iss": "https://idp.bench", "aud": "bench", "exp": expires}
    return [
        jwt.encode({**claims, "sub": f"user-{i}"}, private, algorithm="EdDSA") for i in range(KEYS)
    ]


def child(kind: str, count: int) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        pass
    result = asyncio.run(drive(kind, count))
    print(json.dumps(result))


def run_child(src: Path, kind: str, count: int, callgrind: bool) -> tuple[float, int]:
    """(CPU seconds, instructions or 0) of one child run on checkout ``src``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env["PYTHONPATH"] = str(src)
    env["PYTHONHASHSEED"] = "0"  # the same dict layouts in both runs
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, str(count)]
    with tempfile.TemporaryDirectory() as tmp:
        if callgrind:
            out = Path(tmp) / "callgrind.out"
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *cmd]
        proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{src} {kind}: the run failed:\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    instructions = 0
    if callgrind:
        found = re.search(r"Collected : (\d+)", proc.stderr)
        if found is None:
            raise SystemExit(f"no instruction count in valgrind's output:\n{proc.stderr[-2000:]}")
        instructions = int(found.group(1))
    return float(result["cpu_s"]), instructions


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kinds", default="proxied,flood", help=", ".join(KINDS))
    parser.add_argument(
        "--gateway-src",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="also measure the gateway of this checkout (repeatable)",
    )
    parser.add_argument(
        "--no-current",
        action="store_true",
        help="measure only the --gateway-src checkouts, not this one (e.g. when it runs "
        "interpreted, with no compiled modules beside its sources)",
    )
    parser.add_argument("--cpu", action="store_true", help="CPU time per request, no valgrind")
    parser.add_argument(
        "--access-log",
        choices=("json", "plain", "off"),
        default="json",
        help="the access-log format of the measured gateway (default json, as dataplane_bench)",
    )
    parser.add_argument("--requests", type=int, default=0, help="N2 (default 3000, --cpu 30000)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    os.environ["INSTRUCTIONS_ACCESS_LOG"] = args.access_log  # read by the child runs
    callgrind = not args.cpu
    if callgrind and shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found (Debian: apt-get install valgrind), or use --cpu")
    sources = [] if args.no_current else [("current", ROOT)]
    for item in args.gateway_src:
        label, sep, directory = item.partition("=")
        if not sep or not Path(directory, "gateway").is_dir():
            raise SystemExit(f"--gateway-src wants LABEL=DIR with DIR/gateway, not {item!r}")
        sources.append((label, Path(directory).resolve()))
    n2 = args.requests or (3000 if callgrind else 30000)
    n1 = n2 // 3
    kinds = [k for k in args.kinds.split(",") if k]
    unit = "instructions/request" if callgrind else "CPU µs/request"
    redis = start_redis() if "redis" in kinds else None
    try:
        table(kinds, sources, n1, n2, callgrind, unit)
    finally:
        if redis is not None:
            redis.terminate()
            redis.wait(10)


def start_redis() -> subprocess.Popen[bytes]:
    """A redis-server of the harness's own on a free loopback port (never 6379)."""
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("the redis kind needs redis-server (Debian: apt-get install redis-server)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as conn:
            if conn.connect_ex(("127.0.0.1", port)) == 0:
                os.environ["INSTRUCTIONS_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
                return proc
        time.sleep(0.05)
    proc.terminate()
    raise SystemExit("redis-server did not start")


def table(
    kinds: list[str], sources: list[tuple[str, Path]], n1: int, n2: int, callgrind: bool, unit: str
) -> None:
    print(f"| kind | {' | '.join(label for label, _ in sources)} |  ({unit})")
    print("|---|" + "---:|" * len(sources))
    for kind in kinds:
        if kind not in KINDS:
            raise SystemExit(f"unknown kind {kind!r} ({', '.join(KINDS)})")
        cells = []
        for label, src in sources:
            print(f"  {kind} / {label} ...", file=sys.stderr, flush=True)
            _, ins1 = run_child(src, kind, n1, callgrind)
            cpu2, ins2 = run_child(src, kind, n2, callgrind)
            if callgrind:
                cells.append(f"{(ins2 - ins1) / (n2 - n1):,.0f}")
            else:
                cells.append(f"{cpu2 / n2 * 1e6:.1f}")
        print(f"| {kind} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
