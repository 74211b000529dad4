"""Hot reload of hostile rule files (issue 24 finding 4, and the reverted-edit item).

A running ``RuleSource`` and its watcher, on real files: a file that does not load is
refused whole (logged, counted, the running table kept) and the watcher goes on to apply
the next valid edit; reverting a bad edit clears the last reload error; ``gateway rules
check`` refuses an alias bomb with a message instead of running out of memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from gateway.metrics import Metrics
from gateway.proxy.reload import RuleSource
from tests.support.gateway import ROOT, running_gateway
from tests.unit.test_rule_loader_hostile import alias_bomb, merge_bomb

REGIONS = ("us", "eu", "us2")
VALID = """rules:
  - id: limited
    match: {{prefix: /limited}}
    identity: api_key
    limits: {{default: {count}/60}}
  - id: catch-all
    identity: ip
    limits: {{default: 1000/60}}
"""

HOSTILE = {
    # RecursionError in the composer: the watcher died silently.
    "deep-block": "rules:\n" + "- " * 3000 + "x\n",
    "deep-flow": "rules: " + "[" * 3000 + "]" * 3000 + "\n",
    # Gigabytes on the event loop (the error message walked 9**9 strings).
    "alias-bomb": alias_bomb(),
    "merge-bomb": merge_bomb(),
    # TypeError sorting keys of several types for the message.
    "mixed-keys": "rules:\n  - {1: a, b: c, id: x, identity: ip, limits: {default: 1/1}}\n",
    # ValueError from a constructor, not a YAMLError.
    "bad-int": "rules: !!int nope\n",
    "bad-bytes": "rules: \udcff\n",  # written as bytes 0xff below
}


class FileClock:
    """Writes a file and gives it a new mtime each time: two writes within the file
    system's timestamp granularity, of the same size, must still look like an edit."""

    def __init__(self) -> None:
        self.ns = time.time_ns()

    def write(self, path: Path, text: str) -> None:
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
        self.ns += 1_000_000_000
        os.utime(path, ns=(self.ns, self.ns))


def error_count(metrics: Metrics) -> float:
    value = metrics.registry.get_sample_value("gateway_rule_reloads_total", {"outcome": "error"})
    return value or 0.0


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for the watcher (a generous deadline against a hang, not a timing claim)."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("name", sorted(HOSTILE))
async def test_watcher_refuses_a_hostile_file_and_applies_the_next_edit(tmp_path, caplog, name):
    clock = FileClock()
    path = tmp_path / "rules.yaml"
    clock.write(path, VALID.format(count=5))
    metrics = Metrics()
    source = RuleSource.load([str(path)], REGIONS, metrics)
    served = source.table
    watcher = asyncio.create_task(source.watch(0.02))
    try:
        with caplog.at_level(logging.ERROR, logger="gateway.rules"):
            clock.write(path, HOSTILE[name])
            await until(lambda: error_count(metrics) == 1, "the refusal to be counted")
        assert source.table is served
        assert source.last_error is not None and str(path) in source.last_error
        assert "refused, still serving table" in caplog.text and str(path) in caplog.text
        assert not watcher.done()

        clock.write(path, VALID.format(count=7))
        await until(lambda: source.table is not served, "the valid edit to be applied")
        limited = source.table.by_id("limited")
        assert limited is not None and [str(s) for s in limited.limits_for("eu")] == ["7/60"]
        assert source.last_error is None
        assert error_count(metrics) == 1
        assert not watcher.done()
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher


async def test_reverting_a_bad_edit_clears_the_last_reload_error(tmp_path, upstream):
    clock = FileClock()
    path = tmp_path / "rules.yaml"
    clock.write(path, VALID.format(count=3))
    async with running_gateway(upstream, rules=[str(path)]) as gw:
        served = gw.rules.table.digest
        clock.write(path, VALID.format(count="lots"))
        assert not gw.rules.reload("test")
        info = await gw.proxy.info()  # the admin port's /info
        assert "limits.default" in info["rules"]["last_reload_error"]

        clock.write(path, VALID.format(count=3))  # the edit reverted: the same table
        assert not gw.rules.reload("test")
        assert gw.rules.table.digest == served
        assert gw.rules.last_error is None
        info = await gw.proxy.info()
        assert info["rules"]["last_reload_error"] is None
        sample = gw.metrics.registry.get_sample_value
        assert sample("gateway_rule_reloads_total", {"outcome": "unchanged"}) == 1


async def test_watcher_clears_the_error_when_the_edit_is_reverted(tmp_path):
    clock = FileClock()
    path = tmp_path / "rules.yaml"
    clock.write(path, VALID.format(count=5))
    metrics = Metrics()
    source = RuleSource.load([str(path)], REGIONS, metrics)
    watcher = asyncio.create_task(source.watch(0.02))
    try:
        clock.write(path, alias_bomb())
        await until(lambda: source.last_error is not None, "the refusal")
        clock.write(path, VALID.format(count=5))
        await until(lambda: source.last_error is None, "the revert to clear the error")
        unchanged = {"outcome": "unchanged"}
        assert metrics.registry.get_sample_value("gateway_rule_reloads_total", unchanged) == 1
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher


async def test_the_gateway_serves_the_old_table_through_a_hostile_reload(tmp_path, upstream):
    clock = FileClock()
    path = tmp_path / "rules.yaml"
    clock.write(path, VALID.format(count=2))
    async with (
        running_gateway(upstream, rules=[str(path)], watch_rules=True, watch_interval=0.02) as gw,
        aiohttp.ClientSession() as http,
    ):
        served = gw.rules.table
        clock.write(path, alias_bomb())
        await until(lambda: error_count(gw.metrics) == 1, "the refusal to be counted")
        statuses = []
        for _ in range(3):
            async with http.get(gw.url + "/limited", headers={"x-api-key": "k"}) as r:
                statuses.append(r.status)
        assert statuses == [200, 200, 429]  # the old table's 2/60
        assert gw.rules.table is served
        # SIGHUP's path: the reload is started, off the loop, and applied.
        clock.write(path, VALID.format(count=9))
        gw.rules.request_reload("SIGHUP")
        await until(lambda: gw.rules.table is not served, "the SIGHUP reload")
        async with http.get(gw.url + "/other", headers={"x-api-key": "k"}) as r:
            assert r.status == 200


async def test_reload_async_parses_off_the_event_loop(tmp_path):
    """While the files load in a worker thread, the loop runs other tasks."""
    path = tmp_path / "rules.yaml"
    path.write_text(VALID.format(count=5))
    source = RuleSource.load([str(path)], REGIONS, Metrics())
    rules = "".join(
        f"  - {{id: r{i}, match: {{path: /p{i}}}, identity: ip, limits: {{default: 1/1}}}}\n"
        for i in range(300)
    )
    path.write_text("rules:\n" + rules)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def reload() -> tuple[bool, int]:
        applied = await source.reload_async("test")
        return applied, ticks  # the ticks seen while the files loaded

    loading = asyncio.create_task(reload())
    task = asyncio.create_task(ticker())
    try:
        applied, ticks_during_load = await loading
    finally:
        task.cancel()
    assert applied
    assert ticks_during_load > 0  # a load on the loop would return before any tick
    assert len(source.table.rules) == 300


def test_rules_check_refuses_an_alias_bomb_with_a_message(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "rules", "check", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "1 problem(s):" in out.stderr
    assert f"{path}: YAML over 100000 nodes, aliases expanded (line" in out.stderr
    assert "Traceback" not in out.stderr
