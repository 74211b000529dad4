"""``gateway rules simulate`` on the gateway's own access log: the lines it cannot replay
are counted under the right reason.

A request the gateway answers before the identity is formed (``/ok``, a ``400``) is
logged without the identity components (the writer leaves them out: the access log is on
the hot path). The reader used to check for the missing fields first, so on this
version's own plain log every ``/ok`` line was "written before identity components were
logged", the reason for an older gateway's lines. Such a line has no rule and no
decision, and is counted as answered before the rules were consulted; only a line that
was decided by a rule and still lacks the components is an older gateway's.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.replay.records import NO_COMPONENTS, NO_IDENTITY, parse_line
from tests.support.gateway import GatewayProcess, raw_request

RULES = """
rules:
  - id: per-key
    identity: api_key
    limits: {default: 50/60}
  - id: per-ip
    identity: ip
    limits: {default: 100/60}
"""


def _record(tmp_path: Path, mode: str) -> list[str]:
    """The access-log lines of a real ``gateway serve``: its readiness probes (``/ok``),
    a request it refuses before any rule (``400``), and two requests a rule decides."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    log = tmp_path / f"access-{mode}.log"
    gateway = GatewayProcess(
        ["--rules", str(rules), "--no-embedded", "--access-log", mode,
         "--access-log-file", str(log), "--data-dir", str(tmp_path / "data")],
        log_path=tmp_path / "gateway.log",
    )  # fmt: skip
    try:
        gateway.wait_ready()  # GET /ok until it answers
        with urllib.request.urlopen(gateway.url + "/ok", timeout=5) as r:  # noqa: S310
            assert r.status == 200
        head = b"GET /x HTTP/1.1\r\nHost: localhost\r\nx_api_key: k\r\n\r\n"
        answer = asyncio.run(raw_request(gateway.port, head))
        assert answer.startswith(b"HTTP/1.1 400"), answer
        for headers in ({"x-api-key": "k"}, {}):
            request = urllib.request.Request(gateway.url + "/x", headers=headers)
            try:
                urllib.request.urlopen(request, timeout=5).close()  # noqa: S310
            except urllib.error.HTTPError as exc:  # (no upstream: 404, still decided)
                exc.close()
    finally:
        assert gateway.stop() == 0, gateway.log_text()
    return [line for line in log.read_text().splitlines() if line.strip()]


def _old_format(line: str, mode: str) -> str:
    """A decided line as a gateway before the identity components wrote it."""
    if mode == "json":
        data = json.loads(line[line.index("{") :])
        for name in ("key", "user", "ip", "start_us", "consumer", "tier", "cert"):
            data.pop(name, None)
        return json.dumps(data, separators=(",", ":"))
    return re.sub(r" key=.*$", "", line)


@pytest.mark.parametrize("mode", ["plain", "json"])
def test_the_gateways_own_ok_and_400_lines_are_answered_before_the_rules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    lines = _record(tmp_path, mode)
    ok = [line for line in lines if "/ok" in line]
    refused = [line for line in lines if " 400 " in line or '"status":400' in line]
    decided = [line for line in lines if "per-key" in line or "per-ip" in line]
    assert ok and len(refused) == 1 and len(decided) == 2, lines
    for line in ok + refused:
        assert parse_line(line, {}) == NO_IDENTITY, line
    # An older gateway's decided line (no components) keeps the old reason.
    old = _old_format(decided[0], mode)
    assert parse_line(old, {}) == NO_COMPONENTS, old

    log = tmp_path / "replayed.log"
    log.write_text("\n".join([*lines, old]) + "\n")
    code = main(["rules", "simulate", "--rules", str(tmp_path / "rules.yaml"), "--json",
                 "--no-progress", str(log)])  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["replayed"] == 2
    assert report["skipped"] == {NO_IDENTITY: len(ok) + 1, NO_COMPONENTS: 1}

    code = main(["rules", "simulate", "--rules", str(tmp_path / "rules.yaml"),
                 "--no-progress", str(tmp_path / f"access-{mode}.log")])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert f"skipped {len(ok) + 1}: {NO_IDENTITY}" in text
    assert NO_COMPONENTS not in text


OK_PLAIN = (
    '127.0.0.1 "GET /ok" 200 region=us rule=- decision=- id=- upstream=- dur_ms=1.0 '
    "upstream_ms=- rid=288403a71fa417a93bdccf5c9f0d00e1 time=2026-11-27T21:29:17.986Z"
)
DECIDED_OLD_PLAIN = (
    '127.0.0.1 "GET /x" 404 region=us rule=per-ip decision=allowed id=ip:5c02c5594506 '
    "upstream=- dur_ms=6.4 upstream_ms=- rid=r5 time=2026-11-27T21:29:18.009Z"
)
OK_OLD_JSON = (
    '{"method":"GET","path":"/ok","status":200,"region":"us","client":"127.0.0.1",'
    '"rule":null,"decision":null,"identity":null,"upstream":null,"duration_ms":0.2,'
    '"upstream_ms":null,"request_id":"r1","time":"2026-11-27T21:29:17.986Z"}'
)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (OK_PLAIN, NO_IDENTITY),  # this version's /ok line (as reported)
        (OK_PLAIN.replace(" time=2026-11-27T21:29:17.986Z", ""), NO_IDENTITY),  # older
        (OK_OLD_JSON, NO_IDENTITY),
        (DECIDED_OLD_PLAIN, NO_COMPONENTS),  # decided by a rule, no components: old
        (DECIDED_OLD_PLAIN.replace("rule=per-ip", "rule=-"), NO_COMPONENTS),  # no rule
        (OK_OLD_JSON.replace('"decision":null', '"decision":"allowed"'), NO_COMPONENTS),
    ],
)
def test_a_line_without_a_rule_or_decision_is_classed_before_its_missing_fields(
    line: str, reason: str
) -> None:
    assert parse_line(line, {}) == reason
