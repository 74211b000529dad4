"""Helpers for the control-plane tests: credentials, a config, a server on a free port."""

from __future__ import annotations

import hashlib
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.upstreams.control_plane import ControlPlaneConfig, create_control_plane_app
from gateway.upstreams.control_plane.http_helpers import RUNTIME_KEY
from gateway.upstreams.http_api.parse_budget import ParseBudget

KEY_A = "cp-test-key-alpha-0123456789"
TENANT_A = "11111111-1111-4111-8111-111111111111"
KEY_B = "cp-test-key-bravo-9876543210"
TENANT_B = "22222222-2222-4222-8222-222222222222"
FAST_STEP = 0.05
SECRET_VALUE = "sk-live-VERY-SECRET-value-42"


def headers(key: str = KEY_A, tenant: str = TENANT_A) -> dict[str, str]:
    return {"X-Api-Key": key, "X-Tenant-Id": tenant}


def sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def control_plane_section(step: float = FAST_STEP) -> dict[str, Any]:
    """The ``control_plane:`` config section these tests assume (two tenants, fast pacing);
    a gateway started for the same tests needs this section."""
    return {
        "revision_step_seconds": step,
        "credentials": [
            {"api_key_sha256": sha(KEY_A), "tenant_ids": [TENANT_A], "label": "a"},
            {"api_key_sha256": sha(KEY_B), "tenant_ids": [TENANT_B], "label": "b"},
        ],
        "integrations": {
            "github": {
                "install_url": "https://github.example/apps/test/installations/new",
                "installations": [
                    {
                        "id": "int-shared",
                        "name": "Shared org",
                        "repos": [{"owner": "acme", "name": "agent"}],
                    },
                    {
                        "id": "int-b-only",
                        "tenant_ids": [TENANT_B],
                        "repos": [{"owner": "bravo", "name": "bot", "default_branch": "dev"}],
                    },
                ],
            }
        },
        "max_body_bytes": 65536,
        "auth_wait_max_seconds": 5,
    }


def make_config(data_dir: Path, step: float = FAST_STEP, **section: Any) -> ControlPlaneConfig:
    raw = control_plane_section(step)
    raw.update(section)
    return ControlPlaneConfig.from_mapping(raw, data_dir, {})


def deployment_body(name: str = "agent-one", **revision: Any) -> dict[str, Any]:
    revision_config = {
        "repo_ref": "main",
        "langgraph_config_path": "langgraph.json",
        "image_uri": None,
    }
    revision_config.update(revision)
    return {
        "name": name,
        "source": "github",
        "source_config": {
            "integration_id": "int-shared",
            "repo_url": "https://github.com/acme/agent",
            "deployment_type": "dev",
            "build_on_push": True,
            "custom_url": None,
            "resource_spec": None,
        },
        "source_revision_config": revision_config,
        "secrets": [{"name": "OPENAI_API_KEY", "value": SECRET_VALUE}],
    }


class FakeClock:
    """A wall clock the test moves by hand (the lifecycle then advances deterministically)."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@dataclass
class RunningControlPlane:
    url: str
    app: web.Application

    def wake(self) -> None:
        """Make the lifecycle driver look now (after moving a fake clock)."""
        driver = self.app[RUNTIME_KEY].driver
        assert driver is not None
        driver.wake()


# The database every control plane a test starts uses: None is the SQLite file in its data
# dir; conftest.py sets a fresh PostgreSQL database for the "postgresql" run of each test.
DATABASE = {"url": None}


@asynccontextmanager
async def running_control_plane(
    config: ControlPlaneConfig, clock: Any = None, parse_budget: ParseBudget | None = None
):
    """Serve the control plane on 127.0.0.1 on a free port until the block ends."""
    if config.database_url is None and DATABASE["url"] is not None:
        config = replace(config, database_url=DATABASE["url"])
    app = create_control_plane_app(config, clock=clock, parse_budget=parse_budget)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield RunningControlPlane(f"http://{host}:{port}", app)
    finally:
        await runner.cleanup()
