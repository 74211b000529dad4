"""``--workers N``: N processes serve one port with SO_REUSEPORT; the parent supervises.

The parent keeps the built-in upstreams (one Store, one control plane with its single
lifecycle driver) and forks the proxy workers, which reach the upstreams over loopback.
SIGTERM/SIGINT are passed on to the workers, which drain and stop; a worker that dies
unexpectedly is restarted.

The parent also serves the admin port for all of them: each worker writes its metrics
into a directory of prometheus-client multiprocess files (``gateway.metrics``), which one
scrape of ``/metrics`` collects whole; the console reads the same numbers, the rule files
(the parent loads and watches them too), the counter stores' health (the parent asks them
itself) and each worker's recent refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import glob
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from gateway import __version__, logs
from gateway.app import (
    ADMIN_PORT_WHAT,
    Embedded,
    Service,
    Upstreams,
    _run_loop,
    bind_listeners,
    console_source,
    database_checks,
    open_backend,
    prepare_rules,
    serve_worker,
    unless_hurried,
    with_admin_tls,
)
from gateway.counters.base import CounterBackend
from gateway.metrics import Metrics, shared_registry, worker_gone
from gateway.proxy.admin import create_admin_app
from gateway.proxy.console import Recent
from gateway.proxy.readiness import Readiness, backend_health
from gateway.secrets import identity_secret
from gateway.settings import Settings
from gateway.tls_setup import admin_tls

log = logging.getLogger("gateway.workers")


def _fork_worker(
    settings: Settings,
    index: int,
    urls: dict[str, str],
    embedded: Embedded | None,
    metrics_dir: str,
    admin_sockets: list[socket.socket],
) -> int:
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            if embedded is not None:
                for sock in embedded.sockets.values():
                    sock.close()
            for sock in admin_sockets:  # the supervisor's
                sock.close()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            serve_worker(settings, index, sorted(urls.items()), metrics_dir)
        except BaseException:  # a worker must never return into the parent's code
            logging.getLogger("gateway").exception("worker %d failed", index)
            code = 1
        finally:
            os._exit(code)
    return pid


STARTUP_GRACE_SECONDS = 10.0  # a worker that dies sooner failed to start: do not loop
RESTART_DELAY_SECONDS = 1.0


def recent_refusals(metrics_dir: str) -> list[Recent]:
    """Every worker's latest refusals, newest first."""
    found: list[Recent] = []
    for path in glob.glob(os.path.join(metrics_dir, "recent_*.json")):
        try:
            with open(path, encoding="utf-8") as handle:
                found.extend(tuple(item) for item in json.load(handle))
        except (OSError, ValueError):
            continue
    found.sort(key=lambda r: -r[0])
    return found


