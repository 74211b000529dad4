"""rate_limit_headers (issue 26 item 5): the draft's fields (ietf, the default), the
X-RateLimit-* fields Envoy, Kong and GitHub clients read (legacy), both, or none; for
forwarded answers, refusals and repeats answered from memory alike."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from tests.support.gateway import running_app, running_gateway

RULES = """\
rules:
  - id: per-ip
    identity: ip
    limits: {us: 3/60}
ceilings:
  - id: per-address
    identity: ip
    limits: {us: 100/10}
"""


def _app() -> web.Application:
    async def handler(request: web.Request) -> web.Response:
        # an upstream with rate-limit fields of its own
        return web.Response(text="up", headers={"X-RateLimit-Limit": "999"})

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    return app


@pytest.mark.parametrize("mode", ["ietf", "legacy", "both", "none"])
async def test_each_mode_sends_its_fields(tmp_path, mode):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    async with running_app(_app()) as up, running_gateway(up, rules=[str(rules)]) as gw:
        gw.proxy.gateway.rate_limit_headers = mode
        async with aiohttp.ClientSession() as http:
            answers = []
            for _ in range(5):
                async with http.get(gw.url + "/x") as r:
                    answers.append((r.status, r.headers.copy()))
    assert [status for status, _ in answers] == [200, 200, 200, 429, 429]
    for n, (status, headers) in enumerate(answers):
        ietf = "RateLimit-Policy" in headers and "RateLimit" in headers
        legacy = "X-RateLimit-Limit" in headers and "X-RateLimit-Remaining" in headers
        assert ietf == (mode in ("ietf", "both")), (mode, headers)
        if mode in ("legacy", "both"):
            assert legacy
            # the policy closest to its limit: the rule (3/60), not the ceiling
            assert headers.getall("X-RateLimit-Limit") == ["3"]  # the upstream's replaced
            assert headers["X-RateLimit-Remaining"] == str(max(0, 2 - n))
            reset = int(headers["X-RateLimit-Reset"])
            assert 1 <= reset <= 61
            if status == 429:
                assert reset == int(headers["Retry-After"])
        elif status == 200:
            # the upstream's own field passes untouched when the gateway sends none
            assert headers.getall("X-RateLimit-Limit") == ["999"]
        if mode == "none":
            assert "RateLimit" not in headers and "RateLimit-Policy" not in headers


async def test_the_setting_chooses_the_mode_and_refuses_others(tmp_path, upstream):
    from gateway.settings import SettingsError, load_settings

    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    async with running_gateway(upstream, rules=[str(rules)], rate_limit_headers="legacy") as gw:
        async with aiohttp.ClientSession() as http, http.get(gw.url + "/x") as r:
            assert r.headers["X-RateLimit-Limit"] == "3" and "RateLimit" not in r.headers
    with pytest.raises(SettingsError, match="rate_limit_headers must be"):
        load_settings({"rate_limit_headers": "github"}, env={}, config_file=None)
