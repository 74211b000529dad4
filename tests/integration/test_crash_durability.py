"""Durability of the built-in upstreams when the whole gateway is killed (issue 10, step 5).

The gateway runs as a real ``python -m gateway serve --embedded`` process group. Store
writes and deletes and control-plane lifecycle calls (create, a PATCH that makes a new
revision, delete) run concurrently through the proxy; the process group is then killed
with SIGKILL mid-stream and started again on the same data dir. Everything that was
acknowledged (a 2xx answer received whole) must be there; what was in flight may or may
not be, but never half-written; SQLite's own integrity check passes on the files the
crash left; revisions caught mid-lifecycle go on after the restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.control_plane.support import control_plane_section, deployment_body, headers
from tests.support.gateway import GatewayProcess
from tests.support.redis_servers import RedisServer

RULES = "rules:\n  - {id: all, identity: ip, limits: {default: 1000000/60}}\n"
STORE_WRITERS = 6
DEPLOYERS = 3
ENOUGH_STORE_WRITES = 400  # acknowledged before the kill...
ENOUGH_REVISIONS = 30
WORKLOAD_SECONDS = 6.0  # ...or this long, whichever comes first
TERMINAL = {"DEPLOYED", "BUILD_FAILED", "DEPLOY_FAILED", "INTERRUPTED"}


@dataclass
class Ledger:
    """What the clients were told (acknowledged) and what they had sent without an answer."""

    items: dict[tuple[str, str], dict[str, Any] | None] = field(default_factory=dict)
    pending_items: dict[tuple[str, str], dict[str, Any] | None] = field(default_factory=dict)
    deployments: dict[str, list[str]] = field(default_factory=dict)  # id -> revisions, oldest first
    pending_revisions: dict[str, int] = field(default_factory=dict)  # id -> revisions in flight
    deleted: set[str] = field(default_factory=set)
    pending_deletes: set[str] = field(default_factory=set)
    pending_creates: int = 0
    store_acks: int = 0

    @property
    def revisions(self) -> int:
        return sum(len(revs) for revs in self.deployments.values())


def _start(tmp_path: Path, name: str, *extra: str) -> GatewayProcess:
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"control_plane": control_plane_section(step=0.05)}))
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    args = ["--embedded", "--config", str(config), "--rules", str(rules),
            "--data-dir", str(tmp_path / "data"), "--access-log", "off", *extra]  # fmt: skip
    # Admin port 0: each worker picks a free one (port + i could be taken by anything).
    log = tmp_path / f"{name}.log"
    return GatewayProcess(args, admin_port=0, log_path=log, new_session=True)


async def _store_writer(http: aiohttp.ClientSession, worker: int, ledger: Ledger) -> None:
    namespace = ["durable", f"w{worker}"]
    for index in range(100_000):
        key = f"k{index % 40}"  # keys are rewritten and deleted, not only added
        slot = (".".join(namespace), key)
        if index % 7 == 6:
            ledger.pending_items[slot] = None
            async with http.delete("/store/items", json={"namespace": namespace, "key": key}) as r:
                await r.read()
                assert r.status == 204, r.status
        else:
            value = {"worker": worker, "index": index, "pad": "x" * (index % 97) * 20}
            ledger.pending_items[slot] = value
            body = {"namespace": namespace, "key": key, "value": value}
            async with http.put("/store/items", json=body) as r:
                await r.read()
                assert r.status == 204, r.status
        ledger.items[slot] = ledger.pending_items.pop(slot)
        ledger.store_acks += 1


async def _deployer(http: aiohttp.ClientSession, worker: int, ledger: Ledger) -> None:
    auth = headers()
    for round_ in range(10_000):
        ledger.pending_creates += 1
        body = deployment_body(f"crash-{worker}-{round_}")
        async with http.post("/v2/deployments", json=body, headers=auth) as r:
            created = await r.json()
            assert r.status == 201, created
        ledger.pending_creates -= 1
        deployment = created["id"]
        ledger.deployments[deployment] = [created["latest_revision_id"]]
        for ref in ("v2", "v3"):  # each PATCH with a revision config makes a revision
            ledger.pending_revisions[deployment] = 1
            patch = {"source_revision_config": {"repo_ref": ref}}
            async with http.patch(f"/v2/deployments/{deployment}", json=patch,
                                  headers=auth) as r:  # fmt: skip
                patched = await r.json()
                assert r.status == 200, patched
            del ledger.pending_revisions[deployment]
            ledger.deployments[deployment].append(patched["latest_revision_id"])
        if round_ % 3 == 2:
            ledger.pending_deletes.add(deployment)
            async with http.delete(f"/v2/deployments/{deployment}", headers=auth) as r:
                await r.read()
                assert r.status == 204, r.status
            ledger.pending_deletes.discard(deployment)
            ledger.deleted.add(deployment)


async def _run_until_killed(gw: GatewayProcess, ledger: Ledger) -> None:
    """Run the workload, then SIGKILL the process group while requests are in flight."""
    async with aiohttp.ClientSession(gw.url) as http:
        tasks = [asyncio.create_task(_store_writer(http, n, ledger)) for n in range(STORE_WRITERS)]
        tasks += [asyncio.create_task(_deployer(http, n, ledger)) for n in range(DEPLOYERS)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WORKLOAD_SECONDS
        while loop.time() < deadline and not any(t.done() for t in tasks):
            if ledger.store_acks >= ENOUGH_STORE_WRITES and ledger.revisions >= ENOUGH_REVISIONS:
                break
            await asyncio.sleep(0.05)
        failed = [t for t in tasks if t.done() and t.exception() is not None]
        assert not failed, failed[0].exception()  # every answer before the kill was 2xx
        assert ledger.items and ledger.deployments, "nothing was acknowledged before the kill"
        in_flight = len(ledger.pending_items) + len(ledger.pending_revisions)
        assert in_flight > 0, "the kill should land while requests are in flight"
        code = await asyncio.to_thread(gw.kill_group)
        assert code == -9
        for task in tasks:  # their requests can no longer be acknowledged
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _integrity(data_dir: Path) -> dict[str, str]:
    """SQLite's integrity check of each database file the crash left behind."""
    found = {}
    for name in ("store.sqlite3", "control-plane.sqlite3"):
        with contextlib.closing(sqlite3.connect(data_dir / name)) as db:
            found[name] = db.execute("PRAGMA integrity_check").fetchone()[0]
    return found


