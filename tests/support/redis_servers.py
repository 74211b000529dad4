"""Real ``redis-server`` processes for tests: standalone servers and a 3-master cluster.

Every server runs on a free loopback port (never the machine's shared 6379), in its
own temporary directory, with persistence off. ``kill9`` and ``restart`` simulate a
crash and a recovery on the same port; ``pause``/``resume`` (SIGSTOP/SIGCONT) a
server that hangs without closing connections. ``RedisServer(..., tls=True)`` serves
TLS only (``tls-port``, plain port off) with a throwaway CA and server certificate
made by ``openssl`` in its directory (``make_tls_files``).

Use from a conftest::

    from tests.support.redis_servers import RedisServer, RedisClusterProcess, free_port
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

REDIS_SERVER = shutil.which("redis-server") or "redis-server"
REDIS_CLI = shutil.which("redis-cli") or "redis-cli"
OPENSSL = shutil.which("openssl") or "openssl"
START_TIMEOUT_SECONDS = 10.0
CLUSTER_TIMEOUT_SECONDS = 30.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost it signed."""

    ca_cert: Path
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    done = subprocess.run([OPENSSL, *args], capture_output=True, timeout=30, check=False, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr[-2000:]}")


def make_tls_files(directory: Path) -> TlsFiles:
    """Make a CA (valid one day) and a server certificate for 127.0.0.1 in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = directory / "ca.key", directory / "ca.crt"
    key, csr, cert = directory / "server.key", directory / "server.csr", directory / "server.crt"
    ext = directory / "server.ext"
    ext.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "basicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
    )
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca_cert),
        "-days", "1", "-subj", "/CN=ratelimit-gateway test CA",
    )  # fmt: skip
    _openssl("req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
        "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext),
    )  # fmt: skip
    return TlsFiles(ca_cert, cert, key)


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1:``port`` (and a unix socket)."""

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        password: str | None = None,
        cluster: bool = False,
        tls: bool = False,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.directory = directory
        self.port = port or free_port()
        # A port picked here may be taken by someone else before redis binds it; then
        # the first start picks another one (restarts keep theirs).
        self._may_repick = port is None
        self.password = password
        self.cluster = cluster
        self.extra_args = extra_args
        # Fixed for the server's life: a restarted node must come back on the bus port
        # its peers have in their nodes.conf.
        self.cluster_port = free_port() if cluster else 0
        # With TLS, ``port`` is the TLS port and the plain TCP port is off.
        self.tls_files = make_tls_files(directory / "tls") if tls else None
        self.unix_socket = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp")) / "redis.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://…/0``, or for a TLS server ``rediss://…/0?ssl_ca_certs=<its CA>``."""
        auth = f":{self.password}@" if self.password else ""
        if self.tls_files is not None:
            ca = quote(str(self.tls_files.ca_cert), safe="/")
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={ca}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.unix_socket}"

    def _args(self) -> list[str]:
        if self.tls_files is None:
            ports = ["--port", str(self.port)]
        else:
            ports = [
                "--port", "0",
                "--tls-port", str(self.port),
                "--tls-cert-file", str(self.tls_files.cert),
                "--tls-key-file", str(self.tls_files.key),
                "--tls-ca-cert-file", str(self.tls_files.ca_cert),
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        args = [
            REDIS_SERVER,
            *ports,
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "no",
            "--unixsocket", str(self.unix_socket),
            "--unixsocketperm", "700",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        if self.cluster:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.directory / "nodes.conf"),
                "--cluster-node-timeout", "2000",
                "--cluster-port", str(self.cluster_port),
            ]  # fmt: skip
        return args + list(self.extra_args)

    def start(self) -> RedisServer:
        """Start the process and wait until it answers PING."""
        for attempt in range(3):
            try:
                return self._start_once()
            except RuntimeError:
                if not self._may_repick or attempt == 2:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start_once(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start: {self.log_tail()}")
            # Checking the pid makes sure the answer is from this process, not from
            # another test's server that won a race for the port.
            if _port_open(self.port) and self._answers_as(self.proc.pid):
                self._may_repick = False
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer within {START_TIMEOUT_SECONDS}s")

    def _answers_as(self, pid: int) -> bool:
        lines = [line.strip() for line in self.cli("INFO", "server").splitlines()]
        return f"process_id:{pid}" in lines

    def log_tail(self) -> str:
        try:
            return (self.directory / "redis.log").read_text()[-2000:]
        except OSError:
            return ""

    def cli(self, *command: str) -> str:
        """Run one command with ``redis-cli`` and return its raw output."""
        args = [REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port)]
        if self.tls_files is not None:
            args += ["--tls", "--cacert", str(self.tls_files.ca_cert)]
        if self.password:
            args += ["--no-auth-warning", "-a", self.password]
        done = subprocess.run(
            [*args, *command], capture_output=True, timeout=10, check=False, text=True
        )
        return done.stdout

    def commandstats(self) -> dict[str, int]:
        """Calls per command since the last ``CONFIG RESETSTAT`` (``INFO commandstats``)."""
        calls: dict[str, int] = {}
        for line in self.cli("INFO", "commandstats").splitlines():
            if line.startswith("cmdstat_"):
                name, _, rest = line.partition(":")
                fields = dict(item.split("=", 1) for item in rest.strip().split(","))
                calls[name.removeprefix("cmdstat_")] = int(fields["calls"])
        return calls

    def kill9(self) -> None:
        """Crash the server (SIGKILL): its data is gone, its port closes."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def restart(self) -> RedisServer:
        """Start again on the same port after ``kill9``/``stop``."""
        self.kill9()
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while _port_open(self.port) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.start()

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): connections stay open, nothing answers."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            shutil.rmtree(self.unix_socket.parent, ignore_errors=True)
            return
        if self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None
        shutil.rmtree(self.unix_socket.parent, ignore_errors=True)


class RedisClusterProcess:
    """Three masters (no replicas) joined with ``redis-cli --cluster create``.

    ``full_coverage=False`` sets ``cluster-require-full-coverage no``: when a master
    is down, the others keep serving their own slots instead of refusing everything
    with ``CLUSTERDOWN`` (what a deployment that wants partial availability sets).
    """

    def __init__(self, directory: Path, *, masters: int = 3, full_coverage: bool = True) -> None:
        self.directory = directory
        extra = () if full_coverage else ("--cluster-require-full-coverage", "no")
        self.servers = [
            RedisServer(directory / f"node{i}", cluster=True, extra_args=extra)
            for i in range(masters)
        ]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.servers)
        return f"redis+cluster://{hosts}"

    def start(self) -> RedisClusterProcess:
        for server in self.servers:
            server.start()
        nodes = [f"127.0.0.1:{s.port}" for s in self.servers]
        done = subprocess.run(
            [
                REDIS_CLI,
                "--cluster",
                "create",
                *nodes,
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            timeout=CLUSTER_TIMEOUT_SECONDS,
            check=False,
            text=True,
        )
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        deadline = time.monotonic() + CLUSTER_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in s.cli("CLUSTER", "INFO") for s in self.servers):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def server_for_key(self, key: str) -> RedisServer:
        """The master that serves ``key``'s slot (asked of a live node)."""
        for server in self.servers:
            if server.proc is None or server.proc.poll() is not None:
                continue
            slot = int(server.cli("CLUSTER", "KEYSLOT", key).strip())
            for line in server.cli("CLUSTER", "NODES").splitlines():
                fields = line.split()
                if "master" not in fields[2]:
                    continue
                port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
                for ranges in fields[8:]:
                    low, _, high = ranges.partition("-")
                    if low.isdigit() and int(low) <= slot <= int(high or low):
                        return next(s for s in self.servers if s.port == port)
        raise LookupError(f"no live node knows who serves {key!r}")

    def wait_state(self, state: str, servers: list[RedisServer] | None = None) -> None:
        """Wait until each of ``servers`` (default: all) reports ``cluster_state:<state>``."""
        deadline = time.monotonic() + CLUSTER_TIMEOUT_SECONDS
        for server in servers or self.servers:
            while f"cluster_state:{state}" not in server.cli("CLUSTER", "INFO"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node {server.port} did not reach cluster_state:{state}")
                time.sleep(0.05)

    def node_id(self, server: RedisServer) -> str:
        return server.cli("CLUSTER", "MYID").strip()

    def start_migration(self, slot: int, source: RedisServer, target: RedisServer) -> None:
        """Begin moving ``slot`` from ``source`` to ``target`` (``IMPORTING`` on the
        target, then ``MIGRATING`` on the source): the source answers ``ASK`` for its
        keys that are gone."""
        for server, state, other in ((target, "IMPORTING", source), (source, "MIGRATING", target)):
            out = server.cli("CLUSTER", "SETSLOT", str(slot), state, self.node_id(other))
            if out.strip() != "OK":
                raise RuntimeError(f"CLUSTER SETSLOT {state} failed: {out}")

    def move_keys(
        self, slot: int, source: RedisServer, target: RedisServer, keys: list[str] | None = None
    ) -> int:
        """``MIGRATE`` ``keys`` (default: every key of ``slot`` on ``source``, until none
        is left) to ``target``; how many moved."""
        moved = 0
        while True:
            batch = keys or source.cli("CLUSTER", "GETKEYSINSLOT", str(slot), "100").split()
            if not batch:
                return moved
            out = source.cli(
                "MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", *batch
            )
            if out.strip() not in ("OK", "NOKEY"):
                raise RuntimeError(f"MIGRATE failed: {out}")
            moved += len(batch)
            if keys is not None:
                return moved

    def finish_migration(self, slot: int, source: RedisServer, target: RedisServer) -> None:
        """Give ``slot`` to ``target`` on every node (the target first, then the source,
        as Redis's resharding does): the source now answers ``MOVED``."""
        target_id = self.node_id(target)
        others = [s for s in self.servers if s not in (source, target) and self.is_master(s)]
        for server in (target, source, *others):
            out = server.cli("CLUSTER", "SETSLOT", str(slot), "NODE", target_id)
            if out.strip() != "OK":
                raise RuntimeError(f"CLUSTER SETSLOT NODE failed on {server.port}: {out}")

    def migrate_slot(self, slot: int, source: RedisServer, target: RedisServer) -> int:
        """Move ``slot`` and all its keys from ``source`` to ``target`` (what
        ``redis-cli --cluster reshard`` does for one slot); how many keys moved."""
        self.start_migration(slot, source, target)
        moved = self.move_keys(slot, source, target)
        self.finish_migration(slot, source, target)
        return moved

    def is_master(self, server: RedisServer) -> bool:
        return "role:master" in server.cli("INFO", "replication")

    def add_replica(self, master: RedisServer) -> RedisServer:
        """A new node replicating ``master``, joined with ``redis-cli --cluster
        add-node``; waits until its replication link is up."""
        replica = RedisServer(
            self.directory / f"node{len(self.servers)}",
            cluster=True,
            extra_args=self.servers[0].extra_args,
        )
        replica.start()
        self.servers.append(replica)
        done = subprocess.run(
            [
                REDIS_CLI, "--cluster", "add-node",
                f"127.0.0.1:{replica.port}", f"127.0.0.1:{master.port}",
                "--cluster-slave", "--cluster-master-id", self.node_id(master),
            ],
            capture_output=True, timeout=CLUSTER_TIMEOUT_SECONDS, check=False, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster add-node failed: {done.stdout}{done.stderr}")
        # Joined, it may first be taken for a master (or attached elsewhere): wait until
        # every node lists it as a replica of ``master`` and its link is up, asking again
        # with CLUSTER REPLICATE when it is not (a failover of it is only then meaningful).
        master_id = self.node_id(master)
        me = self.node_id(replica)
        deadline = time.monotonic() + CLUSTER_TIMEOUT_SECONDS
        asked = time.monotonic()
        while not (
            "master_link_status:up" in replica.cli("INFO", "replication")
            and all(self._sees_replica_of(s, me, master_id) for s in self.servers)
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the new replica did not attach to its master")
            if time.monotonic() - asked > 1.0 and not self._sees_replica_of(
                replica, me, master_id
            ):  # (only when it itself says otherwise: asking again restarts its sync)
                replica.cli("CLUSTER", "REPLICATE", master_id)
                asked = time.monotonic()
            time.sleep(0.05)
        return replica

    @staticmethod
    def _sees_replica_of(server: RedisServer, node_id: str, master_id: str) -> bool:
        for line in server.cli("CLUSTER", "NODES").splitlines():
            fields = line.split()
            if fields and fields[0] == node_id:
                return "slave" in fields[2] and fields[3] == master_id
        return False

    def manual_failover(self, replica: RedisServer) -> None:
        """``CLUSTER FAILOVER`` on ``replica`` (its master stops taking writes until the
        replica has caught up, then they swap roles); waits until every node agrees."""
        out = replica.cli("CLUSTER", "FAILOVER")
        if out.strip() != "OK":
            raise RuntimeError(f"CLUSTER FAILOVER failed: {out}")
        deadline = time.monotonic() + CLUSTER_TIMEOUT_SECONDS
        me = self.node_id(replica)
        # Done when every node takes it for a master and it serves slots (a node just
        # joined is briefly a master without any: that is not the failover).
        while not (
            all(self._sees_master(s, me) for s in self.servers) and self._serves_slots(replica)
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the failover did not complete")
            time.sleep(0.05)

    @staticmethod
    def _serves_slots(server: RedisServer) -> bool:
        for line in server.cli("CLUSTER", "NODES").splitlines():
            fields = line.split()
            if len(fields) > 2 and "myself" in fields[2]:
                return len(fields) > 8
        return False

    @staticmethod
    def _sees_master(server: RedisServer, node_id: str) -> bool:
        for line in server.cli("CLUSTER", "NODES").splitlines():
            fields = line.split()
            if fields and fields[0] == node_id:
                return "master" in fields[2]
        return False

    def commandstats(self) -> dict[str, int]:
        """Calls per command summed over every node."""
        total: dict[str, int] = {}
        for server in self.servers:
            for name, calls in server.commandstats().items():
                total[name] = total.get(name, 0) + calls
        return total

    def all_keys(self) -> list[str]:
        keys: list[str] = []
        for server in self.servers:
            keys += [k for k in server.cli("--scan").splitlines() if k]
        return keys

    def flush(self) -> None:
        for server in self.servers:
            server.cli("FLUSHALL")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


class RedisSentinelProcess:
    """One ``redis-server --sentinel`` watching ``master`` under the name ``service``."""

    def __init__(self, directory: Path, master: RedisServer, service: str = "counters") -> None:
        self.directory = directory
        self.master = master
        self.service = service
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.service}/0"

    def start(self) -> RedisSentinelProcess:
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "sentinel.conf"
        config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.directory}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {self.service} 1000\n"
        )
        self.proc = subprocess.Popen(
            [REDIS_SERVER, str(config), "--sentinel", "--logfile", str(self.directory / "log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("redis-server --sentinel exited at start")
            if _port_open(self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("the sentinel did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=5)
        self.proc = None


@contextmanager
def running_redis(directory: Path | None = None, **kwargs: object) -> Iterator[RedisServer]:
    """A started ``RedisServer`` in a fresh directory, stopped on exit."""
    base = Path(tempfile.mkdtemp(prefix="redis-test-")) if directory is None else directory
    server = RedisServer(base, **kwargs)  # type: ignore[arg-type]
    try:
        yield server.start()
    finally:
        server.stop()
        if directory is None:
            shutil.rmtree(base, ignore_errors=True)


@contextmanager
def running_cluster(directory: Path | None = None) -> Iterator[RedisClusterProcess]:
    """A started 3-master ``RedisClusterProcess``, stopped on exit."""
    base = Path(tempfile.mkdtemp(prefix="redis-cluster-")) if directory is None else directory
    cluster = RedisClusterProcess(base)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        if directory is None:
            shutil.rmtree(base, ignore_errors=True)
