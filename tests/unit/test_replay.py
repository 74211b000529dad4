"""gateway.replay: reading access logs of any age, replaying them, comparing two tables."""

from __future__ import annotations

import json

import pytest

from gateway.cli import main
from gateway.policy.loader import load_rules_from_texts
from gateway.replay.records import (
    MALFORMED,
    NO_COMPONENTS,
    NO_IDENTITY,
    NOT_ACCESS_LOG,
    Request,
    parse_line,
    read_logs,
)
from gateway.replay.report import build_report, render_text
from gateway.replay.simulate import replay

NEW_LINE = (
    '{"method":"POST","path":"/runs/query","status":200,"region":"us","client":"10.0.0.1",'
    '"rule":"q","decision":"allowed","identity":"api_key:aaaaaaaaaaaa","upstream":"default",'
    '"duration_ms":1.5,"upstream_ms":1.0,"request_id":"r1","time":"2026-11-23T10:00:00.002Z",'
    '"key":"aaaaaaaaaaaa","user":null,"ip":"cccccccccccc","start_us":1795428000000500}'
)
OLD_LINE = NEW_LINE.split(',"key"')[0] + "}"
PLAIN_LINE = (
    '10.0.0.1 "POST /runs/query" 200 region=us rule=q decision=allowed id=api_key:aaaaaaaaaaaa '
    "upstream=default dur_ms=1.5 upstream_ms=1.0 rid=r1 time=2026-11-23T10:00:00.002Z "
    "key=aaaaaaaaaaaa user=- ip=cccccccccccc start_us=1795428000000500"
)
EXPECTED = Request(
    1795428000000500, "POST", "/runs/query", "us", "aaaaaaaaaaaa", None, "cccccccccccc",
    "allowed", "r1",
)  # fmt: skip


@pytest.mark.parametrize(
    "line",
    [
        NEW_LINE,
        PLAIN_LINE,
        "2026-11-23 10:00:00,002 INFO gateway.access: " + NEW_LINE,  # first line of a batch
        "2026-11-23 10:00:00,002 INFO gateway.access: " + PLAIN_LINE + "\n",
    ],
)
def test_both_line_formats_give_the_same_request(line):
    assert parse_line(line, {}) == EXPECTED


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (OLD_LINE, NO_COMPONENTS),
        (PLAIN_LINE.split(" key=")[0], NO_COMPONENTS),
        (NEW_LINE.replace('"ip":"cccccccccccc"', '"ip":null'), NO_IDENTITY),
        (PLAIN_LINE.replace("ip=cccccccccccc", "ip=-"), NO_IDENTITY),
        (NEW_LINE[:-20], MALFORMED),
        (NEW_LINE.replace("1795428000000500", '"soon"'), MALFORMED),
        (NEW_LINE.replace("1795428000000500", "1795428000000.5"), MALFORMED),
        (NEW_LINE.replace('"region":"us"', '"region":7'), MALFORMED),
        (PLAIN_LINE.replace("start_us=1795428000000500", "start_us=x"), MALFORMED),
        ("2026-11-23 10:00:00,002 INFO gateway: listening on http://127.0.0.1:1", NOT_ACCESS_LOG),
        ("", NOT_ACCESS_LOG),
        ('{"hello": "world"}', NOT_ACCESS_LOG),
        ("\x00\xff binary", NOT_ACCESS_LOG),
    ],
)  # fmt: skip
def test_lines_that_cannot_be_replayed_are_counted_by_reason(line, reason):
    assert parse_line(line, {}) == reason


RULES = """
rules:
  - id: q
    match: {prefix: /q}
    identity: api_key
    limits: {default: 2/10}
  - id: ip
    identity: ip
    limits: {default: 100/60}
"""
LOOSER = RULES.replace("2/10", "3/10")


def _line(n: int, key: str | None, start_ms: int, path: str = "/q") -> str:
    return json.dumps({
        "method": "GET", "path": path, "status": 200, "region": "us", "client": "10.0.0.1",
        "decision": None, "key": key, "user": None, "ip": "cccccccccccc",
        "start_us": start_ms * 1000,
        "request_id": f"r{n}",
    })  # fmt: skip


def _table(text: str):
    return load_rules_from_texts([("rules.yaml", text)])