def supervise(settings: Settings, embedded: Embedded | None) -> int:
    metrics_dir = tempfile.mkdtemp(prefix="gateway-metrics-")
    try:
        return _supervise(settings, embedded, metrics_dir)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _supervise(settings: Settings, embedded: Embedded | None, metrics_dir: str) -> int:
    urls = embedded.urls() if embedded is not None else {}
    # Bound before the workers start: a probe or a scrape that arrives before the
    # supervisor serves it waits in the backlog instead of being refused.
    admin_sockets = bind_listeners(settings.admin_host, settings.admin_port, ADMIN_PORT_WHAT)

    def fork(index: int) -> int:
        return _fork_worker(settings, index, urls, embedded, metrics_dir, admin_sockets)

    workers: dict[int, int] = {}  # pid -> index
    started: dict[int, float] = {}  # index -> when it was (re)started
    failed_start = False
    try:
        for index in range(settings.workers):
            workers[fork(index)] = index
            started[index] = time.monotonic()
    except BaseException:
        _stop_workers(workers, settings.shutdown_timeout)  # (a fork failed: those forked)
        raise
    log.info("started %d workers on port %d (pids %s)", settings.workers, settings.port,
             ", ".join(str(p) for p in workers))  # fmt: skip

    async def main() -> None:
        service = Service(settings.shutdown_timeout)
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        hurry = asyncio.Event()
        signals = 0

        def signalled() -> None:
            # A second signal (an operator's second Ctrl-C): the workers are killed at
            # once, and the built-in upstreams stop without waiting for requests. Counted:
            # a stop begun otherwise (a worker that failed to start) is no first signal.
            nonlocal signals
            signals += 1
            if signals == 2:
                log.warning("second signal: stopping now, without waiting for requests in flight")
                hurry.set()
                _signal_all(workers, signal.SIGKILL)
            stopping.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, signalled)
        if embedded is not None:
            for name, app in embedded.apps.items():
                await service.start_socket(app, [embedded.sockets[name]])
                log.info("built-in %s listening on %s", name, urls[name])
            for note in embedded.notes:
                log.warning("%s", note)
        rules = prepare_rules(settings, Metrics())  # the console's view of the rule files

        # The admin port's own certificate (tls.admin), served here as a single process
        # serves it: rotated when its files change and on SIGHUP. (Its reload metrics
        # stay in this process: the workers' shared files carry the proxy port's.)
        admin_https = admin_tls(settings, Metrics())

        def hup() -> None:
            _signal_all(workers, signal.SIGHUP)
            rules.request_reload("SIGHUP")
            if admin_https is not None:
                admin_https.request_reload("SIGHUP")

        loop.add_signal_handler(signal.SIGHUP, hup)

        def usr1() -> None:  # the access log was rotated: every process reopens it
            _signal_all(workers, signal.SIGUSR1)
            logs.reopen_access_log()

        loop.add_signal_handler(signal.SIGUSR1, usr1)
        watcher = asyncio.create_task(
            rules.watch(settings.watch_interval) if settings.watch_rules else asyncio.sleep(0)
        )
        backends: dict[str, CounterBackend] = {}
        for region in settings.region_table():  # for the console's health column only
            backend = open_backend(settings, region.name, region.counter_url, Metrics())
            start = getattr(backend, "start", None)
            if start is not None:
                await start()
            backends[region.name] = backend

        async def regions() -> list[dict[str, object]]:
            shown: list[dict[str, object]] = []
            for name, backend in backends.items():
                try:
                    healthy = await asyncio.wait_for(backend.healthy(), 1.0)
                except (TimeoutError, OSError):
                    healthy = False
                shown.append({"name": name, "counter_backend": backend.name, "healthy": healthy})
            return shown

        registry = shared_registry(metrics_dir)
        if embedded is not None:
            embedded.register_metrics(registry)
        secret = identity_secret(settings.identity_secret, Path(settings.data_dir))
        console = console_source(
            settings, rules, regions, registry, lambda: recent_refusals(metrics_dir), secret
        )
        router = Upstreams(dict(urls)).router(settings)

        async def info() -> dict[str, object]:
            """The admin port's ``/info``, as one gateway process answers it."""
            table = rules.table
            loaded = dt.datetime.fromtimestamp(table.loaded_at, dt.UTC).isoformat()
            return {
                "version": __version__,
                "default_region": settings.region_table()[0].name,
                "regions": await regions(),
                "rules": {"hash": table.digest, "loaded_at": loaded, "count": len(table.rules),
                          "files": list(table.sources), "last_reload_error": rules.last_error},
                "workers": settings.workers,
                "upstreams": router.info(),
            }  # fmt: skip

        readiness = Readiness(
            rules=lambda: rules.table,
            last_reload_error=lambda: rules.last_error,
            stores=backend_health(backends),
            databases=database_checks(settings, embedded, ()),
        )
        readiness.start()
        admin_watch: asyncio.Task[None] | None = None
        served: Callable[[], Awaitable[dict[str, object]]] = info
        if admin_https is not None:
            log.info("%s", admin_https.describe())
            admin_watch = asyncio.create_task(admin_https.watch())
            served = with_admin_tls(info, admin_https)
        admin = create_admin_app(registry, served, console, readiness=readiness.answer)
        for address in await service.start_socket(
            admin, admin_sockets, ssl_context=None if admin_https is None else admin_https.context
        ):
            log.info("metrics of all %d workers on %s/metrics, console on %s/console",
                     settings.workers, address, address)  # fmt: skip
        nonlocal failed_start
        try:
            while not stopping.is_set():
                for index, status in _reap(workers, metrics_dir):
                    if status == 0 and time.monotonic() - started[index] < STARTUP_GRACE_SECONDS:
                        # A clean exit while starting is a stop, not a failure: a signal to
                        # the process group reached the worker before this loop saw it.
                        log.info("worker %d stopped while starting; stopping", index)
                        stopping.set()
                        break
                    if time.monotonic() - started[index] < STARTUP_GRACE_SECONDS:
                        log.error("worker %d failed while starting (status %d); stopping",
                                  index, status)  # fmt: skip
                        failed_start = True
                        stopping.set()
                        break
                    log.error("worker %d exited (status %d); starting it again", index, status)
                    await asyncio.sleep(RESTART_DELAY_SECONDS)
                    workers[fork(index)] = index
                    started[index] = time.monotonic()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), 0.5)
            readiness.drain()
            _signal_all(workers, signal.SIGTERM)
            deadline = time.monotonic() + settings.shutdown_timeout + 5
            while workers and time.monotonic() < deadline:
                _reap(workers)
                await asyncio.sleep(0.1)
            _signal_all(workers, signal.SIGKILL)
        finally:
            await readiness.stop()
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            if admin_watch is not None:
                admin_watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await admin_watch
            if admin_https is not None:
                await admin_https.close()
            await unless_hurried(service, hurry)
            for backend in backends.values():
                await backend.close()

    try:
        _run_loop(main())
    except BaseException:
        # main() failed before its own stop (a built-in upstream, a store or the admin
        # port could not start): the workers forked above serve the port already and
        # must not outlive their supervisor.
        _stop_workers(workers, settings.shutdown_timeout)
        raise
    return 1 if failed_start else 0


def _stop_workers(workers: dict[int, int], shutdown_timeout: float) -> None:
    """SIGTERM, up to the shutdown timeout (and 5 s) for them to stop, then SIGKILL, and
    reaped (no zombie left behind)."""
    _signal_all(workers, signal.SIGTERM)
    _reap_for(workers, shutdown_timeout + 5, 0.1)
    _signal_all(workers, signal.SIGKILL)
    _reap_for(workers, 5, 0.01)


def _reap_for(workers: dict[int, int], seconds: float, pause: float) -> None:
    """Reap ``workers`` as they end, for up to ``seconds`` or until none is left."""
    deadline = time.monotonic() + seconds
    while workers and time.monotonic() < deadline:
        try:
            _reap(workers)
        except ChildProcessError:  # none left to wait for
            return
        time.sleep(pause)


def _signal_all(workers: dict[int, int], sig: int) -> None:
    for pid in list(workers):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            workers.pop(pid, None)


def _reap(workers: dict[int, int], metrics_dir: str | None = None) -> list[tuple[int, int]]:
    gone = []
    for pid in list(workers):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            gone.append((workers.pop(pid), status))
            if metrics_dir is not None:
                worker_gone(pid, metrics_dir)  # its live gauges; its counts stay
    return gone
