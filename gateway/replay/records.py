"""Requests as access logs recorded them: what a replay needs from each line.

Reads both line formats of ``gateway.proxy.access_log`` (JSON and plain), with or without
the logging prefix the first line of each batch carries (``... INFO gateway.access: ``),
among other log lines. A line that cannot be replayed is counted under a reason, never
an error, whatever it holds (any text, bytes that are not UTF-8, absurd numbers, JSON
nested thousands deep, a line of gigabytes): other log lines, lines written before the
identity components were logged, requests answered before any rule was consulted (a 400,
``/ok``), malformed lines, times out of range, ...

A plain line is read by its grammar, field by field in the order the gateway writes
them, never as a bag of ``name=value`` words: a value is either written as it is (no
space in it, not starting with ``"``) or as a JSON string literal, which is read back
exactly. So a value a client chose (its ``X-Request-Id``, path or method) cannot add a
field, and a line of an older gateway where one did (an unquoted request id with spaces)
does not read at all: it is counted as malformed, never replayed with forged fields.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, NamedTuple

NOT_ACCESS_LOG = "not an access-log line"
NO_COMPONENTS = "written before identity components were logged (no key/user/ip/start_us)"
NO_IDENTITY = "answered before the rules were consulted (no identity: 400, /ok, ...)"
MALFORMED = "malformed access-log line"
BAD_START = "start_us out of range (not a time from 1970 to 9999)"
TOO_DEEP = "JSON nested too deeply"
TOO_LONG = "line too long"
NOT_UTF8 = "not UTF-8 (undecodable bytes)"

# Longer lines are skipped (read in slices, never held whole): an access line is a few
# hundred characters, and its longest values (a path of at most 4096 characters, a request
# id of 128) escaped in full (6 characters each at most) are tens of thousands.
MAX_LINE_CHARS = 1 << 22
_SLICE_CHARS = 1 << 16
# The latest start_us a replay can report (datetime's last microsecond, 9999-12-31).
MAX_START_US = 253_402_300_799_999_999
# An identity hash, region or decision as the gateway writes it: printable, no space.
MAX_TOKEN_CHARS = 256

_PREFIX = "gateway.access: "
# A value of a plain line: a JSON string literal, or written as it is (no space, not
# starting with a quote), or empty. Atomic and possessive: a value has one reading, and a
# line that does not match fails in time linear in its length (no backtracking into it).
_V = r'((?>"[^"\\]*+(?:\\.[^"\\]*+)*+"|[^ "][^ ]*+|))'
# The path, before the request's closing quote: written as it is, it may hold quotes.
_P = r'((?>"[^"\\]*+(?:\\.[^"\\]*+)*+")|[^ "][^ ]*|)'
# client "METHOD path" status, then the fields in the order plain_line writes them
# (time since 2026-11-23, the identity components since the replay exists, a client
# certificate's hash since 2026-11-26).
_PLAIN_HEAD = re.compile(rf'{_V} "{_V} {_P}" (-?[0-9]+) region=')
_PLAIN = re.compile(
    rf'{_V} "{_V} {_P}" (-?[0-9]+) region={_V} rule={_V} decision={_V} id={_V} '
    rf"upstream={_V} dur_ms={_V} upstream_ms={_V} rid={_V}(?: time={_V})?"
    rf"(?: key={_V} user={_V} ip={_V} start_us={_V})?"
    rf"(?: consumer={_V} tier={_V})?"
    rf"(?: cert={_V})?"
)
PLAIN_FIELDS = (
    "client", "method", "path", "status", "region", "rule", "decision", "id", "upstream",
    "dur_ms", "upstream_ms", "rid", "time", "key", "user", "ip", "start_us", "consumer",
    "tier", "cert",
)  # fmt: skip
# Fields where a bare "-" stands for none.
_OPTIONAL = frozenset({"rule", "decision", "id", "upstream", "upstream_ms", "rid", "key",
                       "user", "ip", "consumer", "tier"})  # fmt: skip


class Request(NamedTuple):
    """One recorded request (a tuple: a million of them must stay small)."""

    start_us: int  # when the request began (epoch microseconds)
    method: str
    path: str
    region: str
    key: str | None  # api_key identity hash, 12 hex
    user: str | None  # user_ip identity hash
    ip: str  # ip identity hash
    decision: str | None  # what the gateway logged: allowed, limited, exempt, ...
    request_id: str | None
    tier: str | None = None  # a verified identity's tier: it picks a rule's tier limits
    cert: str | None = None  # client_cert identity hash (a verified client certificate)


@dataclass
class Reading:
    """What was read: the requests in time order, and what was skipped, by reason."""

    requests: list[Request] = field(default_factory=list)
    lines: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    files: list[str] = field(default_factory=list)


def parse_line(
    line: str, strings: dict[str, str], tokens: dict[str, str] | None = None
) -> Request | str:
    """The request a line records, or the reason it cannot be replayed (never raises).

    ``strings`` interns repeated values (methods, paths, regions, hashes): a million
    requests share a few thousand strings. ``tokens`` keeps the hashes, regions and
    decisions already found sane (see ``_token``), so each is checked once per reading."""
    if not line.isascii() and _has_surrogates(line):
        return NOT_UTF8  # read with surrogateescape: bytes that were not UTF-8
    if len(line) > MAX_LINE_CHARS:
        return TOO_LONG
    at = line.find(_PREFIX)
    # The logging prefix comes before the line: never inside a value (after a quote).
    if at >= 0 and line.find('"', 0, at) < 0 and line.find("{", 0, at) < 0:
        line = line[at + len(_PREFIX) :]
    line = line.strip()
    if not line:
        return NOT_ACCESS_LOG
    if tokens is None:
        tokens = {}
    if line[0] == "{":
        return _from_json(line, strings, tokens)
    return _from_plain(line, strings, tokens)


def _has_surrogates(line: str) -> bool:
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _start_us(value: object) -> int | str:
    """start_us as an int, or the reason it is not one a replay can use."""
    if type(value) is not int:
        return MALFORMED
    if not 0 <= value <= MAX_START_US:
        return BAD_START
    return value


def _from_json(line: str, strings: dict[str, str], tokens: dict[str, str]) -> Request | str:
    try:
        data = json.loads(line)
    except ValueError:  # not JSON, numbers of more than 4300 digits, ...
        return MALFORMED
    except RecursionError:  # [[[[...]]]] thousands deep
        return TOO_DEEP
    if not isinstance(data, dict) or "method" not in data or "path" not in data:
        return NOT_ACCESS_LOG
    get = data.get
    if "ip" not in data or "start_us" not in data:
        # No rule and no decision: answered before the rules were consulted, which is
        # what matters whatever the line's age (see ``_from_plain``).
        if "decision" in data and get("decision") is None and get("rule") is None:
            return NO_IDENTITY
        return NO_COMPONENTS
    ip = get("ip")
    if ip is None:
        return NO_IDENTITY
    method, path, region = get("method"), get("path"), get("region")
    key, user, decision, request_id = get("key"), get("user"), get("decision"), get("request_id")
    if not (type(method) is str and type(path) is str):
        return MALFORMED
    start = _start_us(get("start_us"))
    if isinstance(start, str):
        return start
    # The tokens seen before are one lookup each; the others are checked once.
    known = tokens.get
    ip = (known(ip) if type(ip) is str else None) or _token(ip, strings, tokens)
    region = (known(region) if type(region) is str else None) or _token(region, strings, tokens)
    if ip is None or region is None:
        return MALFORMED
    # None or "" for none (a plain line writes both as "-")
    if key is None or key == "":
        key = None
    elif (
        key := (known(key) if type(key) is str else None) or _token(key, strings, tokens)
    ) is None:
        return MALFORMED
    if user is None or user == "":
        user = None
    elif (
        user := (known(user) if type(user) is str else None) or _token(user, strings, tokens)
    ) is None:
        return MALFORMED
    if decision is None or decision == "":
        decision = None
    elif (
        decision := (known(decision) if type(decision) is str else None)
        or _token(decision, strings, tokens)
    ) is None:
        return MALFORMED
    tier = get("tier")
    if tier is None or tier == "":
        tier = None
    elif (tier := _token(tier, strings, tokens)) is None:
        return MALFORMED
    cert = get("cert")
    if cert is None or cert == "":
        cert = None
    elif (cert := _token(cert, strings, tokens)) is None:
        return MALFORMED
    # One setdefault per repeated string: a million requests share a few thousand.
    intern = strings.setdefault
    return Request(
        start,
        intern(method, method),
        intern(path, path),
        region,
        key,
        user,
        ip,
        decision,
        request_id if type(request_id) is str else None,
        tier,
        cert,
    )


def _token(value: object, strings: dict[str, str], tokens: dict[str, str]) -> str | None:
    """``value``, interned, if it is what the gateway writes as an identity hash, region
    or decision: printable text without spaces, at most MAX_TOKEN_CHARS (so a report
    printing it stays one line per entry); else None."""
    if type(value) is not str:
        return None
    found = tokens.get(value)
    if found is not None:
        return found
    if not (0 < len(value) <= MAX_TOKEN_CHARS and value.isprintable() and " " not in value):
        return None
    value = strings.setdefault(value, value)
    tokens[value] = value
    return value


def _value(token: str) -> str | None:
    """A plain line's value: a JSON string literal decoded, anything else as it is (None
    for an invalid literal)."""
    if token[:1] != '"':
        return token
    try:
        value = json.loads(token)
    except ValueError:
        return None
    return value if type(value) is str else None


def plain_fields(line: str) -> dict[str, str | None] | None:
    """Every field of a plain line by name (values decoded; a bare ``-`` as None where it
    stands for none; fields the line does not have absent), or None if the line does not
    follow the grammar."""
    match = _PLAIN.fullmatch(line)
    if match is None:
        return None
    found: dict[str, str | None] = {}
    for name, token in zip(PLAIN_FIELDS, match.groups(), strict=True):
        if token is None:
            continue  # an optional group the line does not have
        if token == "-" and name in _OPTIONAL:  # noqa: S105 (a field, not a password)
            found[name] = None
            continue
        value = _value(token)
        if value is None:
            return None
        found[name] = value
    return found


def _from_plain(line: str, strings: dict[str, str], tokens: dict[str, str]) -> Request | str:
    match = _PLAIN.fullmatch(line)
    if match is None:
        # an access line whose fields are not the gateway's (forged, cut, edited) or
        # another log line
        return MALFORMED if _PLAIN_HEAD.match(line) else NOT_ACCESS_LOG
    if not line.isprintable():  # never written by a gateway: what it cannot print, it quotes
        return MALFORMED
    (_, method, path, _, region, rule, decision, _, _, _, _, rid, _, key, user, ip,
     start_text, _, tier, cert) = match.groups()  # fmt: skip
    if ip is None or start_text is None:
        # The gateway leaves the identity components out of a line it answered before
        # the identity was formed (/ok, a 400): no rule, no decision. Such a line is
        # classed by that, before the missing fields, which otherwise only an older
        # gateway's lines lack.
        if rule == "-" and decision == "-":
            return NO_IDENTITY
        return NO_COMPONENTS
    if ip == "-":
        return NO_IDENTITY
    digits = start_text[1:] if start_text[:1] == "-" else start_text
    if not (digits.isascii() and digits.isdigit()):
        return MALFORMED
    start = _start_us(int(start_text) if len(digits) <= 19 else MAX_START_US + 1)
    if isinstance(start, str):
        return start
    # Values a client chose are quoted when they could not be written as they are.
    method, path = _value(method), _value(path)
    request_id = None if rid == "-" else _value(rid)
    if method is None or path is None or (request_id is None and rid != "-"):
        return MALFORMED
    s, t = strings, tokens
    ip = _token(_value(ip), s, t)
    region = _token(_value(region), s, t)
    if ip is None or region is None:
        return MALFORMED
    if key == "-":
        key = None
    elif (key := _token(_value(key), s, t)) is None:
        return MALFORMED
    if user == "-":
        user = None
    elif (user := _token(_value(user), s, t)) is None:
        return MALFORMED
    if decision == "-":
        decision = None
    elif (decision := _token(_value(decision), s, t)) is None:
        return MALFORMED
    if tier is None or tier == "-":
        tier = None
    elif (tier := _token(_value(tier), s, t)) is None:
        return MALFORMED
    if cert is not None and (cert := _token(_value(cert), s, t)) is None:
        return MALFORMED
    return Request(
        start,
        s.setdefault(method, method),
        s.setdefault(path, path),
        region,
        key,
        user,
        ip,
        decision,
        request_id,
        tier,
        cert,
    )


def read_logs(
    paths: Iterable[str | Path], progress: Callable[[int], None] | None = None
) -> Reading:
    """Every request the logs record, sorted by when it began (a stable sort: requests
    of one millisecond keep their order in the files). ``progress`` gets characters read.
    Bytes that are not UTF-8 make their line unreadable (``NOT_UTF8``), never the file."""
    reading = Reading()
    strings: dict[str, str] = {}
    tokens: dict[str, str] = {}
    done = 0
    for path in paths:
        reading.files.append(str(path))
        with open(path, encoding="utf-8", errors="surrogateescape") as handle:
            done = _read(handle, reading, strings, tokens, progress, done)
    reading.requests.sort(key=_start)
    return reading


def _start(request: Request) -> int:
    return request.start_us


def _read(
    handle: IO[str],
    reading: Reading,
    strings: dict[str, str],
    tokens: dict[str, str],
    progress: Callable[[int], None] | None,
    done: int,
) -> int:
    append = reading.requests.append
    skipped = reading.skipped
    readline = handle.readline
    lines = 0
    while line := readline(MAX_LINE_CHARS + 1):
        lines += 1
        done += len(line)
        if progress is not None and lines % 20_000 == 0:
            progress(done)
        if len(line) > MAX_LINE_CHARS and line[-1] != "\n":
            # longer than any access line: the rest is read in slices and dropped
            while (rest := readline(_SLICE_CHARS)) and rest[-1] != "\n":
                done += len(rest)
            done += len(rest)
            skipped[TOO_LONG] += 1
            continue
        found = parse_line(line, strings, tokens)
        if isinstance(found, str):
            skipped[found] += 1
        else:
            append(found)
    reading.lines += lines
    if progress is not None:
        progress(done)
    return done


def iso_us(epoch_us: int) -> str:
    """Epoch microseconds as the access log writes times (UTC, milliseconds)."""
    epoch_ms = epoch_us // 1000
    moment = datetime.fromtimestamp(epoch_ms // 1000, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{epoch_ms % 1000:03d}Z"
