from __future__ import annotations

import pytest

from tests.support.gateway import running_app
from tests.support.loops import run  # noqa: F401 (a fixture: the scenario on both event loops)
from tests.support.upstream import create_upstream_app


@pytest.fixture
async def upstream_app():
    app = create_upstream_app()
    async with running_app(app) as url:
        yield app, url


@pytest.fixture
async def upstream(upstream_app):
    return upstream_app[1]


@pytest.fixture(scope="session")
def postgres():
    """One throwaway PostgreSQL server for the session (started on first use)."""
    from tests.support.postgres_server import postgres_server

    with postgres_server() as server:
        yield server


@pytest.fixture
def pg_database_url(postgres):
    """A fresh, empty database on the session's server; dropped afterwards."""
    url = postgres.create_database()
    yield url
    postgres.drop_database(url)


@pytest.fixture
def store_database_url():
    """Where the Store under test keeps its items: None is SQLite. tests/store runs every
    Store test on both backends by overriding this fixture."""
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the output of the gateway processes it started."""
    from tests.support import gateway

    outcome = yield
    report = outcome.get_result()
    if report.failed and not hasattr(item, "gateway_output_shown"):
        item.gateway_output_shown = True  # once, whether setup, call or teardown failed
        for gw in gateway.STARTED:
            text = gw.output or gw.log_text()
            report.sections.append((f"gateway on port {gw.port} (exit {gw.proc.poll()})", text))
    if report.when == "teardown":
        gateway.STARTED.clear()
