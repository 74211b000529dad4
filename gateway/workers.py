"""``--workers N``: N processes serve one port with SO_REUSEPORT; the parent supervises.

The parent keeps the built-in upstreams (one Store, one control plane with its single
lifecycle driver) and forks the proxy workers, which reach the upstreams over loopback.
SIGTERM/SIGINT are passed on to the workers, which drain and stop; a worker that dies
unexpectedly is restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

from gateway.app import Embedded, Service, _run_loop, serve_worker
from gateway.settings import Settings

log = logging.getLogger("gateway.workers")


def _fork_worker(
    settings: Settings, index: int, urls: dict[str, str], embedded: Embedded | None
) -> int:
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            if embedded is not None:
                for sock in embedded.sockets.values():
                    sock.close()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            serve_worker(settings, index, sorted(urls.items()))
        except BaseException:  # a worker must never return into the parent's code
            logging.getLogger("gateway").exception("worker %d failed", index)
            code = 1
        finally:
            os._exit(code)
    return pid


STARTUP_GRACE_SECONDS = 10.0  # a worker that dies sooner failed to start: do not loop
RESTART_DELAY_SECONDS = 1.0


def supervise(settings: Settings, embedded: Embedded | None) -> int:
    urls = embedded.urls() if embedded is not None else {}
    workers: dict[int, int] = {}  # pid -> index
    started: dict[int, float] = {}  # index -> when it was (re)started
    failed_start = False
    for index in range(settings.workers):
        workers[_fork_worker(settings, index, urls, embedded)] = index
        started[index] = time.monotonic()
    log.info("started %d workers on port %d (pids %s)", settings.workers, settings.port,
             ", ".join(str(p) for p in workers))  # fmt: skip

    async def main() -> None:
        service = Service(settings.shutdown_timeout)
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: _signal_all(workers, signal.SIGHUP))
        if embedded is not None:
            for name, app in embedded.apps.items():
                await service.start_socket(app, embedded.sockets[name])
                log.info("built-in %s listening on %s", name, urls[name])
            for note in embedded.notes:
                log.warning("%s", note)
        nonlocal failed_start
        try:
            while not stopping.is_set():
                for index, status in _reap(workers):
                    if time.monotonic() - started[index] < STARTUP_GRACE_SECONDS:
                        log.error("worker %d failed while starting (status %d); stopping",
                                  index, status)  # fmt: skip
                        failed_start = True
                        stopping.set()
                        break
                    log.error("worker %d exited (status %d); starting it again", index, status)
                    await asyncio.sleep(RESTART_DELAY_SECONDS)
                    workers[_fork_worker(settings, index, urls, embedded)] = index
                    started[index] = time.monotonic()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), 0.5)
            _signal_all(workers, signal.SIGTERM)
            deadline = time.monotonic() + settings.shutdown_timeout + 5
            while workers and time.monotonic() < deadline:
                _reap(workers)
                await asyncio.sleep(0.1)
            _signal_all(workers, signal.SIGKILL)
        finally:
            await service.stop()

    _run_loop(main())
    return 1 if failed_start else 0


def _signal_all(workers: dict[int, int], sig: int) -> None:
    for pid in list(workers):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            workers.pop(pid, None)


def _reap(workers: dict[int, int]) -> list[tuple[int, int]]:
    gone = []
    for pid in list(workers):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            gone.append((workers.pop(pid), status))
    return gone
