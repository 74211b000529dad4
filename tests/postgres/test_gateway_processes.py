"""Full ``gateway serve --embedded --database-url ...`` processes on one PostgreSQL database.

Each gateway here is a real child process (its own Store, control plane, pools and
lifecycle driver), as a gateway on another host would be. The database records every
committed status change with a trigger, so "each step once, in order, none lost" is read
from the database itself, not from what the gateways say.

To kill an instance *mid-step*, the trigger stalls the first step into ``BUILDING`` (once:
a sequence, which a rollback does not undo, counts the stalls). While it stalls, the step is
written inside the driver's transaction (which holds the control plane's write lock) but not
committed; the test finds which gateway owns that connection and kills or freezes it there.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from gateway.upstreams.control_plane.lifecycle import REVISION_FLOW
from tests.control_plane.support import control_plane_section, deployment_body, headers
from tests.support.gateway import GatewayProcess

RULES = "rules:\n  - {id: all, identity: ip, limits: {default: 1000000/60}}\n"
STEP = 0.2  # revision_step_seconds of both gateways
STALL = 2.0  # seconds the first step into BUILDING stalls (under the 5 s statement_timeout)
DEPLOYMENTS = 3

RECORD_STEPS = f"""
CREATE TABLE status_log (revision text, old text, new text, seq bigserial);
CREATE SEQUENCE stalls;
CREATE FUNCTION log_status() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status <> OLD.status THEN
    INSERT INTO status_log (revision, old, new) VALUES (NEW.id, OLD.status, NEW.status);
    IF NEW.status = 'BUILDING' AND nextval('stalls') = 1 THEN
      PERFORM pg_sleep({STALL});
    END IF;
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER revisions_log AFTER UPDATE ON revisions
  FOR EACH ROW EXECUTE FUNCTION log_status();
"""


def _gateway(tmp_path: Path, name: str, database_url: str) -> GatewayProcess:
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"control_plane": control_plane_section(step=STEP)}))
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    args = ["--embedded", "--config", str(config), "--rules", str(rules),
            "--data-dir", str(tmp_path / name), "--access-log", "off",
            "--database-url", database_url]  # fmt: skip
    return GatewayProcess(args, admin_port=0, log_path=tmp_path / f"{name}.log", new_session=True)


@contextlib.contextmanager
def _gateways(tmp_path: Path, database_url: str, *names: str) -> Iterator[list[GatewayProcess]]:
    started: list[GatewayProcess] = []
    try:
        for name in names:  # one at a time: the first migrates, the others find it done
            started.append(_gateway(tmp_path, name, database_url).wait_ready(60))
        yield started
    finally:
        for gw in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(gw.proc.pid, signal.SIGCONT)
            gw.stop()


def _call(method: str, url: str, body: Any = None, **extra: str) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(  # noqa: S310 (loopback only)
        url, data=data, method=method, headers={"Content-Type": "application/json", **extra}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:  # noqa: S310
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def _group(leader: int) -> list[int]:
    """Every process in ``leader``'s process group (the gateway and anything it forked)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ProcessLookupError):
                if os.getpgid(int(entry.name)) == leader:
                    members.append(int(entry.name))
    return members


def _owner_of_local_port(gateways: list[GatewayProcess], port: int) -> GatewayProcess:
    """The gateway holding the TCP socket whose local port is ``port``."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for gw in gateways:
        for pid in _group(gw.proc.pid):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return gw
    raise AssertionError(f"no gateway owns the database connection from port {port}")


def _wait_for_stalled_step(database_url: str, timeout: float = 30) -> int:
    """The client port of the connection whose step into BUILDING is stalled."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(database_url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT client_port FROM pg_stat_activity WHERE wait_event = 'PgSleep' "
                "AND application_name = 'gateway-control-plane'"
            ).fetchone()
            if row is not None:
                return int(row[0])
            time.sleep(0.02)
    raise AssertionError("no lifecycle step stalled")


def _histories(database_url: str) -> dict[str, list[tuple[str, str]]]:
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT revision, old, new FROM status_log ORDER BY seq").fetchall()
    steps: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for revision, old, new in rows:
        steps[revision].append((old, new))
    return dict(steps)


def _wait_all_deployed(database_url: str, revisions: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with psycopg.connect(database_url, autocommit=True) as conn:
        while True:
            statuses = {
                rid: status
                for rid, status in conn.execute(
                    "SELECT id, status FROM revisions WHERE id = ANY(%s)", (revisions,)
                ).fetchall()
            }
            if set(statuses.values()) == {"DEPLOYED"} and len(statuses) == len(revisions):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"revisions stuck: {statuses}")
            time.sleep(0.1)


