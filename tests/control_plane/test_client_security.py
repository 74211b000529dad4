"""The client's promises about its credentials, against real servers on loopback ports:
redirects are never followed (a second "thief" server receives nothing), no URL is shown
with its credentials, the hosted service's key is never sent over plain HTTP, and answers
are read only up to a bound."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.client import (
    ClientSettings,
    ControlPlaneClient,
    ControlPlaneError,
    api,
    run_quickstart,
)

from .support import KEY_A, SECRET_VALUE, TENANT_A, deployment_body
from .test_cli import run_cli

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PASSWORD = "PASSW0RD-in-the-url"
LANGSMITH_KEY = "lsv2_pt_hosted-service-key-0123456789"


@pytest.fixture(autouse=True)
def control_plane_backend() -> str:
    """No control plane runs here: once, without the SQLite/PostgreSQL parametrization."""
    return "none"


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    """``handler`` answers every method and path on 127.0.0.1, on a free port."""

    async def route(request: web.Request) -> web.StreamResponse:
        return await handler(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", route)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


class Recorder:
    """A server that must receive nothing: keeps what any request brought."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(
            {
                "path": request.path_qs,
                "headers": dict(request.headers),
                "body": await request.text(),
            }
        )
        return web.json_response({"id": "stolen", "latest_revision_id": "r"}, status=201)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def assert_no_secret(text: str) -> None:
    for secret in (KEY_A, SECRET_VALUE, PASSWORD, LANGSMITH_KEY):
        assert secret not in text, text


# ---- 1. redirects are never followed -------------------------------------------------------


CALLS: dict[str, Callable[[ControlPlaneClient], Awaitable[Any]]] = {
    "create": lambda c: c.create_deployment(deployment_body()),
    "list": lambda c: c.list_deployments(),
    "get": lambda c: c.get_deployment("d1"),
    "update": lambda c: c.update_deployment("d1", {"secrets": deployment_body()["secrets"]}),
    "delete": lambda c: c.delete_deployment("d1"),
    "revisions": lambda c: c.list_revisions("d1"),
    "revision": lambda c: c.get_revision("d1", "r1"),
    "redeploy": lambda c: c.redeploy_revision("d1", "r1"),
    "wait": lambda c: c.wait_for_revision("d1", "r1", poll_interval=0.01, timeout=5),
    "quickstart": lambda c: run_quickstart(c, deployment_body(), {}, poll_interval=0.01),
}


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("call", sorted(CALLS))
async def test_a_redirect_to_another_origin_is_an_error_and_the_thief_gets_nothing(
    status: int, call: str
) -> None:
    thief = Recorder()
    async with serving(thief) as thief_url:
        target = thief_url.replace("http://", "http://thief:THIEF-PW@") + "/steal?token=t0k"

        async def redirect(request: web.Request) -> web.StreamResponse:
            await request.read()
            return web.Response(status=status, headers={"Location": target})

        async with (
            serving(redirect) as url,
            ControlPlaneClient(url, KEY_A, TENANT_A, request_timeout=10) as client,
        ):
            with pytest.raises(ControlPlaneError) as info:
                await CALLS[call](client)
    assert thief.seen == []
    message = str(info.value)
    assert info.value.status == status
    assert f"answered {status}" in message and "not followed" in message
    assert thief_url.removeprefix("http://") + "/steal" in message  # where it pointed
    assert_no_secret(message)
    assert "THIEF-PW" not in message and "t0k" not in message


async def test_a_same_origin_redirect_is_not_followed_either_nor_with_a_given_session() -> None:
    seen: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(request.path)
        if request.path == "/elsewhere/v2/deployments":
            return web.json_response({"id": "x", "latest_revision_id": "r"}, status=201)
        return web.Response(status=308, headers={"Location": "/elsewhere/v2/deployments"})

    async with serving(handler) as url, aiohttp.ClientSession() as session:
        client = ControlPlaneClient(url, KEY_A, TENANT_A, session=session)
        with pytest.raises(ControlPlaneError) as info:
            await client.create_deployment(deployment_body())
    assert seen == ["/v2/deployments"]
    assert f"{url}/elsewhere/v2/deployments" in str(info.value)
    assert_no_secret(str(info.value))


