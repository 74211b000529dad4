"""A small real upstream for proxy tests: echo, server-sent events, slow, upload sink."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

EVENTS_KEY = web.AppKey("events", dict)


def create_upstream_app() -> web.Application:
    app = web.Application(client_max_size=1024**3, handler_args={"auto_decompress": False})
    # Coordination for streaming tests: the test releases each SSE event / sees each chunk.
    app[EVENTS_KEY] = {"sse_gate": asyncio.Queue(), "chunks": asyncio.Queue()}

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response(
            {
                "method": request.method,
                "path": request.raw_path,
                "headers": {k: v for k, v in request.headers.items()},
                "header_list": [[k, v] for k, v in request.headers.items()],
                "body_length": len(body),
            },
            headers={
                "X-Upstream": "yes",
                "Connection": "keep-alive, X-Hop",
                "X-Hop": "secret",
                "Keep-Alive": "timeout=5",
            },
        )

    async def sse(request: web.Request) -> web.StreamResponse:
        gate: asyncio.Queue[int] = request.app[EVENTS_KEY]["sse_gate"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n in range(int(request.query.get("n", "3"))):
            await gate.get()
            await response.write(f"data: {json.dumps({'n': n})}\n\n".encode())
        await response.write_eof()
        return response

    async def upload(request: web.Request) -> web.Response:
        chunks: asyncio.Queue[int] = request.app[EVENTS_KEY]["chunks"]
        total = 0
        async for chunk in request.content.iter_any():
            total += len(chunk)
            chunks.put_nowait(total)
        return web.json_response({"received": total})

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query.get("s", "5")))
        return web.json_response({"slow": True})

    async def stream_seconds(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            for _ in range(int(request.query.get("n", "5"))):
                await response.write(b"tick\n")
                await asyncio.sleep(float(request.query.get("every", "0.2")))
            await response.write_eof()
        except ConnectionError:  # the gateway hung up because its client did: expected
            pass
        return response

    app.router.add_get("/sse", sse)
    app.router.add_post("/upload", upload)
    app.router.add_get("/slow", slow)
    app.router.add_get("/ticks", stream_seconds)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app
