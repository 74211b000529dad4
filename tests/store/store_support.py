"""Helpers shared by the Store tests: a fake clock, in-process and child-process Stores."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from gateway.upstreams.store import StoreConfig, create_store_app

REPO_ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    """A clock the test moves by hand (epoch seconds)."""

    def __init__(self, start: float = 1_750_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class RunningStore:
    """A Store app served on a free loopback port."""

    url: str
    app: web.Application
    runner: web.AppRunner
    clock: FakeClock | None = None


async def start_store(config: StoreConfig, clock: FakeClock | None = None) -> RunningStore:
    """Serve a Store app on 127.0.0.1 with an OS-chosen port."""
    app = create_store_app(config, clock=clock)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return RunningStore(f"http://127.0.0.1:{port}", app, runner, clock)


# -- stand-alone store processes (durability and multi-process tests) -----------------


@dataclass
class StoreProcess:
    """``python -m gateway.upstreams.store`` running in a child process."""

    process: subprocess.Popen[str]
    url: str
    stderr_lines: list[str] = field(default_factory=list)

    def kill_hard(self) -> None:
        """SIGKILL: no cleanup, no flush, no goodbye."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


_LISTENING = re.compile(r"store listening on (http://\S+)")


async def spawn_store_process(data_dir: Path, *extra: str) -> StoreProcess:
    """Start a Store process on a free port and wait until it prints its address."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.upstreams.store", "--data-dir", str(data_dir), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO_ROOT,
        env=env,
    )
    assert process.stdout is not None
    stdout = process.stdout
    line = await asyncio.wait_for(asyncio.to_thread(stdout.readline), timeout=60)
    match = _LISTENING.search(line)
    if match is None:
        rest = await asyncio.to_thread(stdout.read) if process.poll() is not None else ""
        process.kill()
        raise AssertionError(f"store process did not start: {line}{rest}")
    return StoreProcess(process, match.group(1))