async def test_the_cli_does_not_follow_a_redirect() -> None:
    thief = Recorder()
    async with serving(thief) as thief_url:

        async def redirect(request: web.Request) -> web.StreamResponse:
            await request.read()
            return web.Response(status=307, headers={"Location": thief_url + "/steal"})

        async with serving(redirect) as url:
            code, out, err = await run_cli(
                url, "quickstart", "--name", "x", "--image-uri", "i", "--secret", "OPENAI_API_KEY"
            )
    assert code == 1 and out == ""
    assert "not followed" in err and thief_url in err
    assert thief.seen == []
    assert_no_secret(err)


# ---- 2. no URL is shown with its credentials ----------------------------------------------


async def test_an_unreachable_url_is_shown_without_its_credentials() -> None:
    port = closed_port()
    async with ControlPlaneClient(
        f"http://admin:{PASSWORD}@127.0.0.1:{port}", KEY_A, TENANT_A, request_timeout=10
    ) as client:
        with pytest.raises(ControlPlaneError) as info:
            await client.list_deployments()
    message = str(info.value)
    assert "unreachable" in message and f"127.0.0.1:{port}" in message
    assert "admin" not in message
    assert_no_secret(message)


async def test_a_redirect_from_a_url_with_credentials_does_not_show_them() -> None:
    async def redirect(request: web.Request) -> web.StreamResponse:
        return web.Response(status=302, headers={"Location": "/login"})

    async with (
        serving(redirect) as url,
        ControlPlaneClient(
            url.replace("http://", f"http://admin:{PASSWORD}@"), KEY_A, TENANT_A
        ) as client,
    ):
        with pytest.raises(ControlPlaneError) as info:
            await client.get_deployment("d1")
    assert "/login" in str(info.value)
    assert "admin" not in str(info.value)
    assert_no_secret(str(info.value))


def test_a_bad_url_is_shown_without_its_credentials() -> None:
    env = {"GATEWAY_API_KEY": KEY_A, "GATEWAY_TENANT_ID": TENANT_A}
    for url in (f"ftp://admin:{PASSWORD}@host/x", f"http://admin:{PASSWORD}@:80/x"):
        with pytest.raises(ValueError, match="URL") as info:
            ClientSettings.resolve(env, base_url=url)
        assert_no_secret(str(info.value))


async def test_the_cli_shows_no_url_credentials() -> None:
    url = f"http://admin:{PASSWORD}@127.0.0.1:{closed_port()}"
    code, _out, err = await run_cli(url, "list")
    assert code == 1 and "unreachable" in err
    assert_no_secret(err)
    code, _out, err = await run_cli(url.replace("http", "gopher", 1), "list")
    assert code == 2 and "URL" in err
    assert_no_secret(err)


# ---- 3. LANGSMITH_API_KEY never goes over plain HTTP --------------------------------------


def test_langsmith_key_is_used_only_with_an_https_url() -> None:
    env = {"LANGSMITH_API_KEY": LANGSMITH_KEY, "GATEWAY_TENANT_ID": TENANT_A}
    for url in (None, "http://127.0.0.1:8080", "http://control-plane.example/api-host"):
        with pytest.raises(ValueError, match="GATEWAY_API_KEY") as info:
            ClientSettings.resolve(env, base_url=url)
        assert "https://" in str(info.value)
        assert_no_secret(str(info.value))
    https = "https://api.host.example/api-host"
    assert ClientSettings.resolve(env, base_url=https).api_key == LANGSMITH_KEY
    assert ClientSettings.resolve({**env, "GATEWAY_CONTROL_PLANE_URL": https}).api_key == (
        LANGSMITH_KEY
    )
    # The project's own key, or an explicit one, wins and goes anywhere it is pointed.
    own = {**env, "GATEWAY_API_KEY": KEY_A}
    assert ClientSettings.resolve(own) == ClientSettings(api.DEFAULT_URL, KEY_A, TENANT_A)
    assert ClientSettings.resolve(env, api_key="flag").api_key == "flag"
    with pytest.raises(ValueError, match="GATEWAY_API_KEY"):
        ClientSettings.resolve({"GATEWAY_TENANT_ID": TENANT_A})


