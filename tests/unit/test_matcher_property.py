"""Fuzzing the rule matcher against a reference model of docs/rules.md.

Random rule tables (every path form, method lists, identities, shadow and unlimited
rules, limits for some regions only) are written as YAML, loaded by the real loader, and
asked about random requests. The model reads the same rule dictionaries and applies the
documented evaluation order by hand: the first rule that applies in the region, matches
method and path, and can form its identity wins; shadow rules met before it are collected.

The model of a ``{uuid}`` template parameter is the one the docs give: any segment that
Python's ``uuid.UUID`` accepts once percent-decoded, so that no spelling of a run id a
Python upstream would serve can leave a UUID-keyed rule. A separate property checks that
every such spelling of one UUID lands on one counter key of the default table.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import unicodedata
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import yaml
from hypothesis import assume, example, given
from hypothesis import strategies as st

from gateway.policy.loader import RuleLoadError, load_rules, load_rules_from_texts
from gateway.policy.matcher import Selection, select
from gateway.policy.model import RuleTable
from gateway.policy.paths import PathError, normalise_path
from gateway.ratelimit.identity import IdentityHasher, RequestIdentity
from gateway.ratelimit.limiter import limit_checks
from tests.support.fuzz import fuzz

FUZZ = fuzz(300)
ROOT = Path(__file__).resolve().parents[2]
SECRET = b"fuzzing-secret-0123456789"
HASHER = IdentityHasher(SECRET)
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"]
REGIONS = ["us", "eu", "us2"]
WORDS = ["a", "b", "runs", "x1", "42", "Runs", "B"]  # rule values in either case too
TEMPLATE_PARAMS = ["{uuid}", "{uuid}", "{rid:uuid}", "{int}", "{str}", "{id}", "{n:int}", "{s:str}"]
REGEXES = [r"^/a/[0-9]+$", r"/runs/.*", r"/(a|b)(/(a|b))*", r".*/x1", r"/[^/]+/42",
           r"/RUNS/[A-Z]+", r"/B/.*"]  # fmt: skip


# --- the reference model ----------------------------------------------------------


def model_hash(kind: str, value: str) -> str:
    """HMAC-SHA256 of ``kind NUL value`` under the identity secret, 32 hex digits."""
    mac = hmac.new(SECRET, f"{kind}\0{value}".encode(), hashlib.sha256)
    return mac.hexdigest()[:32]


def python_reads(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def java_digit(char: str) -> int:
    """java.lang.Character.digit(char, 16), from its javadoc: a character whose
    Character.isDigit is true (Unicode category Nd) has its decimal value; an ASCII or
    fullwidth Latin letter A-F, either case, is 10-15; anything else is -1."""
    if unicodedata.category(char) == "Nd":
        return unicodedata.digit(char)
    for letters in ("ABCDEF", "abcdef", "\uff21\uff22\uff23\uff24\uff25\uff26",
                    "\uff41\uff42\uff43\uff44\uff45\uff46"):  # fmt: skip
        if char in letters:
            return 10 + letters.index(char)
    return -1


def java_parse_long(text: str, begin: int, end: int) -> int | None:
    """Long.parseLong(text, begin, end, 16): an optional sign, then one or more digits,
    the result within a long; None where it throws NumberFormatException."""
    if begin >= end:
        return None
    negative = text[begin] == "-"
    if text[begin] in "+-":
        begin += 1
        if begin == end:
            return None
    value = 0
    for char in text[begin:end]:
        digit = java_digit(char)
        if digit < 0:
            return None
        value = value * 16 + digit
    value = -value if negative else value
    return value if -(2**63) <= value < 2**63 else None


def java_reads(name: str) -> bool:
    """java.util.UUID.fromString(name) as JDK 17 writes it (fromString1): the length, the
    positions of the first five '-' found by indexOf, and five Long.parseLong calls."""
    if len(name) > 36:
        return False
    dash1 = name.find("-", 0)
    dash2 = name.find("-", dash1 + 1)
    dash3 = name.find("-", dash2 + 1)
    dash4 = name.find("-", dash3 + 1)
    dash5 = name.find("-", dash4 + 1)
    if dash4 < 0 or dash5 >= 0:
        return False
    bounds = [(0, dash1), (dash1 + 1, dash2), (dash2 + 1, dash3), (dash3 + 1, dash4),
              (dash4 + 1, len(name))]  # fmt: skip
    return all(java_parse_long(name, b, e) is not None for b, e in bounds)


def java_trim(text: str) -> str:
    """String.trim(): every character up to U+0020 off both ends."""
    start, end = 0, len(text)
    while start < end and text[start] <= " ":
        start += 1
    while end > start and text[end - 1] <= " ":
        end -= 1
    return text[start:end]


def java8_reads(name: str) -> bool:
    """java.util.UUID.fromString(name) as JDK 8 writes it: name.split("-") (String.split
    drops trailing empty strings) must give 5 components, each read by
    Long.decode("0x" + component): hex digits after the prefix, no sign there, within a
    long."""
    parts = name.split("-")
    while parts and parts[-1] == "":
        parts.pop()
    if len(parts) != 5:
        return False
    for part in parts:
        if part[:1] == "+":
            return False  # Long.decode("0x+..."): a sign in the wrong position
        if java_parse_long(part, 0, len(part)) is None:
            return False
    return True


def dotnet_space(char: str) -> bool:
    """char.IsWhiteSpace: U+0009-U+000D, U+0020, U+0085, U+00A0 and the separators."""
    return char in "\t\n\x0b\x0c\r \x85\xa0" or unicodedata.category(char) in ("Zs", "Zl", "Zp")


def dotnet_trim(text: str) -> str:
    """String.Trim(): white space off both ends."""
    start, end = 0, len(text)
    while start < end and dotnet_space(text[start]):
        start += 1
    while end > start and dotnet_space(text[end - 1]):
        end -= 1
    return text[start:end]


def dotnet_hex(span: str) -> tuple[bool, int, bool]:
    """Guid.TryParseHex(span, out uint, ref overflow), as .NET's Guid.cs writes it: a
    leading '+' skipped, then "0x"/"0X" if more than one character is left, then leading
    zeros; every other character a hex digit (ASCII); more than 8 digits overflow.
    Returns (parsed, value, overflow)."""
    if span:
        if span[0] == "+":
            span = span[1:]
        if len(span) > 1 and span[0] == "0" and span[1] in "xX":
            span = span[2:]
    i = 0
    while i < len(span) and span[i] == "0":
        i += 1
    value, processed = 0, 0
    for char in span[i:]:
        if char not in "0123456789abcdefABCDEF":
            return False, 0, processed > 8
        value = value * 16 + int(char, 16)
        processed += 1
    return True, value & 0xFFFFFFFF, processed > 8


def dotnet_d(text: str) -> bool:
    """TryParseExactD, strict then TryCompatParsing (components at fixed widths)."""
    if len(text) != 36 or any(text[i] != "-" for i in (8, 13, 18, 23)):
        return False
    for start, width in ((0, 8), (9, 4), (14, 4), (19, 4), (24, 4)):
        if not dotnet_hex(text[start : start + width])[0]:
            return False
    return all(c in "0123456789abcdefABCDEF" for c in text[28:36])  # never took 0x or +


def dotnet_x(text: str) -> bool:
    """TryParseExactX, white space already eaten: '{', "0x", a number up to ',' (three
    times), '{', then eight "0x" bytes up to ',' or '}', then '}' and nothing more."""
    if not text or text[0] != "{":
        return False
    pos = 1  # where the next "0x" must be
    for index in range(11):
        if text[pos : pos + 2] not in ("0x", "0X"):
            return False
        start = pos + 2
        end = text.find("}" if index == 10 else ",", start)
        if end <= start:
            return False
        parsed, value, overflow = dotnet_hex(text[start:end])
        if not parsed or overflow or (index >= 3 and value > 0xFF):
            return False
        pos = end + 1
        if index == 2:
            if text[pos : pos + 1] != "{":
                return False
            pos += 1
    return pos == len(text) - 1 and text[pos] == "}"


def dotnet_reads(text: str) -> bool:
    """Guid.TryParse(text) (TryParseGuid): trimmed; with a '-', "P" by '(' and "B" by '{'
    (38 characters around a "D"), else "D"; without, "X" if there is a '{' (white space
    anywhere eaten), else "N" (32 hex digits)."""
    text = dotnet_trim(text)
    if "-" in text:
        if text[:1] == "(":
            return len(text) == 38 and text[37] == ")" and dotnet_d(text[1:37])
        if text[:1] == "{":
            return len(text) == 38 and text[37] == "}" and dotnet_d(text[1:37])
        return dotnet_d(text)
    if "{" in text:
        return dotnet_x("".join(c for c in text if not dotnet_space(c)))
    return len(text) == 32 and all(c in "0123456789abcdefABCDEF" for c in text)


def model_is_uuid(segment: str) -> bool:
    """docs/rules.md: a segment, percent-decoded, that Python's uuid.UUID reads, that
    Spring reads (java.util.UUID.fromString of JDK 17 or JDK 8 after String.trim) or that
    ASP.NET reads (Guid.TryParse after its Trim); what either trims is trimmed before the
    Java and .NET readers."""
    text = urllib.parse.unquote(segment)
    if python_reads(text):
        return True
    value = text
    while (again := dotnet_trim(java_trim(value))) != value:  # what either trims, all of it
        value = again
    return java_reads(value) or java8_reads(value) or dotnet_reads(value)


def model_template(template: str, path: str, canonical: bool = False) -> bool:
    """``canonical``: a {uuid} parameter takes only 8-4-4-4-12 hex digits (an exemption's
    test, docs/rules.md)."""
    wanted, given_ = template.split("/"), path.split("/")
    if len(wanted) != len(given_):
        return False
    for pattern, segment in zip(wanted, given_, strict=True):
        param = re.fullmatch(r"\{(\w+)(?::(\w+))?\}", pattern)
        if param is None:
            if pattern != segment:
                return False
            continue
        name, kind = param.groups()
        kind = kind or (name if name in ("uuid", "int", "str") else "str")
        if not segment:
            return False
        if kind == "int" and not set(segment) <= set("0123456789"):
            return False
        if kind == "uuid" and not (
            re.fullmatch(r"[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}", segment)
            if canonical
            else model_is_uuid(segment)
        ):
            return False
    return True


def model_path(form: dict[str, str], path: str, fold: bool = True) -> bool:
    """Paths match whatever their case (docs/rules.md): path and value folded; with
    ``fold`` false, as written (how an exemption is confirmed)."""
    if not form:
        return True
    ((kind, value),) = form.items()
    if kind == "regex":  # anchored at both ends
        return re.fullmatch(value, path, re.IGNORECASE if fold else 0) is not None
    if fold:
        path, value = path.lower(), value.lower()
    if kind == "path":
        return path == value
    if kind == "prefix":
        return value == "/" or path == value or path.startswith(value + "/")
    if kind == "contains":
        return value in path
    if kind == "suffix":
        return path.endswith(value)
    assert kind == "template", kind
    return model_template(value, path, canonical=not fold)


def model_alternative(alt: dict[str, Any], method: str, path: str, fold: bool = True) -> bool:
    methods = alt.get("methods")
    head_as_get = method == "HEAD" and "GET" in (methods or ())
    if methods is not None and method not in methods and not head_as_get:
        return False
    return model_path({k: v for k, v in alt.items() if k != "methods"}, path, fold)


def model_applies_in(rule: dict[str, Any], region: str) -> bool:
    if rule.get("unlimited"):
        return True
    limits = rule["limits"]
    return region in limits or (region == "us2" and "us" in limits) or "default" in limits


def model_identity(kind: str, client: str, key: str | None, user: str | None) -> str | None:
    if kind == "ip":
        return model_hash(kind, client)
    if kind == "api_key":
        return None if key is None else model_hash(kind, key)
    return None if user is None else model_hash(kind, f"{user}\0{client}")


def model_select(
    rules: list[dict[str, Any]], region: str, method: str, path: str, who: tuple[Any, ...]
) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    shadows: list[tuple[str, str]] = []
    for rule in rules:
        if not model_applies_in(rule, region):
            continue
        match = rule.get("match", {})
        alternatives = match if isinstance(match, list) else [match]
        if not any(model_alternative(a, method, path) for a in alternatives):
            continue
        # An exemption applies only where the path also matches as written (docs/rules.md):
        # folding the case may make a limit stricter, never an exemption wider.
        if rule.get("unlimited") and not any(
            model_alternative(a, method, path, fold=False) for a in alternatives
        ):
            continue
        identity = model_identity(rule.get("identity", "ip"), *who)
        if identity is None:
            continue
        if rule.get("shadow"):
            shadows.append((rule["id"], identity))
            continue
        return rule["id"], identity, shadows
    return None, None, shadows


def outcome(selection: Selection) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    rule = None if selection.rule is None else selection.rule.id
    return rule, selection.identity, [(r.id, key) for r, key in selection.shadows]


# --- generated tables and requests ------------------------------------------------


@st.composite
def path_forms(draw: st.DrawFn) -> dict[str, str]:
    kinds = ["", "path", "prefix", "contains", "suffix", "regex"] + ["template"] * 3
    kind = draw(st.sampled_from(kinds))
    words = st.lists(st.sampled_from(WORDS), min_size=1, max_size=3)
    if kind in ("path", "prefix"):
        return {kind: "/" + "/".join(draw(words))}
    if kind in ("contains", "suffix"):
        return {kind: draw(st.sampled_from(["/a", "a/b", "runs", "/x1", "b", "2"]))}
    if kind == "template":
        parts = st.lists(st.sampled_from(WORDS + TEMPLATE_PARAMS), min_size=1, max_size=3)
        return {kind: "/" + "/".join(draw(parts))}
    if kind == "regex":
        return {kind: draw(st.sampled_from(REGEXES))}
    return {}


@st.composite
def alternatives(draw: st.DrawFn) -> dict[str, Any]:
    alt: dict[str, Any] = dict(draw(path_forms()))
    if draw(st.booleans()):
        alt["methods"] = draw(st.lists(st.sampled_from(METHODS), min_size=1, max_size=3))
    return alt


@st.composite
def rule_dicts(draw: st.DrawFn, index: int) -> dict[str, Any]:
    rule: dict[str, Any] = {"id": f"r{index}"}
    match = draw(st.lists(alternatives(), min_size=1, max_size=2))
    if match != [{}]:
        rule["match"] = match if len(match) > 1 else match[0]
    flavour = draw(st.sampled_from(["plain", "plain", "plain", "shadow", "unlimited"]))
    if flavour == "unlimited":
        rule["unlimited"] = True
        return rule
    if flavour == "shadow":
        rule["shadow"] = True
    rule["identity"] = draw(st.sampled_from(["ip", "api_key", "user_ip"]))
    regions = draw(st.lists(st.sampled_from(["us", "eu", "us2", "default"]), min_size=1,
                            max_size=3, unique=True))  # fmt: skip
    rule["limits"] = {region: f"{draw(st.integers(1, 99))}/60" for region in regions}
    return rule


@st.composite
def loaded_tables(draw: st.DrawFn) -> tuple[list[dict[str, Any]], RuleTable]:
    """Random rules, less those the loader rightly refuses as unreachable."""
    count = draw(st.integers(1, 7))
    rules = [draw(rule_dicts(n)) for n in range(count)]
    while rules:
        try:
            text = yaml.safe_dump({"rules": rules})
            return rules, load_rules_from_texts([("fuzz.yaml", text)])
        except RuleLoadError as exc:
            unreachable = set()
            for problem in exc.problems:
                assert "unreachable" in problem.message, str(problem)
                found = re.match(r"'(r\d+)'", problem.rule or "")
                assert found is not None
                unreachable.add(found.group(1))
            rules = [r for r in rules if r["id"] not in unreachable]
    assume(False)
    raise AssertionError("unreachable")


@st.composite
def uuid_spellings(draw: st.DrawFn) -> tuple[str, uuid.UUID]:
    """A path segment spelling some UUID in one of the ways ``uuid.UUID`` reads, percent-
    encoded where a path needs it, and the UUID it spells."""
    int_prefix = draw(st.sampled_from(["", "", "", "+", "0x", "0X", "+0x"]))
    underscores = draw(st.integers(0, 2))
    digits = draw(
        st.text("0123456789abcdefABCDEF", min_size=32 - len(int_prefix) - underscores,
                max_size=32 - len(int_prefix) - underscores)
    )  # fmt: skip
    for _ in range(underscores):  # int() takes single underscores between digits
        at = draw(st.integers(1, len(digits) - 1))
        if "_" not in digits[at - 1 : at + 1]:
            digits = digits[:at] + "_" + digits[at:]
    body = int_prefix + digits
    for _ in range(draw(st.integers(0, 6))):  # hyphens anywhere in the digits
        at = draw(st.integers(0, len(body)))
        body = body[:at] + "-" + body[at:]
    if draw(st.integers(0, 5)) == 0:  # "urn:" anywhere: uuid.UUID deletes it wherever it is
        at = draw(st.integers(0, len(body)))
        body = body[:at] + "urn:" + body[at:]
    prefix = "".join(draw(st.lists(st.sampled_from(["urn:", "uuid:"]), max_size=3)))
    opening = "{" * draw(st.integers(0, 2))
    closing = "}" * draw(st.integers(0, 2))
    inside = draw(st.booleans())  # braces around the prefix, or between it and the digits
    text = opening + prefix + body + closing if inside else prefix + opening + body + closing
    if draw(st.integers(0, 9)) == 0:  # a Unicode decimal digit: int() reads it
        zeros = [i for i, c in enumerate(text) if c == "0"]
        if zeros:
            at = draw(st.sampled_from(zeros))
            text = text[:at] + draw(st.sampled_from(["\uff10", "\u0660"])) + text[at + 1 :]
    spelled = "".join(encode_char(draw, c) for c in text)
    try:
        value = uuid.UUID(text)
    except ValueError:
        assume(False)
        raise
    return spelled, value


def encode_char(draw: st.DrawFn, char: str) -> str:
    """How a client may write one character in a path: braces and non-ASCII always
    encoded (raw they are refused), the rest raw or encoded, in either case of hex."""
    must = char in "{}" or not char.isascii()
    if not must and draw(st.integers(0, 7)) != 0:
        return char
    quoted = urllib.parse.quote(char, safe="")
    if quoted == char:
        quoted = f"%{ord(char):02X}"
    return quoted if draw(st.booleans()) else quoted.lower()


JAVA_DIGITS = "0123456789abcdefABCDEF\uff10\uff41\uff26\u0660\u0966"  # Character.digit reads all
PADDING = ["", "", " ", "  ", "\u00a0", "\u3000", "\u2009"]  # what Spring or ASP.NET trims


HEX = "0123456789abcdefABCDEF"


@st.composite
def dotnet_component(draw: st.DrawFn, width: int | None) -> str:
    """What TryParseHex may be given: '+', "0x", zeros and hex digits in any mix (at a
    fixed ``width`` in the "D" form), sometimes a stray character."""
    kinds = ["+", "0x", "0X", "0", "0", "a", "F", "9", "00", "x", "g"]
    pieces = draw(st.lists(st.sampled_from(kinds), max_size=6))
    text = "".join(pieces)
    if width is not None:
        text = (text + draw(st.text(HEX, min_size=width, max_size=width)))[:width]
    return text


@st.composite
def java_and_dotnet_spellings(draw: st.DrawFn) -> str:
    """A segment Spring or ASP.NET may read as a UUID (every draw is kept, the model
    decides): java.util.UUID's groups (JDK 17: one to 17 digits, '+' signs; JDK 8: any
    length, trailing '-'), .NET's "D" with its compatibility components, "B"/"P" around
    it, "X" with white space, zeros and signs, white space around; percent-encoded."""
    form = draw(st.sampled_from(["java", "java", "d", "b", "p", "x", "x"]))
    if form == "java":
        signs = st.sampled_from(["", "", "+"])
        digits = st.text(JAVA_DIGITS, min_size=1, max_size=draw(st.sampled_from([17, 40])))
        count = draw(st.sampled_from([5, 5, 5, 4, 6]))
        text = "-".join(draw(signs) + draw(digits) for _ in range(count))
        text += "-" * draw(st.sampled_from([0, 0, 1, 3]))
    elif form in ("d", "b", "p"):
        widths = [8, 4, 4, 4, 4]
        parts = [draw(dotnet_component(w)) for w in widths]
        text = "-".join(parts[:4]) + "-" + parts[4] + draw(st.text(HEX, min_size=8, max_size=8))
        if form != "d":
            text = ("{" + text + "}") if form == "b" else ("(" + text + ")")
    else:
        spaces = st.sampled_from(["", "", "", " ", "\u00a0"])
        items = [
            draw(spaces) + "0x" + draw(dotnet_component(None)) + draw(spaces) for _ in range(11)
        ]
        if draw(st.booleans()):  # sometimes a well-formed value
            value = draw(st.uuids()).hex
            items = [f"0x{value[a:b]}" for a, b in ((0, 8), (8, 12), (12, 16))]
            items += [f"0x{value[i : i + 2]}" for i in range(16, 32, 2)]
        text = "{" + ",".join(items[:3]) + ",{" + ",".join(items[3:]) + "}}"
    text = draw(st.sampled_from(PADDING)) + text + draw(st.sampled_from(PADDING))
    return "".join("%20" if c == " " else encode_char(draw, c) for c in text)  # raw: refused


@st.composite
def request_paths(draw: st.DrawFn) -> str:
    pieces = st.one_of(
        st.sampled_from(WORDS),
        st.sampled_from(["", ".", "..", "7", "runs", "%7B", "x%2Dy", "stats"]),
        uuid_spellings().map(lambda pair: pair[0]),
        java_and_dotnet_spellings(),
        st.uuids().map(lambda u: str(u)[: draw(st.integers(20, 36))]),  # near misses
        st.uuids().map(lambda u: f"%7B{u}%7Dx"),
        st.text("abcxyz0123456789-_:%+", max_size=8),
    )
    raw = "/" + "/".join(draw(st.lists(pieces, min_size=0, max_size=4)))
    if draw(st.booleans()):  # any letter in either case
        flips = draw(st.lists(st.booleans(), min_size=len(raw), max_size=len(raw)))
        raw = "".join(c.swapcase() if f else c for c, f in zip(raw, flips, strict=True))
    try:
        return normalise_path(raw)
    except PathError:
        assume(False)
        raise


headers = st.one_of(st.none(), st.sampled_from(["k1", "k2"]), st.text("abc-_.", min_size=1))
clients = st.sampled_from(["192.0.2.1", "198.51.100.7", "2001:db8::/64"])


def fill(draw: st.DrawFn, shape: str) -> str:
    """A path made from a rule's own path text: its parameters filled with values that
    do or do not fit them (UUID spellings, near misses, numbers, words)."""
    values = st.one_of(
        uuid_spellings().map(lambda pair: pair[0]),
        uuid_spellings().map(lambda pair: pair[0]),
        st.sampled_from(["7", "x", "%7Bx%7D", "urn:uuid:", "0x"]),
        st.uuids().map(lambda u: u.hex[:31]),
    )
    return re.sub(r"\{[^}]*\}", lambda _: draw(values), shape)


@st.composite
def requests_for(draw: st.DrawFn, rules: list[dict[str, Any]]) -> tuple[Any, ...]:
    shapes = [
        value
        for rule in rules
        for alt in (rule.get("match") or [{}] if isinstance(rule.get("match"), list)
                    else [rule.get("match", {})])
        for kind, value in alt.items()
        if kind in ("path", "prefix", "template")
    ]  # fmt: skip
    if shapes and draw(st.integers(0, 3)):
        raw = fill(draw, draw(st.sampled_from(shapes))) + draw(st.sampled_from(["", "/b", "/"]))
        try:
            path = normalise_path(raw)
        except PathError:
            path = "/"
    else:
        path = draw(request_paths())
    region = draw(st.sampled_from(REGIONS))
    method = draw(st.sampled_from([*METHODS, "PROPFIND"]))
    return region, method, path, draw(clients), draw(headers), draw(headers)


@FUZZ
@given(data=st.data(), table=loaded_tables())
def test_selection_agrees_with_the_model(
    data: st.DataObject, table: tuple[list[dict[str, Any]], RuleTable]
) -> None:
    rules, loaded = table
    requests = data.draw(st.lists(requests_for(rules), min_size=1, max_size=6))
    for region, method, path, client, key, user in requests:
        identity = RequestIdentity(HASHER, client, key, user)
        expected = model_select(rules, region, method, path, (client, key, user))
        assert outcome(select(loaded, region, method, path, identity.key_for)) == expected
        # Asked again (now from the match cache) with no identity headers at all.
        bare = RequestIdentity(HASHER, client, None, None)
        expected = model_select(rules, region, method, path, (client, None, None))
        assert outcome(select(loaded, region, method, path, bare.key_for)) == expected


DEFAULT_TABLE = load_rules([ROOT / "rules" / "default.yaml"])


def counter_keys(region: str, method: str, path: str) -> list[str]:
    identity = RequestIdentity(HASHER, "192.0.2.1", "sk-fuzz", None)
    chosen = select(DEFAULT_TABLE, region, method, path, identity.key_for)
    assert chosen.rule is not None and chosen.identity is not None
    return [c.key for c in limit_checks(region, chosen.rule, chosen.identity, True)]


@FUZZ
@given(
    spelling=uuid_spellings(),
    method=st.sampled_from(["GET", "HEAD"]),
    base=st.sampled_from(["/runs/", "/api/v1/runs/", "//runs/./", "/api/x/../v1/runs/"]),
    region=st.sampled_from(REGIONS),
)
@example(spelling=("%7Burn:uuid:0b6f2a4c-1d2e-4f00-8a9b-0123456789ab%7D",
                   uuid.UUID("0b6f2a4c-1d2e-4f00-8a9b-0123456789ab")),
         method="GET", base="/runs/", region="us")  # fmt: skip
@example(spelling=("uuid%3Aurn:+b6f2a4c1d2e4f008a9b0123456789ab",
                   uuid.UUID("0b6f2a4c-1d2e-4f00-8a9b-0123456789ab")),
         method="GET", base="/runs/", region="eu")  # fmt: skip
def test_every_uuid_spelling_is_one_counter_key(
    spelling: tuple[str, uuid.UUID], method: str, base: str, region: str
) -> None:
    text, value = spelling
    path = normalise_path(base + text)
    canonical = normalise_path(base.replace("x/../", "") + str(value))
    keys = counter_keys(region, method, path)
    assert keys == counter_keys(region, "GET", canonical)
    assert all(key.startswith(f"rl:{{{region}:run-lookup:") for key in keys)


@FUZZ
@given(
    spelling=java_and_dotnet_spellings(),
    base=st.sampled_from(["/runs/", "/api/v1/runs/", "/RUNS/"]),
    region=st.sampled_from(REGIONS),
)
@example(spelling="0190a1b2-c3d4-7e5f-8a6b-7c8d9e0f1a2b%20", base="/runs/", region="us")
@example(spelling="190a1b2-c3d4-7e5f-8a6b-7c8d9e0f1a2b", base="/runs/", region="us")
@example(spelling="1-1-1-1-1-", base="/runs/", region="us")  # JDK 8: trailing '-' dropped
@example(spelling="0000000000000000000000000001-2-3-4-5", base="/runs/", region="us")  # JDK 8
@example(spelling="d85b1407-0x1d-4694-9392-03acc5870eb1", base="/runs/", region="us")  # .NET
@example(spelling="%7B0x+,0x+,0x+,%7B0x+,0x+,0x+,0x+,0x+,0x+,0x+,0x+%7D%7D", base="/runs/",
         region="us")  # fmt: skip
def test_spellings_spring_or_aspnet_read_as_an_id_stay_in_its_rule(
    spelling: str, base: str, region: str
) -> None:
    # A security review: Spring trims a path variable and reads it with
    # java.util.UUID.fromString, which takes groups of any length, so
    # /runs/<a UUIDv7 without its leading 0> and /runs/<uuid>%20 reached it as that run
    # while the default table counted them by the looser default rule.
    try:
        path = normalise_path(base + spelling)
    except PathError:
        assume(False)
        raise
    keys = counter_keys(region, "GET", path)
    rule = "run-lookup" if model_is_uuid(spelling) else "default-api-key"
    assert keys and all(key.startswith(f"rl:{{{region}:{rule}:") for key in keys), (path, keys)
