"""``GET /ready`` (issue 26 item 3) on real ``gateway serve`` processes: real redis-server
and PostgreSQL processes started here, stopped and started again to make the instance
unready and ready again.

* Everything up: ``200`` on the public port and on the admin port (any ``Host``: probes
  are exempt from the admin port's Host check, like ``/ok``), ``HEAD`` too.
* A region's Redis down with a fail-closed rule there: ``503`` naming the region and the
  rule (and such a request really is refused), never the store's address or password;
  ready again once it answers. With ``--workers 2`` each worker answers on the shared
  port, and the supervisor's admin port answers from its own view of the stores.
* A region's Redis down where every rule fails open (a fail-closed rule elsewhere does
  not count): ``200``, the region listed under ``degraded``.
* The built-in Store's PostgreSQL down: ``503`` naming the services, then ready again
  (one process: the services' breakers and a probe; workers: the workers' own probe).
* A graceful stop: ``/ready`` turns ``503`` while a request is still in flight, ``/ok``
  stays ``200``, and the request completes.

Every wait polls until the state is reached (or a generous deadline fails the test with
the last answer and the gateway's log); nothing asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from tests.support.gateway import GatewayProcess, free_port, running_app, running_gateway
from tests.support.postgres_server import PostgresServer, postgres_server
from tests.support.redis_servers import RedisServer, running_redis

PASSWORD = "eu-store-password-do-not-show"
WAIT_SECONDS = 60.0

Answer = tuple[int, Any]


def _get(url: str, *, method: str = "GET", host: str | None = None) -> Answer:
    headers = {} if host is None else {"Host": host}
    request = urllib.request.Request(url, method=method, headers=headers)  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=5) as r:  # noqa: S310 - loopback
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    return status, (json.loads(raw) if raw else None)


def _wait_for(
    gw: GatewayProcess, url: str, wanted: Callable[[int, Any], bool], what: str
) -> Answer:
    """Poll ``url`` until ``wanted(status, body)``; fail with the last answer and the log."""
    deadline = time.monotonic() + WAIT_SECONDS
    last: Answer | str = "nothing"
    while time.monotonic() < deadline:
        if gw.proc.poll() is not None:
            pytest.fail(f"the gateway exited with {gw.proc.returncode}:\n{gw.log_text()}")
        try:
            status, body = _get(url)
        except OSError as exc:
            last = repr(exc)
        else:
            if wanted(status, body):
                return status, body
            last = (status, body)
        time.sleep(0.1)
    pytest.fail(f"{url} never answered {what}; last: {last}\n{gw.log_text()}")


def _ready(status: int, body: Any) -> bool:
    return status == 200 and body == {"ready": True, "not_ready": [], "degraded": []}


def _findings(body: Any, key: str, check: str) -> list[dict[str, str]]:
    return [f for f in body[key] if f["check"] == check]


def _gateway(tmp_path: Path, args: list[str]) -> GatewayProcess:
    base = ["--data-dir", str(tmp_path / "data"), "--access-log", "off"]
    return GatewayProcess([*base, *args], log_path=tmp_path / "gateway.log").wait_ready(60)


@contextlib.contextmanager
def _running(gw: GatewayProcess) -> Iterator[GatewayProcess]:
    try:
        yield gw
    finally:
        gw.stop()


def _regions_config(tmp_path: Path, us: RedisServer, eu: RedisServer, rules: str) -> list[str]:
    """Two regions, each counted in its own Redis (chosen by Host), and ``rules``."""
    config = tmp_path / "gateway.yaml"
    config.write_text(
        yaml.safe_dump({
            "region": "us",
            "regions": {
                "us": {"redis_url": us.url, "hosts": ["us.test"]},
                "eu": {"redis_url": eu.url, "hosts": ["eu.test"]},
            },
        })
    )  # fmt: skip
    rule_file = tmp_path / "rules.yaml"
    rule_file.write_text(rules)
    return ["--config", str(config), "--rules", str(rule_file), "--no-embedded"]


def test_ready_when_everything_is_up_on_both_ports(tmp_path: Path) -> None:
    with running_redis(tmp_path / "redis") as redis:
        args = ["--redis-url", redis.url, "--no-embedded"]
        with _running(_gateway(tmp_path, args)) as gw:
            admin = f"http://127.0.0.1:{gw.admin_port}"
            _wait_for(gw, gw.url + "/ready", _ready, "ready")
            assert _ready(*_get(admin + "/ready"))
            # Probes reach it by any name, like /ok (the Host check guards /info only).
            assert _ready(*_get(admin + "/ready", host="probe.example.net"))
            assert _get(admin + "/info", host="probe.example.net")[0] == 421
            assert _get(gw.url + "/ready", method="HEAD")[0] == 200
            assert _get(admin + "/ready", method="HEAD")[0] == 200
            assert _get(gw.url + "/ok") == (200, {"ok": True})


@pytest.mark.parametrize("workers", [1, 2])
def test_a_region_store_down_with_a_fail_closed_rule_is_not_ready(
    tmp_path: Path, workers: int
) -> None:
    rules = (
        "rules:\n"
        "  - {id: eu-writes, identity: ip, match: {methods: [POST]}, failure_mode: closed,\n"
        "     limits: {eu: 100/10}}\n"
        "  - {id: all, identity: ip, limits: {default: 1000/60}}\n"
    )
    with (
        running_redis(tmp_path / "us") as us,
        running_redis(tmp_path / "eu", password=PASSWORD) as eu,
    ):
        args = [*_regions_config(tmp_path, us, eu, rules), "--workers", str(workers)]
        with _running(_gateway(tmp_path, args)) as gw:
            admin = f"http://127.0.0.1:{gw.admin_port}"
            _wait_for(gw, gw.url + "/ready", _ready, "ready")
            _wait_for(gw, admin + "/ready", _ready, "ready")

            eu.kill9()

            def eu_down(status: int, body: Any) -> bool:
                down = _findings(body, "not_ready", "counter_store") if status == 503 else []
                return [f["region"] for f in down] == ["eu"]

            for url in (gw.url + "/ready", admin + "/ready"):
                _, body = _wait_for(gw, url, eu_down, "503 naming region eu")
                assert body["ready"] is False and body["degraded"] == []
                detail = _findings(body, "not_ready", "counter_store")[0]["detail"]
                assert "eu-writes" in detail
                text = json.dumps(body)
                assert PASSWORD not in text and str(eu.port) not in text, text
            # What /ready says is what traffic meets: that rule's requests are refused.
            refused = urllib.request.Request(  # noqa: S310 - loopback
                gw.url + "/items", method="POST", data=b"", headers={"Host": "eu.test"}
            )
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(refused, timeout=5)  # noqa: S310
            assert caught.value.code == 503
            assert _get(gw.url + "/ok") == (200, {"ok": True})

            eu.restart()
            _wait_for(gw, gw.url + "/ready", _ready, "ready again")
            _wait_for(gw, admin + "/ready", _ready, "ready again")


def test_a_region_store_down_where_every_rule_fails_open_is_ready_but_degraded(
    tmp_path: Path,
) -> None:
    # The only fail-closed rule holds us, not eu: eu's outage refuses nothing.
    rules = (
        "rules:\n"
        "  - {id: us-writes, identity: ip, match: {methods: [POST]}, failure_mode: closed,\n"
        "     limits: {us: 100/10}}\n"
        "  - {id: all, identity: ip, limits: {default: 1000/60}}\n"
    )
    with running_redis(tmp_path / "us") as us, running_redis(tmp_path / "eu") as eu:
        with _running(_gateway(tmp_path, _regions_config(tmp_path, us, eu, rules))) as gw:
            _wait_for(gw, gw.url + "/ready", _ready, "ready")

            eu.kill9()

            def degraded(status: int, body: Any) -> bool:
                return status == 200 and bool(_findings(body, "degraded", "counter_store"))

            _, body = _wait_for(gw, gw.url + "/ready", degraded, "200 with eu degraded")
            assert body["ready"] is True and body["not_ready"] == []
            assert [f["region"] for f in body["degraded"]] == ["eu"]
            # Ready, so no "not ready" line: the log says it all the same.
            _wait_log(gw, "WARNING gateway.readiness: region eu: the counter store does not answer")
            admin = f"http://127.0.0.1:{gw.admin_port}/ready"
            status, same = _get(admin)
            assert status == 200 and same["degraded"] == body["degraded"]

            # us's store down too: its fail-closed rule makes the instance not ready.
            us.kill9()

            def us_down(status: int, body: Any) -> bool:
                down = _findings(body, "not_ready", "counter_store") if status == 503 else []
                return [f["region"] for f in down] == ["us"]

            _, body = _wait_for(gw, gw.url + "/ready", us_down, "503 naming region us")
            assert [f["region"] for f in body["degraded"]] == ["eu"]

            us.restart()
            eu.restart()
            _wait_for(gw, gw.url + "/ready", _ready, "ready again")
            _wait_log(gw, "region eu: the counter store answers again")
            # us's outage was logged as not ready, not as the fail-open warning.
            assert "region us: the counter store does not answer" not in _log(gw)


def _log(gw: GatewayProcess) -> str:
    assert gw.log_path is not None
    return gw.log_path.read_text(errors="replace")


def _wait_log(gw: GatewayProcess, text: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while text not in _log(gw):
        if time.monotonic() > deadline:
            pytest.fail(f"the log never said {text!r}:\n{gw.log_text()}")
        time.sleep(0.1)


def test_an_unreachable_counter_store_is_said_at_start_up(tmp_path: Path) -> None:
    """A mistyped --redis-url with the shipped rules (which fail open): the instance is
    ready, and the log says within the first checks that its counts are its own."""
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    with _running(_gateway(tmp_path, ["--redis-url", nowhere, "--no-embedded"])) as gw:
        _wait_log(gw, "the counter store does not answer; every rule there fails open")
        status, body = _get(gw.url + "/ready")
        assert status == 200 and _findings(body, "degraded", "counter_store")
        time.sleep(2.5)  # two more rounds of checks
        assert _log(gw).count("the counter store does not answer") == 1  # once, not per check


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test's own (the session's is shared: never stopped)."""
    with postgres_server() as server:
        yield server