def _start_lifecycles(database_url: str, gateways: list[GatewayProcess]) -> list[str]:
    """Install the step recorder, create deployments through both gateways; their revisions."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(RECORD_STEPS)
    revisions = []
    for n in range(DEPLOYMENTS):
        status, body = _call(
            "POST",
            gateways[n % len(gateways)].url + "/v2/deployments",
            deployment_body(f"kill-{n}"),
            **headers(),
        )
        assert status == 201, body
        revisions.append(body["latest_revision_id"])
    return revisions


def _assert_each_step_once_in_order(database_url: str, revisions: list[str]) -> None:
    histories = _histories(database_url)
    assert set(histories) == set(revisions)
    expected = list(itertools.pairwise(REVISION_FLOW))
    for revision in revisions:
        assert histories[revision] == expected, (revision, histories[revision])
    with psycopg.connect(database_url) as conn:
        attempts = conn.execute("SELECT last_value FROM stalls").fetchone()
    # One step into BUILDING per revision committed, plus the stalled one, which the
    # instance stopped there never committed (the sequence keeps the count of attempts).
    assert attempts == (len(revisions) + 1,)


@pytest.mark.timeout(180)
def test_an_instance_killed_mid_step_leaves_no_stuck_revision(
    pg_database_url: str, tmp_path: Path
) -> None:
    with _gateways(tmp_path, pg_database_url, "a", "b") as gateways:
        revisions = _start_lifecycles(pg_database_url, gateways)
        port = _wait_for_stalled_step(pg_database_url)
        driver = _owner_of_local_port(gateways, port)
        survivor = next(gw for gw in gateways if gw is not driver)
        # SIGKILL mid-step: the step is written in the driver's open transaction, which
        # holds the control plane's write lock; nothing of it is committed.
        assert driver.kill_group() == -signal.SIGKILL
        _wait_all_deployed(pg_database_url, revisions, timeout=60)
        _assert_each_step_once_in_order(pg_database_url, revisions)
        status, listed = _call("GET", survivor.url + "/v2/deployments", **headers())
        assert status == 200
        by_name = {d["name"]: d for d in listed["resources"]}
        assert {by_name[f"kill-{n}"]["status"] for n in range(DEPLOYMENTS)} == {"READY"}


@pytest.mark.timeout(180)
def test_an_instance_frozen_mid_step_leaves_no_stuck_revision_and_steps_nothing_twice(
    pg_database_url: str, tmp_path: Path
) -> None:
    """A frozen instance (SIGSTOP: a hung host, a network partition) keeps its connection
    open and its transaction with it: the database must end that transaction by itself
    (``idle_in_transaction_session_timeout``), or its write lock blocks every other
    instance for as long as the instance stays frozen."""
    with _gateways(tmp_path, pg_database_url, "a", "b") as gateways:
        revisions = _start_lifecycles(pg_database_url, gateways)
        port = _wait_for_stalled_step(pg_database_url)
        driver = _owner_of_local_port(gateways, port)
        os.killpg(driver.proc.pid, signal.SIGSTOP)
        _wait_all_deployed(pg_database_url, revisions, timeout=60)
        _assert_each_step_once_in_order(pg_database_url, revisions)
        # It wakes up: its pending step fails to commit, and it steps nothing again.
        os.killpg(driver.proc.pid, signal.SIGCONT)
        time.sleep(3 * STEP + 2)
        _assert_each_step_once_in_order(pg_database_url, revisions)
        for gw in gateways:
            status, listed = _call("GET", gw.url + "/v2/deployments", **headers())
            assert status == 200, listed
            assert {d["status"] for d in listed["resources"]} == {"READY"}


@pytest.mark.timeout(120)
def test_two_gateways_serve_one_store_and_one_control_plane(
    pg_database_url: str, tmp_path: Path
) -> None:
    with _gateways(tmp_path, pg_database_url, "a", "b") as (a, b):
        for n in range(20):
            writer, reader = (a, b) if n % 2 else (b, a)
            item = {"namespace": ["shared", "n"], "key": f"k{n}", "value": {"n": n}}
            assert _call("PUT", writer.url + "/store/items", item)[0] == 204
            query = f"/store/items?namespace=shared.n&key=k{n}"
            status, got = _call("GET", reader.url + query)  # at once: no wait, no retry
            assert status == 200 and got["value"] == {"n": n}, got
            # Rewritten through the reader, read back through the writer.
            item["value"] = {"n": n, "again": True}
            assert _call("PUT", reader.url + "/store/items", item)[0] == 204
            assert _call("GET", writer.url + query)[1]["value"] == {"n": n, "again": True}
        key = {"namespace": ["shared", "n"], "key": "k0"}
        assert _call("DELETE", a.url + "/store/items", key)[0] == 204
        assert _call("GET", b.url + "/store/items?namespace=shared.n&key=k0") == (200, None)
        status, found = _call("POST", b.url + "/store/items/search",
                              {"namespace_prefix": ["shared"], "limit": 100})  # fmt: skip
        assert status == 200
        assert {i["key"] for i in found["items"]} == {f"k{n}" for n in range(1, 20)}

        status, created = _call("POST", a.url + "/v2/deployments",
                                deployment_body("shared-one"), **headers())  # fmt: skip
        assert status == 201, created
        status, seen = _call("GET", f"{b.url}/v2/deployments/{created['id']}", **headers())
        assert status == 200, seen
        assert (seen["name"], seen["latest_revision_id"]) == (
            "shared-one",
            created["latest_revision_id"],
        )
        patch = {"source_revision_config": {"repo_ref": "v2"}}
        status, patched = _call("PATCH", f"{b.url}/v2/deployments/{created['id']}", patch,
                                **headers())  # fmt: skip
        assert status == 200, patched
        status, revisions = _call(
            "GET", f"{a.url}/v2/deployments/{created['id']}/revisions", **headers()
        )
        assert status == 200
        assert [r["id"] for r in revisions["resources"]] == [
            patched["latest_revision_id"],
            created["latest_revision_id"],
        ]
        assert _call("DELETE", f"{b.url}/v2/deployments/{created['id']}", **headers())[0] == 204
        status, gone = _call("GET", f"{a.url}/v2/deployments/{created['id']}", **headers())
        assert status == 404, gone
