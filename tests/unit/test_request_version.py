"""The request's HTTP version read from the request line's bytes (``version_in``) against
llhttp's own answer (``get_http_version``), on made-up request lines: whenever the bytes
give a version, it is the parser's."""

from __future__ import annotations

import contextlib

import httptools
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy.server import version_in

METHODS = [b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"PROPFIND"]
VERSIONS = [b"1.1", b"1.0", b"0.9", b"2.0", b"1.2"]
TARGET_CHARS = "abcXYZ019/-._~%?=&*:@!$'()+,;"


class Recorder:
    """What the server takes from llhttp at the end of the first head: the method, the
    target (as its pieces join), the version the parser reports."""

    def __init__(self) -> None:
        self.url: list[bytes] = []
        self.first: tuple[bytes, bytes, str] | None = None
        self.parser: httptools.HttpRequestParser | None = None

    def on_url(self, url: bytes) -> None:
        self.url.append(url)

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        if self.first is None:
            method = self.parser.get_method()
            self.first = (method, b"".join(self.url), self.parser.get_http_version())
        self.url = []


def parsed(raw: bytes) -> tuple[bytes, bytes, str] | None:
    recorder = Recorder()
    parser = recorder.parser = httptools.HttpRequestParser(recorder)
    with contextlib.suppress(httptools.HttpParserError):
        parser.feed_data(raw)  # (what was parsed before an error still counts)
    return recorder.first


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    lead = draw(st.sampled_from([b"", b"", b"\r\n", b"\n", b"\r\n\r\n"]))
    method = draw(st.sampled_from(METHODS))
    # (a target that holds a version, and runs of spaces that move the real one past
    # where a line of single spaces has it)
    target = draw(
        st.lists(st.sampled_from(["/", "a", "HTTP/1.1", "HTTP/1.0", "?q=", "%20", "*", "~"]),
                 min_size=1, max_size=6).map("".join)
        | st.text(TARGET_CHARS, min_size=1, max_size=20)
    ).encode()  # fmt: skip
    space1 = draw(st.sampled_from([b" ", b" ", b"  "]) | st.integers(1, 12).map(lambda n: b" " * n))
    space2 = draw(
        st.sampled_from([b" ", b" ", b"  ", b"\t"]) | st.integers(1, 12).map(lambda n: b" " * n)
    )
    version = b"HTTP/" + draw(st.sampled_from(VERSIONS))
    if draw(st.integers(0, 5)) == 0:  # an HTTP/0.9 line: no version at all
        space2 = version = b""
    end = draw(st.sampled_from([b"\r\n", b"\r\n", b"\n", b" \r\n"]))
    fields = draw(st.sampled_from([b"", b"Host: a\r\n", b"Host: a\r\nX-V: HTTP/1.0\r\n"]))
    line = lead + method + space1 + target + space2 + version + end + fields + b"\r\n"
    if draw(st.booleans()):  # a second request in the same read
        line += b"GET /b HTTP/" + draw(st.sampled_from(VERSIONS)) + b"\r\n\r\n"
    return line


@settings(max_examples=2000, deadline=None)
@given(raw=requests())
def test_a_version_read_from_the_bytes_is_the_parsers(raw: bytes) -> None:
    first = parsed(raw)
    if first is None:
        return  # llhttp refused the line: the server never asks
    method, target, version = first
    fast = version_in(raw, method, target)
    assert fast is None or fast == version, (raw, fast, version)


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_the_common_line_is_read_from_its_bytes(version: str) -> None:
    raw = f"GET /x?a=1 HTTP/{version}\r\nHost: a\r\n\r\n".encode()
    assert parsed(raw) == (b"GET", b"/x?a=1", version)
    assert version_in(raw, b"GET", b"/x?a=1") == version


@pytest.mark.parametrize(
    "raw",
    [
        b"\r\nGET /x HTTP/1.0\r\n\r\n",  # an empty line before it: the parser says
        b"GET  /x HTTP/1.0\r\n\r\n",  # two spaces
        b"GET /x  HTTP/1.0\r\n\r\n",
        b"GET /x HTTP/2.0\r\n\r\n",  # another version
        # A target that holds a version where one line of single spaces has its version:
        # only the CR after it tells this line apart (without that check, 1.1 not 1.0).
        b"GET" + b" " * 10 + b"/HTTP/1.1 HTTP/1.0\r\n\r\n",
        b"GET /HTTP/1.1" + b" " * 10 + b"HTTP/1.0\r\n\r\n",
        # HTTP/0.9 lines (review finding): a target that ends in a version, then the
        # line's CRLF, where a line of single spaces has its version and CR.
        b"GET" + b" " * 10 + b"/HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET" + b" " * 10 + b"/HTTP/1.0\r\nHost: a\r\n\r\n",
        b"GET http://a/HTTP/1.1\r\n\r\n",
    ],
)
def test_other_lines_are_left_to_the_parser(raw: bytes) -> None:
    first = parsed(raw)
    assert first is not None
    assert version_in(raw, first[0], first[1]) is None
