"""``gateway rules explain`` and the console's explain form: which rule a request hits,
and why earlier ones did not.

What a request's headers mean (an identity, none, an unknown key, a refusal) is never
judged here a second time: the described request is parsed by llhttp (httptools, the
data plane's parser) and read by the data plane's own code, ``Gateway.begin`` up to the
choice of its rule (``gateway.app.request_reader``, a ``ReadRequest``), on a gateway built
from the same settings as ``gateway serve``'s (the console's: the running gateway's
settings, secret and verified identities). This module words what it decided: the rule
``select`` chooses in each region (the data plane's matcher), why each earlier rule did
not apply, and the answer the gateway gives besides the rule's count (401 ...).
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import httptools

from gateway.identity.verified import Refusal, VerifiedIdentities
from gateway.policy.loader import DEFAULT_REGIONS, load_rules
from gateway.policy.matcher import Selection, select
from gateway.policy.model import IdentityKind, Rule, RuleTable
from gateway.policy.paths import split_target
from gateway.ratelimit.identity import IdentityHasher, RequestIdentity

HEADER_FOR = {IdentityKind.API_KEY: "x-api-key", IdentityKind.USER_IP: "x-user-id"}
DEFAULT_HOST = "localhost"  # the Host of a described request that names none


class Refused(ValueError):
    """The gateway answers the request itself, before any rule counts it (400, 405, 431
    ...): ``status`` and the answer's detail."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"the gateway refuses this request ({status}): {detail}")
        self.status = status
        self.detail = detail


@dataclass(frozen=True)
class Reading:
    """What the data plane made of a request before choosing its rule."""

    method: str  # the method rules are chosen by (a kept method override's, if any)
    path: str  # normalised
    # The identity inputs (None: the gateway answers the request itself, ``own``).
    identity: RequestIdentity | None
    tier: str | None = None
    notes: tuple[str, ...] = ()  # what verified identities made of the headers, and why
    # Answered so once the rule's count lets the request through (an unknown key's 401):
    # (status, detail).
    answer: tuple[int, str] | None = None
    own: int | None = None  # the status of the gateway's own answer (/ok, /ready)
    key_header: str = "x-api-key"  # the header an API key is read from


# (method, request target, header (name, value) pairs as llhttp delivers them, TCP peer
# address) -> the data plane's reading; ``Refused`` when it answers before any rule.
ReadRequest = Callable[[str, bytes, list[tuple[bytes, bytes]], str], Reading]
# The data plane's reading for a loaded table and hasher (``gateway.app.request_reader``).
ReaderFor = Callable[[RuleTable, IdentityHasher], ReadRequest]


def explain(
    rules: Sequence[str],
    method: str,
    target: str,
    headers: Sequence[str],
    client_ip: str,
    region: str | None = None,
    *,
    reader: ReaderFor,
    regions: Iterable[str] = (),
    secret: tuple[bytes, str] | None = None,
) -> str:
    """A human-readable account of how the table treats the described request.
    ``reader``: the data plane's reading for the loaded table and hasher; ``regions``:
    names the rule files may use besides the defaults; ``secret``: the deployment's
    identity secret and where it was found (``gateway.secrets.existing_identity_secret``),
    else the hashes are keyed with a throwaway one. ``ValueError`` for a region the
    gateway does not know (``region`` is checked against the known ones, never added to
    them) or a client address that is not one."""
    table = load_rules(rules, DEFAULT_REGIONS | set(regions))
    key, secret_source = secret or (
        secrets.token_hex(32).encode(),
        "a throwaway secret (no deployment secret found)",
    )
    hasher = IdentityHasher(key)
    read = reader(table, hasher)
    return explain_request(
        table, hasher, secret_source, method, target, headers, client_ip, region, read=read
    )


def explain_request(
    table: RuleTable,
    hasher: IdentityHasher,
    secret_source: str,
    method: str,
    target: str,
    headers: Sequence[str],
    client_ip: str,
    region: str | None = None,
    *,
    read: ReadRequest,
) -> str:
    """``explain`` for a loaded table and hasher (the admin console's explain form), the
    request read with ``read`` (the data plane's reading for that table and hasher).
    ``ValueError`` names what is wrong with the described request; ``Refused`` (one)
    says the gateway answers it itself before any rule."""
    if region is not None:
        check_region(region, table.regions)
    client_ip = check_client_ip(client_ip)
    method, wire_target, fields = described_request(method, target, headers)
    raw_path, _ = split_target(target)
    reading = read(method, wire_target, fields, client_ip)
    path = reading.path
    lines = [
        f"request: {reading.method} {path}"
        + (f"  (normalised from {raw_path})" if path != raw_path else "")
    ]
    if reading.method != method:
        lines.append(f"method: {reading.method}, from the kept method override ({method} sent)")
    identity = reading.identity
    if identity is None:
        lines.append(
            f"answered by the gateway itself ({reading.own}) before any rule: never limited"
        )
        return "\n".join(lines)
    lines.append(f"identity hashes keyed with {secret_source}")
    lines.extend(f"identity: {note}" for note in reading.notes)
    if reading.answer is not None:
        status, detail = reading.answer
        lines.append(
            f"answer: {status} once the rule below lets it through (never forwarded): {detail}"
        )
    for name in [region] if region else sorted(table.regions):
        selection = select(table, name, reading.method, path, identity.key_for, reading.tier)
        lines.append("")
        lines.append(f"region {name}:")
        lines.extend(_explain_region(table, name, reading, identity, selection))
        if table.ceilings:
            lines.extend(_explain_ceilings(table, name, reading, identity, selection))
    return "\n".join(lines)


