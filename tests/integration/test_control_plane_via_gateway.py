"""The control-plane quick-start and status-code tests, run again through the real gateway.

The gateway runs as `python -m gateway serve --embedded` with the default rule table, so
every control-plane call below is rate-limited and proxied exactly as in production.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import yaml

from tests.control_plane.support import KEY_A, TENANT_A, control_plane_section, headers
from tests.control_plane.test_client import (  # noqa: F401 - collected again here
    test_failing_build_is_reported_as_an_error,
    test_quickstart_with_the_client,
)
from tests.control_plane.test_deployments_http import (  # noqa: F401 - collected again here
    test_auth_status_codes,
    test_invalid_create_bodies_are_422,
    test_other_tenants_resources_are_404,
    test_patch_with_only_source_config_makes_no_revision,
    test_quickstart_over_raw_http,
)
from tests.support.gateway import GatewayProcess


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw-cp")
    config = tmp / "gateway.yaml"
    config.write_text(yaml.safe_dump({"control_plane": control_plane_section()}))
    gw = GatewayProcess(
        ["--config", str(config), "--embedded", "--data-dir", str(tmp / "data")],
        log_path=tmp / "gateway.log",
    )
    try:
        gw.wait_ready()
        yield gw.url
    finally:
        gw.stop()


@pytest.fixture
def control_plane_url(gateway_url):
    return gateway_url


@pytest.fixture
async def http(control_plane_url):
    async with aiohttp.ClientSession(control_plane_url) as session:
        yield session


async def test_the_control_plane_document_is_reachable_through_the_gateway(http):
    async with http.get("/api-host/openapi.json") as r:
        assert r.status == 200
        document = await r.json()
    assert document["openapi"] == "3.1.0"
    assert document["paths"]["/v2/deployments"]["post"]["operationId"] == "create_deployment"


async def test_control_plane_answers_carry_rate_limit_fields(http):
    async with http.get("/v2/deployments", headers=headers()) as r:
        assert r.status == 200
        assert r.headers["RateLimit-Policy"].startswith('"default-api-key";q=1000;w=10')
    async with http.get("/api-host/v2/deployments", headers={"X-Tenant-Id": TENANT_A}) as r:
        assert r.status == 401  # no key: the control plane refuses, the IP catch-all counted it
        assert '"catch-all"' in r.headers["RateLimit-Policy"]
    results = await asyncio.gather(
        *(
            http.get("/v2/deployments", headers={"X-Api-Key": KEY_A, "X-Tenant-Id": TENANT_A})
            for _ in range(5)
        )
    )
    for r in results:
        assert r.status == 200
        r.release()
