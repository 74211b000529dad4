"""The console's explain form reads a described request as the data plane does.

It used to read headers as claimed: with verified keys it called an over-length key
absent where the gateway answers 401, and explained an ``x_api_key`` header the gateway
refuses (400). Here a real ``gateway serve`` answers the same requests on its proxy port
and through the console on its admin port, and neither explain (console or
``gateway rules explain``) writes a line to the operator's access log.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from gateway.app import console_source
from gateway.identity.key_edit import add_key
from gateway.metrics import Metrics
from gateway.proxy.admin import create_admin_app
from gateway.proxy.reload import RuleSource
from gateway.settings import load_settings
from tests.support.gateway import SECRET, GatewayProcess, raw_request, running_app, running_gateway

RULES = (
    "rules:\n"
    "  - id: per-key\n    identity: api_key\n    limits: {default: 50/60}\n"
    "  - id: per-ip\n    identity: ip\n    limits: {default: 100/60}\n"
)
LONG_KEY = "k" * 300  # over the 256 bytes an identity header may hold


def _config(tmp_path: Path, **extra: str) -> tuple[Path, Path, str]:
    """(config file, rules file, a known key): known keys, unknown ones refused."""
    keys = tmp_path / "keys.yaml"
    known = add_key(keys, "acme")
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"identity:\n  api_key: {{keys: {keys}, unknown: reject}}\n"
        + "".join(f"{name}: {value}\n" for name, value in extra.items())
    )
    return config, rules, known


async def _explain(http: aiohttp.ClientSession, url: str, headers: str) -> tuple[int, str]:
    body = {"method": "GET", "path": "/x", "headers": headers, "region": "us"}
    async with http.post(url + "/console/api/explain", json=body) as r:
        data = await r.json()
        return r.status, data.get("text") or data["detail"]


async def _status(port: int, header: bytes) -> int:
    head = b"GET /x HTTP/1.1\r\nHost: localhost\r\n" + header + b"\r\n\r\n"
    answer = await raw_request(port, head)
    return int(answer.split(b" ", 2)[1])


def _lines(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.exists() else 0


async def _settled_lines(path: Path, at_least: int) -> int:
    """The access log's line count once the gateway's batch (50 ms) is written."""
    deadline = time.monotonic() + 10
    while _lines(path) < at_least:
        assert time.monotonic() < deadline, path.read_text() if path.exists() else "no log"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    return _lines(path)


async def test_the_console_and_the_running_gateway_tell_the_same_story(tmp_path):
    log = tmp_path / "access.log"
    config, rules, known = _config(
        tmp_path, access_log="plain", access_log_file=str(log), data_dir=str(tmp_path)
    )
    gateway = GatewayProcess(
        ["--config", str(config), "--rules", str(rules), "--no-embedded"],
        log_path=tmp_path / "gateway.log",
    )
    try:
        await asyncio.to_thread(gateway.wait_ready)
        # The data plane: an over-length key is an unknown one (401), x_api_key a refused
        # spelling (400), each an access-log line.
        assert await _status(gateway.port, b"x-api-key: " + LONG_KEY.encode()) == 401
        assert await _status(gateway.port, b"x_api_key: " + known.encode()) == 400
        before = await _settled_lines(log, 2)
        admin = f"http://127.0.0.1:{gateway.admin_port}"
        async with aiohttp.ClientSession() as http:
            status, text = await _explain(http, admin, f"x-api-key: {LONG_KEY}")
            assert status == 200, text
            # (as claimed, the console said: no valid x-api-key header, per-ip counts it)
            assert "the API key is unknown: answered 401" in text
            assert "answer: 401 once the rule below lets it through" in text
            assert "= per-ip: MATCHES" in text and LONG_KEY not in text
            status, detail = await _explain(http, admin, f"x_api_key: {known}")
            assert status == 422 and "the gateway refuses this request (400)" in detail
            assert known not in detail
            status, text = await _explain(http, admin, f"X-API-Key: {known}")
            assert status == 200 and "known API key of consumer acme" in text
            assert "= per-key: MATCHES" in text and known not in text
            # read again and again: fresh counters each time, never a 429 of its own
            for _ in range(60):
                status, text = await _explain(http, admin, f"x-api-key: {known}")
                assert status == 200 and "= per-key: MATCHES" in text
        await asyncio.sleep(0.3)
        assert _lines(log) == before, log.read_text()  # no line for any explained request
    finally:
        gateway.stop()
    assert "Traceback" not in gateway.log_text()


async def test_a_supervisors_console_reads_the_configs_identities(tmp_path):
    """With ``--workers`` the console is the supervisor's, which serves no request: it
    loads the config's identities for the form and reads the key file again when it
    changes. Compared with an in-process data plane on the same config."""
    config, rules, known = _config(tmp_path)
    settings = load_settings(
        {"rules": [str(rules)], "embedded": False, "access_log": "off"},
        env={},
        config_file=str(config),
    )
    metrics = Metrics()
    source = RuleSource.load(settings.rules, ["us"], metrics)

    async def regions() -> list[dict[str, object]]:
        return [{"name": "us", "counter_backend": "memory", "healthy": True}]

    console = console_source(settings, source, regions, metrics.registry, lambda: [], SECRET)
    app = create_admin_app(metrics.registry, None, console)
    async with (
        running_gateway(None, rules=[str(rules)], config_file=str(config)) as gw,
        running_app(app) as admin,
        aiohttp.ClientSession() as http,
    ):
        port = int(gw.url.rsplit(":", 1)[1])
        assert await _status(port, b"x-api-key: " + LONG_KEY.encode()) == 401
        status, text = await _explain(http, admin, f"x-api-key: {LONG_KEY}")
        assert status == 200 and "the API key is unknown: answered 401" in text
        assert await _status(port, b"x_api_key: " + known.encode()) == 400
        status, detail = await _explain(http, admin, f"x_api_key: {known}")
        assert status == 422 and "(400)" in detail
        status, text = await _explain(http, admin, f"x-api-key: {known}")
        assert "known API key of consumer acme" in text
        # a key added to the file: known to the console's next reading
        added = add_key(tmp_path / "keys.yaml", "beta", "gold")
        status, text = await _explain(http, admin, f"x-api-key: {added}")
        assert status == 200 and "known API key of consumer beta, tier gold" in text


def test_rules_explain_neither_opens_nor_writes_the_access_log(tmp_path):
    log = tmp_path / "access.log"
    config, rules, known = _config(tmp_path, access_log="plain", access_log_file=str(log))
    for header in (f"x-api-key: {known}", f"x-api-key: {LONG_KEY}", "x-user-id: u1"):
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "rules", "explain", "GET", "/x", "--rules",
             str(rules), "--config", str(config), "-H", header],
            capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
            env={**os.environ, "GATEWAY_IDENTITY_SECRET": SECRET.decode()},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "MATCHES" in done.stdout
    assert not log.exists()
