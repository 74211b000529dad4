from __future__ import annotations

import pytest

from tests.support.gateway import running_app
from tests.support.upstream import create_upstream_app


@pytest.fixture
async def upstream_app():
    app = create_upstream_app()
    async with running_app(app) as url:
        yield app, url


@pytest.fixture
async def upstream(upstream_app):
    return upstream_app[1]
