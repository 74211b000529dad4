"""The Host header: one value, one host, whoever reads it (RFC 9110 7.2, RFC 9112 3.2).

A security review: ``Host: api.eu.example.com:80:80`` was in no region's host list here
(counted in the default region) while nginx, which ends the host at the first ':', served
it as api.eu.example.com. The class: a Host value two readers can take for two hosts. The
gateway now refuses every value that is not ``uri-host [":" port]``, and the property
below checks, over drawn values, that whatever it accepts names the same host to each
reference reader: nginx's (``ngx_http_validate_host``: up to the first ':' outside
brackets, lower case, a trailing '.' dropped), Go's (``net.SplitHostPort``, as its
ServeMux strips the port: whatever sits between brackets) and the standard library's URL
parser. A review found ``[api.eu.example.com]:80`` accepted, which Go reads as
api.eu.example.com: bracketed names and out-of-range ports are drawn too.
"""

from __future__ import annotations

import urllib.parse

from hypothesis import example, given
from hypothesis import strategies as st

from gateway.proxy.routing import RegionMap, valid_host
from tests.support.fuzz import fuzz

FUZZ = fuzz(500)
PIECES = ["api", "eu", "example", "com", ".", ":", "80", "443", "[", "]", "::1", "%41", "%",
          "_", "-", "@", "/", " ", "\t", "\\", "a:b", "127.0.0.1", "\u00e9", "~", "+",
          "[api.eu.example.com]", "[::ffff:1.2.3.4]", "[v1.x]", "[fe80::1%25eth0]", ":99999",
          ":65536", ":0", "[", "1:2"]  # fmt: skip


def nginx_host(value: str) -> str:
    """The host nginx's ngx_http_validate_host keeps: up to the first ':' outside a
    bracketed literal, lower case, without a trailing '.'."""
    name = value[: value.index("]") + 1] if value.startswith("[") else value.split(":", 1)[0]
    return name.lower().rstrip(".")


def go_host(value: str) -> str:
    """Go's ServeMux (stripHostPort): without a ':', the value; else net.SplitHostPort's
    host (with brackets, what sits between them; else the part before the only ':'), or
    the value as it is where SplitHostPort fails."""
    if ":" not in value:
        return value.lower().rstrip(".")
    if value.startswith("["):
        end = value.find("]")
        rest = value[end + 1 :]
        if end < 0 or rest[:1] != ":" or "[" in value[1:] or "]" in rest:
            return value.lower().rstrip(".")
        return "[" + value[1:end].lower() + "]"  # (brackets kept, to compare with the others)
    host = value.rpartition(":")[0]
    if ":" in host or "[" in value or "]" in value:
        return value.lower().rstrip(".")
    return host.lower().rstrip(".")


def library_host(value: str) -> str | None:
    """The host urllib.parse reads from ``//value``; None where it refuses the value."""
    try:
        parts = urllib.parse.urlsplit("//" + value)
        parts.port  # noqa: B018 (raises on a port that is not a number, or out of range)
    except ValueError:
        return None
    host = parts.hostname or ""  # lower case, an IP literal without its brackets
    if parts.netloc.startswith("["):
        host = f"[{host}]"
    return host.rstrip(".")


@FUZZ
@given(st.lists(st.sampled_from(PIECES), max_size=8).map("".join))
@example("api.eu.example.com:80:80")
@example("api.eu.example.com:80")
@example("[::1]:8080")
@example("[api.eu.example.com]:80")
@example("api.eu.example.com:99999")
def test_an_accepted_host_names_one_host_to_every_reader(value: str) -> None:
    raw = value.encode("utf-8")
    if not valid_host(raw):
        return
    name = nginx_host(value)
    assert library_host(value) == name, value
    if ":" in value and not value.endswith(":"):  # (Go: "host:" is a port that is empty)
        assert go_host(value) == name, value
    regions = RegionMap("us", {name: "eu"} if name else {})
    assert regions.region_for(value) == ("eu" if name else "us"), value


def test_the_reviewers_host_is_refused_and_plain_ones_are_not() -> None:
    for bad in [b"api.eu.example.com:80:80", b"a b", b"a/b", b"a@b", b"%4", b"[::1", b"a:b",
                b"\xc3\xa9", b"a\\b", b"[api.eu.example.com]:80", b"[v1.x]", b"a:65536",
                b"[fe80::1%25eth0]"]:  # fmt: skip
        assert not valid_host(bad), bad
    for good in [b"api.eu.example.com", b"api.eu.example.com:80", b"[::1]:8080", b"127.0.0.1",
                 b"a_b", b"x:", b"API.EU.EXAMPLE.COM."]:  # fmt: skip
        assert valid_host(good), good
