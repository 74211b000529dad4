"""``gateway health``, the container healthcheck: it reads the settings `gateway serve`
reads, so it follows the port wherever it is set and speaks HTTPS when TLS is on (the
image's plain-HTTP one-liner failed with 400 then: user review), and asks the admin port
when the proxy port requires client certificates. Real gateway processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.gateway import ROOT, SECRET, free_port
from tests.support.tls_pki import Pki, write_pair


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki()


def _env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(GATEWAY_IDENTITY_SECRET=SECRET.decode(), **settings)
    return env


def _health(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "health", *args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def _serve(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--no-embedded"],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def _until_healthy(proc: subprocess.Popen[bytes], env: dict[str, str], log: Path) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        done = _health(env)
        if done.returncode == 0:
            return done.stdout
        time.sleep(0.2)
    pytest.fail(f"never healthy: {done.stderr}\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=30)


def test_plain_http_on_a_port_set_in_the_config_file(tmp_path: Path) -> None:
    port, admin = free_port(), free_port()
    config = tmp_path / "gateway.yaml"
    config.write_text(f"port: {port}\nadmin_port: {admin}\ndata_dir: {tmp_path / 'data'}\n")
    env = _env(GATEWAY_CONFIG=str(config))
    assert _health(env).returncode == 1  # nothing listens yet
    proc = _serve(env, tmp_path / "gateway.log")
    try:
        seen = _until_healthy(proc, env, tmp_path / "gateway.log")
        assert f"http://127.0.0.1:{port}/ok (proxy port): 200" in seen
        ready = _health(env, "--ready")
        assert ready.returncode == 0 and "/ready" in ready.stdout
    finally:
        _stop(proc)
    gone = _health(env)
    assert gone.returncode == 1 and "ConnectionRefusedError" in gone.stderr


def test_https_on_the_proxy_port(tmp_path: Path, pki: Pki) -> None:
    write_pair(tmp_path / "tls", pki.issue("gateway.example.com"))
    port = free_port()
    env = _env(
        GATEWAY_PORT=str(port), GATEWAY_ADMIN_PORT=str(free_port()),
        GATEWAY_DATA_DIR=str(tmp_path / "data"),
        GATEWAY_TLS_CERT=str(tmp_path / "tls" / "tls.crt"),
        GATEWAY_TLS_KEY=str(tmp_path / "tls" / "tls.key"),
    )  # fmt: skip
    proc = _serve(env, tmp_path / "gateway.log")
    try:
        seen = _until_healthy(proc, env, tmp_path / "gateway.log")
        assert f"https://127.0.0.1:{port}/ok (proxy port): 200" in seen
        # What the image's probe did before: plain HTTP to the TLS port is refused.
        with pytest.raises(urllib.error.HTTPError) as plain:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ok", timeout=5)  # noqa: S310
        assert plain.value.code == 400
    finally:
        _stop(proc)


def test_client_certificates_required_asks_the_admin_port(tmp_path: Path, pki: Pki) -> None:
    write_pair(tmp_path / "tls", pki.issue("gateway.example.com"))
    ca = tmp_path / "ca.crt"
    from tests.support.tls_pki import pem

    ca.write_bytes(pem(pki.ca.cert))
    admin = free_port()
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"port: {free_port()}\nadmin_port: {admin}\ndata_dir: {tmp_path / 'data'}\n"
        f"tls:\n  cert: {tmp_path / 'tls' / 'tls.crt'}\n  key: {tmp_path / 'tls' / 'tls.key'}\n"
        f"  client_ca: {ca}\n  client_auth: required\n"
    )
    env = _env(GATEWAY_CONFIG=str(config))
    proc = _serve(env, tmp_path / "gateway.log")
    try:
        seen = _until_healthy(proc, env, tmp_path / "gateway.log")
        assert f"http://127.0.0.1:{admin}/ok (admin port): 200" in seen
    finally:
        _stop(proc)


def test_a_configuration_error_is_said_and_exits_2(tmp_path: Path) -> None:
    done = _health(_env(GATEWAY_PORT="99999"))
    assert done.returncode == 2 and "port must be 0..65535" in done.stderr
