"""Canonical request paths, so that no spelling of a path can dodge its limit.

The path matched against the rules is the path forwarded upstream: percent-encoded
unreserved characters are decoded, ``//`` collapses, ``.`` and ``..`` segments are
resolved and a trailing ``/`` is dropped. Spellings that upstreams disagree about are
refused with 400 instead: an encoded ``/``, ``\\`` or ``%00``, ``;`` path parameters,
control characters, and ``..`` above the root.
"""

from __future__ import annotations

import string
from typing import Final

UNRESERVED: Final = frozenset(string.ascii_letters + string.digits + "-._~")
HEX: Final = frozenset(string.hexdigits)
# Allowed raw in a path (RFC 3986 pchar plus '/'), except ';' which we refuse on purpose.
ALLOWED_RAW: Final = frozenset(string.ascii_letters + string.digits + "-._~!$&'()*+,=:@/%")
FORBIDDEN_DECODED: Final = {"/": "an encoded '/' (%2F)", "\\": "an encoded '\\' (%5C)"}
MAX_PATH_BYTES: Final = 4096


class PathError(ValueError):
    """The request target cannot be normalised safely; answer 400 with this message."""


def split_target(target: str) -> tuple[str, str]:
    """Split a request target into path and query string (without the ``?``)."""
    path, _, query = target.partition("?")
    return path, query


def normalise_path(raw: str) -> str:
    """The canonical form of an origin-form path, or ``PathError``."""
    if not raw.startswith("/"):
        raise PathError("the request target must be a path starting with '/'")
    if len(raw) > MAX_PATH_BYTES:
        raise PathError(f"the path is longer than {MAX_PATH_BYTES} bytes")
    if "%" in raw or any(c not in ALLOWED_RAW for c in raw):
        raw = _decode(raw)
    segments: list[str] = []
    for segment in raw.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if not segments:
                raise PathError("the path climbs above the root with '..'")
            segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments)


def _decode(raw: str) -> str:
    out: list[str] = []
    i = 0
    n = len(raw)
    while i < n:
        c = raw[i]
        if c == "%":
            pair = raw[i + 1 : i + 3]
            if len(pair) != 2 or not set(pair) <= HEX:
                raise PathError("the path has a malformed percent-encoding")
            decoded = chr(int(pair, 16))
            if decoded in UNRESERVED:
                out.append(decoded)
            elif decoded in FORBIDDEN_DECODED:
                raise PathError(f"the path contains {FORBIDDEN_DECODED[decoded]}")
            elif decoded == ";":
                raise PathError("path parameters (';', %3B) are not accepted")
            elif ord(decoded) < 0x20 or ord(decoded) == 0x7F:
                raise PathError("the path contains an encoded control character")
            else:
                out.append("%" + pair.upper())  # stays encoded: it is data, not structure
            i += 3
            continue
        if c == ";":
            raise PathError("path parameters (';') are not accepted")
        if c == "\\":
            raise PathError("the path contains '\\'")
        if c not in ALLOWED_RAW:
            raise PathError(
                f"the path contains a character that must be percent-encoded: {repr(c)}"
            )
        out.append(c)
        i += 1
    return "".join(out)
