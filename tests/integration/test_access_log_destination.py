"""The access log has its own destination (issue 28 item 1): nothing but access lines, one
bare JSON object a line with --access-log json, while the gateway's own logs go to stderr
(as JSON lines with --log-format json); a rotated file is reopened (on SIGUSR1, and when
it was moved away). A real `gateway serve` process, with --workers 2 too."""

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

from tests.support.gateway import ROOT, SECRET, free_port
from tests.support.redis_servers import RedisServer


def _get(url: str, n: int) -> None:
    for i in range(n):
        req = urllib.request.Request(url + f"/ok-not/{i}", headers={"x-api-key": f"k{i}"})
        try:
            urllib.request.urlopen(req, timeout=10).read()  # noqa: S310 (loopback)
        except urllib.error.HTTPError as exc:  # 404: no upstream; still logged
            exc.read()


def _wait_lines(path: Path, n: int) -> list[str]:
    for _ in range(1000):
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n:
            return lines
        time.sleep(0.02)
    raise AssertionError(f"{path}: {n} lines never came")


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--admin-port", "0",
         "--data-dir", str(tmp_path / "data"), "--access-log", "json", "--log-format", "json",
         "--access-log-file", str(tmp_path / "access.log"), *extra],
        cwd=ROOT, env={**os.environ, "GATEWAY_IDENTITY_SECRET": SECRET.decode()},
        stdout=subprocess.PIPE, stderr=open(tmp_path / "stderr", "wb"),  # noqa: SIM115
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(1500):
        try:
            urllib.request.urlopen(url + "/ok", timeout=1).read()  # noqa: S310
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise AssertionError((tmp_path / "stderr").read_text()) from None
            time.sleep(0.02)
    raise AssertionError("the gateway never answered /ok")


@pytest.mark.parametrize("workers", [1, 2])
def test_access_lines_alone_as_json_and_reopened_after_rotation(tmp_path, workers):
    extra: tuple[str, ...] = ("--no-embedded",)
    redis = None
    if workers > 1:  # workers need shared counters
        redis = RedisServer(tmp_path / "redis").start()
        extra += ("--workers", "2", "--redis-url", redis.url)
    proc, url = _start(tmp_path, *extra)
    try:
        _get(url, 20)
        access = tmp_path / "access.log"
        lines = _wait_lines(access, 20)
        records = [json.loads(line) for line in lines]  # every line: one JSON object
        assert all(isinstance(r, dict) and r["method"] == "GET" for r in records)
        assert "k1" not in access.read_text()  # never a key
        # rotation: the file is moved away, SIGUSR1 reopens it at its path
        access.rename(tmp_path / "access.log.1")
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)  # (the signal is handled by every process; nothing is asserted on it)
        _get(url, 10)
        fresh = _wait_lines(access, 10)
        assert all(json.loads(line)["method"] == "GET" for line in fresh)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        if redis is not None:
            redis.stop()
    assert out == b""  # the access log went to its file, nothing to stdout
    app_lines = (tmp_path / "stderr").read_text().splitlines()
    assert app_lines and all(json.loads(line)["logger"] for line in app_lines)
    assert not any(json.loads(line)["logger"] == "gateway.access" for line in app_lines)


def test_default_destination_is_stdout_with_nothing_else(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--admin-port", "0",
         "--data-dir", str(tmp_path / "data"), "--access-log", "json", "--no-embedded"],
        cwd=ROOT, env={**os.environ, "GATEWAY_IDENTITY_SECRET": SECRET.decode()},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1500):
            try:
                urllib.request.urlopen(url + "/ok", timeout=1).read()  # noqa: S310
                break
            except OSError:
                time.sleep(0.02)
        _get(url, 5)
        time.sleep(0.3)  # the access log's batch is written within 50 ms
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    lines = out.decode().splitlines()
    records = [json.loads(line) for line in lines]  # /ok's probes, then the 5
    assert [r["path"] for r in records if r["path"] != "/ok"] == [f"/ok-not/{i}" for i in range(5)]
    assert b"gateway listening" in err  # the gateway's own logs: stderr, as text
