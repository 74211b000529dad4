"""Issue 24, finding 5: no log line can stop a replay.

``gateway rules simulate`` reads logs it did not write itself: rotated files cut in the
middle of a line, other programs' lines, hand edits, lines a client shaped. Whatever a line
holds (random text or bytes, absurd or huge numbers, JSON nested thousands deep, bytes
that are not UTF-8, NUL, a line of megabytes), reading, replaying and reporting never
raise: the line is replayed or counted under a reason the report shows.
"""

from __future__ import annotations

import json
import random

from hypothesis import given
from hypothesis import strategies as st

from gateway.cli import main
from gateway.policy.loader import load_rules_from_texts
from gateway.replay.records import (
    BAD_START,
    MALFORMED,
    MAX_LINE_CHARS,
    NO_COMPONENTS,
    NO_IDENTITY,
    NOT_ACCESS_LOG,
    NOT_UTF8,
    TOO_DEEP,
    TOO_LONG,
    Request,
    parse_line,
    read_logs,
)
from gateway.replay.report import build_report, render_text
from gateway.replay.saved import save_report
from gateway.replay.simulate import replay
from tests.support.fuzz import fuzz

REASONS = {NOT_ACCESS_LOG, NO_COMPONENTS, NO_IDENTITY, MALFORMED, BAD_START, TOO_DEEP,
           TOO_LONG, NOT_UTF8}  # fmt: skip

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

JSON_LINE = (
    '{"method":"POST","path":"/q/a","status":200,"region":"us","client":"10.0.0.1",'
    '"rule":"q","decision":"allowed","identity":"api_key:aaaaaaaaaaaa","upstream":"default",'
    '"duration_ms":1.5,"upstream_ms":1.0,"request_id":"r1","time":"2026-11-23T10:00:00.002Z",'
    '"key":"aaaaaaaaaaaa","user":null,"ip":"cccccccccccc","start_us":1795428000000500}'
)
PLAIN_LINE = (
    '10.0.0.1 "POST /q/a" 200 region=us rule=q decision=allowed id=api_key:aaaaaaaaaaaa '
    "upstream=default dur_ms=1.5 upstream_ms=1.0 rid=r1 time=2026-11-23T10:00:00.002Z "
    "key=aaaaaaaaaaaa user=- ip=cccccccccccc start_us=1795428000000500"
)
START = "1795428000000500"
DEEP = 100_000

# (line as bytes, the reason it is skipped for)
HOSTILE: list[tuple[bytes, str]] = [
    (JSON_LINE.replace(START, "1e308").encode(), MALFORMED),
    (JSON_LINE.replace(START, "1e400").encode(), MALFORMED),  # inf
    (JSON_LINE.replace(START, "NaN").encode(), MALFORMED),
    (JSON_LINE.replace(START, "-Infinity").encode(), MALFORMED),
    (JSON_LINE.replace(START, str(10**400)).encode(), BAD_START),
    (JSON_LINE.replace(START, "9" * 5000).encode(), MALFORMED),  # past int's digit limit
    (JSON_LINE.replace(START, "-1").encode(), BAD_START),
    (JSON_LINE.replace(START, str(2**63)).encode(), BAD_START),
    (JSON_LINE.replace(START, "true").encode(), MALFORMED),
    (PLAIN_LINE.replace(START, "1e308").encode(), MALFORMED),
    (PLAIN_LINE.replace(START, "1_000").encode(), MALFORMED),
    (PLAIN_LINE.replace(START, "\u0661\u0662").encode(), MALFORMED),  # Arabic digits
    (PLAIN_LINE.replace(START, str(10**400)).encode(), BAD_START),
    (PLAIN_LINE.replace(START, "9" * 5000).encode(), BAD_START),
    (PLAIN_LINE.replace(START, "-5").encode(), BAD_START),
    (b"[" * DEEP + b"]" * DEEP, NOT_ACCESS_LOG),  # not an object: never parsed
    (b"{" + b'"a":{' * DEEP + b"}" * DEEP + b"}", TOO_DEEP),
    (b'{"method":"GET","path":"/","x":' + b"[" * DEEP, TOO_DEEP),
    (JSON_LINE.replace('"r1"', '"\xff\xfe"').encode("latin-1"), NOT_UTF8),
    (PLAIN_LINE.encode().replace(b"/q/a", b"/q/\xc3"), NOT_UTF8),
    (b"\xff\xfe\xfd garbage", NOT_UTF8),
    (b"\x00" * 100, NOT_ACCESS_LOG),
    (PLAIN_LINE.replace("/q/a", "/q/\x00").encode(), MALFORMED),  # never written bare
    (PLAIN_LINE.replace("rid=r1", "rid=r\u2028").encode(), MALFORMED),
    (JSON_LINE.replace('"region":"us"', '"region":"u s"').encode(), MALFORMED),
    (JSON_LINE.replace('"ip":"cccccccccccc"', '"ip":["x"]').encode(), MALFORMED),
    (JSON_LINE.replace('"key":"aaaaaaaaaaaa"', '"key":"a\\nb"').encode(), MALFORMED),
    (JSON_LINE.replace('"path":"/q/a"', '"path":7').encode(), MALFORMED),
    (PLAIN_LINE.replace("rid=r1", 'rid="r1').encode(), MALFORMED),  # unterminated
    (PLAIN_LINE.replace("rid=r1", 'rid="\\x41"').encode(), MALFORMED),  # not JSON's
    (PLAIN_LINE.replace(" user=-", "").encode(), MALFORMED),  # a field missing
    (PLAIN_LINE.replace("rid=r1", "rid=r1 ip=dddddddddddd").encode(), MALFORMED),  # forged
    (PLAIN_LINE.encode() + b" extra=1", MALFORMED),
    (b"x" * (MAX_LINE_CHARS + 10), TOO_LONG),
    ((PLAIN_LINE + " " * MAX_LINE_CHARS).encode(), TOO_LONG),
    (b"just some text", NOT_ACCESS_LOG),
    (b"{}", NOT_ACCESS_LOG),
    (b"[]", NOT_ACCESS_LOG),
    (b'"a string"', NOT_ACCESS_LOG),
]