async def test_the_cli_does_not_send_the_langsmith_key_over_plain_http() -> None:
    listener = Recorder()
    async with serving(listener) as url:
        code, out, err = await run_cli(
            url,
            "list",
            env_extra={"GATEWAY_API_KEY": "", "LANGSMITH_API_KEY": LANGSMITH_KEY},
        )
    assert listener.seen == []
    assert code == 2 and out == ""
    assert "GATEWAY_API_KEY" in err and "https://" in err
    assert_no_secret(err)


# ---- 4. answers are read up to a bound ------------------------------------------------------


class Streamer:
    """Answers ``status`` with a chunked body of ``total`` bytes, then never ends it."""

    def __init__(self, status: int, total: int, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.total = total
        self.headers = headers or {}
        self.written = 0
        self.done = asyncio.Event()

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=self.status, headers=self.headers)
        if "Content-Length" not in self.headers:
            response.enable_chunked_encoding()
        try:
            await response.prepare(request)
            chunk = b"x" * 65536
            while self.written < self.total:
                await response.write(chunk)
                self.written += len(chunk)
            # The body never ends (only a bounded read returns) until the client hangs up.
            while request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.done.set()
        return response


async def test_an_endless_error_body_is_cut_without_reading_it_all() -> None:
    total = 16 * 1024 * 1024
    server = Streamer(500, total)
    async with (
        serving(server) as url,
        ControlPlaneClient(url, KEY_A, TENANT_A, request_timeout=5) as client,
    ):
        started = time.monotonic()
        with pytest.raises(ControlPlaneError) as info:
            await client.list_deployments()
        elapsed = time.monotonic() - started
        await asyncio.wait_for(server.done.wait(), 5)  # the client hung up
    assert info.value.status == 500, str(info.value)
    assert len(info.value.text) == api.MAX_ERROR_TEXT
    assert str(info.value).endswith("[cut]")
    assert elapsed < 4
    assert server.written < total


async def test_a_declared_oversize_answer_is_refused_unread() -> None:
    server = Streamer(200, 65536, {"Content-Length": str(api.MAX_RESPONSE_BYTES + 1)})
    async with (
        serving(server) as url,
        ControlPlaneClient(url, KEY_A, TENANT_A, request_timeout=5) as client,
    ):
        with pytest.raises(ControlPlaneError, match="larger than") as info:
            await client.get_deployment("d1")
    assert info.value.status == 200


async def test_an_oversize_chunked_answer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "MAX_RESPONSE_BYTES", 1024 * 1024)
    total = 64 * 1024 * 1024
    server = Streamer(200, total)
    async with (
        serving(server) as url,
        ControlPlaneClient(url, KEY_A, TENANT_A, request_timeout=5) as client,
    ):
        with pytest.raises(ControlPlaneError, match="larger than 1048576 bytes") as info:
            await client.list_revisions("d1")
    assert info.value.status == 200
    assert server.written < total


async def test_a_large_legitimate_page_is_read_whole() -> None:
    page = {
        "resources": [{"id": f"d{i}", "name": "n" * 20000} for i in range(100)],
        "offset": 100,
    }

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(page)

    async with serving(handler) as url, ControlPlaneClient(url, KEY_A, TENANT_A) as client:
        assert await client.list_deployments(limit=100) == page


# ---- 5. A server's words reach the terminal as text, never as control sequences ------------


async def test_the_cli_writes_a_servers_control_characters_as_escapes() -> None:
    hostile = "\x1b]0;owned\x07\x1b[2J\x1b[31mdeployment gone\x1b[0m\r\x08"

    async def answer(request: web.Request) -> web.Response:
        # Not JSON (which would escape them): a proxy's or a hostile server's plain text.
        return web.Response(text=hostile, status=502)

    async with serving(answer) as url:
        code, _out, err = await run_cli(url, "list")
    assert code == 1
    assert "deployment gone" in err
    assert not any(c in err for c in "\x1b\x07\x08\r"), repr(err)
    assert "\\x1b[2J" in err  # shown, so the operator sees what the server sent
