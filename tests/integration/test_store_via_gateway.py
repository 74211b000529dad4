"""The Store's langgraph-sdk and validation tests, run again through the gateway proxy.

The gateway in front is the real proxy application (default rule table, in-process
counters) with the Store as its built-in upstream on its own loopback port, exactly as
`gateway serve --embedded` wires it.
"""

from __future__ import annotations

import aiohttp
import pytest

from tests.store.conftest import http, running_store, sdk, store_config  # noqa: F401
from tests.store.test_store_sdk import *  # noqa: F403 - every SDK test, collected again here
from tests.store.test_store_validation import *  # noqa: F403
from tests.support.gateway import running_gateway


@pytest.fixture
async def store_base_url(running_store):  # noqa: F811 - overrides the direct URL
    async with running_gateway(None, builtin={"store": running_store.url}) as gw:
        yield gw.url


async def test_store_calls_are_rate_limited_like_any_other(store_base_url):
    async with aiohttp.ClientSession() as client:
        for n in range(100):
            async with client.post(store_base_url + "/store/items/search", json={}) as r:
                assert r.status == 200
                assert r.headers["RateLimit"].startswith(f'"catch-all";r={99 - n};t=')
        async with client.post(store_base_url + "/store/items/search", json={}) as r:
            assert r.status == 429
        async with client.get(store_base_url + "/store/openapi.json") as r:
            assert r.status == 429  # the same client address, the same catch-all bucket
