"""gateway.proxy.access_log: the same lines as before, written in batches."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.policy.model import IdentityKind
from gateway.proxy.access_log import (
    AccessLogger,
    AccessRecord,
    json_line,
    plain_line,
    tenths,
    utc_now_ms,
)
from gateway.ratelimit.identity import IdentityHasher, RequestIdentity

FIELDS = [
    "method", "path", "status", "region", "client", "rule", "decision", "identity",
    "upstream", "duration_ms", "upstream_ms", "request_id", "time", "key", "user", "ip",
    "start_us", "consumer", "tier", "cert",
]  # fmt: skip


def logged(r: AccessRecord) -> dict[str, Any]:
    """What a JSON line holds: every field but the identities it is computed from."""
    fields = dataclasses.asdict(dataclasses.replace(r, identities=None))
    del fields["identities"], fields["own_request_id"]
    return fields


ODD_PATHS = [
    '/a"b',
    "/back\\slash",
    "/new\nline",
    "/cr\rtab\t",
    "/nul\x00bell\x07del\x7f",
    "/caf\u00e9/\u4e2d\u6587/\U0001f600",
    "/line\u2028separator",
    "/percent%s%d%%",
    '/"},{"status":200',
]


def record(**changes: Any) -> AccessRecord:
    base = AccessRecord(
        method="POST",
        path="/runs/query",
        status=429,
        region="us",
        client="127.0.0.1",
        rule="runs-query",
        decision="limited",
        identity="api_key:0123456789ab",
        upstream=None,
        duration_ms=0.25,
        upstream_ms=None,
        request_id="0123456789abcdef0123456789abcdef",
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture
def access(caplog):
    with caplog.at_level(logging.INFO, logger="gateway.access"):

        def messages() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.name == "gateway.access"]

        yield messages


def test_json_lines_have_every_field_in_order_and_match_json_dumps():
    r = record(upstream="default", upstream_ms=12.345, decision=None)
    line = json_line(r)
    assert line == json.dumps(logged(r), separators=(",", ":"))
    parsed = json.loads(line)
    assert list(parsed) == FIELDS
    assert parsed["upstream_ms"] == 12.345 and parsed["decision"] is None
    assert parsed["status"] == 429 and parsed["duration_ms"] == 0.25


def test_lines_sharing_their_repeated_fields_differ_only_where_the_records_do():
    # json_line keeps the text of the repeated fields per combination: every field that
    # changes (in the kept part or not) must still show in the line.
    records = [
        record(),
        record(identity="api_key:ba9876543210", duration_ms=7.5, request_id="r2"),
        record(status=200, decision="allowed", upstream="default", upstream_ms=1.25),
        record(rule=None, decision=None, identity=None),
        record(path="/other", client="10.0.0.9", region="eu", method="GET"),
        record(upstream="store"),
        record(),  # the first one again, from the kept text
    ]
    for r in records:
        line = json_line(r)
        assert line == json.dumps(logged(r), separators=(",", ":"))
    assert json_line(records[0]) == json_line(records[-1])


def test_plain_lines_are_as_before():
    assert plain_line(record()) == (
        '127.0.0.1 "POST /runs/query" 429 region=us rule=runs-query decision=limited '
        "id=api_key:0123456789ab upstream=- dur_ms=0.2 upstream_ms=- "
        "rid=0123456789abcdef0123456789abcdef"
    )
    assert plain_line(record(rule=None, upstream="default", upstream_ms=3.06)) == (
        '127.0.0.1 "POST /runs/query" 429 region=us rule=- decision=limited '
        "id=api_key:0123456789ab upstream=default dur_ms=0.2 upstream_ms=3.1 "
        "rid=0123456789abcdef0123456789abcdef"
    )


@pytest.mark.parametrize("path", ODD_PATHS)
def test_json_escapes_any_path(path):
    r = record(path=path, request_id='id "quoted" \\ here', client="::1")
    line = json_line(r)
    assert line == json.dumps(logged(r), separators=(",", ":"))
    assert json.loads(line) == logged(r)
    assert line.isascii() and line.isprintable()  # one line, whatever the path holds


@pytest.mark.parametrize("path", ODD_PATHS)
def test_plain_lines_stay_one_line(path):
    line = plain_line(record(path=path))
    assert line.isprintable() and "\n" not in line
    assert line.startswith('127.0.0.1 "POST ') and line.endswith(" rid=" + "0123456789abcdef" * 2)
    if path.isprintable():
        assert f"POST {path}" in line  # printable paths are written as they are
    else:  # the rest as their JSON string literal (ASCII, escaped), read back exactly
        assert f'POST {json.dumps(path)}" 429 ' in line


def test_without_an_event_loop_each_line_is_written_at_once(access):
    logger = AccessLogger("json")
    logger.emit(record(status=200))
    logger.emit(record(status=429))
    assert [json.loads(m)["status"] for m in access()] == [200, 429]


async def test_lines_go_out_together_once_the_first_has_waited_flush_seconds(access):
    loop = asyncio.get_running_loop()
    logger = AccessLogger("json", flush_seconds=0.3)
    started = loop.time()  # at or before the first emit, which schedules the flush
    for status in (200, 201):
        logger.emit(record(status=status))
    assert access() == []  # nothing written on the request path
    await asyncio.sleep(0)
    logger.emit(record(status=429))  # a later loop turn: joins the same batch
    await asyncio.sleep(0.05)
    # Nothing before flush_seconds. Asserted only while the loop's clock says so: a slow,
    # loaded machine may wake this task after the flush was due (it then ran already).
    if loop.time() - started < logger.flush_seconds:
        assert access() == []
    await asyncio.sleep(0.3)  # past the flush (only a lower bound on the wait matters)
    (message,) = access()
    assert [json.loads(line)["status"] for line in message.split("\n")] == [200, 201, 429]
    logger.emit(record(status=404))
    await asyncio.sleep(0.35)
    assert len(access()) == 2 and json.loads(access()[1])["status"] == 404


async def test_a_full_batch_is_written_at_once(access):
    logger = AccessLogger("plain", max_batch=3, flush_seconds=0.01)
    for _ in range(7):
        logger.emit(record())
    assert [m.count("\n") + 1 for m in access()] == [3, 3]
    await asyncio.sleep(0.03)
    assert [m.count("\n") + 1 for m in access()] == [3, 3, 1]


async def test_flush_at_stop_writes_what_is_buffered(access):
    logger = AccessLogger("plain", flush_seconds=0.01)
    logger.emit(record(path="/a"))
    logger.emit(record(path="/b"))
    logger.flush()
    (message,) = access()
    assert [line.split('"')[1] for line in message.split("\n")] == ["POST /a", "POST /b"]
    logger.flush()  # nothing left: nothing written
    await asyncio.sleep(0.03)  # the flush scheduled earlier finds nothing either
    assert len(access()) == 1


async def test_a_percent_in_a_line_is_never_interpolated(access):
    logger = AccessLogger("plain")
    logger.emit(record(path="/percent%s%d%%"))
    logger.flush()
    assert "POST /percent%s%d%%" in access()[0]


async def test_off_writes_nothing(access):
    logger = AccessLogger("off")
    logger.emit(record())
    logger.flush()
    await asyncio.sleep(0)
    assert access() == []


async def test_nothing_is_formatted_when_the_logger_is_quiet(caplog):
    with caplog.at_level(logging.WARNING, logger="gateway.access"):
        logger = AccessLogger("json")
        logger.emit(record())
        logger.flush()
        await asyncio.sleep(0)
    assert not [r for r in caplog.records if r.name == "gateway.access"]


async def test_a_logger_turned_up_later_gets_its_lines(caplog):
    # INFO is asked once per batch: quiet at first, lines from when it is turned up
    with caplog.at_level(logging.WARNING, logger="gateway.access"):
        logger = AccessLogger("plain")
        logger.emit(record(path="/quiet"))
        caplog.set_level(logging.INFO, logger="gateway.access")
        logger.emit(record(path="/heard"))
        logger.flush()
    messages = [r.getMessage() for r in caplog.records if r.name == "gateway.access"]
    assert len(messages) == 1 and "POST /heard" in messages[0] and "/quiet" not in messages[0]


@given(st.integers(min_value=0, max_value=10**9 - 1))
@settings(max_examples=3000, deadline=None)  # no per-example deadline: CI machines are slow
def test_tenths_is_format_for_whole_microseconds(micros):
    ms = int(micros) / 1000  # as duration_ms and upstream_ms are made
    assert tenths(ms) == format(ms, ".1f")


def test_tenths_is_format_at_every_tie_and_table_edge():
    for micros in [*range(0, 3000), *range(99_000, 101_000), 123_456_750]:
        assert tenths(micros / 1000) == format(micros / 1000, ".1f"), micros


@given(st.floats(allow_nan=True, allow_infinity=True))
@settings(deadline=None)
def test_tenths_is_format_for_any_float(value):
    assert tenths(value) == format(value, ".1f")


def _plain_as_before(r: AccessRecord) -> str:
    """The plain line as formatted before the kept heads (one f-string, appended to)."""
    upstream_ms = "-" if r.upstream_ms is None else format(r.upstream_ms, ".1f")
    rid = r.request_id
    line = (
        f'{r.client} "{r.method} {r.path}" {r.status} region={r.region} '
        f"rule={r.rule or '-'} decision={r.decision or '-'} id={r.identity or '-'} "
        f"upstream={r.upstream or '-'} dur_ms={format(r.duration_ms, '.1f')} "
        f"upstream_ms={upstream_ms} rid={rid or '-'}"
    )
    if r.time is not None:
        line = f"{line} time={r.time}"
    if r.ip is not None:
        line = f"{line} key={r.key or '-'} user={r.user or '-'} ip={r.ip} start_us={r.start_us}"
    if r.consumer is not None or r.tier is not None:
        line = f"{line} consumer={r.consumer or '-'} tier={r.tier or '-'}"
    return line


_WORDS = st.sampled_from(["/x", "GET", "us", "10.0.0.1", "a b", "-", "", '"q', "{j", "é", "\n"])


@given(
    method=_WORDS,
    path=_WORDS,
    client=_WORDS,
    region=_WORDS,
    upstream=st.none() | _WORDS,
    rid=st.none() | _WORDS,
    rule=st.none() | st.sampled_from(["r1", ""]),
    status=st.sampled_from([200, 429]),
    micros=st.integers(0, 10**7),
    ip=st.none() | st.just("0123456789ab"),
    consumer=st.none() | st.sampled_from(["acme", ""]),
)
@settings(max_examples=1500, deadline=None)
def test_plain_lines_from_kept_heads_match_the_old_formatting(
    method, path, client, region, upstream, rid, rule, status, micros, ip, consumer
):
    r = record(
        method=method, path=path, client=client, region=region, upstream=upstream,
        request_id=rid, rule=rule, status=status, duration_ms=micros / 1000,
        upstream_ms=None if upstream is None else micros / 2000, ip=ip, start_us=micros,
        key="k" * 12 if ip else None, time="2026-11-26T00:00:00.000Z", consumer=consumer,
    )  # fmt: skip
    line = plain_line(r)
    assert plain_line(r) == line  # the second time from the kept head
    quoted = any(
        v == "" or " " in v or not v.isprintable() or v[0] in '"{'
        for v in (method, path, client, region)
    ) or any(
        v is not None and (v in ("-", "") or " " in v or not v.isprintable() or v[0] in '"{')
        for v in (upstream, rid)
    )
    if not quoted:
        assert line == _plain_as_before(r)
    else:  # every value a client or the configuration chose, read back exactly
        assert line.count(" region=") == 1 and "\n" not in line


def test_records_have_no_place_for_a_query_string(access):
    assert [f.name for f in dataclasses.fields(AccessRecord)] == [
        *FIELDS,
        "identities",
        "own_request_id",
    ]
    logger = AccessLogger("json")
    logger.emit(record(path="/runs/query"))
    assert json.loads(access()[0])["path"] == "/runs/query"
    assert "?" not in access()[0]


def test_every_emitted_line_carries_its_own_time(access):
    logger = AccessLogger("plain")
    logger.emit(record())
    logger.emit(record())
    logger.flush()
    lines = access()
    assert len(lines) == 2
    for line in lines:
        stamp = line.rsplit(" time=", 1)[1]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", stamp), line
    json_logger = AccessLogger("json")
    json_logger.emit(record())
    json_logger.flush()
    assert json.loads(access()[-1])["time"].endswith("Z")


def test_the_time_field_is_the_wall_clock_to_the_millisecond():
    # Formatted once per millisecond and once per second: a cached text must still be
    # the current one, across many calls and second boundaries.
    seen = set()
    for _ in range(20_000):
        before = datetime.now(UTC).replace(tzinfo=None)
        stamp = utc_now_ms()
        after = datetime.now(UTC).replace(tzinfo=None)
        parsed = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ")
        # The stamp is the float epoch seconds times 1000, truncated: near a millisecond's
        # edge the float's rounding (a quarter of a microsecond at today's epoch) can put
        # it a microsecond past what datetime read (CI saw .735Z against .734999).
        late = after + timedelta(microseconds=1)
        assert before - timedelta(milliseconds=1) <= parsed <= late, (before, stamp, after)
        seen.add(stamp)
    assert len(seen) > 1  # the text moves on with the clock


def test_lines_carry_every_identity_component_hashed_never_raw(access):
    hasher = IdentityHasher(b"s" * 32)
    ids = RequestIdentity(hasher, "198.51.100.7", "sk-secret-key", "alice")
    before = datetime.now(UTC)
    logger = AccessLogger("json")
    logger.emit(record(identities=ids, duration_ms=40.0))
    logger.flush()
    line = access()[-1]
    parsed = json.loads(line)
    assert parsed["key"] == hasher.digest(IdentityKind.API_KEY, "sk-secret-key")[:12]
    assert parsed["user"] == hasher.digest(IdentityKind.USER_IP, "alice\x00198.51.100.7")[:12]
    assert parsed["ip"] == hasher.digest(IdentityKind.IP, "198.51.100.7")[:12]
    assert "sk-secret-key" not in line and "alice" not in line
    # start_us: when the request began (the end less its duration), in microseconds
    end = datetime.strptime(parsed["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    end_us = round(end.timestamp() * 1000) * 1000  # the time field is cut to the millisecond
    assert end_us - 40_000 <= parsed["start_us"] < end_us - 40_000 + 50_000
    assert parsed["start_us"] >= before.timestamp() * 1e6 - 40_000
    assert isinstance(parsed["start_us"], int)
    plain = AccessLogger("plain")
    plain.emit(record(identities=RequestIdentity(hasher, "198.51.100.7", None, None)))
    plain.flush()
    tail = access()[-1].split(" time=", 1)[1].split(" ", 1)[1]
    ip_hash = parsed["ip"]
    assert re.fullmatch(rf"key=- user=- ip={ip_hash} start_us=\d{{16}}", tail), tail


def test_identity_hashes_computed_for_matching_are_reused(access):
    calls = []
    # The hashlib construction, whose keyed inner state can be wrapped to count digests
    # (what is counted is how often a digest is made, not how: the C HMAC makes the same).
    hasher = IdentityHasher(b"s" * 32, native=False)
    keyed = hasher._inner

    class CountingHMAC:  # each digest starts from a copy of the keyed inner state
        def copy(self):
            return CountingHMAC.Copy(keyed.copy())

        class Copy:
            def __init__(self, mac):
                self.mac = mac

            def update(self, data):  # "<kind>\0<value>": the kind is what is counted
                calls.append(data.split(b"\0", 1)[0].decode())
                self.mac.update(data)

            def digest(self):
                return self.mac.digest()

    hasher._inner = CountingHMAC()
    ids = RequestIdentity(hasher, "198.51.100.7", "k", None, memo={})
    ids.key_for(IdentityKind.API_KEY)  # as rule matching does
    logger = AccessLogger("json")
    logger.emit(record(identities=ids))
    logger.emit(
        record(identities=RequestIdentity(ids.hasher, "198.51.100.7", "k", None, memo=ids.memo))
    )
    logger.flush()
    assert calls == ["api_key", "ip"]  # then the connection's memo
    off = AccessLogger("off")
    off.emit(record(identities=RequestIdentity(ids.hasher, "203.0.113.1", "k2", None)))
    assert len(calls) == 2  # with the log off nothing is hashed


def test_lines_of_long_paths_are_written_but_not_kept():
    # The kept heads hold a path twice (key and text): a client sending long, new paths
    # must not pin 4096 of them.
    from gateway.proxy import access_log

    access_log._HEADS.clear()
    access_log._PLAIN_HEADS.clear()
    for n in range(50):
        path = f"/{n}/" + "a" * 60_000
        r = record(path=path)
        assert f"POST {path}" in plain_line(r) and json.loads(json_line(r))["path"] == path
    short = record(path="/short")
    plain_line(short), json_line(short)
    assert len(access_log._PLAIN_HEADS) == 1 and len(access_log._HEADS) == 1