def _revisions_in_flight(data_dir: Path) -> int:
    """Revisions the kill caught mid-lifecycle (read from the file, before any restart)."""
    marks = ",".join("?" * len(TERMINAL))
    with contextlib.closing(sqlite3.connect(data_dir / "control-plane.sqlite3")) as db:
        query = f"SELECT count(*) FROM revisions WHERE status NOT IN ({marks})"
        return int(db.execute(query, sorted(TERMINAL)).fetchone()[0])


async def _stored_items(http: aiohttp.ClientSession) -> dict[tuple[str, str], Any]:
    found: dict[tuple[str, str], Any] = {}
    offset = 0
    while True:
        body = {"namespace_prefix": ["durable"], "limit": 1000, "offset": offset}
        async with http.post("/store/items/search", json=body) as r:
            assert r.status == 200
            page = (await r.json())["items"]
        for item in page:
            found[(".".join(item["namespace"]), item["key"])] = item["value"]
        if len(page) < 1000:
            return found
        offset += 1000


async def _check_store(http: aiohttp.ClientSession, ledger: Ledger) -> None:
    stored = await _stored_items(http)
    for slot, value in ledger.items.items():
        allowed = [value]
        if slot in ledger.pending_items:  # a later write was in flight: it may have landed
            allowed.append(ledger.pending_items[slot])
        assert stored.get(slot) in allowed, slot
    for slot, value in stored.items():  # nothing the clients never sent, nothing torn
        assert slot in ledger.items or slot in ledger.pending_items, slot
        assert value in (ledger.items.get(slot), ledger.pending_items.get(slot)), slot


