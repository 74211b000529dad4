"""Serve the Store on its own: ``python -m gateway.upstreams.store --data-dir DIR --port P``.

Prints ``store listening on http://HOST:PORT`` once it accepts connections (with ``--port 0``
the line carries the port the OS chose), so tests and scripts can wait for it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from pathlib import Path

from aiohttp import web

from gateway.upstreams.http_api.serving import ApiAppRunner
from gateway.upstreams.store.app import create_store_app
from gateway.upstreams.store.config import StoreConfig


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gateway.upstreams.store")
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--default-ttl-minutes", type=float, default=None)
    parser.add_argument("--sweep-interval-seconds", type=float, default=60.0)
    parser.add_argument("--synchronous", choices=("full", "normal"), default="full")
    parser.add_argument("--database-url", default=None, help="PostgreSQL instead of SQLite")
    parser.add_argument(
        "--trusted-proxy",
        action="append",
        default=[],
        metavar="CIDR",
        help="a peer whose X-Forwarded-For is walked for the client (repeatable; loopback "
        "always is): behind a gateway on another host, the gateway's address and every proxy "
        "the gateway trusts, so that the parse budget counts by the client the gateway resolved",
    )
    return parser.parse_args(argv)


async def serve(config: StoreConfig, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT, then close storage cleanly."""
    # Parser errors answered as the Store's JSON, like every other error.
    runner = ApiAppRunner(create_store_app(config), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    print(f"store listening on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the stand-alone Store server."""
    args = _arguments(argv)
    try:
        config = StoreConfig(
            data_dir=args.data_dir,
            default_ttl_minutes=args.default_ttl_minutes,
            sweep_interval_seconds=args.sweep_interval_seconds,
            sqlite_synchronous=args.synchronous,
            database_url=args.database_url,
            trusted_proxies=tuple(args.trusted_proxy),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(config, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
