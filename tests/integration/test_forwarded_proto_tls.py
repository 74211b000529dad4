"""X-Forwarded-Proto says how the client came in (issue 26 item 1): https on the TLS
port, http on the plain one; a client's own value is never believed from an untrusted
peer. Real gateway, real TLS clients, the recording upstream."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from tests.integration.test_tls_gateway import https_gateway, pair_config, write_config
from tests.support.gateway import running_app
from tests.support.tls_pki import Pki, client_context, write_pair
from tests.support.upstream import create_upstream_app


def test_the_tls_port_forwards_https_and_the_plain_port_http(tmp_path: Path) -> None:
    async def scenario() -> None:
        pki = Pki()
        cert, key = write_pair(tmp_path / "pair", pki.issue("gateway.test", serial=0x777))
        config = write_config(tmp_path, pair_config(cert, key))
        async with (
            running_app(create_upstream_app()) as upstream,
            https_gateway(upstream, config) as (gw, _, _, url),
        ):
            connector = aiohttp.TCPConnector(ssl=client_context(pki))
            async with aiohttp.ClientSession(connector=connector) as http:
                for claimed in ({}, {"X-Forwarded-Proto": "http"}):
                    async with http.get(f"{url}/x", headers=claimed) as r:
                        seen = (await r.json())["headers"]
                        assert seen["X-Forwarded-Proto"] == "https", seen
                async with http.get(f"{gw.url}/x", headers={"X-Forwarded-Proto": "https"}) as r:
                    seen = (await r.json())["headers"]
                    assert seen["X-Forwarded-Proto"] == "http", seen

    asyncio.run(scenario())
