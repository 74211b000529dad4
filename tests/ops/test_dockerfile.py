"""The image's definition: what can be checked without a container engine, and its command
line run for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gateway.cli import build_parser
from tests.ops.helpers import DOCKERIGNORE, ROOT, read_dockerfile, setting_env_names
from tests.support.gateway import free_port

DOCKER = read_dockerfile()


def test_small_base_and_two_stages_from_python_slim():
    assert DOCKER.stages, "no FROM"
    assert all(stage.split()[0] == "python:3.11-slim" for stage in DOCKER.stages)


def test_runs_as_a_non_root_user():
    user = DOCKER.all("USER")
    assert user, "the final stage sets USER"
    name = user[-1].split(":")[0]
    assert name not in ("root", "0")


def test_environment_names_are_real_settings():
    env = DOCKER.env
    gateway_names = {k for k in env if k.startswith("GATEWAY_")}
    assert gateway_names <= setting_env_names(), gateway_names - setting_env_names()
    assert env["GATEWAY_HOST"] == "0.0.0.0"
    assert env["GATEWAY_RULES"] == "/etc/gateway/rules"
    assert env["GATEWAY_DATA_DIR"] == "/data"


def test_rules_are_baked_in_where_gateway_rules_points():
    copies = DOCKER.copies()
    assert copies["/etc/gateway/rules"] == ROOT / "rules"
    assert (ROOT / "rules" / "default.yaml").is_file()
    assert "/data" in json.loads(DOCKER.one("VOLUME"))


def test_exposes_the_traffic_and_admin_ports():
    assert DOCKER.one("EXPOSE").split() == ["8080", "9090"]
    defaults = build_parser().parse_args(["serve"])
    assert defaults.port is None and defaults.admin_port is None  # 8080 / 9090 by default


def test_command_line_parses_with_the_cli():
    argv = [*DOCKER.entrypoint, *DOCKER.cmd]
    assert argv[:2] == ["gateway", "serve"]
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve"


def test_healthcheck_is_the_health_command():
    options, command = DOCKER.healthcheck
    assert command == ["gateway", "health"], "liveness, with the settings serve reads"
    assert build_parser().parse_args(command[1:]).command == "health"
    assert any(o.startswith("--timeout=3s") for o in options), "above the probe's own 2 s"


def test_dockerignore_keeps_the_build_context_small_but_complete():
    ignored = {
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "data", "tests"} <= ignored
    needed = {"gateway", "rules", "pyproject.toml", "README.md"}
    assert not needed & ignored


def _image_environment(tmp_path: Path, port: int, admin_port: int) -> dict[str, str]:
    """The image's ENV as the process would see it, with paths inside the image mapped to
    what COPY puts there, and the listeners moved to loopback and free ports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    copies = DOCKER.copies()
    for name, value in DOCKER.env.items():
        if name == "PATH":
            continue
        env[name] = str(copies.get(value.rstrip("/"), value))
    env.update(
        GATEWAY_HOST="127.0.0.1",
        GATEWAY_ADMIN_HOST="127.0.0.1",
        GATEWAY_PORT=str(port),
        GATEWAY_ADMIN_PORT=str(admin_port),
        GATEWAY_DATA_DIR=str(tmp_path / "data"),
        GATEWAY_SHUTDOWN_TIMEOUT="10",
    )
    return env


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310
        return response.status, response.read()


def _wait_ok(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"gateway exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if _get(url)[0] == 200:
                return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"gateway did not answer /ok:\n{log.read_text()[-3000:]}")


def _healthcheck(env: dict[str, str]) -> int:
    _, command = DOCKER.healthcheck
    assert command[0] == "gateway"
    argv = [sys.executable, "-m", "gateway", *command[1:]]
    return subprocess.run(argv, env=env, capture_output=True, timeout=15).returncode


def test_the_image_command_serves_and_stops_cleanly_on_sigterm(tmp_path):
    port, admin_port = free_port(), free_port()
    env = _image_environment(tmp_path, port, admin_port)
    argv = [*DOCKER.entrypoint, *DOCKER.cmd]
    assert argv[0] == "gateway"
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", *argv[1:]],
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_ok(proc, f"http://127.0.0.1:{port}/ok", log)

        # The HEALTHCHECK's own command line reports healthy.
        assert _healthcheck(env) == 0

        # The baked-in rules are the ones in force, and the metrics port answers.
        status, body = _get(f"http://127.0.0.1:{admin_port}/info")
        info = json.loads(body)
        assert status == 200
        assert info["rules"]["files"] == [str(ROOT / "rules" / "default.yaml")]
        status, body = _get(f"http://127.0.0.1:{port}/info")  # counted: the log line below
        assert status == 200 and "files" not in json.loads(body)["rules"]
        status, body = _get(f"http://127.0.0.1:{admin_port}/metrics")
        assert status == 200 and b"gateway_rules " in body

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # Once stopped, the health check fails.
    assert _healthcheck(env) != 0
    # GATEWAY_ACCESS_LOG from the image is in force: one JSON line per request.
    lines = [line for line in log.read_text().splitlines() if '"path":"/info"' in line]
    assert lines, log.read_text()[-3000:]
    record = json.loads(lines[0][lines[0].index("{") :])
    assert record["status"] == 200 and record["rule"] == "high-throughput-ip"
