"""The Python client against a real control plane: quick-start, failures, timeout."""

from __future__ import annotations

import socket

import pytest

from gateway.client import (
    ClientSettings,
    ControlPlaneClient,
    ControlPlaneError,
    RevisionFailed,
    RevisionWaitTimeout,
    run_quickstart,
)

from .support import KEY_A, TENANT_A, deployment_body, make_config, running_control_plane

FAST = {"poll_interval": 0.02, "timeout": 120}


def client_for(url: str) -> ControlPlaneClient:
    return ControlPlaneClient(url, KEY_A, TENANT_A, request_timeout=10)


@pytest.mark.parametrize("suffix", ["", "/api-host"])
async def test_quickstart_with_the_client(control_plane_url, suffix):
    steps: list[str] = []
    progress = []
    async with client_for(control_plane_url + suffix) as client:
        result = await run_quickstart(
            client,
            deployment_body(),
            {"source_revision_config": {"repo_ref": "v2"}},
            on_step=steps.append,
            on_progress=progress.append,
            **FAST,
        )
        assert result.deleted
        assert result.first_revision["status"] == "DEPLOYED"
        assert result.second_revision["status"] == "DEPLOYED"
        assert result.second_revision["id"] != result.first_revision["id"]
        assert result.second_revision["source_revision_config"]["repo_ref"] == "v2"
        with pytest.raises(ControlPlaneError) as info:
            await client.get_deployment(result.deployment["id"])
    assert info.value.status == 404
    assert "not found" in info.value.text
    assert "404" in str(info.value)
    assert any("created deployment" in s for s in steps)
    assert any("deleted deployment" in s for s in steps)
    assert progress[0].changed and progress[-1].status == "DEPLOYED"
    assert all(p.elapsed >= 0 for p in progress)
    assert next(p.polls for p in progress if p.revision_id == result.first_revision["id"]) == 1


async def test_failing_build_is_reported_as_an_error(control_plane_url):
    async with client_for(control_plane_url) as client:
        with pytest.raises(RevisionFailed) as info:
            await run_quickstart(
                client,
                deployment_body(langgraph_config_path="langgraph.yml"),
                {"source_revision_config": {"repo_ref": "v2"}},
                **FAST,
            )
    assert info.value.revision["status"] == "BUILD_FAILED"
    assert "BUILD_FAILED" in str(info.value)
    assert ".json" in str(info.value)
    assert "left in place" in str(info.value)


async def test_wait_timeout_is_honoured(tmp_path):
    config = make_config(tmp_path / "data", step=3600)
    async with running_control_plane(config) as cp, client_for(cp.url) as client:
        created = await client.create_deployment(deployment_body())
        with pytest.raises(RevisionWaitTimeout) as info:
            await client.wait_for_revision(
                created["id"], created["latest_revision_id"], poll_interval=0.05, timeout=0.3
            )
        assert info.value.last_status == "CREATING"
        assert "0.3" in str(info.value)
        with pytest.raises(RevisionWaitTimeout):
            await client.wait_for_revision(
                created["id"], created["latest_revision_id"], poll_interval=60, timeout=0
            )


async def test_unexpected_statuses_show_the_response_text(control_plane_url):
    async with ControlPlaneClient(control_plane_url, "bad-key", TENANT_A) as client:
        with pytest.raises(ControlPlaneError) as info:
            await client.list_deployments()
    assert info.value.status == 401
    assert "Invalid API key" in str(info.value)
    async with client_for(control_plane_url) as client:
        with pytest.raises(ControlPlaneError) as info:
            await client.create_deployment({"name": "x"})
        assert info.value.status == 422
        assert "expected 201, got 422" in str(info.value)
        page = await client.list_deployments(limit=5)
        assert page == {"resources": [], "offset": 0}
        with pytest.raises(ValueError):
            await client.get_deployment("../etc")


async def test_unreachable_control_plane_is_an_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with client_for(f"http://127.0.0.1:{port}") as client:
        with pytest.raises(ControlPlaneError) as info:
            await client.list_deployments()
    assert info.value.status is None
    assert "unreachable" in str(info.value)


def test_settings_resolution():
    env = {"LANGSMITH_API_KEY": "ls", "GATEWAY_TENANT_ID": "t"}
    with pytest.raises(ValueError, match="GATEWAY_API_KEY"):
        ClientSettings.resolve(env)  # the hosted key is never sent over plain HTTP
    settings = ClientSettings.resolve(env, base_url="https://cp.example")
    assert settings == ClientSettings("https://cp.example", "ls", "t")
    env["GATEWAY_API_KEY"] = "gw"
    assert ClientSettings.resolve(env) == ClientSettings("http://127.0.0.1:8080", "gw", "t")
    env["GATEWAY_CONTROL_PLANE_URL"] = "http://127.0.0.1:9/api-host"
    assert ClientSettings.resolve(env).api_key == "gw"
    assert ClientSettings.resolve(env, api_key="flag").api_key == "flag"
    assert ClientSettings.resolve(env).base_url.endswith("/api-host")
    with pytest.raises(ValueError, match="API key"):
        ClientSettings.resolve({"GATEWAY_TENANT_ID": "t"})
    with pytest.raises(ValueError, match="tenant"):
        ClientSettings.resolve({"GATEWAY_API_KEY": "k"})
    with pytest.raises(ValueError, match="URL"):
        ClientSettings.resolve(env, base_url="ftp://x")
