"""Issue 24, finding 5: what a client chooses cannot add a field or a line to the access log.

A client chooses its ``X-Request-Id`` (printable ASCII, spaces and ``=`` included), its
path and its method. The plain format writes such a value as it is only when it reads back
as itself (printable, no space, not starting with a quote, not ``-``); anything else is
written as its JSON string literal, which the replay reads back exactly. The JSON format
quotes every string. The property below holds for any text in every such field.
"""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gateway.policy.model import IdentityKind
from gateway.proxy.access_log import AccessLogger, AccessRecord, json_line, plain_line
from gateway.ratelimit.identity import IdentityHasher, RequestIdentity
from gateway.replay.records import (
    MALFORMED,
    NO_IDENTITY,
    PLAIN_FIELDS,
    Request,
    parse_line,
    plain_fields,
    read_logs,
)
from tests.support.fuzz import fuzz

FORGED_RID = "abc key=api_key:deadbeef ip=1.2.3.4 start_us=1"
HASHER = IdentityHasher(b"k" * 32)


@pytest.fixture
def access(caplog):
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        yield lambda: [r.getMessage() for r in caplog.records if r.name == "gateway.access"]


def refused(**changes: Any) -> AccessRecord:
    """A request answered before any rule was consulted (no identity components)."""
    fields: dict[str, Any] = dict(
        method="GET", path="/x", status=400, region="us", client="203.0.113.9",
        request_id=FORGED_RID,
    )  # fmt: skip
    fields.update(changes)
    return AccessRecord(**fields)


@pytest.mark.parametrize("mode", ["plain", "json"])
def test_a_request_id_cannot_add_identity_fields_to_a_refused_request(access, mode):
    # Before the fix the plain line read "rid=abc key=api_key:deadbeef ip=1.2.3.4
    # start_us=1 time=...", and the replay took it for a request of that key and address.
    logger = AccessLogger(mode)
    logger.emit(refused())
    logger.flush()
    (line,) = access()
    assert "\n" not in line
    # not replayed: no rule saw it (a plain line leaves the components out), and counted
    # as such in both formats (rule=- decision=-), not as an older gateway's line
    assert parse_line(line, {}) == NO_IDENTITY
    if mode == "plain":
        fields = plain_fields(line)
        assert fields is not None
        assert fields["rid"] == FORGED_RID
        assert not {"key", "user", "ip", "start_us"} & set(fields)
    else:
        data = json.loads(line)
        assert data["request_id"] == FORGED_RID
        assert data["ip"] is None and data["key"] is None and data["start_us"] is None


@pytest.mark.parametrize("mode", ["plain", "json"])
def test_a_request_id_cannot_replace_the_identity_of_a_counted_request(access, mode):
    ids = RequestIdentity(HASHER, "198.51.100.7", "sk-real", None)
    logger = AccessLogger(mode)
    logger.emit(refused(status=429, rule="q", decision="limited", identity="api_key:x",
                        identities=ids))  # fmt: skip
    logger.flush()
    (line,) = access()
    found = parse_line(line, {})
    assert isinstance(found, Request)
    assert found.request_id == FORGED_RID
    assert found.key == HASHER.digest(IdentityKind.API_KEY, "sk-real")[:12]
    assert found.ip == HASHER.digest(IdentityKind.IP, "198.51.100.7")[:12]
    assert found.key != "api_key:deadbeef" and found.ip != "1.2.3.4"
    assert found.start_us > 10**15


def test_a_forged_line_written_by_an_older_gateway_is_not_replayed():
    # What the unquoted format wrote for such a request: read by the line's grammar, the
    # fields after rid are out of order, so the line is malformed, not a request.
    old = (
        '203.0.113.9 "GET /x" 400 region=us rule=- decision=- id=- upstream=- dur_ms=0.1 '
        f"upstream_ms=- rid={FORGED_RID} time=2026-11-23T10:00:00.002Z"
    )
    assert parse_line(old, {}) == MALFORMED
    full = old.replace(" time=", " time=T key=- user=- ip=cccccccccccc start_us=5 time=")
    assert parse_line(full, {}) == MALFORMED


def test_ordinary_values_are_written_as_before_and_odd_ones_quoted():
    line = plain_line(refused(request_id="0123456789abcdef", time="T"))
    assert line == (
        '203.0.113.9 "GET /x" 400 region=us rule=- decision=- id=- upstream=- dur_ms=0.0 '
        "upstream_ms=- rid=0123456789abcdef time=T"
    )
    line = plain_line(refused(path="/a b", method='"GET', request_id="-"))
    assert line.startswith('203.0.113.9 ""\\"GET" "/a b"" 400 region=us ')
    assert ' rid="-"' in line
    fields = plain_fields(line)
    assert fields is not None
    assert (fields["method"], fields["path"], fields["rid"]) == ('"GET', "/a b", "-")


def test_the_logging_prefix_inside_a_value_is_not_taken_for_the_prefix():
    forged = 'x gateway.access: {"method":"GET","path":"/","region":"us","ip":"i","start_us":5}'
    for line in (plain_line(refused(request_id=forged, time="T")),
                 json_line(refused(request_id=forged))):  # fmt: skip
        assert parse_line(line, {}) == NO_IDENTITY
        prefixed = "2026-11-23 10:00:00,002 INFO gateway.access: " + line
        assert parse_line(prefixed, {}) == NO_IDENTITY


