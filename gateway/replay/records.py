"""Requests as access logs recorded them: what a replay needs from each line.

Reads both line formats of ``gateway.proxy.access_log`` (JSON and plain), with or without
the logging prefix the first line of each batch carries (``... INFO gateway.access: ``),
among other log lines. A line that cannot be replayed is counted under a reason, never
an error: other log lines, lines written before the identity components were logged,
requests answered before any rule was consulted (a 400, ``/ok``), malformed lines.
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

_PREFIX = "gateway.access: "
# client "METHOD path" status key=value ...
_PLAIN = re.compile(r'(\S+) "(\S+) (\S*)" (-?\d+) (.*)')


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


@dataclass
class Reading:
    """What was read: the requests in time order, and what was skipped, by reason."""

    requests: list[Request] = field(default_factory=list)
    lines: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    files: list[str] = field(default_factory=list)


def parse_line(line: str, strings: dict[str, str]) -> Request | str:
    """The request a line records, or the reason it cannot be replayed.

    ``strings`` interns repeated values (methods, paths, regions, hashes): a million
    requests share a few thousand strings."""
    at = line.find(_PREFIX)
    if at >= 0:
        line = line[at + len(_PREFIX) :]
    line = line.strip()
    if not line:
        return NOT_ACCESS_LOG
    if line[0] == "{":
        return _from_json(line, strings)
    return _from_plain(line, strings)


def _from_json(line: str, strings: dict[str, str]) -> Request | str:
    try:
        data = json.loads(line)
    except ValueError:
        return MALFORMED
    if not isinstance(data, dict) or "method" not in data or "path" not in data:
        return NOT_ACCESS_LOG
    if "ip" not in data or "start_us" not in data:
        return NO_COMPONENTS
    get = data.get
    ip, start = get("ip"), get("start_us")
    if ip is None:
        return NO_IDENTITY
    method, path, region = get("method"), get("path"), get("region")
    key, user, decision, request_id = get("key"), get("user"), get("decision"), get("request_id")
    if type(start) is not int or not (
        type(method) is str and type(path) is str and type(region) is str and type(ip) is str
    ):
        return MALFORMED
    if not (
        (key is None or type(key) is str)
        and (user is None or type(user) is str)
        and (decision is None or type(decision) is str)
    ):
        return MALFORMED
    # One setdefault per repeated string: a million requests share a few thousand.
    intern = strings.setdefault
    return Request(
        start,
        intern(method, method),
        intern(path, path),
        intern(region, region),
        None if key is None else intern(key, key),
        None if user is None else intern(user, user),
        intern(ip, ip),
        None if decision is None else intern(decision, decision),
        request_id if type(request_id) is str else None,
    )


def _from_plain(line: str, strings: dict[str, str]) -> Request | str:
    match = _PLAIN.fullmatch(line)
    if match is None:
        return NOT_ACCESS_LOG
    fields = dict(part.partition("=")[::2] for part in match.group(5).split(" "))
    if "ip" not in fields or "start_us" not in fields:
        return NO_COMPONENTS if "region" in fields else NOT_ACCESS_LOG
    if "region" not in fields:
        return MALFORMED
    try:
        start = int(fields["start_us"])
    except ValueError:
        return MALFORMED
    s = strings

    def opt(name: str) -> str | None:
        value = fields.get(name, "-")
        return None if value == "-" else s.setdefault(value, value)

    ip = opt("ip")
    if ip is None:
        return NO_IDENTITY
    return Request(
        start,
        s.setdefault(match.group(2), match.group(2)),
        s.setdefault(match.group(3), match.group(3)),
        s.setdefault(fields["region"], fields["region"]),
        opt("key"),
        opt("user"),
        ip,
        opt("decision"),
        fields.get("rid"),
    )


def read_logs(
    paths: Iterable[str | Path], progress: Callable[[int], None] | None = None
) -> Reading:
    """Every request the logs record, sorted by when it began (a stable sort: requests
    of one millisecond keep their order in the files). ``progress`` gets bytes read."""
    reading = Reading()
    strings: dict[str, str] = {}
    done = 0
    for path in paths:
        reading.files.append(str(path))
        with open(path, encoding="utf-8", errors="replace") as handle:
            done = _read(handle, reading, strings, progress, done)
    reading.requests.sort(key=_start)
    return reading


def _start(request: Request) -> int:
    return request.start_us


def _read(
    handle: IO[str],
    reading: Reading,
    strings: dict[str, str],
    progress: Callable[[int], None] | None,
    done: int,
) -> int:
    append = reading.requests.append
    skipped = reading.skipped
    lines = 0
    for line in handle:
        lines += 1
        done += len(line)
        if progress is not None and lines % 20_000 == 0:
            progress(done)
        found = parse_line(line, strings)
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