@pytest.mark.parametrize("workers", [1, 2])
def test_the_built_in_services_database_down_is_not_ready(
    tmp_path: Path, own_postgres: PostgresServer, workers: int
) -> None:
    database_url = own_postgres.create_database()
    with running_redis(tmp_path / "redis") as redis:
        args = ["--embedded", "--database-url", database_url, "--rules", str(_one_rule(tmp_path))]
        if workers > 1:
            args += ["--workers", str(workers), "--redis-url", redis.url]
        with _running(_gateway(tmp_path, args)) as gw:
            _wait_for(gw, gw.url + "/ready", _ready, "ready")

            own_postgres.stop()

            def database_down(status: int, body: Any) -> bool:
                down = _findings(body, "not_ready", "database") if status == 503 else []
                return {f["service"] for f in down} == {"store", "control-plane"}

            _, body = _wait_for(gw, gw.url + "/ready", database_down, "503 naming the services")
            text = json.dumps(body)
            assert "127.0.0.1" not in text and str(own_postgres.port) not in text, text
            if workers == 1:  # the admin port of the process that runs them agrees
                admin = f"http://127.0.0.1:{gw.admin_port}/ready"
                _wait_for(gw, admin, database_down, "503 naming the services")
            assert _get(gw.url + "/ok") == (200, {"ok": True})

            own_postgres.start()
            _wait_for(gw, gw.url + "/ready", _ready, "ready again")