# Text a client may choose: anything, with the pieces of the format more often than chance.
PIECES = [" ", '"', "{", "[", "\\", "=", "-", "\n", "\r", "\r\n", "\x00", "\x85", "\u2028", "\x1e",
          " key=k ip=i start_us=1", ' rid="', '" 200 ', "gateway.access: ", "{", "\\u0041",
          "\udc80", "\xe9", "\U0001f600", "\t", "\x7f"]  # fmt: skip
CLIENT_TEXT = st.lists(
    st.one_of(
        st.text(max_size=8),
        st.sampled_from(PIECES),
    ),
    max_size=8,
).map("".join)


def _record(client, method, path, rid, with_time, with_ids, with_cert=False) -> AccessRecord:
    return AccessRecord(
        method=method, path=path, status=429, region="us", client=client, rule="q",
        decision="limited", identity="api_key:0123456789ab", duration_ms=1.5,
        request_id=rid, time="2026-11-23T10:00:00.002Z" if with_time else None,
        key="aaaaaaaaaaaa" if with_ids else None, user=None,
        ip="cccccccccccc" if with_ids else None,
        start_us=1795428000000500 if with_ids else None,
        cert="dddddddddddd" if with_cert else None,
    )  # fmt: skip


def _one_line(line: str) -> None:
    assert line.splitlines() == [line]  # no separator str.splitlines knows
    assert io.StringIO(line + "\n", newline=None).readlines() == [line + "\n"]  # as read
    line.encode("utf-8")  # no lone surrogate: the log can be written as UTF-8
    assert line == line.strip()


@given(
    client=CLIENT_TEXT,
    method=CLIENT_TEXT,
    path=CLIENT_TEXT,
    rid=st.none() | CLIENT_TEXT,
    with_time=st.booleans(),
    with_ids=st.booleans(),
    with_cert=st.booleans(),
)
@example(client="1.2.3.4", method="GET", path="/", rid=FORGED_RID, with_time=True,
         with_ids=False, with_cert=False)  # fmt: skip
@example(client="", method="", path="", rid="", with_time=False, with_ids=True, with_cert=False)
@example(client='"', method="-", path='"/a b\\"', rid='"x"', with_time=True, with_ids=True,
         with_cert=True)  # fmt: skip
@fuzz(1500)
def test_any_client_text_round_trips_in_one_line_in_both_formats(
    client, method, path, rid, with_time, with_ids, with_cert
):
    r = _record(client, method, path, rid, with_time, with_ids, with_cert)

    line = plain_line(r)
    _one_line(line)
    fields = plain_fields(line)
    assert fields is not None, line
    expected = {
        "client": client, "method": method, "path": path, "status": "429", "region": "us",
        "rule": "q", "decision": "limited", "id": "api_key:0123456789ab", "upstream": None,
        "dur_ms": "1.5", "upstream_ms": None, "rid": rid,
    }  # fmt: skip
    if with_time:
        expected["time"] = "2026-11-23T10:00:00.002Z"
    if with_ids:
        expected.update(key="aaaaaaaaaaaa", user=None, ip="cccccccccccc",
                        start_us="1795428000000500")  # fmt: skip
    if with_cert:
        expected["cert"] = "dddddddddddd"
    assert fields == expected, line  # exactly these fields, each value as it was
    assert list(fields) == [name for name in PLAIN_FIELDS if name in expected]

    as_json = json_line(r)
    _one_line(as_json)
    data = json.loads(as_json)
    assert (data["client"], data["method"], data["path"], data["request_id"]) == (
        client, method, path, rid,
    )  # fmt: skip

    for written in (line, as_json):
        found = parse_line(written, {})
        if with_ids:
            cert = "dddddddddddd" if with_cert else None
            assert found == Request(1795428000000500, method, path, "us", "aaaaaaaaaaaa",
                                    None, "cccccccccccc", "limited", rid, None,
                                    cert), written  # fmt: skip
        else:
            assert isinstance(found, str)  # not replayed, whatever the client wrote


@given(paths=st.lists(CLIENT_TEXT, min_size=1, max_size=5), rid=CLIENT_TEXT)
@fuzz(150)
def test_a_written_log_file_reads_back_one_request_per_line(tmp_path_factory, paths, rid):
    # through the file, as the replay reads one: UTF-8 bytes, universal newlines
    log = tmp_path_factory.mktemp("log") / "access.log"
    records = [_record("10.0.0.1", "POST", p, rid, True, True) for p in paths]
    lines = [f(r) for r in records for f in (plain_line, json_line)]
    log.write_bytes(("\n".join(lines) + "\n").encode("utf-8"))
    reading = read_logs([log])
    assert reading.lines == len(lines) and not reading.skipped
    assert sorted(r.path for r in reading.requests) == sorted(p for p in paths for _ in "ab")
    assert {r.request_id for r in reading.requests} == {rid}
