"""The revision lifecycle: ordering, failures, supersession, redeploy and restart.

Most tests drive a fake clock by hand so each step happens exactly when the test says.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gateway.upstreams.control_plane.lifecycle import REVISION_FLOW, next_step

from .support import (
    FakeClock,
    deployment_body,
    headers,
    make_config,
    running_control_plane,
)

H = headers()
STEP = 10.0  # fake seconds; only the fake clock moves


async def get_json(session, path):
    r = await session.get(path, headers=H)
    assert r.status == 200, await r.text()
    return await r.json()


async def revision_status(session, dep_id, rev_id):
    return (await get_json(session, f"/v2/deployments/{dep_id}/revisions/{rev_id}"))["status"]


async def step_until(cp, session, clock, dep_id, rev_id, status):
    """Move the fake clock one step at a time until the revision has ``status``."""
    for _ in range(50):
        current = await revision_status(session, dep_id, rev_id)
        if current == status:
            return
        before = current
        clock.now += STEP
        cp.wake()
        for _ in range(500):
            current = await revision_status(session, dep_id, rev_id)
            if current != before:
                break
            await asyncio.sleep(0.005)
    raise AssertionError(f"never reached {status}; last {current}")


def test_next_step_walks_the_flow_and_fails_bad_builds():
    good = ({"repo_url": "https://github.com/a/b"}, {"langgraph_config_path": "langgraph.json"})
    status, walked = "CREATING", ["CREATING"]
    while status != "DEPLOYED":
        status, message = next_step(status, "github", *good)
        assert message is None
        walked.append(status)
    assert tuple(walked) == REVISION_FLOW
    bad_path = ({"repo_url": "https://github.com/a/b"}, {"langgraph_config_path": "graph.yaml"})
    assert next_step("AWAITING_BUILD", "github", *bad_path) == ("BUILDING", None)
    status, message = next_step("BUILDING", "github", *bad_path)
    assert status == "BUILD_FAILED" and ".json" in message
    bad_url = ({"repo_url": "not a url"}, {"langgraph_config_path": "langgraph.json"})
    assert next_step("BUILDING", "github", *bad_url)[0] == "BUILD_FAILED"


async def test_restart_in_the_middle_of_a_lifecycle_resumes(tmp_path):
    clock = FakeClock()
    config = make_config(tmp_path / "data", step=STEP)
    async with running_control_plane(config, clock) as cp, aiohttp.ClientSession(cp.url) as s:
        r = await s.post("/v2/deployments", json=deployment_body(), headers=H)
        created = await r.json()
        dep_id, rev_id = created["id"], created["latest_revision_id"]
        await step_until(cp, s, clock, dep_id, rev_id, "BUILDING")

    # A new process on the same data dir: the state is kept and the revision finishes.
    async with running_control_plane(config, clock) as cp, aiohttp.ClientSession(cp.url) as s:
        assert await revision_status(s, dep_id, rev_id) == "BUILDING"
        dep = await get_json(s, f"/v2/deployments/{dep_id}")
        assert dep["status"] == "AWAITING_DATABASE"
        assert dep["active_revision_id"] is None
        await step_until(cp, s, clock, dep_id, rev_id, "DEPLOYED")
        dep = await get_json(s, f"/v2/deployments/{dep_id}")
        assert dep["status"] == "READY"
        assert dep["active_revision_id"] == rev_id


async def test_restart_with_real_clock_finishes_revision(tmp_path):
    config = make_config(tmp_path / "data", step=0.05)
    async with running_control_plane(config) as cp, aiohttp.ClientSession(cp.url) as s:
        r = await s.post("/v2/deployments", json=deployment_body(), headers=H)
        created = await r.json()
    async with running_control_plane(config) as cp, aiohttp.ClientSession(cp.url) as s:
        for _ in range(2000):
            status = await revision_status(s, created["id"], created["latest_revision_id"])
            if status == "DEPLOYED":
                break
            await asyncio.sleep(0.01)
        assert status == "DEPLOYED"


async def test_failed_build_keeps_previous_active_revision(tmp_path):
    clock = FakeClock()
    config = make_config(tmp_path / "data", step=STEP)
    async with running_control_plane(config, clock) as cp, aiohttp.ClientSession(cp.url) as s:
        r = await s.post("/v2/deployments", json=deployment_body(), headers=H)
        created = await r.json()
        dep_id, first = created["id"], created["latest_revision_id"]
        await step_until(cp, s, clock, dep_id, first, "DEPLOYED")
        r = await s.patch(
            f"/v2/deployments/{dep_id}",
            json={"source_revision_config": {"langgraph_config_path": "langgraph.yaml"}},
            headers=H,
        )
        second = (await r.json())["latest_revision_id"]
        await step_until(cp, s, clock, dep_id, second, "BUILD_FAILED")
        revision = await get_json(s, f"/v2/deployments/{dep_id}/revisions/{second}")
        assert ".json" in revision["status_message"]
        dep = await get_json(s, f"/v2/deployments/{dep_id}")
        assert dep["active_revision_id"] == first
        assert dep["latest_revision_id"] == second

        # Redeploying the first revision makes a new revision with its configuration.
        r = await s.post(f"/v2/deployments/{dep_id}/revisions/{first}/redeploy", headers=H)
        assert r.status == 200
        third = (await r.json())["latest_revision_id"]
        assert third not in (first, second)
        listing = await get_json(s, f"/v2/deployments/{dep_id}/revisions")
        assert [rev["id"] for rev in listing["resources"]] == [third, second, first]
        rev3 = listing["resources"][0]
        assert rev3["source_revision_config"]["langgraph_config_path"] == "langgraph.json"
        await step_until(cp, s, clock, dep_id, third, "DEPLOYED")
        assert (await get_json(s, f"/v2/deployments/{dep_id}"))["active_revision_id"] == third
        r = await s.post(f"/v2/deployments/{dep_id}/revisions/missing/redeploy", headers=H)
        assert r.status == 404


async def test_repo_url_that_is_not_a_url_fails_the_build(tmp_path):
    clock = FakeClock()
    config = make_config(tmp_path / "data", step=STEP)
    body = deployment_body()
    body["source_config"]["repo_url"] = "acme/agent"
    async with running_control_plane(config, clock) as cp, aiohttp.ClientSession(cp.url) as s:
        r = await s.post("/v2/deployments", json=body, headers=H)
        assert r.status == 201
        created = await r.json()
        await step_until(cp, s, clock, created["id"], created["latest_revision_id"], "BUILD_FAILED")
        dep = await get_json(s, f"/v2/deployments/{created['id']}")
        assert dep["status"] == "AWAITING_DATABASE"
        assert dep["active_revision_id"] is None


async def test_newer_revision_interrupts_one_in_flight(tmp_path):
    clock = FakeClock()
    config = make_config(tmp_path / "data", step=STEP)
    async with running_control_plane(config, clock) as cp, aiohttp.ClientSession(cp.url) as s:
        r = await s.post("/v2/deployments", json=deployment_body(), headers=H)
        created = await r.json()
        dep_id, first = created["id"], created["latest_revision_id"]
        await step_until(cp, s, clock, dep_id, first, "QUEUED")
        r = await s.patch(
            f"/v2/deployments/{dep_id}",
            json={"source_revision_config": {"repo_ref": "hotfix"}},
            headers=H,
        )
        second = (await r.json())["latest_revision_id"]
        revision = await get_json(s, f"/v2/deployments/{dep_id}/revisions/{first}")
        assert revision["status"] == "INTERRUPTED"
        assert second in revision["status_message"]
        await step_until(cp, s, clock, dep_id, second, "DEPLOYED")
        assert await revision_status(s, dep_id, first) == "INTERRUPTED"


@pytest.mark.parametrize("step", [0.0])
async def test_zero_step_deploys_immediately(tmp_path, step):
    config = make_config(tmp_path / "data", step=step)
    async with running_control_plane(config) as cp, aiohttp.ClientSession(cp.url) as s:
        r = await s.post("/v2/deployments", json=deployment_body(), headers=H)
        created = await r.json()
        for _ in range(1000):
            status = await revision_status(s, created["id"], created["latest_revision_id"])
            if status == "DEPLOYED":
                break
            await asyncio.sleep(0.005)
        assert status == "DEPLOYED"