def _one_rule(tmp_path: Path) -> Path:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {id: all, identity: ip, limits: {default: 1000000/60}}\n")
    return rules


async def test_a_graceful_stop_turns_ready_503_first_and_finishes_the_request(
    tmp_path: Path,
) -> None:
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        entered.set()
        await release.wait()
        return web.json_response({"finished": True})

    upstream = web.Application()
    upstream.router.add_get("/slow", slow)
    async with running_app(upstream) as upstream_url:
        args = ["--upstream", upstream_url, "--rules", str(_one_rule(tmp_path)),
                "--no-embedded", "--shutdown-timeout", "60"]  # fmt: skip
        gw = await asyncio.to_thread(_gateway, tmp_path, args)
        try:
            admin = f"http://127.0.0.1:{gw.admin_port}"
            await asyncio.to_thread(_wait_for, gw, gw.url + "/ready", _ready, "ready")
            async with aiohttp.ClientSession() as http:

                async def in_flight() -> tuple[int, Any]:
                    async with http.get(gw.url + "/slow") as r:
                        return r.status, await r.json()

                request = asyncio.create_task(in_flight())
                await asyncio.wait_for(entered.wait(), WAIT_SECONDS)
                gw.proc.send_signal(signal.SIGTERM)

                def draining(status: int, body: Any) -> bool:
                    return status == 503 and bool(_findings(body, "not_ready", "draining"))

                # The request is held upstream all along: this is during the drain.
                await asyncio.to_thread(_wait_for, gw, admin + "/ready", draining, "503")
                assert not request.done()
                assert await asyncio.to_thread(_get, admin + "/ok") == (200, {"ok": True})

                release.set()
                assert await request == (200, {"finished": True})
            assert await asyncio.to_thread(gw.proc.wait, 30) == 0
            assert "not ready: draining" in gw.log_text()
        finally:
            release.set()
            gw.stop()