def test_the_virtual_clock_follows_the_recorded_times(tmp_path):
    # three requests in a second, then one 11 s later (the window of 10 s has passed);
    # the log is out of order (written when requests ended): the replay sorts by start
    log = tmp_path / "access.log"
    t = 1_795_428_000_000
    lines = [_line(2, "k1", t + 300), _line(1, "k1", t + 100), _line(3, "k1", t + 600),
             _line(4, "k1", t + 11_000), _line(5, "k2", t + 700)]  # fmt: skip
    log.write_text("\n".join(lines) + "\n")
    reading = read_logs([log])
    assert [r.request_id for r in reading.requests] == ["r1", "r2", "r3", "r5", "r4"]
    (result,) = replay(reading.requests, [_table(RULES)])
    q = result.rules["q"]
    assert (q.matched, q.limited) == (5, 1)
    assert q.identities == {"api_key:k1": [1, (t + 600) * 1000]}
    assert bytes(result.limited_flags) == bytes([0, 0, 1, 0, 0])


def test_a_baseline_shows_what_changes_per_rule_and_identity(tmp_path):
    log = tmp_path / "access.log"
    t = 1_795_428_000_000
    lines = [_line(n, "k1", t + n) for n in range(3)]
    lines += [_line(10 + n, "k2", t + 10 + n) for n in range(4)]
    lines += [OLD_LINE, "garbage", _line(99, "k3", t + 50, path="/other")]
    log.write_text("\n".join(lines) + "\n")
    reading = read_logs([log])
    new, old = replay(reading.requests, [_table(LOOSER), _table(RULES)])
    report = build_report(reading, new, old, top=5)
    assert report["replayed"] == 8 and report["lines"] == 10
    assert report["skipped"] == {NO_COMPONENTS: 1, NOT_ACCESS_LOG: 1}
    diff = report["diff"]
    assert diff["requests_newly_allowed"] == 2 and diff["requests_newly_limited"] == 0
    assert diff["identities_newly_freed"] == 1
    assert diff["top_newly_freed"] == [{"identity": "api_key:k1", "was_limited": 1}]
    (changed,) = diff["rules_changed"]
    assert changed["id"] == "q" and changed["limited"] == [3, 1]
    assert changed["newly_freed"] == ["api_key:k1"] and changed["newly_limited"] == []
    rules = {r["id"]: r for r in report["new"]["rules"]}
    assert rules["q"]["top_limited"][0]["identity"] == "api_key:k2"
    assert rules["ip"]["matched"] == 1
    text = render_text(report)
    assert "q" in text and "limited 3 -> 1 (-2)" in text and "api_key:k1" in text
    assert f"skipped 1: {NO_COMPONENTS}" in text


def test_the_command_line_writes_json_saves_the_report_and_refuses_bad_input(tmp_path, capsys):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    log = tmp_path / "access.log"
    t = 1_795_428_000_000
    log.write_text("\n".join(_line(n, "k1", t + n) for n in range(5)) + "\n")
    data = tmp_path / "data"
    code = main(["rules", "simulate", "--rules", str(rules), "--json", "--save",
                 "--data-dir", str(data), "--no-progress", str(log)])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0
    report = json.loads(out.out)
    assert report["new"]["decisions"] == {"allowed": 2, "limited": 3}
    assert report["baseline"] is None and report["diff"] is None
    assert json.loads((data / "last-replay.json").read_text()) == report
    assert "saved" in out.err

    assert main(["rules", "simulate", "--rules", str(rules), str(tmp_path / "nope.log")]) == 2
    assert "cannot read" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules: [{id: x}]")
    assert main(["rules", "simulate", "--rules", str(bad), str(log)]) == 1
    assert "do not load" in capsys.readouterr().err


def test_the_progress_bar_is_drawn_when_asked(tmp_path, capsys):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    log = tmp_path / "access.log"
    log.write_text(_line(1, "k1", 1_795_428_000_000) + "\n")
    assert main(["rules", "simulate", "--rules", str(rules), "--progress", str(log)]) == 0
    err = capsys.readouterr().err
    assert "replaying [" in err and "100%" in err


@pytest.mark.parametrize("path", ["/runs/query", "/a b", '/q"x', "/tab\there", "/caf\u00e9"])
def test_what_the_gateway_writes_reads_back_the_same_in_both_formats(access_caplog, path):
    from gateway.proxy.access_log import AccessLogger, AccessRecord
    from gateway.ratelimit.identity import IdentityHasher, RequestIdentity

    ids = RequestIdentity(IdentityHasher(b"k" * 32), "2001:db8::/64", "sk-1", "u-1")
    found = []
    for mode in ("json", "plain"):
        record = AccessRecord(method="POST", path=path, status=429, region="eu",
                              client="2001:db8::/64", rule="q", decision="limited",
                              identity="api_key:0", duration_ms=2.5, request_id="rid-1",
                              identities=ids)  # fmt: skip
        logger = AccessLogger(mode)
        logger.emit(record)
        logger.flush()
        found.append(parse_line(access_caplog()[-1], {}))
    from_json, from_plain = found
    assert isinstance(from_json, Request) and from_json.path == path
    assert from_json.key and from_json.user and from_json.ip and from_json.decision == "limited"
    # a value that cannot be written as it is is quoted, and read back exactly
    assert from_plain == from_json._replace(start_us=from_plain.start_us)