async def _check_control_plane(http: aiohttp.ClientSession, ledger: Ledger) -> None:
    auth = headers()
    for deployment, acknowledged in ledger.deployments.items():
        async with http.get(f"/v2/deployments/{deployment}", headers=auth) as r:
            if deployment in ledger.deleted:
                assert r.status == 404, deployment
                continue
            if deployment in ledger.pending_deletes and r.status == 404:
                continue  # the delete in flight landed
            assert r.status == 200, deployment
        path = f"/v2/deployments/{deployment}/revisions?limit=100"
        async with http.get(path, headers=auth) as r:
            assert r.status == 200
            listed = [rev["id"] for rev in (await r.json())["resources"]]
        # Every acknowledged revision is there, latest first; one more may be there if a
        # PATCH was in flight.
        extra = ledger.pending_revisions.get(deployment, 0)
        assert listed[len(listed) - len(acknowledged) :] == acknowledged[::-1], deployment
        assert len(acknowledged) <= len(listed) <= len(acknowledged) + extra, deployment


async def _wait_lifecycle_resumed(http: aiohttp.ClientSession, ledger: Ledger) -> None:
    """Revisions caught mid-lifecycle by the kill go on after the restart: the newest of
    each deployment is DEPLOYED and active, the older ones are finished too."""
    auth = headers()
    live = [d for d in ledger.deployments if d not in ledger.deleted | ledger.pending_deletes]
    statuses: dict[str, list[str]] = {}
    for _ in range(300):  # bounded: 300 * 0.05 s
        for deployment in live:
            path = f"/v2/deployments/{deployment}/revisions?limit=100"
            async with http.get(path, headers=auth) as r:
                statuses[deployment] = [rev["status"] for rev in (await r.json())["resources"]]
        if all(s[0] == "DEPLOYED" and set(s) <= TERMINAL for s in statuses.values()):
            break
        await asyncio.sleep(0.05)
    for deployment, found in statuses.items():
        assert found[0] == "DEPLOYED" and set(found) <= TERMINAL, (deployment, found)
        async with http.get(f"/v2/deployments/{deployment}", headers=auth) as r:
            shown = await r.json()
        assert shown["active_revision_id"] == shown["latest_revision_id"], deployment


async def _crash_and_recover(tmp_path: Path, *extra: str) -> Ledger:
    first = _start(tmp_path, "first", *extra)
    ledger = Ledger()
    try:
        await asyncio.to_thread(first.wait_ready)
        await _run_until_killed(first, ledger)
    except BaseException:
        print(first.log_text())  # shown by pytest when the test fails
        raise
    finally:
        first.stop()
    assert _integrity(tmp_path / "data") == {
        "store.sqlite3": "ok",
        "control-plane.sqlite3": "ok",
    }
    # So the restart has lifecycles to resume (the workload creates revisions throughout).
    assert _revisions_in_flight(tmp_path / "data") > 0
    second = _start(tmp_path, "second", *extra)
    try:
        await asyncio.to_thread(second.wait_ready)
        async with aiohttp.ClientSession(second.url) as http:
            await _check_store(http, ledger)
            await _check_control_plane(http, ledger)
            await _wait_lifecycle_resumed(http, ledger)
    except BaseException:
        print(second.log_text())
        raise
    finally:
        second.stop()
    return ledger


async def test_acknowledged_writes_survive_kill_9_of_the_gateway(tmp_path: Path) -> None:
    ledger = await _crash_and_recover(tmp_path)
    assert ledger.store_acks >= 50 and ledger.revisions >= 3


async def test_acknowledged_writes_survive_kill_9_of_all_workers(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    # Two proxy workers and the parent that keeps the built-in upstreams: one SIGKILL to
    # the process group takes them all, as an OOM kill or a lost host would.
    ledger = await _crash_and_recover(
        tmp_path, "--workers", "2", "--redis-url", redis_server.url, "--redis-timeout-ms", "1000"
    )
    assert ledger.store_acks >= 50 and ledger.revisions >= 3
