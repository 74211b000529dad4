"""The real `python -m gateway` process: start-up, SIGHUP, graceful stop, workers guard."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest

from tests.support.gateway import ROOT, GatewayProcess


def test_help_explains_and_workers_need_shared_counters(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for words in ("--upstream", "--redis-url", "GATEWAY_", "--trusted-proxy", "Examples"):
        assert words in out
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--workers",
            "2",
            "--no-embedded",
            "--data-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode == 2
    assert "--redis-url" in refused.stderr and "--workers 2" in refused.stderr


def test_bad_configuration_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - {id: x, identity: ip, limits: {us: nope}}\n")
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--rules", str(bad), "--no-embedded"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "bad.yaml" in result.stderr and "limits.us" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--port", "99999"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "port must be 0..65535" in result.stderr


async def test_graceful_stop_finishes_a_stream_in_flight_and_sighup_reloads(tmp_path, upstream):
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {id: all, identity: ip, limits: {default: 1000/60}}\n")
    log = tmp_path / "gateway.log"
    gw = GatewayProcess(
        [
            "--upstream",
            upstream,
            "--rules",
            str(rules),
            "--no-embedded",
            "--data-dir",
            str(tmp_path),
            "--shutdown-timeout",
            "20",
        ],
        log_path=log,
    )
    try:
        await asyncio.to_thread(gw.wait_ready)
        async with aiohttp.ClientSession() as http:
            async with http.get(gw.url + "/info") as r:
                old = (await r.json())["rules"]["hash"]
            rules.write_text("rules:\n  - {id: all2, identity: ip, limits: {default: 999/60}}\n")
            gw.proc.send_signal(signal.SIGHUP)
            for _ in range(100):
                async with http.get(gw.url + "/info") as r:
                    if (await r.json())["rules"]["hash"] != old:
                        break
                await asyncio.sleep(0.05)
            async with http.get(gw.url + "/x") as r:
                assert r.headers["RateLimit-Policy"] == '"all2";q=999;w=60'

            # A stream of ~1.5 s is in flight when SIGTERM arrives: it must complete.
            async with http.get(gw.url + "/ticks?n=6&every=0.25") as r:
                first = await r.content.readline()
                assert first == b"tick\n"
                gw.proc.send_signal(signal.SIGTERM)
                rest = await r.content.read()
                assert rest == b"tick\n" * 5
        code = await asyncio.to_thread(gw.proc.wait, 30)
        assert code == 0
        text = log.read_text()
        assert "stopping: no new connections" in text and "stopped" in text
        assert "gateway listening on http://127.0.0.1:" in text
        assert "region us [default]: counters in in-process memory" in text
        # Where the rest goes, with its URL: a sidecar's operator can check the target.
        assert f"route (everything else) -> default at {upstream}" in text
    finally:
        gw.stop()


def _serve(*args, timeout=30):
    return subprocess.run(
        [sys.executable, "-m", "gateway", "serve", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_workers_fail_fast_and_clearly(tmp_path):
    import socket

    memory = _serve(
        "--workers", "2", "--redis-url", "memory://", "--no-embedded", "--data-dir", str(tmp_path)
    )
    assert memory.returncode == 2 and "needs shared counters" in memory.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - {id: x, identity: ip, limits: {us: 0/1}}\n")
    rules = _serve(
        "--workers",
        "2",
        "--redis-url",
        "redis://127.0.0.1:1/0",
        "--no-embedded",
        "--rules",
        str(bad),
        "--data-dir",
        str(tmp_path),
    )
    assert rules.returncode == 2 and "limits.us" in rules.stderr
    assert "Traceback" not in rules.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = _serve(
            "--workers",
            "2",
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--no-embedded",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path),
        )
    assert taken.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in taken.stderr
    assert "Traceback" not in taken.stderr


async def test_a_second_signal_stops_without_waiting_for_requests_in_flight(tmp_path, upstream):
    """An operator's second Ctrl-C: the first one waits for requests in flight (up to
    shutdown_timeout), the second ends the wait at once; the cut request is still logged."""
    log = tmp_path / "gateway.log"
    access = tmp_path / "access.log"
    gw = GatewayProcess(
        ["--upstream", upstream, "--no-embedded", "--data-dir", str(tmp_path),
         "--shutdown-timeout", "60", "--access-log-file", str(access)],
        log_path=log,
    )  # fmt: skip
    try:
        gw.wait_ready()
        async with aiohttp.ClientSession() as http:
            async with http.get(gw.url + "/ticks?n=200&every=0.25") as r:
                assert await r.content.readline() == b"tick\n"
                gw.proc.send_signal(signal.SIGINT)
                await asyncio.sleep(1.5)
                assert gw.proc.poll() is None, "the first signal waits for the stream"
                assert await r.content.readline() == b"tick\n", "and the stream goes on"
                started = time.monotonic()
                gw.proc.send_signal(signal.SIGINT)
                code = await asyncio.to_thread(gw.proc.wait, 30)
                assert time.monotonic() - started < 10, "not the 60 s shutdown_timeout"
        assert code == 0
        text = log.read_text()
        assert "second signal: stopping now" in text and "stopped" in text
        assert '"GET /ticks" ' in access.read_text(), "the cut request is logged"
    finally:
        gw.stop()


def test_a_taken_port_is_a_failed_start_not_a_graceful_stop(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = _serve("--port", str(port), "--data-dir", str(tmp_path), "--no-embedded")
    assert taken.returncode == 1
    assert "cannot start" in taken.stderr and "address already in use" in taken.stderr
    assert "draining" not in taken.stderr and "graceful stop" not in taken.stderr


def _failed_start(port: int, *args: str) -> tuple[int, str, int]:
    """``gateway serve`` on ``port`` that is expected to fail: its exit status, its
    stderr, and how many connect attempts the data port accepted until it exited."""
    import socket

    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--no-embedded",
         "--upstream", "http://127.0.0.1:9", *args],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        served = 0
        while proc.poll() is None:  # connect attempts until the process is gone
            with socket.socket() as probe:
                probe.settimeout(1)
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    served += 1
            time.sleep(0.005)
        stderr = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, stderr, served


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_taken_admin_port_fails_the_start_before_anything_is_served(tmp_path, workers):
    """Every port is bound before the data plane answers: a gateway that cannot have its
    admin port exits without having served a client or a readiness probe (it once
    answered /ok for a moment, then exited, and a test's readiness wait took it as up)."""
    import socket

    from tests.support.gateway import free_port

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        admin = busy.getsockname()[1]
        code, stderr, served = _failed_start(
            free_port(), "--admin-port", str(admin), "--workers", workers,
            "--redis-url", "redis://127.0.0.1:1/0", "--data-dir", str(tmp_path),
        )  # fmt: skip
    assert served == 0, "the data port accepted connections of a start that failed"
    assert code == 1
    assert f"cannot listen on 127.0.0.1:{admin} (the admin port" in stderr
    assert "Traceback" not in stderr


def test_workers_do_not_outlive_a_supervisor_that_failed_to_start(tmp_path):
    """The supervisor forks its workers, then starts its own part (the admin port's
    application, the built-in services, the console's stores): a failure there ended it
    and left the workers serving the port for good. Now they are stopped with it."""
    import socket
    from pathlib import Path

    from tests.support.gateway import free_port

    port = free_port()
    fault = str(Path(__file__).resolve().parents[1] / "support" / "fail_admin_app")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--admin-port", "0",
         "--workers", "2", "--redis-url", "redis://127.0.0.1:1/0", "--no-embedded",
         "--upstream", "http://127.0.0.1:9", "--data-dir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": fault, "GATEWAY_TEST_FAIL_ADMIN_APP": "1"},
        start_new_session=True,  # its group: orphaned workers are killed below, whatever
    )  # fmt: skip
    try:
        stderr = proc.communicate(timeout=90)[1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode != 0 and "injected" in stderr, stderr[-2000:]
    # Nothing serves the data port any more: the workers went with their supervisor.
    with socket.socket() as probe:
        probe.settimeout(2)
        assert probe.connect_ex(("127.0.0.1", port)) != 0, "a worker still serves the port"


def test_an_unusable_admin_certificate_fails_the_start_before_anything_is_served(tmp_path):
    """The same for the admin port's certificate files: read before the data port
    listens (they were read after it, so the start failed after serving for a moment)."""
    from tests.support.gateway import free_port

    (tmp_path / "tls.crt").write_text("not a certificate\n")
    (tmp_path / "tls.key").write_text("not a key\n")
    config = tmp_path / "gw.yaml"
    config.write_text(f"tls:\n  admin: {{cert: {tmp_path}/tls.crt, key: {tmp_path}/tls.key}}\n")
    code, stderr, served = _failed_start(
        free_port(), "--admin-port", "0", "--config", str(config), "--data-dir", str(tmp_path)
    )
    assert served == 0, "the data port accepted connections of a start that failed"
    assert code == 2 and "admin port" in stderr, stderr[-2000:]
    assert "Traceback" not in stderr


def test_the_test_harness_starts_again_when_a_picked_port_was_taken(tmp_path, monkeypatch):
    """GatewayProcess picks free ports before the process binds them; one taken meanwhile
    (seen in CI) fails that start before it serves, and the harness starts it again on
    fresh ports instead of failing the test that wanted a gateway."""
    import socket

    import tests.support.gateway as support

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = iter([support.free_port(), taken])  # the data port, then the admin port
        real = support.free_port
        monkeypatch.setattr(support, "free_port", lambda: next(picks, None) or real())
        gw = GatewayProcess(["--no-embedded", "--upstream", "http://127.0.0.1:9",
                             "--data-dir", str(tmp_path)])  # fmt: skip
        try:
            assert gw.admin_port == taken
            gw.wait_ready()
            assert gw.admin_port != taken
            with urllib.request.urlopen(f"http://127.0.0.1:{gw.admin_port}/ready") as r:
                assert r.status == 200
        finally:
            gw.stop()


def test_a_generated_control_plane_key_is_never_logged(tmp_path):
    """The first start generates a control-plane credential: the log says where it is
    kept and for which tenant, never the key, at DEBUG either."""
    import json

    log = tmp_path / "gateway.log"
    gw = GatewayProcess(
        ["--data-dir", str(tmp_path / "data"), "--log-level", "DEBUG"], log_path=log
    )
    try:
        gw.wait_ready(60)
    finally:
        gw.stop()
    stored = json.loads((tmp_path / "data" / "control-plane-credential.json").read_text())
    text = log.read_text()
    assert "control-plane-credential.json" in text and stored["tenant_id"] in text
    assert stored["api_key"] not in text


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
async def test_one_signal_to_the_process_group_of_workers_stops_gracefully(tmp_path, upstream, sig):
    """Review finding: with --workers a signal to the process group (a terminal's Ctrl-C,
    systemd's default KillMode) reaches each worker twice, directly and as the
    supervisor's SIGTERM: that is still one graceful stop, not a hurried one."""
    from tests.support.redis_servers import RedisServer

    redis = RedisServer(tmp_path / "redis").start()
    log = tmp_path / "gateway.log"
    gw = GatewayProcess(
        ["--upstream", upstream, "--no-embedded", "--data-dir", str(tmp_path),
         "--shutdown-timeout", "60", "--workers", "2", "--redis-url", redis.url],
        log_path=log, new_session=True,
    )  # fmt: skip
    try:
        gw.wait_ready()
        async with aiohttp.ClientSession() as http:
            async with http.get(gw.url + "/ticks?n=12&every=0.25") as r:
                assert await r.content.readline() == b"tick\n"
                os.killpg(gw.proc.pid, sig)
                try:
                    rest = await r.content.read()
                except aiohttp.ClientPayloadError as exc:
                    await asyncio.to_thread(gw.proc.wait, 30)
                    raise AssertionError(f"cut off:\n{log.read_text()[-3000:]}") from exc
        assert rest == b"tick\n" * 11, "the stream in flight finishes"
        assert await asyncio.to_thread(gw.proc.wait, 30) == 0
        assert "second signal" not in log.read_text()
    finally:
        gw.stop()
        redis.stop()