def check_region(region: str, known: Iterable[str]) -> None:
    """``ValueError`` naming the known regions unless ``region`` is one of them. Names
    are case-sensitive, as ``gateway serve`` takes them: one that differs from a known
    name only in case gets the right spelling suggested."""
    names = sorted(known)
    if region in names:
        return
    message = f"unknown region {region[:64]!r}; known regions: {', '.join(names)}"
    same = [name for name in names if name.casefold() == region.casefold()]
    if same:
        message += f" (did you mean {same[0]!r}? region names are case-sensitive)"
    raise ValueError(message)


def check_client_ip(client_ip: str) -> str:
    """The described TCP peer's address (surrounding blanks dropped), or ``ValueError``
    when it is no IPv4 or IPv6 address: a TCP peer always has one, and anything else
    would be hashed and counted as if it were."""
    address = client_ip.strip()
    try:
        ipaddress.ip_address(address)
    except ValueError:
        raise ValueError(
            f"client address {client_ip[:64]!r} is not an IP address (give the TCP "
            "peer's address as the gateway sees it, e.g. 203.0.113.7 or 2001:db8::7)"
        ) from None
    return address


def described_request(
    method: str, target: str, headers: Sequence[str]
) -> tuple[str, bytes, list[tuple[bytes, bytes]]]:
    """The request a client sends for the description, as the data plane's parser reads
    it: (method, target, header pairs). Text is sent as UTF-8 (what curl sends; bytes that
    came through a command line undecoded go back as they were). llhttp keeps a value's
    bytes but its leading SP/HTAB; RFC 9110 5.5 drops the trailing ones too, as the data
    plane does. ``ValueError`` when the description is no request; ``Refused`` when llhttp
    refuses the request (the data plane answers it 400)."""
    method = method.upper()
    if not method.replace("-", "").isalpha() or len(method) > 16:
        raise ValueError(f"{method[:20]!r} is not an HTTP method")
    if _breaks_line(target):
        raise ValueError("the request target holds a line break")
    lines = [f"{method} {target} HTTP/1.1".encode("utf-8", "surrogateescape")]
    host = False
    for header in headers:
        name, sep, value = header.partition(":")
        if not sep:
            raise ValueError(f"header {header!r} is not 'Name: value'")
        if _breaks_line(header):
            raise ValueError(f"header {name!r} holds a line break: write one header a line")
        name = name.strip()
        host = host or name.lower() == "host"
        lines.append(f"{name}:{value}".encode("utf-8", "surrogateescape"))
    if not host:  # every HTTP/1.1 client sends one
        lines.append(f"Host: {DEFAULT_HOST}".encode())
    parsed = _Parsed()
    parser = httptools.HttpRequestParser(parsed)
    try:
        parser.feed_data(b"\r\n".join(lines) + b"\r\n\r\n")
    except httptools.HttpParserUpgrade:
        pass  # (the head is read: what follows it is not the gateway's to parse)
    except httptools.HttpParserError as exc:
        raise Refused(400, f"malformed HTTP request (llhttp: {exc or type(exc).__name__})") from exc
    if not parsed.complete:
        raise ValueError("the description is not one complete request head")
    return parser.get_method().decode("ascii"), b"".join(parsed.url), parsed.headers


def _breaks_line(text: str) -> bool:
    return "\r" in text or "\n" in text


class _Parsed:
    """httptools' callbacks: the request head's target and header pairs."""

    def __init__(self) -> None:
        self.url: list[bytes] = []
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        self.complete = True