def _table():
    return load_rules_from_texts([("rules.yaml", RULES)])


def _replay_everything(log, tmp_path) -> dict:
    """Read, replay through two tables, report, render and save: what the CLI does."""
    reading = read_logs([log])
    assert reading.lines == sum(reading.skipped.values()) + len(reading.requests)
    assert set(reading.skipped) <= REASONS, reading.skipped
    new, old = replay(reading.requests, [_table(), _table()])
    report = build_report(reading, new, old)
    render_text(report)
    json.dumps(report)
    save_report(report, tmp_path / "data")
    return report


def test_every_hostile_line_is_counted_under_its_reason(tmp_path):
    log = tmp_path / "access.log"
    good = [JSON_LINE.encode(), PLAIN_LINE.encode()]
    log.write_bytes(b"\n".join(good + [line for line, _ in HOSTILE] + good) + b"\n")
    report = _replay_everything(log, tmp_path)
    expected: dict[str, int] = {}
    for _, reason in HOSTILE:
        expected[reason] = expected.get(reason, 0) + 1
    assert report["skipped"] == dict(sorted(expected.items()))
    assert report["replayed"] == 4 and report["lines"] == 4 + len(HOSTILE)
    text = render_text(report)
    for reason, n in expected.items():
        assert f"skipped {n:,}: {reason}" in text


def test_each_hostile_line_alone():
    for n, (line, reason) in enumerate(HOSTILE):
        assert parse_line(line.decode("utf-8", "surrogateescape"), {}) == reason, n


def test_the_command_line_reports_the_reasons_and_exits_cleanly(tmp_path, capsys):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    log = tmp_path / "access.log"
    log.write_bytes(b"\n".join([JSON_LINE.encode()] + [line for line, _ in HOSTILE]))
    code = main(["rules", "simulate", "--rules", str(rules), "--no-progress", str(log)])
    out = capsys.readouterr().out
    assert code == 0
    for reason in (TOO_DEEP, NOT_UTF8, BAD_START, TOO_LONG):
        assert f"skipped {sum(r == reason for _, r in HOSTILE)}: {reason}" in out
    assert "replayed 1 requests" in out


def _mutations(rng: random.Random, line: str, n: int) -> list[str]:
    """``n`` copies of ``line`` with a few characters inserted, deleted or replaced."""
    alphabet = ' "\\={}[]-:,0123456789e.\n\r\x00\udc80\u2028ax'
    found = []
    for _ in range(n):
        chars = list(line)
        for _ in range(rng.randint(1, 6)):
            at = rng.randrange(len(chars) + 1)
            what = rng.random()
            if what < 0.4:
                chars.insert(at, rng.choice(alphabet))
            elif chars and what < 0.7:
                del chars[min(at, len(chars) - 1)]
            elif chars:
                chars[min(at, len(chars) - 1)] = rng.choice(alphabet)
        found.append("".join(chars))
    return found


def test_mutated_lines_never_stop_the_replay(tmp_path):
    rng = random.Random(24)
    lines = _mutations(rng, JSON_LINE, 3000) + _mutations(rng, PLAIN_LINE, 3000)
    log = tmp_path / "access.log"
    log.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape"))
    report = _replay_everything(log, tmp_path)
    assert report["replayed"] > 0 and report["skipped"]


LINE_BYTES = st.one_of(
    st.binary(max_size=300),
    st.text(st.characters(exclude_categories=()), max_size=300).map(
        lambda t: t.encode("utf-8", "surrogatepass")
    ),
    st.sampled_from([JSON_LINE, PLAIN_LINE]).flatmap(
        lambda line: st.tuples(
            st.integers(0, len(line)), st.integers(0, len(line)), st.binary(max_size=40)
        ).map(lambda cut: line[: cut[0]].encode() + cut[2] + line[cut[1] :].encode())
    ),
    # any number where start_us goes: small, negative, past 2**63, of hundreds of digits
    st.sampled_from([JSON_LINE, PLAIN_LINE]).flatmap(
        lambda line: st.one_of(
            st.integers(),
            st.integers(-(10**30), 10**30),
            st.integers(0, 1000).map(lambda n: 10**n),
            st.floats().map(repr),
            st.text(max_size=30),
        ).map(lambda v: line.replace(START, str(v)).encode("utf-8", "surrogatepass"))
    ),
    # JSON nested deeper than the decoder's recursion, around or inside a line
    st.tuples(st.integers(1, 20_000), st.sampled_from(["[", '{"a":', '[{"b":'])).map(
        lambda deep: (deep[1] * deep[0]).encode()
    ),
    st.integers(1, 20_000).map(lambda n: JSON_LINE.replace("1.5", "[" * n + "]" * n).encode()),
)


@given(st.lists(LINE_BYTES, min_size=1, max_size=20))
@fuzz(400)
def test_random_lines_never_raise(tmp_path_factory, lines):
    directory = tmp_path_factory.mktemp("fuzz")
    log = directory / "access.log"
    log.write_bytes(b"\n".join(lines))
    report = _replay_everything(log, directory)
    assert report["replayed"] + sum(report["skipped"].values()) == report["lines"]
    for line in lines:
        found = parse_line(line.decode("utf-8", "surrogateescape"), {})
        assert isinstance(found, Request) or found in REASONS
