"""A throwaway PostgreSQL server for the tests: ``initdb`` + ``pg_ctl`` in a temporary
directory on a free loopback port, stopped at the end. Never a server already running on the
machine (5432 is left alone).

PostgreSQL refuses to run as root, so when the tests run as root the cluster belongs to
``nobody`` and the server processes run as that user.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

SEARCH_DIRS = ("/usr/lib/postgresql/17/bin", "/usr/lib/postgresql/16/bin",
               "/usr/lib/postgresql/15/bin", "/usr/lib/postgresql/14/bin")  # fmt: skip
INSTALL_HINT = (
    "PostgreSQL server binaries (initdb, pg_ctl) are required by the tests: "
    "Debian/Ubuntu: sudo apt-get install -y postgresql; or set GATEWAY_TEST_PG_BIN to "
    "the directory holding them"
)


def find_bin_dir() -> Path | None:
    """Where initdb and pg_ctl are: $GATEWAY_TEST_PG_BIN, the PATH, or Debian's layout."""
    candidates = [os.environ.get("GATEWAY_TEST_PG_BIN", "")]
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(str(Path(on_path).parent))
    candidates.extend(SEARCH_DIRS)
    for directory in candidates:
        if directory and (Path(directory) / "initdb").is_file():
            return Path(directory)
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class PostgresServer:
    """One running cluster; ``create_database`` hands each test its own empty database."""

    bin_dir: Path
    root: Path
    port: int = 0
    user: str | None = None  # the OS user running the server (None: the current one)
    durable: bool = False  # fsync on (benchmarks); tests run with fsync off
    created: list[str] = field(default_factory=list)

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "postgres", *, password: str | None = None) -> str:
        auth = "postgres" if password is None else f"postgres:{password}"
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin_dir / args[0]), *args[1:]],
            check=check,
            capture_output=True,
            text=True,
            user=self.user,
            timeout=60,
        )

    def init(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run("initdb", "-D", str(self.data_dir), "-U", "postgres", "--auth=trust",
                  "--no-sync", "-E", "UTF8", "--locale=C")  # fmt: skip

    def start(self) -> None:
        if not self.port:
            self.port = free_port()
        # fsync off: a test cluster need not survive power loss, and it is much faster.
        # (The crash tests kill the server process, which fsync=off survives: the OS keeps
        # what was written.)
        durable = "on" if self.durable else "off"
        options = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port} "
            f"-c unix_socket_directories='{self.root}' -c fsync={durable} "
            f"-c full_page_writes={durable} -c synchronous_commit=on -c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.data_dir), "-o", options, "-w", "-t", "60",
                  "-l", str(self.root / "server.log"), "start")  # fmt: skip

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "stop", check=False)

    def kill(self) -> None:
        """``kill -9`` the postmaster (its children die with it on the next request)."""
        pid_file = self.data_dir / "postmaster.pid"
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        # The backends notice their parent is gone and exit; wait for them to free the port.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    pass
            except OSError:
                break
            time.sleep(0.05)
        for child in _children_of(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        time.sleep(0.2)
        # The killed postmaster may stay a zombie until this machine's init reaps it; a new
        # postmaster would take its still-existing PID in postmaster.pid for a running
        # server and refuse to start ("lock file already exists", for the data directory
        # and for the socket). Dead is dead: wait for it to be gone or a zombie, and then
        # both lock files are stale.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        if not _alive(pid):
            for stale in (pid_file, self.root / f".s.PGSQL.{self.port}.lock"):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()

    def create_database(self) -> str:
        """A new empty database; returns its URL."""
        name = "t_" + uuid.uuid4().hex[:16]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
        self.created.append(name)
        return self.url(name)

    def drop_database(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _alive(pid: int) -> bool:
    """Running: it exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _children_of(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                children.append(int(entry.name))
    return children


@contextlib.contextmanager
def postgres_server(*, durable: bool = False) -> Iterator[PostgresServer]:
    """Start a cluster in a temporary directory; stop it and remove the directory after."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise RuntimeError(INSTALL_HINT)
    user = "nobody" if os.geteuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="gateway-pg-"))
    server = PostgresServer(bin_dir, root / "cluster", user=user, durable=durable)
    if user is not None:
        os.chmod(root, 0o755)
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
