"""Fixtures: a real control plane on a loopback port with fast pacing.

``control_plane_url`` is the one address every HTTP and client test uses, so the same tests
can be pointed at the gateway proxy in front of the control plane by overriding it.
"""

from __future__ import annotations

import aiohttp
import pytest

from . import support
from .support import RunningControlPlane, make_config, running_control_plane


@pytest.fixture(autouse=True, params=["sqlite", "postgresql"])
def control_plane_backend(request):
    """Every control-plane test runs on both backends: SQLite in its data dir, and a fresh
    database on the session's throwaway PostgreSQL server."""
    url = request.getfixturevalue("pg_database_url") if request.param == "postgresql" else None
    support.DATABASE["url"] = url
    yield request.param
    support.DATABASE["url"] = None


@pytest.fixture
async def control_plane(tmp_path) -> RunningControlPlane:
    async with running_control_plane(make_config(tmp_path / "data")) as running:
        yield running


@pytest.fixture
def control_plane_url(control_plane: RunningControlPlane) -> str:
    return control_plane.url


@pytest.fixture
async def http(control_plane_url: str):
    async with aiohttp.ClientSession(control_plane_url) as session:
        yield session