FAIL_CLOSED_ONLY_IN_EU = (
    "rules:\n"
    "  - {id: eu-writes, identity: ip, failure_mode: closed, limits: {eu: 10/10}}\n"
    "  - {id: all, identity: ip, limits: {default: 1000/60}}\n"
)
# What the rules may add, and whether it makes us's outage refuse requests (not ready).
TABLE_CHANGES = [
    ("a shadow rule never refuses", False,
     "  - {id: trial, identity: ip, shadow: true, failure_mode: closed, limits: {us: 5/10}}\n"),
    ("an unlimited rule is never counted", False,
     "  - {id: free, match: {path: /free}, unlimited: true, failure_mode: closed}\n"),
    ("a tier's limits count", True,
     "  - {id: tiered, identity: api_key, failure_mode: closed, limits: {eu: 10/10},\n"
     "     tiers: {pro: {us: 100/10}}}\n"),
    ("a ceiling counts", True,
     "ceilings:\n"
     "  - {id: backstop, identity: ip, failure_mode: closed, limits: {us: 9000/10}}\n"),
]  # fmt: skip


async def _ready_answer(http: aiohttp.ClientSession, url: str) -> Answer:
    async with http.get(url + "/ready") as r:
        return r.status, await r.json()


@pytest.mark.parametrize(
    ("change", "refuses", "text"), TABLE_CHANGES, ids=[c[0] for c in TABLE_CHANGES]
)
async def test_the_verdict_follows_the_rule_table_in_force(
    tmp_path: Path, change: str, refuses: bool, text: str
) -> None:
    """us's counter store does not answer (nothing listens on its port). Whether that
    makes the instance not ready is read from the table in force at each answer: a
    reload that adds a fail-closed rule for us turns it 503 at once."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(FAIL_CLOSED_ONLY_IN_EU)
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    async with (
        running_gateway(rules=[str(rules)], redis_url=nowhere) as gw,
        aiohttp.ClientSession() as http,
    ):
        deadline = time.monotonic() + WAIT_SECONDS
        while True:  # until the first PING has failed
            status, body = await _ready_answer(http, gw.url)
            if (status == 200 and body["degraded"]) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert status == 200 and [f["region"] for f in body["degraded"]] == ["us"], body

        if text.startswith("ceilings:"):
            rules.write_text(FAIL_CLOSED_ONLY_IN_EU + text)
        else:
            rules.write_text(FAIL_CLOSED_ONLY_IN_EU.replace("rules:\n", "rules:\n" + text))
        assert gw.rules.reload("test"), gw.rules.last_error
        status, body = await _ready_answer(http, gw.url)
        if refuses:
            assert status == 503 and body["degraded"] == [], body
            (finding,) = body["not_ready"]
            rule_id = text.split("id: ")[1].split(",")[0]
            assert finding["region"] == "us" and rule_id in finding["detail"], finding
        else:
            assert status == 200 and body["not_ready"] == [], body

        # A reload refused keeps the table in force and says so, as a warning only.
        rules.write_text("rules: [")
        assert not gw.rules.reload("test")
        status, after = await _ready_answer(http, gw.url)
        assert status == (503 if refuses else 200)
        expected = ["rules"] if refuses else ["rules", "counter_store"]
        assert [f["check"] for f in after["degraded"]] == expected, after
