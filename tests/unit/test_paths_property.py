"""Fuzzing the path normaliser against a reference model of its documented behaviour.

The model below restates README "How requests are handled" step 2 and docs/rules.md
("Rules see the canonical path") as directly as possible: split the raw path into
literal text and ``%XX`` escapes, decode the escapes of unreserved characters, keep
other escapes (upper-cased), refuse what servers disagree about, then resolve dot
segments. Every input, however odd (raw bytes read as latin-1, as the data plane reads
the request target; any unicode, as ``gateway rules explain`` gets it), must give the
model's answer and never an exception other than ``PathError``.
"""

from __future__ import annotations

import re
import string

from hypothesis import example, given
from hypothesis import strategies as st

from gateway.policy.paths import PathError, normalise_path
from tests.support.fuzz import fuzz

FUZZ = fuzz(400)

UNRESERVED = set(string.ascii_letters + string.digits + "-._~")
# RFC 3986 pchar, less ';' (path parameters are refused on purpose) and '%' (escapes).
PCHAR = UNRESERVED | set("!$&'()*+,=:@")
ESCAPE = re.compile(r"(%[0-9A-Fa-f]{2})")
MAX_PATH = 4096


def model_normalise(raw: str) -> str | None:
    """The canonical path, or None where the gateway must answer 400."""
    if not raw.startswith("/") or len(raw) > MAX_PATH:
        return None
    decoded: list[str] = []
    for n, part in enumerate(ESCAPE.split(raw)):
        if n % 2 == 0:  # literal text between escapes
            if any(c != "/" and c not in PCHAR for c in part):
                return None  # a stray '%', ';', '\', a control or non-ASCII character...
            decoded.append(part)
            continue
        char = chr(int(part[1:], 16))
        if char in UNRESERVED:
            decoded.append(char)
        elif char in "/\\;" or ord(char) < 0x20 or ord(char) == 0x7F:
            return None  # structure in disguise, or a control character
        else:
            decoded.append(part.upper())
    stack: list[str] = []
    for segment in "".join(decoded).split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if not stack:
                return None
            stack.pop()
        else:
            stack.append(segment)
    return "/" + "/".join(stack)


def actual(raw: str) -> str | None:
    try:
        return normalise_path(raw)
    except PathError:
        return None


# Pieces that make paths interesting: dot segments plain and encoded, encoded structure,
# escapes of every byte in either case, characters that must be refused.
ODD_PIECES = [
    "", ".", "..", "%2e", "%2E", "%2e%2E", ".%2e", "runs", "query", "a:b@c", "~u",
    "%2F", "%2f", "%5C", "%5c", "\\", ";", "%3B", ";x=1", "%00", "%7F", "%25", "%zz", "%4",
    "%", " ", "é", "\x00", "\t", "\u2028", "?", "#", "{", "%7B", "%7d", "%3A", "%41", "%7e",
]  # fmt: skip


@st.composite
def escapes(draw: st.DrawFn) -> str:
    byte = draw(st.integers(0, 255))
    digits = f"{byte:02x}"
    return "%" + "".join(draw(st.sampled_from([c.lower(), c.upper()])) for c in digits)


segments = st.one_of(
    st.sampled_from(ODD_PIECES),
    escapes(),
    st.text(alphabet=string.ascii_letters + string.digits + "-._~!$&'()*+,=:@", max_size=6),
    st.lists(st.one_of(st.sampled_from(ODD_PIECES), escapes()), max_size=3).map("".join),
)
structured_paths = st.lists(segments, max_size=10).map(lambda parts: "/" + "/".join(parts))
raw_byte_paths = st.binary(max_size=48).map(lambda b: "/" + b.decode("latin-1"))
unicode_paths = st.text(max_size=24).map(lambda t: "/" + t)
any_paths = st.one_of(structured_paths, raw_byte_paths, unicode_paths, st.text(max_size=12))


@FUZZ
@given(raw=any_paths)
@example(raw="/" + "a" * (MAX_PATH - 1))
@example(raw="/" + "a" * MAX_PATH)
@example(raw="/runs/x/%2e%2e/%2E%2E/query")
@example(raw="/%2e%2e")
@example(raw="/a/%5c")
def test_normaliser_agrees_with_the_model(raw: str) -> None:
    assert actual(raw) == model_normalise(raw)


@FUZZ
@given(raw=any_paths)
def test_canonical_paths_are_fixed_points_without_ambiguous_spellings(raw: str) -> None:
    path = actual(raw)
    if path is None:
        return
    assert path.startswith("/")
    assert normalise_path(path) == path  # forwarding it again changes nothing
    parts = path.split("/")[1:]
    assert path == "/" or all(p not in ("", ".", "..") for p in parts)
    for escape in re.findall(r"%(..)", path):
        assert escape == escape.upper()
        assert chr(int(escape, 16)) not in UNRESERVED


@FUZZ
@given(
    prefix=st.lists(st.sampled_from(["", ".", "%2e", "x/..", "x/%2E%2E", "/"]), max_size=4),
    tail=st.sampled_from(["", "/", "//", "/.", "/%2e"]),
    target=st.sampled_from(["runs/query", "runs/%71uery", "%72uns//query", "runs/./query"]),
)
def test_spellings_of_one_path_are_one_path(prefix: list[str], tail: str, target: str) -> None:
    raw = "/" + "/".join([*prefix, target]) + tail
    assert normalise_path(raw) == "/runs/query"
