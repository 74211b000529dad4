"""A verified client certificate as an identity (issue 26 item 1): a `client_cert` rule
counts per certificate subject on the TLS port (optional client certificates: a request
without one falls to the next rule, counted per address). Real gateway over TLS, a CA and
client certificates made in the test."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp

from gateway.policy.loader import load_rules_from_texts
from gateway.proxy.plane import DataPlane
from gateway.proxy.upstream_pool import UpstreamPool
from gateway.replay.records import Request, parse_line
from gateway.replay.simulate import replay
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


def test_client_cert_rules_count_per_verified_subject(tmp_path: Path, caplog) -> None:
    """And a replay of the gateway's own access log through the same rules decides every
    request as the gateway did: the lines carry each certificate's hash."""
    caplog.set_level(logging.INFO, logger="gateway.access")

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
            running_gateway(
                upstream, rules=[str(rules)], config_file=str(config), access_log="plain"
            ) as gw,
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
            gw.gateway.access_log.flush()

    asyncio.run(scenario())
    lines = [
        line
        for record in caplog.records
        if record.name == "gateway.access"
        for line in record.getMessage().splitlines()
    ]
    requests = [r for r in (parse_line(line, {}) for line in lines) if isinstance(r, Request)]
    assert len(requests) == 7
    assert len({r.cert for r in requests}) == 3  # service-a's, service-b's, and none
    assert all("service-" not in line for line in lines)  # hashes, never the subject
    (result,) = replay(sorted(requests, key=lambda r: r.start_us), [
        load_rules_from_texts([("rules.yaml", RULES)])
    ])  # fmt: skip
    assert result.compared == 7 and result.agreed == 7
    assert result.rules["per-service"].limited == 1


async def test_on_the_plain_port_a_client_cert_rule_never_matches(tmp_path, upstream):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    async with running_gateway(upstream, rules=[str(rules)]) as gw, aiohttp.ClientSession() as h:
        async with h.get(gw.url + "/x") as r:
            assert r.headers["RateLimit-Policy"].startswith('"per-address"')
