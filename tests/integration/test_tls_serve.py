"""`gateway serve` with HTTPS as a real process: the start-up log, requests, a SIGHUP
rotation, /info on the admin port's own certificate, and unusable files refused as a
configuration error (also before --workers forks)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_tls_gateway import fetch
from tests.support.gateway import ROOT, SECRET, free_port, running_app
from tests.support.redis_servers import RedisServer
from tests.support.tls_pki import Pki, swap_to, write_pair
from tests.support.upstream import create_upstream_app


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki()


def start(args: list[str], log: Path) -> subprocess.Popen:
    env = {"GATEWAY_IDENTITY_SECRET": SECRET.decode(), "PATH": "/usr/bin:/bin"}
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", *args],
        cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip


async def test_serve_https_end_to_end(tmp_path: Path, pki: Pki) -> None:
    live, admin_live = tmp_path / "live", tmp_path / "admin-live"
    write_pair(tmp_path / "g1", pki.issue("gateway.test", serial=0x901))
    write_pair(tmp_path / "a1", pki.issue("admin.test", serial=0xA01))
    swap_to(live, tmp_path / "g1")
    swap_to(admin_live, tmp_path / "a1")
    config = tmp_path / "gw.yaml"
    config.write_text(
        f"tls:\n  cert: {live}/tls.crt\n  key: {live}/tls.key\n"
        f"  admin: {{cert: {admin_live}/tls.crt, key: {admin_live}/tls.key}}\n"
    )
    port, admin_port = free_port(), free_port()
    log = tmp_path / "gateway.log"
    async with running_app(create_upstream_app()) as upstream:
        proc = start(
            ["--upstream", upstream, "--port", str(port), "--admin-port", str(admin_port),
             "--config", str(config), "--data-dir", str(tmp_path / "data")],
            log,
        )  # fmt: skip
        try:
            for _ in range(3000):
                assert proc.poll() is None, log.read_text()
                try:
                    serial, status, headers, _ = await fetch(port, pki, "/runs", {"x-api-key": "k"})
                    break
                except OSError:
                    await asyncio.sleep(0.01)
            assert serial == 0x901 and status == 200 and "ratelimit" in headers
            text = log.read_text()
            assert "TLS on the proxy port: certificate " in text
            assert f"gateway listening on https://127.0.0.1:{port}" in text
            assert "TLS on the admin port: certificate " in text
            assert f"metrics on https://127.0.0.1:{admin_port}/metrics" in text
            # A SIGHUP rotation of both.
            write_pair(tmp_path / "g2", pki.issue("gateway.test", serial=0x902))
            write_pair(tmp_path / "a2", pki.issue("admin.test", serial=0xA02))
            swap_to(live, tmp_path / "g2")
            swap_to(admin_live, tmp_path / "a2")
            proc.send_signal(signal.SIGHUP)
            for _ in range(3000):
                if (await fetch(port, pki, "/ok"))[0] == 0x902:
                    break
                await asyncio.sleep(0.01)
            for _ in range(3000):
                serial, status, _, body = await fetch(admin_port, pki, "/info")
                if serial == 0xA02:
                    break
                await asyncio.sleep(0.01)
            assert (serial, status) == (0xA02, 200)
            info = json.loads(body)
            assert info["tls"]["serial"] == "902" and info["admin_tls"]["serial"] == "a02"
            assert info["tls"]["reloads"] == 1 and info["admin_tls"]["reloads"] == 1
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, log.read_text()


def test_unusable_files_are_a_configuration_error(tmp_path: Path) -> None:
    for extra in ([], ["--workers", "2", "--redis-url", "redis://127.0.0.1:1/0"]):
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "serve", "--port", str(free_port()),
             "--tls-cert", str(tmp_path / "missing.crt"), "--tls-key", str(tmp_path / "k"),
             "--data-dir", str(tmp_path / "data"), *extra],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
            env={"GATEWAY_IDENTITY_SECRET": SECRET.decode(), "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert (
            f"gateway: configuration error: HTTPS on the proxy port: TLS certificate file "
            f"{tmp_path / 'missing.crt'} does not exist" in done.stderr
        ), done.stderr


async def test_the_supervisors_admin_port_serves_its_own_certificate(
    tmp_path: Path, pki: Pki
) -> None:
    # With --workers the supervisor serves the admin port: tls.admin applies there too
    # (it used to be plain HTTP whatever the configuration said), and rotates on SIGHUP.
    admin_live = tmp_path / "admin-live"
    write_pair(tmp_path / "a1", pki.issue("admin.test", serial=0xB01))
    swap_to(admin_live, tmp_path / "a1")
    config = tmp_path / "gw.yaml"
    config.write_text(f"tls:\n  admin: {{cert: {admin_live}/tls.crt, key: {admin_live}/tls.key}}\n")
    port, admin_port = free_port(), free_port()
    log = tmp_path / "gateway.log"
    redis = RedisServer(tmp_path / "redis").start()  # workers need shared counters
    proc = start(
        ["--workers", "2", "--redis-url", redis.url, "--no-embedded", "--port", str(port),
         "--admin-port", str(admin_port), "--config", str(config),
         "--data-dir", str(tmp_path / "data")],
        log,
    )  # fmt: skip
    try:
        status = 0
        for _ in range(3000):
            assert proc.poll() is None, log.read_text()
            try:
                serial, status, _, body = await fetch(admin_port, pki, "/info")
                break
            except OSError:
                await asyncio.sleep(0.01)
        assert (serial, status) == (0xB01, 200), log.read_text()
        info = json.loads(body)
        assert info["workers"] == 2 and info["admin_tls"]["serial"] == "b01"
        assert (await fetch(admin_port, pki, "/ready"))[1] in (200, 503)
        # plain HTTP on it fails the handshake: no answer in clear
        reader, writer = await asyncio.open_connection("127.0.0.1", admin_port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert not answer.startswith(b"HTTP/1.1 200")
        text = log.read_text()
        assert "TLS on the admin port: certificate " in text
        assert f"metrics of all 2 workers on https://127.0.0.1:{admin_port}/metrics" in text
        # SIGHUP to the supervisor rotates the admin port's pair
        write_pair(tmp_path / "a2", pki.issue("admin.test", serial=0xB02))
        swap_to(admin_live, tmp_path / "a2")
        proc.send_signal(signal.SIGHUP)
        for _ in range(3000):
            serial, status, _, body = await fetch(admin_port, pki, "/info")
            if serial == 0xB02:
                break
            await asyncio.sleep(0.01)
        assert (serial, status) == (0xB02, 200)
        assert json.loads(body)["admin_tls"]["reloads"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        redis.stop()
        assert code == 0, log.read_text()
