"""What a rule reload says after a refused one, and on SIGHUP.

A refused edit is logged at ERROR; fixing the files must not leave that ERROR as the last
word while /info says ``last_reload_error: None``: the reload that finds the rules valid
again says so at INFO, naming the table in force (its hash and size, as the start-up log
names it), whether the fix restored the running table or made a new one. A SIGHUP that
finds the table unchanged says so in one INFO line (the operator asked); the watcher's
own unchanged reloads, with nothing refused before, stay at DEBUG.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import pytest

from gateway.metrics import Metrics
from gateway.proxy.reload import RuleSource
from tests.integration.test_reload_hostile import VALID, FileClock, until
from tests.support.gateway import GatewayProcess

REGIONS = ("us", "eu", "us2")
BAD = VALID.format(count="lots")


def _source(tmp_path: Path, clock: FileClock, count: int = 5) -> tuple[Path, RuleSource]:
    path = tmp_path / "rules.yaml"
    clock.write(path, VALID.format(count=count))
    return path, RuleSource.load([str(path)], REGIONS, Metrics())


def _records(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "gateway.rules" and r.levelno >= level
    ]


def test_restoring_the_running_table_after_a_refused_edit_says_the_rules_are_valid_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FileClock()
    path, source = _source(tmp_path, clock)
    served = source.table
    caplog.set_level(logging.DEBUG, logger="gateway.rules")
    clock.write(path, BAD)
    assert not source.reload("file changed")
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    caplog.clear()

    clock.write(path, VALID.format(count=5))  # the bad edit reverted: the same table
    assert not source.reload("file changed")
    assert source.table is served and source.last_error is None
    (line,) = _records(caplog)  # one INFO line, after the ERROR
    assert caplog.records[-1].levelno == logging.INFO
    assert "valid again" in line and "unchanged" in line
    assert served.digest[:12] in line and served.size_text in line and str(path) in line


def test_fixing_a_refused_edit_with_a_new_table_says_the_rules_are_valid_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FileClock()
    path, source = _source(tmp_path, clock)
    old = source.table
    caplog.set_level(logging.INFO, logger="gateway.rules")
    clock.write(path, BAD)
    assert not source.reload("file changed")
    caplog.clear()
    clock.write(path, VALID.format(count=9))
    assert source.reload("file changed")
    (line,) = _records(caplog)
    assert line.startswith("rules reloaded (file changed)") and "valid again" in line
    assert source.table.digest[:12] in line and f"(was {old.digest[:12]})" in line
    # the next change, with nothing refused before it, is a plain reload
    caplog.clear()
    clock.write(path, VALID.format(count=11))
    assert source.reload("file changed")
    (line,) = _records(caplog)
    assert line.startswith("rules reloaded") and "valid again" not in line


def test_an_unchanged_reload_is_quiet_unless_asked_for_or_after_a_refusal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FileClock()
    path, source = _source(tmp_path, clock)
    caplog.set_level(logging.DEBUG, logger="gateway.rules")
    clock.write(path, VALID.format(count=5))  # touched, the same table
    assert not source.reload("file changed")
    assert _records(caplog) == []  # the watcher's unchanged reload: DEBUG only
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]

    caplog.clear()
    assert not source.reload("SIGHUP", asked=True)  # an operator's SIGHUP
    (line,) = _records(caplog)
    assert line.startswith("rules reloaded (SIGHUP): table unchanged")
    assert source.table.digest[:12] in line and source.table.size_text in line


async def test_a_sighup_with_an_unchanged_table_logs_one_info_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FileClock()
    _, source = _source(tmp_path, clock)
    caplog.set_level(logging.INFO, logger="gateway.rules")
    source.request_reload("SIGHUP")  # what the SIGHUP handler calls
    await until(lambda: bool(_records(caplog)), "the SIGHUP reload's line")
    assert _records(caplog) == [
        f"rules reloaded (SIGHUP): table unchanged, still serving "
        f"{source.table.size_text} from {source.paths[0]} (table {source.table.digest[:12]})"
    ]


async def test_a_worker_says_it_at_debug_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With --workers the supervisor says it once; each worker only at DEBUG."""
    clock = FileClock()
    path, source = _source(tmp_path, clock)
    source.announce = False
    caplog.set_level(logging.DEBUG, logger="gateway.rules")
    clock.write(path, BAD)
    assert not source.reload("file changed")
    clock.write(path, VALID.format(count=5))
    assert not source.reload("file changed")
    assert not await source.reload_async("SIGHUP", asked=True)
    assert len(caplog.records) == 3
    assert {r.levelno for r in caplog.records} == {logging.DEBUG}


def test_the_running_gateway_logs_the_fix_of_a_refused_edit_and_an_unchanged_sighup(
    tmp_path: Path,
) -> None:
    """The reported sequence on ``gateway serve``: a bad edit (ERROR), the file restored
    (INFO: valid again, the table in force), then SIGHUP (INFO: unchanged)."""
    clock = FileClock()
    rules = tmp_path / "rules.yaml"
    clock.write(rules, VALID.format(count=5))
    log = tmp_path / "gateway.log"
    gateway = GatewayProcess(
        ["--rules", str(rules), "--no-embedded", "--access-log", "off",
         "--data-dir", str(tmp_path / "data")],
        log_path=log,
    )  # fmt: skip
    try:
        gateway.wait_ready()
        table = _table_hash(log.read_text())

        def wait_for(text: str, after: int) -> str:
            deadline = time.monotonic() + 30
            while text not in log.read_text()[after:]:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            return log.read_text()[after:]

        clock.write(rules, BAD)
        wait_for("refused, still serving table", 0)
        refused_at = log.read_text().index("refused, still serving table")
        clock.write(rules, VALID.format(count=5))
        after = wait_for("rules valid again", refused_at)
        line = next(x for x in after.splitlines() if "rules valid again" in x)
        assert "INFO" in line and line.endswith(f"(table {table})"), line

        hup_at = len(log.read_text())
        gateway.proc.send_signal(signal.SIGHUP)
        after = wait_for("rules reloaded (SIGHUP): table unchanged", hup_at)
        assert f"(table {table})" in after and "ERROR" not in after
    finally:
        gateway.stop()


def _table_hash(text: str) -> str:
    """The table hash the start-up line names: ``rules: ... (table 4bf7578fb4aa)``."""
    line = next(x for x in text.splitlines() if "gateway: rules: " in x)
    return line.split("(table ", 1)[1][:12]


def test_the_reload_example_in_the_docs_quotes_todays_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/rules.md shows a refused edit and its fix on the default table: the ERROR
    line's hash drifts unless checked (the INFO line's is, by tests/ops)."""
    from gateway.policy.loader import load_rules
    from tests.support.gateway import ROOT

    monkeypatch.chdir(ROOT)
    digest = load_rules(["rules"]).digest[:12]
    text = (ROOT / "docs" / "rules.md").read_text()
    quoted = [line for line in text.splitlines() if "refused, still serving table" in line]
    assert quoted
    assert all(line.rstrip(":").endswith(f"still serving table {digest}") for line in quoted)