@pytest.fixture
def access_caplog(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="gateway.access"):
        yield lambda: [r.getMessage() for r in caplog.records if r.name == "gateway.access"]


@pytest.mark.parametrize("path", ["/runs/query", "/a b"])  # as it is, and quoted
def test_a_client_certificates_hash_is_logged_and_read_back_in_both_formats(access_caplog, path):
    """A request over a verified client certificate logs the certificate's identity hash
    (never the subject), so a replay can count it as a client_cert rule would."""
    from gateway.policy.model import IdentityKind
    from gateway.proxy.access_log import AccessLogger, AccessRecord
    from gateway.ratelimit.identity import IdentityHasher, RequestIdentity

    subject = "CN=billing-service,O=Example"
    hasher = IdentityHasher(b"k" * 32)
    ids = RequestIdentity(hasher, "10.0.0.1", None, None, client_cert=subject)
    found, lines = [], []
    for mode in ("json", "plain"):
        record = AccessRecord(method="GET", path=path, status=200, region="us",
                              client="10.0.0.1", rule="svc", decision="allowed",
                              identity="client_cert:0", duration_ms=1.0,
                              identities=ids)  # fmt: skip
        logger = AccessLogger(mode)
        logger.emit(record)
        logger.flush()
        lines.append(access_caplog()[-1])
        found.append(parse_line(lines[-1], {}))
    from_json, from_plain = found
    want = hasher.digest(IdentityKind.CLIENT_CERT, subject)[:12]
    assert isinstance(from_json, Request) and from_json.cert == want
    assert from_plain == from_json._replace(start_us=from_plain.start_us)
    assert all(subject not in line and "billing" not in line for line in lines)
    # without a certificate the plain line has no cert field, and reads back as none
    record = AccessRecord(method="GET", path=path, status=200, region="us", client="10.0.0.1",
                          identities=RequestIdentity(hasher, "10.0.0.1", "sk-1", None))  # fmt: skip
    logger = AccessLogger("plain")
    logger.emit(record)
    logger.flush()
    assert " cert=" not in access_caplog()[-1]
    plain = parse_line(access_caplog()[-1], {})
    assert isinstance(plain, Request) and plain.cert is None


CERT_RULES = """
rules:
  - id: svc
    identity: client_cert
    limits: {default: 2/10}
  - id: ip
    identity: ip
    limits: {default: 100/60}
"""


def test_a_client_cert_rule_is_replayed_per_certificate(tmp_path):
    """Requests with a certificate's hash count per certificate under a client_cert rule;
    requests without one go on to the next rule, as the gateway does."""
    log = tmp_path / "access.log"
    t = 1_795_428_000_000
    lines = []
    for n in range(6):  # three each from two certificates, in the same second
        entry = json.loads(_line(n, None, t + n))
        entry["cert"] = "aaaaaaaaaaaa" if n % 2 else "bbbbbbbbbbbb"
        lines.append(json.dumps(entry))
    lines.append(_line(6, None, t + 7))  # no certificate: the ip rule
    log.write_text("\n".join(lines) + "\n")
    reading = read_logs([log])
    assert [r.cert for r in reading.requests] == [
        "bbbbbbbbbbbb", "aaaaaaaaaaaa", "bbbbbbbbbbbb", "aaaaaaaaaaaa", "bbbbbbbbbbbb",
        "aaaaaaaaaaaa", None,
    ]  # fmt: skip
    (result,) = replay(reading.requests, [_table(CERT_RULES)])
    svc = result.rules["svc"]
    assert (svc.matched, svc.limited) == (6, 2)  # each certificate's third request
    assert set(svc.identities) == {"client_cert:aaaaaaaaaaaa", "client_cert:bbbbbbbbbbbb"}
    assert result.rules["ip"].matched == 1
    assert bytes(result.limited_flags) == bytes([0, 0, 0, 0, 1, 1, 0])
