"""The two reference servers of ``dataplane_bench.py``, each run as its own process.

    python benchmarks/dataplane_servers.py proxy PORT UPSTREAM_URL
    python benchmarks/dataplane_servers.py flood PORT

``proxy``: the smallest honest aiohttp pass-through proxy — a ``web.Application`` with one
catch-all route and one shared ``ClientSession`` (no limit on pooled connections), on
uvloop. Hop-by-hop headers are dropped both ways; a response of known length up to 64 KiB
is read whole and sent in one ``web.Response``, anything else is streamed in 64 KiB
chunks. No rate limiting, no logging: what an aiohttp proxy costs before any logic.

``flood``: aiohttp's bare low-level ``web.Server`` answering every request with a fixed
``429`` (JSON body, ``Retry-After``), on uvloop. No routing, no logic: the floor under
which no aiohttp-based gateway can answer a flood.

Both listen on 127.0.0.1 only and stop on SIGTERM / SIGINT.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp
from aiohttp import web

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
SMALL_BODY = 64 * 1024
FLOOD_BODY = b'{"detail": "rate limit exceeded for rule \'flood\'; retry in 300 seconds"}'


def proxy_app(upstream: str) -> web.Application:
    upstream = upstream.rstrip("/")
    app = web.Application()
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def open_session(app: web.Application) -> None:
        app[session_key] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        )

    async def close_session(app: web.Application) -> None:
        await app[session_key].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        body = await request.read() if request.body_exists else None
        async with app[session_key].request(
            request.method,
            upstream + request.path_qs,
            headers=headers,
            data=body,
            allow_redirects=False,
        ) as up:
            out = [
                (k, v)
                for k, v in up.headers.items()
                if k.lower() not in HOP_BY_HOP and k.lower() != "content-length"
            ]
            length = up.content_length
            if length is not None and length <= SMALL_BODY:
                return web.Response(status=up.status, headers=out, body=await up.read())
            response = web.StreamResponse(status=up.status, headers=out)
            if length is not None:
                response.content_length = length
            await response.prepare(request)
            async for chunk in up.content.iter_chunked(SMALL_BODY):
                await response.write(chunk)
            await response.write_eof()
            return response

    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


async def flood_handler(request: web.BaseRequest) -> web.StreamResponse:
    return web.Response(
        status=429,
        body=FLOOD_BODY,
        content_type="application/json",
        headers={"Retry-After": "300"},
    )


async def serve(kind: str, port: int, upstream: str | None) -> None:
    if kind == "proxy":
        assert upstream
        runner: web.BaseRunner = web.AppRunner(proxy_app(upstream), access_log=None)
    else:
        runner = web.ServerRunner(web.Server(flood_handler, access_log=None))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> None:
    kind, port = sys.argv[1], int(sys.argv[2])
    if kind not in ("proxy", "flood"):
        raise SystemExit(f"unknown server {kind!r}: proxy or flood")
    upstream = sys.argv[3] if kind == "proxy" else None
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(serve(kind, port, upstream))
    else:
        uvloop.run(serve(kind, port, upstream))


if __name__ == "__main__":
    main()
