"""Which path segments a ``{uuid}`` template parameter takes: every spelling a common
upstream reads as a UUID, so that no spelling of one id leaves the rule that limits it.

Over-accepting is safe for a limit (a segment that only looks like an id is counted by
the stricter rule); under-accepting is a way around it. So a segment is a UUID when any of
these readers takes it, percent-decoded:

* Python's ``uuid.UUID`` (FastAPI/pydantic, Django's ``<uuid:...>``, Flask): 32 hex
  digits, hyphens anywhere, braces, ``urn:uuid:``, what ``int(..., 16)`` reads;
* Java's ``UUID.fromString`` as Spring reads a path variable (after ``String.trim()``):
  JDK 17 on (five '-'-separated groups of one or more digits, a '+' allowed, at most 36
  characters) and JDK 8 (``split("-")``, trailing empty groups dropped, ``Long.decode``:
  no sign, no length limit); digits as ``Character.digit(c, 16)`` reads them (Unicode
  decimal digits, fullwidth letters);
* .NET's ``Guid.Parse`` as ASP.NET's ``{id:guid}`` reads it (after ``Trim()``): the "D"
  form with its compatibility path (a component may start with '+', '0x' or '+0x' within
  its fixed width), "B" and "P" (the same in braces or parentheses), "X"
  (``{0x..,0x..,0x..,{0x..,...}}``, white space anywhere) and "N".

An exemption (``unlimited``) must not take more than the upstream serves under that
path, so its test uses ``is_canonical_uuid`` instead (``PathMatcher.exact_test``).
"""

from __future__ import annotations

import re
import unicodedata
import uuid
from typing import Final
from urllib.parse import unquote

__all__ = ["is_canonical_uuid", "is_uuid_segment"]

# What Java's String.trim() drops (every character up to U+0020) and what .NET's Trim()
# drops (Unicode white space): both, around the value.
_TRIMMED: Final = "".join(chr(c) for c in range(0x3001) if c <= 0x20 or chr(c).isspace())
_SPACE: Final = re.compile(r"\s+")  # what .NET's "X" parsing removes anywhere
_LONG_MAX: Final = (1 << 63) - 1
_CANONICAL: Final = re.compile(r"[0-9A-Fa-f]{8}(?:-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}")
# .NET's TryParseHex on one component: '+', then '0x' (either case), then hex digits (any
# number, none included); ``digits``: those after the leading zeros.
_DOTNET_HEX: Final = re.compile(r"\+?(?:0[xX])?0*(?P<digits>[0-9A-Fa-f]*)")
_HEX: Final = re.compile(r"[0-9A-Fa-f]*")


def is_uuid_segment(segment: str) -> bool:
    """Whether a path segment, percent-decoded, is a UUID to any reader above."""
    text = unquote(segment)
    if _python_uuid(text):
        return True
    trimmed = text.strip(_TRIMMED)
    return _java17_uuid(trimmed) or _java8_uuid(trimmed) or _dotnet_guid(trimmed)


def is_canonical_uuid(segment: str) -> bool:
    """Whether a segment is a UUID as every reader writes one: 8-4-4-4-12 hex digits."""
    return _CANONICAL.fullmatch(segment) is not None


def _python_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def _java_digit(char: str) -> int:
    """``Character.digit(char, 16)``: a Unicode decimal digit, or a Latin letter A-F in
    either case, ASCII or fullwidth; -1 for any other character."""
    if char.isdecimal():
        return unicodedata.decimal(char)
    code = ord(char)
    for first in (0x41, 0x61, 0xFF21, 0xFF41):  # A, a, fullwidth A, fullwidth a
        if first <= code <= first + 5:
            return code - first + 10
    return -1


def _java_long(digits: str) -> bool:
    """Whether ``Long.parseLong(digits, 16)`` (no sign left) reads it."""
    value = 0
    for char in digits:
        digit = _java_digit(char)
        if digit < 0:
            return False
        value = value * 16 + digit
    return bool(digits) and value <= _LONG_MAX


def _java17_uuid(text: str) -> bool:
    if len(text) > 36:
        return False
    groups = text.split("-")
    return len(groups) == 5 and all(
        _java_long(group[1:] if group[:1] == "+" else group) for group in groups
    )


def _java8_uuid(text: str) -> bool:
    groups = text.rstrip("-").split("-")  # String.split drops trailing empty strings
    return len(groups) == 5 and all(_java_long(group) for group in groups)


def _dotnet_guid(text: str) -> bool:
    """``Guid.TryParse`` of a trimmed value: by its first character and whether it holds
    a '-' or a '{', as .NET chooses the form."""
    if "-" in text:
        if text[:1] in ("(", "{"):
            closing = ")" if text[0] == "(" else "}"
            return len(text) == 38 and text[-1] == closing and _dotnet_d(text[1:-1])
        return _dotnet_d(text)
    if "{" in text:
        return _dotnet_x(_SPACE.sub("", text))
    return len(text) == 32 and _HEX.fullmatch(text) is not None


def _dotnet_d(text: str) -> bool:
    """The "D" form with the compatibility path: 36 characters, '-' at 8, 13, 18 and 23;
    each component but the last 8 digits read by TryParseHex within its width."""
    if len(text) != 36 or any(text[i] != "-" for i in (8, 13, 18, 23)):
        return False
    parts = (text[0:8], text[9:13], text[14:18], text[19:23], text[24:28])
    return all(_DOTNET_HEX.fullmatch(p) for p in parts) and bool(_HEX.fullmatch(text[28:]))


def _dotnet_x(text: str) -> bool:
    """The "X" form, white space removed: ``{0xA,0xB,0xC,{0xD0,...,0xD7}}``; A, B and C
    of at most 8 significant digits (B and C are truncated to 16 bits), each D at most
    0xFF."""
    if not (text.startswith("{") and text.endswith("}}")):
        return False
    head, brace, tail = text[1:-2].partition(",{")
    fields = head.split(",")
    items = tail.split(",")
    if not brace or len(fields) != 3 or len(items) != 8:
        return False
    for item, most in [*((f, 8) for f in fields), *((i, 2) for i in items)]:
        if item[:2] not in ("0x", "0X") or len(item) == 2:
            return False
        found = _DOTNET_HEX.fullmatch(item[2:])
        if found is None or len(found["digits"]) > most:
            return False
    return True
