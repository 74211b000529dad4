"""A verified client certificate as an identity (issue 26 item 1): a `client_cert` rule
counts per certificate subject on the TLS port (optional client certificates: a request
without one falls to the next rule, counted per address). Real gateway over TLS, a CA and
client certificates made in the test."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from gateway.proxy.plane import DataPlane
from gateway.proxy.upstream_pool import UpstreamPool
from gateway.tls_setup import tls_listener
from tests.integration.test_tls_gateway import pair_config
from tests.support.gateway import running_app, running_gateway
from tests.support.tls_pki import Pki, client_context, write_pair
from tests.support.upstream import create_upstream_app

RULES = """\
rules:
  - id: per-service
    identity: client_cert
    limits: {us: 2/60}
  - id: per-address
    identity: ip
    limits: {us: 100/60}
"""


def test_client_cert_rules_count_per_verified_subject(tmp_path: Path) -> None:
    async def scenario() -> None:
        pki, clients = Pki(), Pki()
        cert, key = write_pair(tmp_path / "pair", pki.issue("gateway.test"))
        ca = clients.write_ca(tmp_path / "clients-ca.pem")
        rules = tmp_path / "rules.yaml"
        rules.write_text(RULES)
        config = tmp_path / "gateway.yaml"
        config.write_text(pair_config(cert, key, f"  client_ca: {ca}\n  client_auth: optional\n"))
        async with (
            running_app(create_upstream_app()) as upstream,
            running_gateway(upstream, rules=[str(rules)], config_file=str(config)) as gw,
        ):
            listener = tls_listener(gw.settings, gw.metrics)
            assert listener is not None and gw.proxy.plane is not None
            plane = DataPlane(gw.gateway, UpstreamPool(8, 5.0), gw.proxy.plane.limits)
            await plane.start("127.0.0.1", 0, tls=listener)
            url = f"https://localhost:{plane.ports[0]}"

            async def statuses(context, n: int) -> list[tuple[int, str]]:
                found = []
                connector = aiohttp.TCPConnector(ssl=context, force_close=True)
                async with aiohttp.ClientSession(connector=connector) as http:
                    for _ in range(n):
                        async with http.get(f"{url}/x") as r:
                            found.append((r.status, r.headers["RateLimit-Policy"].split(";")[0]))
                return found

            a = client_context(pki, clients.issue("service-a", server=False), tmp_path / "a")
            b = client_context(pki, clients.issue("service-b", server=False), tmp_path / "b")
            assert await statuses(a, 3) == [(200, '"per-service"')] * 2 + [
                (429, '"per-service"')
            ]  # each connection anew: the subject, not the connection, is counted
            assert await statuses(b, 1) == [(200, '"per-service"')]
            # no certificate: the client_cert rule cannot form its identity
            assert await statuses(client_context(pki), 3) == [(200, '"per-address"')] * 3
            await plane.stop(5)
            await listener.close()

    asyncio.run(scenario())


async def test_on_the_plain_port_a_client_cert_rule_never_matches(tmp_path, upstream):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    async with running_gateway(upstream, rules=[str(rules)]) as gw, aiohttp.ClientSession() as h:
        async with h.get(gw.url + "/x") as r:
            assert r.headers["RateLimit-Policy"].startswith('"per-address"')