def identity_notes(
    verified: VerifiedIdentities | None,
    *,
    key_sent: bool,
    key_counted: bool,
    consumer: str | None,
    consumer_tier: str | None,
    user_dropped: bool,
    token_user: str | None,
    token_tier: str | None,
    token_failure: str | None,
    refusal: Refusal | None,
) -> tuple[str, ...]:
    """What verified identities made of a request's headers, in words: the facts come
    from the data plane's reading (``gateway.app.request_reader``). Never a key or a
    token."""
    if verified is None:
        return ()
    notes: list[str] = []
    if verified.keys is not None and consumer is not None:
        notes.append(
            f"known API key of consumer {consumer}"
            + (f", tier {consumer_tier}" if consumer_tier else "")
            + ": counted per consumer (all its keys share the counters)"
        )
    elif verified.keys is not None and key_sent:
        if refusal is not None and refusal.reason == "unknown_key":
            notes.append(
                f"the API key is unknown: answered {refusal.status} after its per-address count"
            )
        else:
            notes.append("the API key is unknown: counted as a request without a key")
    elif key_counted:
        notes.append("API keys are counted as claimed (no key file configured)")
    if user_dropped:
        notes.append("x-user-id ignored: believed only from trusted proxies")
    if token_failure is not None:
        if refusal is not None and refusal.reason == token_failure:
            action = f"answered {refusal.status}"
        else:
            action = "counted without a user"
        notes.append(f"the bearer token does not verify ({token_failure}): {action}")
    elif token_user is not None:
        notes.append(
            f"verified token of user {token_user}" + (f", tier {token_tier}" if token_tier else "")
        )
    return tuple(notes)


def _explain_ceilings(
    table: RuleTable,
    region: str,
    reading: Reading,
    identity: RequestIdentity,
    selection: Selection,
) -> list[str]:
    """The ceilings, each applied (counted with the rule, all or nothing) or why not."""
    lines = ["  ceilings (applied besides the rule, counted with it all or nothing):"]
    applied = {ceiling.id: key for ceiling, key in selection.ceilings}
    for ceiling in table.ceilings:
        if selection.exempt:
            lines.append(f"  - {ceiling.id}: not applied, the request is exempt")
            continue
        key = applied.get(ceiling.id)
        if key is None:
            reason = _why_not(ceiling, region, reading, identity) or "its identity is not formed"
            lines.append(f"  - {ceiling.id}: not applied, {reason}")
            continue
        limits = ", ".join(str(s) for s in ceiling.limits_for(region))
        kind = "shadow ceiling (counted, never refuses)" if ceiling.shadow else "APPLIES"
        lines.append(f"  + {ceiling.id}: {kind}  [{ceiling.source} #{ceiling.index}]")
        lines.append(f"      identity: {ceiling.identity.value} -> {key}")
        lines.append(f"      limit in {region}: {limits} (count/seconds)")
    return lines


def _explain_region(
    table: RuleTable,
    region: str,
    reading: Reading,
    identity: RequestIdentity,
    selection: Selection,
) -> list[str]:
    """The rules in order up to the one ``select`` chose: the shadow rules it counted on
    the way, and why each other one did not apply."""
    lines: list[str] = []
    chosen = selection.rule
    shadows = {rule.id for rule, _ in selection.shadows}
    for rule in table.rules:
        if chosen is not None and rule.id == chosen.id:
            return lines + _matched(table, region, chosen, selection, reading.tier)
        if rule.id in shadows:
            lines.append(f"  ~ {rule.id}: shadow rule, counted and reported, evaluation goes on")
            continue
        reason = _why_not(rule, region, reading, identity) or "not chosen by the matcher"
        lines.append(f"  - {rule.id}: skipped, {reason}")
    lines.append("  no rule matches: the request is not limited")
    return lines


def _matched(
    table: RuleTable, region: str, rule: Rule, selection: Selection, tier: str | None
) -> list[str]:
    if rule.unlimited:
        return [f"  = {rule.id}: MATCHES, exempt (unlimited)  [{rule.source} #{rule.index}]"]
    limits = ", ".join(str(s) for s in rule.limits_for(region))
    lines = [f"  = {rule.id}: MATCHES  [{rule.source} #{rule.index}]"]
    if rule.policy:
        lines.append(f"      tier: {tier} (policy {rule.policy})")
    lines.append(f"      category: {rule.category}")
    lines.append(f"      identity: {rule.identity.value} -> {selection.identity}")
    lines.append(f"      limit in {region}: {limits} (count/seconds)")
    others = ", ".join(
        f"{r}: {', '.join(str(s) for s in rule.limits_for(r))}"
        for r in sorted(table.regions)
        if r != region
    )
    lines.append(f"      other regions: {others}")
    if not rule.fail_open:
        lines.append("      failure mode: closed (503 while the counter store is down)")
    return lines


def _why_not(rule: Rule, region: str, reading: Reading, identity: RequestIdentity) -> str | None:
    if not rule.unlimited and not rule.limits_for(region):
        return f"no limit for region {region}"
    if not rule.matches(reading.method, reading.path):
        wanted = " or ".join(a.describe() for a in rule.alternatives)
        return f"does not match ({wanted})"
    if identity.key_for(rule.identity) is None:
        if rule.identity is IdentityKind.CLIENT_CERT:
            return "identity client_cert cannot be formed (no verified client certificate)"
        header = HEADER_FOR.get(rule.identity, "")
        if rule.identity is IdentityKind.API_KEY:
            header = reading.key_header
        return f"identity {rule.identity.value} cannot be formed (no valid {header} header)"
    return None
