"""Run the real gateway: in-process on a free port, or as a `python -m gateway` process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.app import Proxy, Upstreams
from gateway.metrics import Metrics
from gateway.proxy.handler import Gateway
from gateway.proxy.reload import RuleSource
from gateway.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RULES = str(ROOT / "rules")
SECRET = b"test-secret-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningGateway:
    url: str
    proxy: Proxy
    metrics: Metrics
    rules: RuleSource
    settings: Settings

    @property
    def gateway(self) -> Gateway:
        assert self.proxy.gateway is not None
        return self.proxy.gateway


@asynccontextmanager
async def running_gateway(
    upstream: str | None = None,
    builtin: Mapping[str, str] | None = None,
    rules: Sequence[str] = (DEFAULT_RULES,),
    config_file: str | None = None,
    **overrides: Any,
):
    """Start the proxy app (what `gateway serve` runs) on a free loopback port."""
    flags = {
        "rules": list(rules),
        "upstream": upstream,
        "embedded": False,
        "watch_rules": False,
        "access_log": "off",
        **overrides,
    }
    settings = load_settings(flags, env={}, config_file=config_file)
    metrics = Metrics()
    source = RuleSource.load(settings.rules, [r.name for r in settings.region_table()], metrics)
    proxy = Proxy(settings, Upstreams(dict(builtin or {})), metrics, source, SECRET)
    await proxy.start("127.0.0.1", 0)
    try:
        yield RunningGateway(f"http://127.0.0.1:{proxy.port}", proxy, metrics, source, settings)
    finally:
        await proxy.stop(5)


@asynccontextmanager
async def running_app(app: web.Application):
    """Serve any aiohttp app on a free loopback port; yields its base URL."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


# Every gateway process started by the test running now: a failed test's report shows
# their output (tests/conftest.py), which CI prints and which explains a failed start.
STARTED: list[GatewayProcess] = []


class GatewayProcess:
    """`python -m gateway serve ...` as a child process, waited for until /ok answers."""

    def __init__(
        self,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        admin_port: int | None = None,
        log_path: Path | None = None,
        new_session: bool = False,
    ):
        # Ports picked here can be taken before the process binds them (another process
        # listens there, or an outgoing connection got it as its ephemeral port); the
        # gateway then fails its start before serving anything, and wait_ready starts it
        # again on fresh ports. Ports a test chose are never changed.
        self._picked = (port is None, admin_port is None)
        self.port = port or free_port()
        # 0 lets every process (each worker too) pick its own free admin port.
        self.admin_port = free_port() if admin_port is None else admin_port
        self._serve_args = list(args)
        self._env = {**os.environ, "GATEWAY_IDENTITY_SECRET": SECRET.decode(), **(env or {})}
        self._new_session = new_session
        # The output always goes to a file: a failed start says why in the error.
        self._own_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="gateway-", suffix=".log")
            self.log_path, self._log = Path(name), os.fdopen(fd, "ab")
        else:
            self.log_path, self._log = log_path, open(log_path, "ab")  # noqa: SIM115
        self.output = ""  # the output's tail, kept by stop() (which removes an own log)
        self._spawn()
        STARTED.append(self)

    def _spawn(self) -> None:
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "gateway", "serve", "--port", str(self.port),
                     "--admin-port", str(self.admin_port), *self._serve_args]  # fmt: skip
        self._log_start = self.log_path.stat().st_size
        # new_session: the gateway and its workers get a process group of their own, so
        # ``kill_group`` can SIGKILL all of them at once (and nothing else).
        self.proc = subprocess.Popen(
            self.args,
            env=self._env,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=self._new_session,
        )

    def _lost_a_picked_port(self) -> bool:
        """This start failed on a port picked here that something took meanwhile."""
        with open(self.log_path, "rb") as handle:
            handle.seek(self._log_start)
            text = handle.read().decode(errors="replace")
        if "already in use" not in text.lower():
            return False
        ports = zip((self.port, self.admin_port), self._picked, strict=True)
        picked = [port for port, mine in ports if mine]
        # the gateway's own message, and asyncio's for the data port
        named = [f"127.0.0.1:{p}" for p in picked] + [f"'127.0.0.1', {p})" for p in picked]
        return any(name in text for name in named)

    def wait_ready(self, timeout: float = 30.0) -> GatewayProcess:
        import urllib.request

        deadline = time.monotonic() + timeout
        restarts = 3
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if restarts and self._lost_a_picked_port():
                    restarts -= 1
                    if self._picked[0]:
                        self.port = free_port()
                    if self._picked[1]:
                        self.admin_port = free_port()
                    # (what a test reads of the log is the start that served it)
                    self._log.write(b"-- started again: a picked port was taken --\n")
                    self._log.flush()
                    self._spawn()
                    continue
                raise RuntimeError(f"gateway exited with {self.proc.returncode}: {self.log_text()}")
            try:
                with urllib.request.urlopen(self.url + "/ok", timeout=1) as r:  # noqa: S310
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"gateway did not become ready: {self.log_text()}")

    def log_text(self) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text(errors="replace")[-4000:]
        return ""

    def kill_group(self) -> int:
        """``kill -9`` the whole process group (needs ``new_session=True``): no cleanup,
        no flush, no goodbye, for the gateway, its workers and the built-in upstreams."""
        assert os.getpgid(self.proc.pid) == self.proc.pid, "started without new_session"
        os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait(30)

    def stop(self, sig: int = 15, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.output = self.log_text()
        if self._own_log:
            self.log_path.unlink(missing_ok=True)
        return self.proc.returncode


async def raw_request(port: int, request: bytes) -> bytes:
    """Send bytes as they are (requests aiohttp's client would refuse to write)."""
    import asyncio

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    return data


async def get_json(session: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, Any]:
    async with session.get(url, **kw) as r:
        return r.status, await r.json(content_type=None)
