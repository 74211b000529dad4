"""The gateway's decisions about one request: refuse what is malformed, limit, route.

Free of any connection handling: ``gateway.proxy.server`` feeds it parsed requests and
writes what it answers. Everything a request needs is decided synchronously when it
can be (in-process counters, a refusal already in the deny cache, every fixed answer),
so the common answers cost no task and no await.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import unquote_to_bytes

from gateway import __version__
from gateway.identity.jwt import InvalidToken, VerifiedUser
from gateway.identity.verified import VerifiedIdentities, counted_consumer
from gateway.metrics import CounterChild, HistogramChild, Metrics
from gateway.policy.matcher import Selection, select
from gateway.policy.model import IdentityKind, Rule, RuleTable
from gateway.policy.paths import PathError, normalise_path
from gateway.proxy.access_log import AccessLogger, AccessRecord
from gateway.proxy.relay import (
    HOP_BY_HOP,
    METHOD_OVERRIDES,
    PATH_OVERRIDES,
    UNTRUSTED_FORWARDING,
)
from gateway.proxy.reload import RuleSource
from gateway.proxy.request import Incoming
from gateway.proxy.request_id import accept_request_id, new_request_id
from gateway.proxy.routing import RegionMap, Router, valid_host
from gateway.proxy.upstream_pool import Upstream
from gateway.proxy.wire import Answer, json_body
from gateway.ratelimit.decision import Decision, LimitReport, Outcome
from gateway.ratelimit.identity import (
    ClientAddressPolicy,
    IdentityHasher,
    RequestIdentity,
    valid_identity_header,
)
from gateway.ratelimit.limiter import Limiter
from gateway.ratelimit.ports import CounterBackend

log = logging.getLogger("gateway.proxy")
# The clocks, bound once: a module attribute is a dict lookup on every call.
_monotonic: Final = time.monotonic
_perf_counter: Final = time.perf_counter

REFUSED_METHODS: Final = frozenset({"CONNECT", "TRACE"})
HEALTH_PATH: Final = "/ok"
READY_PATH: Final = "/ready"  # readiness: exempt like /ok, answered by ``Gateway.readiness``
INFO_PATH: Final = "/info"
# What the gateway reads in a request header (by lower-case name); every other header is
# only relayed. One dict lookup per header decides.
_HOST: Final = 1
_API_KEY: Final = 2
_CONNECTION: Final = 3
_FORWARDED_FOR: Final = 4
_REQUEST_ID: Final = 5
_FORWARDED_PROTO: Final = 6
_CONTENT_LENGTH: Final = 7
_TRANSFER_ENCODING: Final = 8
_EXPECT: Final = 9
_SINGLE: Final = 10
_USER_ID: Final = 11
_OVERRIDE: Final = 12
_TOKEN: Final = 13  # the JWT's header (identity.user.jwt.header), when configured
# A header spelled like one the gateway reads or manages, with '_' for '-' (x_api_key):
# refused. CGI/WSGI servers (wsgiref, uWSGI, and gunicorn before 22) name both spellings
# HTTP_X_API_KEY, so the upstream would take as the key (the user, the override, the
# forwarded-for) a header the gateway neither counted by nor removed.
_ALIAS: Final = 14
# What a kept method override may name (the methods the gateway forwards).
_OVERRIDABLE: Final = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# Headers a message may carry once: upstreams disagree about which of two copies counts
# (the same list as aiohttp's parser, so the gateway refuses what its upstreams would).
SINGLETONS: Final = frozenset(
    {
        b"content-length", b"content-location", b"content-range", b"content-type", b"etag",
        b"host", b"max-forwards", b"server", b"transfer-encoding", b"user-agent",
    }
)  # fmt: skip
_BASE_ROLES: Final = {
    b"host": _HOST, b"x-api-key": _API_KEY, b"x-user-id": _USER_ID,
    b"connection": _CONNECTION, b"x-forwarded-for": _FORWARDED_FOR,
    b"x-request-id": _REQUEST_ID, b"x-forwarded-proto": _FORWARDED_PROTO,
    b"content-length": _CONTENT_LENGTH, b"transfer-encoding": _TRANSFER_ENCODING,
    b"expect": _EXPECT, **{name: _OVERRIDE for name in METHOD_OVERRIDES},
    **{name: _SINGLE for name in SINGLETONS - {b"host", b"content-length", b"transfer-encoding"}},
}  # fmt: skip
# Headers the relay sets, drops or passes only from trusted peers without a role above:
# their '_' spellings would reach a CGI-style upstream as the header itself.
_MANAGED: Final = HOP_BY_HOP | UNTRUSTED_FORWARDING | PATH_OVERRIDES | {b"via"}


def _aliases(name: bytes) -> list[bytes]:
    """Every spelling of ``name`` with one or more of its '-' written '_' (2 ** k - 1 of
    them for k dashes: the names are the gateway's own and configured ones, which
    ``gateway.identity.config`` holds to a few dashes)."""
    parts = name.split(b"-")
    spellings = [parts[0]]
    for part in parts[1:]:
        spellings = [s + sep + part for s in spellings for sep in (b"-", b"_")]
    return [s for s in spellings if s != name]


def _with_aliases(roles: dict[bytes, int]) -> dict[bytes, int]:
    """``roles`` plus the '_' spellings of every name in it or in ``_MANAGED``, so one dict
    lookup a header still decides (the common header costs nothing more)."""
    out: dict[bytes, int] = {}
    for name in [*roles, *_MANAGED]:
        for alias in _aliases(name):
            out[alias] = _ALIAS
    out.update(roles)  # a name the gateway reads keeps its role
    return out


_ROLES: Final = _with_aliases(_BASE_ROLES)
OK_ANSWER: Final = Answer.json(200, b'{"ok": true}')
# RFC 9110 15.5.6: a 405 names the methods that are allowed.
REFUSED_METHOD_ANSWERS: Final = {
    method: Answer.error(
        405,
        f"{method} is not accepted by this gateway",
        [("Allow", "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS")],
    )
    for method in REFUSED_METHODS
}
# Identities whose refusal is known in advance, kept at most (oldest dropped first).
MAX_KNOWN_REFUSALS: Final = 100_000
MAX_CACHED_PATHS: Final = 10_000
_STATUS_CLASSES: Final = {n: f"{n}xx" for n in range(1, 6)}
_sha256: Final = hashlib.sha256
_time: Final = time.time  # tokens expire in epoch seconds
MAX_KNOWN_TOKENS: Final = 100_000  # verified tokens kept by hash (then the cache starts over)
MAX_FORWARDED_CHAINS: Final = 4096  # X-Forwarded-For values kept resolved (see _forwarded)
# Only values this short are kept: at most 4096 x 512 bytes, whatever a client sends.
MAX_KEPT_CHAIN_BYTES: Final = 512
# Outcome.value through the enum's descriptor costs more than a dict lookup.
_OUTCOME_LABELS: Final = {outcome: outcome.value for outcome in Outcome}


@dataclass(slots=True)
class KnownRefusal:
    """A refusal any repeat is sure to get until ``until`` (monotonic seconds), with its
    answer rendered once per whole second of wait: a flood from one identity costs a
    dict lookup and a write (benchmarks/README.md, "Data plane", the flood rows).

    Kept under the policy that refused and that policy's identity (the rule's, or a
    ceiling's: a client spraying keys meets its address's ceiling refusal, whatever the
    key). A repeat takes it only when its own selection names the same rule and ceilings,
    so the answer's ``RateLimit-Policy`` is the one its own decision would list."""

    decision: Decision
    until: float
    report_at: float  # when the limit frees a slot again (Retry-After counts down to it)
    counted: CounterChild  # gateway_requests_total{...,decision="limited"}
    deny_cache_hits: CounterChild | None  # for refusals the deny cache knew
    overhead: HistogramChild
    key: tuple[str, str, str]  # (region, policy, identity): where it is kept
    report: LimitReport  # the policy that refused
    policy: str  # the RateLimit-Policy field of the decision
    rule: Rule | None  # what the decision's selection named
    ceilings: tuple[Rule, ...]
    wait: int = 0
    answer: Answer | None = None

    # Written out: mypyc compiles this one, while the dataclass's own would run as Python
    # code on every construction (~3x slower; tests/unit/test_native.py checks it matches).
    def __init__(
        self,
        decision: Decision,
        until: float,
        report_at: float,
        counted: CounterChild,
        deny_cache_hits: CounterChild | None,
        overhead: HistogramChild,
        key: tuple[str, str, str],
        report: LimitReport,
        policy: str,
        rule: Rule | None,
        ceilings: tuple[Rule, ...],
        wait: int = 0,
        answer: Answer | None = None,
    ) -> None:
        self.decision = decision
        self.until = until
        self.report_at = report_at
        self.counted = counted
        self.deny_cache_hits = deny_cache_hits
        self.overhead = overhead
        self.key = key
        self.report = report
        self.policy = policy
        self.rule = rule
        self.ceilings = ceilings
        self.wait = wait
        self.answer = answer


# The 429 bodies differ only by rule and wait: kept once each, bounded.
_MAX_CACHED_429: Final = 4096


@dataclass(frozen=True, slots=True)
class Peer:
    address: str | None  # the TCP peer
    trusted: bool  # a trusted proxy
    client: str | None  # the client address when it does not depend on headers


@dataclass
class Gateway:
    """Everything the request path needs, built once by ``gateway.app``."""

    rules: RuleSource
    limiter: Limiter
    backends: dict[str, CounterBackend]
    hasher: IdentityHasher
    addresses: ClientAddressPolicy
    regions: RegionMap
    router: Router
    metrics: Metrics
    access_log: AccessLogger
    max_header_bytes: int = 8190
    max_headers: int = 100
    keep_method_override: bool = False
    # Known keys and JWT users (None: identities are counted as claimed).
    verified: VerifiedIdentities | None = None
    # ``/ready``'s answer (status, JSON body), computed without waiting (None: not served,
    # the path is an ordinary request). Set by ``gateway.app``.
    readiness: Callable[[], tuple[int, bytes]] | None = None
    # Which rate-limit fields answers carry: ietf (the draft's RateLimit-Policy and
    # RateLimit), legacy (X-RateLimit-Limit / -Remaining / -Reset), both, or none.
    rate_limit_headers: str = "ietf"
    # What the gateway reads in a header, by lower-case name (the module's _ROLES, with
    # the configured identity headers: see use_identities).
    _roles: dict[bytes, int] = field(default_factory=lambda: dict(_ROLES))
    # (status, body) of a refusal, per (rule, wait), for the table in force
    _limited_bodies: dict[tuple[str, int], tuple[int, bytes]] = field(default_factory=dict)
    _bodies_table: RuleTable | None = None
    _refusals: dict[tuple[str, str, str], KnownRefusal] = field(default_factory=dict)
    _paths: dict[bytes, str] = field(default_factory=dict)  # raw path -> normalised
    _counted: dict[str, str] = field(default_factory=dict)  # consumer -> its counted value
    _tokens: dict[bytes, VerifiedUser] = field(default_factory=dict)  # see _verify
    _tokens_generation: int = -1  # the verifier's key set those verdicts were reached with
    # (trusted proxy, X-Forwarded-For as received) -> the client address it names: walking
    # the chain with ``ipaddress`` cost more than the rest of a request (+61 %
    # instructions, benchmarks/README.md "Shipped table"), and a proxy forwards the same
    # few clients over and over. Bounded (emptied when full): a client writing a new
    # chain each request costs what it did without the cache.
    _forwarded: dict[tuple[str | None, bytes], tuple[str, bool]] = field(default_factory=dict)
    _refusals_table: RuleTable | None = None

    def use_identities(self, verified: VerifiedIdentities) -> None:
        """Verify identities from now on: the key header may be another than x-api-key,
        and the token's header is read."""
        self.verified = verified
        roles = dict(_BASE_ROLES)
        if verified.key_header != b"x-api-key":
            del roles[b"x-api-key"]
            roles[verified.key_header] = _API_KEY
        if verified.token_header is not None:
            roles[verified.token_header] = _TOKEN
        self._roles = _with_aliases(roles)

    # --- the synchronous part: everything up to the rate-limit decision

    def peer(self, address: str | None) -> Peer:
        """What a connection's TCP peer means, worked out once per connection."""
        trusted = self.addresses.peer_trusted(address)
        # From an untrusted peer forwarding headers are ignored: the client is the peer.
        client = None if trusted else self.addresses.client_address(address, None)
        return Peer(address, trusted, client)

    def _forwarded_client(self, peer: Peer, chain: list[bytes]) -> tuple[str, bool]:
        """The client a trusted proxy names in its X-Forwarded-For header(s), and whether
        it names one (False: the proxy's own request)."""
        raw = chain[0] if len(chain) == 1 else b", ".join(chain)
        if len(raw) > MAX_KEPT_CHAIN_BYTES:  # (kept, a long chain would hold its memory)
            return self.addresses.forwarded_client(peer.address, raw.decode("latin-1"))
        key = (peer.address, raw)
        found = self._forwarded.get(key)
        if found is None:
            forwarded = raw.decode("latin-1") if raw else None
            found = self.addresses.forwarded_client(peer.address, forwarded)
            if len(self._forwarded) >= MAX_FORWARDED_CHAINS:
                self._forwarded.clear()
            self._forwarded[key] = found
        return found

    def begin(
        self, req: Incoming, peer: Peer, memo: dict[tuple[IdentityKind, str], str] | None = None
    ) -> Answer | None:
        """Check, identify and (when it can be known now) decide ``req``.

        Returns the answer when the gateway answers itself, or None when the request
        goes on: to ``decide`` (``req.decision`` is None) or to ``after_decision``.
        """
        record = req.record = AccessRecord(
            req.method, "-", 0, self.regions.default, peer.address or "-"
        )
        problem = self._read_headers(req)
        record.request_id = req.request_id
        record.own_request_id = req.given_request_id is None
        if problem is not None:
            # A head the gateway refuses may frame its body in a way an upstream reads
            # differently: nothing after it on this connection is read (framing doubt).
            req.keep_alive = False
            return problem
        method = req.method
        if req.version != "1.1" and req.version != "1.0":
            return Answer.error(505, f"HTTP/{req.version} is not supported; use HTTP/1.1")
        if method in REFUSED_METHODS:
            return REFUSED_METHOD_ANSWERS[method]
        target = req.target
        qmark = target.find(b"?")
        if qmark < 0:
            raw = target
        else:
            raw = target[:qmark]
            query = req.query = target[qmark:]  # with the "?", byte for byte
            if b"method" in query or b"%" in query:  # else no key can read '_method'
                problem = self._query_override(req, query)
                if problem is not None:
                    return problem
        # Keyed by the raw bytes: a path seen before costs one lookup, no decoding.
        path = self._paths.get(raw)
        if path is None:
            raw_path = raw.decode("latin-1")
            if not raw_path.startswith("/") and "://" in raw_path:
                return Answer.error(400, "absolute-form request targets are refused")
            try:
                path = normalise_path(raw_path)
            except PathError as exc:
                record.path = raw_path[:200]
                return Answer.error(400, str(exc))
            if len(raw) <= 256:  # the paths a service sees again and again
                if len(self._paths) >= MAX_CACHED_PATHS:
                    self._paths.clear()
                self._paths[raw] = path
        req.path = record.path = path
        if path == HEALTH_PATH and (method == "GET" or method == "HEAD"):
            return OK_ANSWER
        if (
            path == READY_PATH
            and self.readiness is not None
            and (method == "GET" or method == "HEAD")
        ):
            status, body = self.readiness()
            return Answer.json(status, body, [("Cache-Control", "no-store")])

        regions = self.regions
        if regions.by_host:
            host = req.host
            region = regions.region_for(None if host is None else host.decode("latin-1"))
            record.region = region
        else:
            region = regions.default
        req.region = region
        client = peer.client
        if client is None:  # a trusted proxy: the client is named in X-Forwarded-For
            client, req.names_client = self._forwarded_client(peer, req.forwarded_for)
        req.client_ip = record.client = client
        req.trusted_peer = peer.trusted
        if self.verified is not None:
            self._verify(req, peer, self.verified)
            record.consumer, record.tier = req.consumer, req.tier
        identity = RequestIdentity(
            self.hasher, req.client_ip, req.api_key, req.user_id, None, memo, req.client_cert
        )
        record.identities = identity  # the access log's identity components (for replays)
        table = req.table = self.rules.table
        selection = req.selection = select(
            table, region, req.rule_method or method, path, identity.key_for, req.tier
        )
        if self._refusals:
            if table is not self._refusals_table:  # limits may have changed: forget all
                self._refusals.clear()
            elif not selection.shadows:
                rule = selection.rule
                if rule is not None and not selection.ceilings:  # the common case
                    known = self._refusals.get(
                        (region, rule.policy or rule.id, selection.identity or "")
                    )
                    if known is not None and (known.rule is not rule or known.ceilings):
                        known = None
                else:
                    known = self._known_refusal(region, selection)
                if known is not None:
                    answer = self._repeat_refusal(req, known)
                    if answer is not None:
                        return answer
        req.decision = self.limiter.decide_now(region, selection)
        return None

    def _verify(self, req: Incoming, peer: Peer, verified: VerifiedIdentities) -> None:
        """Replace claimed identities with verified ones: a known key by its consumer, a
        user by a verified token's. What verifies nothing is counted as a request without
        it (per client address), and answered 401 when so configured."""
        key = req.api_key
        keys = verified.keys
        if key is not None and keys is not None:
            # (the ring's lookup written out: one C call to hashlib, no Python frames)
            consumer = keys.ring.by_digest.get(_sha256(key.encode("latin-1")).digest())
            if consumer is None:
                req.api_key = None
                req.refusal = verified.unknown_key()
            else:
                counted = self._counted.get(consumer.name)
                if counted is None:
                    if len(self._counted) >= MAX_KNOWN_REFUSALS:
                        self._counted.clear()
                    counted = self._counted[consumer.name] = counted_consumer(consumer)
                req.api_key = counted
                req.consumer = consumer.name
                req.tier = consumer.tier
        if verified.user_header_trusted_only and not peer.trusted:
            req.user_id = None
            req.drop_user_header = True
        value = req.token_header
        if (
            value is not None
            and verified.tokens is not None
            and verified.token_header not in req.connection_tokens  # (hop-by-hop: unseen)
        ):
            # A token verified before, by the SHA-256 of the header's value (no bearer
            # token kept in clear): a dict lookup in compiled code until it expires (the
            # verifier's own cache, behind it, costs three Python calls a request).
            digest = _sha256(value).digest()
            generation = verified.tokens.generation
            if generation != self._tokens_generation:
                # The keys changed: verdicts of the old ones are void (a token of a key
                # removed from the JWKS must stop working now, not at its own exp).
                self._tokens.clear()
                self._tokens_generation = generation
            user = self._tokens.get(digest)
            if user is None or _time() >= user.expires:
                try:
                    user = verified.user(value, req.client_ip)
                except InvalidToken as exc:
                    self.metrics.child(self.metrics.token_failures, exc.reason).inc()
                    if req.refusal is None:
                        req.refusal = verified.invalid_token(exc.reason)
                    return
                if len(self._tokens) >= MAX_KNOWN_TOKENS:
                    self._tokens.clear()
                self._tokens[digest] = user
            req.user_id = user.user
            if req.tier is None:
                req.tier = user.tier

    def _known_refusal(self, region: str, selection: Selection) -> KnownRefusal | None:
        """The refusal a repeat of this selection is sure to get, if one is known: kept
        under the rule's policy and identity, or under a ceiling's."""
        refusals = self._refusals
        rule = selection.rule
        known = None
        if rule is not None:
            # keyed by the policy (a tier's is its own), not only the rule's id
            known = refusals.get((region, rule.policy or rule.id, selection.identity or ""))
        ceilings = selection.ceilings
        if known is None:
            for ceiling, identity in ceilings:
                known = refusals.get((region, ceiling.policy or ceiling.id, identity))
                if known is not None:
                    break
            else:
                return None
        if known.rule is not rule or len(known.ceilings) != len(ceilings):
            return None
        for remembered, (ceiling, _) in zip(known.ceilings, ceilings, strict=True):
            if remembered is not ceiling:
                return None  # another set of policies: its own decision lists them
        return known

    def _repeat_refusal(self, req: Incoming, known: KnownRefusal) -> Answer | None:
        now = _monotonic()
        decision = known.decision
        if now >= known.until:
            self._refusals.pop(known.key, None)
            return None
        record = req.record
        assert record is not None
        # What _observe does, from what was looked up when the refusal was remembered.
        known.counted.inc()
        if known.deny_cache_hits is not None:
            known.deny_cache_hits.inc()
        if record.consumer is not None or record.tier is not None:
            self._count_consumer(req.region, record, "limited")
        record.rule = decision.rule_id
        record.decision = "limited"
        record.identity = decision.logged_identity
        wait = max(1, -int((now - known.report_at) // 1))  # whole seconds, rounded up
        if known.answer is None or known.wait != wait:
            report = known.report
            state = f'"{report.name}";r={report.remaining};t={wait}'
            known.wait = wait
            fields = [("RateLimit-Policy", known.policy), ("RateLimit", state)]
            if self.rate_limit_headers != "ietf":
                fields = self._rate_fields((report,), fields, wait)
            known.answer = self._limited(decision, fields, wait)
        req.rate_headers = []
        req.known_refusal = known
        known.overhead.observe(_perf_counter() - req.started)
        return known.answer

    def refuse_again(self, req: Incoming, first: Incoming, known: KnownRefusal) -> Answer | None:
        """``begin`` for ``req``, read from the same bytes as ``first`` on the same
        connection, which was answered from ``known``: the same answer while that refusal
        holds, or None when ``begin`` must run (the table was reloaded, the refusal was
        forgotten or has ended). Never with verified identities: a key file or a token
        may have changed what the same bytes mean."""
        if (
            self.verified is not None
            or first.table is not self.rules.table
            or self._refusals.get(known.key) is not known
        ):
            return None
        first_record = first.record
        if first_record is None:
            return None
        record = req.record = AccessRecord(
            req.method, req.path, 0, first_record.region, first_record.client
        )
        given = req.given_request_id
        req.request_id = record.request_id = new_request_id() if given is None else given
        record.own_request_id = given is None
        record.identities = first_record.identities
        return self._repeat_refusal(req, known)

    def _remember_refusal(self, req: Incoming, decision: Decision) -> None:
        selection = req.selection
        if not decision.certain_ms or selection is None or selection.shadows:
            return
        if req.table is not self.rules.table:
            return  # decided under a table a reload has replaced since
        reports = decision.reports
        if len(reports) == 1:  # the common case
            report = reports[0]
        else:
            # Exactly one policy refused, with one window (its report named after the
            # policy, as the lookup keys it), and it names the decision.
            refused = [r for r in reports if r.exceeded and not r.shadow]
            if len(refused) != 1 or refused[0].rule_id != decision.rule_id:
                return
            report = refused[0]
        policy_name = report.name
        rule = selection.rule
        if rule is not None and rule.id == report.rule_id:
            if policy_name != (rule.policy or rule.id):
                return  # a rule of several windows: not kept
        else:
            for ceiling, _ in selection.ceilings:
                if ceiling.id == report.rule_id and policy_name == (ceiling.policy or ceiling.id):
                    break
            else:
                return
        refusals = self._refusals
        if self._refusals_table is not self.rules.table:
            refusals.clear()
            self._refusals_table = self.rules.table
        if len(refusals) >= MAX_KNOWN_REFUSALS:
            del refusals[next(iter(refusals))]
        now = _monotonic()
        key = (req.region, policy_name, decision.identity_hash or "")
        # The backend's clock read whole milliseconds a moment ago: one less is certain.
        m, region = self.metrics, req.region
        headers = req.rate_headers
        refusals[key] = KnownRefusal(
            decision,
            now + (decision.certain_ms - 1) / 1000,
            now + report.reset_ms / 1000,
            m.child(m.requests, region, decision.rule_id or "-",
                    decision.identity_kind or "-", "limited"),
            m.child(m.deny_cache_hits, region) if decision.source == "deny-cache" else None,
            m.child(m.overhead, region),
            key,
            report,
            headers[0][1] if headers else "",
            rule,
            tuple(c for c, _ in selection.ceilings),
        )  # fmt: skip

    def _read_headers(self, req: Incoming) -> Answer | None:
        """One pass over the raw headers: limits, framing, and what the gateway reads."""
        headers = req.headers
        if len(headers) > self.max_headers:
            req.request_id = new_request_id()
            return Answer.error(431, f"too many request headers (at most {self.max_headers})")
        limit = self.max_header_bytes
        # A head that arrived in fewer bytes than the limit holds no header over it: the
        # per-header check is skipped (the common case).
        sized = req.head_size > limit
        api_key = user_id = None  # the identity headers' raw values, and how many came
        api_keys = user_ids = 0
        tokens: set[bytes] | None = None
        given_id: bytes | None = None
        too_big: bytes | None = None
        last_coding = expect = None
        # The method overrides as (lower-case name, value): which of them the upstream
        # receives depends on Connection, known only once every header is read.
        overrides: list[tuple[bytes, bytes]] | None = None
        alias: bytes | None = None  # the first '_' spelling of a header the gateway reads
        only_chunked = True
        singles: set[bytes] | None = None
        roles = self._roles
        tokens_seen = 0
        for name, value in headers:
            if sized and len(name) + len(value) > limit and too_big is None:
                too_big = name
            lower = name.lower()
            role = roles.get(lower)
            if role is None:
                continue  # the common case: a header the gateway only relays
            if role == _API_KEY:
                api_key = value
                api_keys += 1
                continue
            if role == _USER_ID:
                user_id = value
                user_ids += 1
                continue
            if role == _ALIAS:
                if alias is None:
                    alias = name
                continue
            if lower in SINGLETONS:
                if singles is None:
                    singles = set()
                elif lower in singles:
                    shown = name.decode("latin-1")
                    req.request_id = new_request_id()
                    return Answer.error(400, f"send one {shown} header, not several")
                singles.add(lower)
            if role == _HOST:
                req.host = value
            elif role == _CONNECTION:
                if tokens is None:
                    tokens = set()
                tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
            elif role == _FORWARDED_FOR:
                req.forwarded_for.append(value)
            elif role == _REQUEST_ID:
                given_id = value
            elif role == _FORWARDED_PROTO:
                req.forwarded_proto = value
            elif role == _CONTENT_LENGTH:
                req.content_length = int(value)  # llhttp accepted it: digits only
            elif role == _TRANSFER_ENCODING:
                req.chunked = True
                last_coding = value.rsplit(b",", 1)[-1].strip().lower()
                only_chunked = value.strip().lower() == b"chunked"
            elif role == _EXPECT:
                expect = value.lower()
            elif role == _OVERRIDE:
                if overrides is None:
                    overrides = []
                overrides.append((lower, value))
            elif role == _TOKEN:
                req.token_header = value
                tokens_seen += 1
        accepted = None if given_id is None else accept_request_id(given_id)
        if accepted:
            req.request_id = req.given_request_id = accepted
        else:
            req.request_id = new_request_id()
        if alias is not None:
            shown = alias[:64].decode("latin-1")
            meant = shown.lower().replace("_", "-")
            return Answer.error(
                400,
                f"header {repr(shown)} is refused: upstreams that read '_' as '-' would "
                f"take it as {repr(meant)}, which this gateway reads; send {repr(meant)}",
            )
        if req.chunked:
            if last_coding != b"chunked":
                # Without chunked last a request body has no length (RFC 9112 6.3).
                return Answer.error(400, "Transfer-Encoding must end with chunked")
            if not only_chunked:
                # Relayed de-chunked, a coded body would reach the upstream unlabelled.
                return Answer.error(501, "no transfer coding but chunked is supported")
            if req.version == "1.0":
                return Answer.error(400, "Transfer-Encoding in an HTTP/1.0 request (RFC 9112 6.1)")
        if expect is not None:
            if expect != b"100-continue":
                return Answer.error(417, "the only expectation accepted is 100-continue")
            req.expect_continue = True
        host = req.host
        if host is None:
            if req.version == "1.1":
                return Answer.error(400, "an HTTP/1.1 request must carry a Host header (RFC 9112)")
        elif not valid_host(host):
            return Answer.error(
                400, "the Host header must be one host name or address and an optional :port"
            )
        if too_big is not None:
            shown = too_big[:64].decode("latin-1")
            return Answer.error(431, f"request header {repr(shown)} is over {limit} bytes")
        if tokens:
            req.connection_tokens = frozenset(tokens)
        if tokens_seen > 1:
            # Upstreams disagree about which of two credentials counts.
            return Answer.error(400, "send one bearer token header, not several")
        if overrides is not None and self.keep_method_override:
            problem = _method_override(req, overrides, tokens)
            if problem is not None:
                return problem
        if api_key is not None:
            verified = self.verified
            key_name = "x-api-key" if verified is None else verified.config.api_key.header
            problem = _identity_header(req, key_name, api_key, api_keys, tokens, True)
            if problem is not None:
                return problem
            if (
                req.api_key is None
                and verified is not None
                and verified.keys is not None
                and not (tokens and verified.key_header in tokens)
            ):
                # Sent, and so forwarded, yet forming no identity (empty, or over
                # MAX_IDENTITY_HEADER_BYTES): where keys are verified it is looked up like
                # any key, so it is an unknown key (401 with unknown: reject), never a
                # request without one that reaches the upstream with the key on it.
                req.api_key = api_key.decode("latin-1")
        if user_id is not None:
            return _identity_header(req, "x-user-id", user_id, user_ids, tokens, False)
        return None

    def _query_override(self, req: Incoming, query: bytes) -> Answer | None:
        """A ``_method`` query parameter: Laravel, Symfony and express method-override
        take it for the request's method (on POST), so a POST counted by its own rule
        would be applied as, say, a DELETE. Refused (400) unless keep_method_override
        is on; then, on a POST, it chooses the rule as an override header does (one
        override in all, naming a method accepted here). It cannot be dropped as the
        headers are without rewriting the target the client signed or cached by, so on
        other methods it is refused too (an upstream honouring it on every method)."""
        values = query_overrides(query)
        if values is None:
            return Answer.error(
                400,
                f"the query holds more than {MAX_METHOD_SPELLINGS} spellings of 'method' "
                "(any of which could read as a '_method' parameter); send fewer",
            )
        if not values:
            return None
        if not self.keep_method_override:
            return Answer.error(
                400,
                "the query parameter '_method' is refused: frameworks (Laravel, Symfony, "
                "express method-override) apply it as the request's method, which this "
                "gateway does not count by; send the request with the method itself, or "
                "set keep_method_override",
            )
        if req.method != "POST":
            return Answer.error(400, "a '_method' query parameter is taken only on POST")
        if len(values) > 1 or req.keep_override:
            return Answer.error(400, "send one method override, not several")
        method = values[0].decode("latin-1").upper()
        if method not in _OVERRIDABLE:
            shown = repr(values[0][:32].decode("latin-1"))
            return Answer.error(400, f"the method override {shown} names no method accepted here")
        req.rule_method = method
        return None

    # --- after the decision

    async def decide(self, req: Incoming) -> Decision:
        """The decision when it needs the counter store (``CounterUnavailableError``
        when the store is down and the rule fails closed)."""
        assert req.selection is not None
        return await self.limiter.decide(req.region, req.selection)

    def decide_later(self, req: Incoming, done: Callable[[Decision | Exception], None]) -> bool:
        """``decide`` by callback, when the counter backend can (``Limiter.decide_later``)."""
        assert req.selection is not None
        return self.limiter.decide_later(req.region, req.selection, done)

    def unavailable(self, req: Incoming) -> Answer:
        selection, record = req.selection, req.record
        assert selection is not None and record is not None
        rule = selection.rule
        rule_id = rule.id if rule else "-"
        record.rule, record.decision = rule_id, "unavailable"
        kind = rule.identity.value if rule else "-"
        self._count(req.region, rule_id, kind, "unavailable")
        detail = (
            f"rate-limit counters for region {repr(req.region)} are unavailable and rule "
            f"{repr(rule_id)} fails closed; retry shortly"
        )
        return Answer.error(503, detail, [("Retry-After", "1")])

    def after_decision(self, req: Incoming, decision: Decision) -> Answer | Upstream | None:
        """The answer (429, 404), the upstream to forward to, or None for ``/info``."""
        record = req.record
        assert record is not None
        self._observe(req.region, decision, record)
        headers = decision.header_fields()
        if self.rate_limit_headers != "ietf" and headers:
            headers = self._rate_fields(decision.reports, headers, 0)
            req.legacy_rate = self.rate_limit_headers != "none"
        req.rate_headers = headers
        if decision.outcome is Outcome.LIMITED:
            self.metrics.child(self.metrics.overhead, req.region).observe(
                _perf_counter() - req.started
            )
            self._remember_refusal(req, decision)
            return self._limited(decision, headers, decision.retry_after)
        refusal = req.refusal
        if refusal is not None:
            # Counted per client address like any request without an identity, and let
            # through by that count: answered here, never forwarded.
            self.metrics.child(self.metrics.identity_refusals, refusal.reason).inc()
            return Answer.error(refusal.status, refusal.detail, [*headers, *refusal.fields])
        path = req.path
        if path == INFO_PATH and (req.method == "GET" or req.method == "HEAD"):
            return None
        upstream = self.router.route(path)
        if upstream is None:
            return Answer.error(404, f"no upstream serves {path}", headers)
        record.upstream = upstream.name
        if len(headers) == 2:  # RateLimit-Policy and RateLimit: the common case
            (n0, t0), (n1, t1) = headers
            req.rate_lines = f"{n0}: {t0}\r\n{n1}: {t1}\r\n".encode("latin-1")
        elif headers:
            req.rate_lines = "".join([f"{n}: {t}\r\n" for n, t in headers]).encode("latin-1")
        self.metrics.child(self.metrics.overhead, req.region).observe(_perf_counter() - req.started)
        return upstream

    def _rate_fields(
        self, reports: tuple[LimitReport, ...], ietf: list[tuple[str, str]], wait: int
    ) -> list[tuple[str, str]]:
        """The rate-limit fields in the configured style (``rate_limit_headers``): the
        draft's (ietf), ``X-RateLimit-*`` as Envoy, Kong and GitHub clients read them
        (legacy) for the policy closest to its limit, both, or none."""
        mode = self.rate_limit_headers
        if mode == "none":
            return []
        enforced = [r for r in reports if not r.shadow] or list(reports)
        refused = [r for r in enforced if r.exceeded]
        closest = min(refused or enforced, key=lambda r: r.remaining / r.count)
        legacy = [
            ("X-RateLimit-Limit", str(closest.count)),
            ("X-RateLimit-Remaining", str(closest.remaining)),
            ("X-RateLimit-Reset", str(wait or closest.reset_seconds)),  # seconds from now
        ]
        return legacy if mode == "legacy" else [*ietf, *legacy]

    def _limited(self, decision: Decision, headers: list[tuple[str, str]], wait: int) -> Answer:
        rule_id = decision.rule_id or "-"
        table = self.rules.table
        if table is not self._bodies_table:  # a rule's refusal may have changed
            self._limited_bodies.clear()
            self._bodies_table = table
        found = self._limited_bodies.get((rule_id, wait))
        if found is None:
            if len(self._limited_bodies) >= _MAX_CACHED_429:
                self._limited_bodies.clear()
            rule = None if decision.rule_id is None else table.by_id(decision.rule_id)
            if rule is not None and rule.refusal_detail:
                detail = rule.refusal_detail.replace("{rule}", rule_id).replace(
                    "{retry_after}", str(wait)
                )
            else:
                detail = f"rate limit exceeded for rule {repr(rule_id)}; retry in {wait} seconds"
            status = 429 if rule is None else rule.refusal_status
            found = self._limited_bodies[(rule_id, wait)] = (status, json_body(detail))
        return Answer.json(found[0], found[1], [*headers, ("Retry-After", str(wait))])

    def _observe(self, region: str, decision: Decision, record: AccessRecord) -> None:
        rule = decision.rule_id or "-"
        kind = decision.identity_kind or "-"
        label = _OUTCOME_LABELS[decision.outcome]
        if decision.source == "fallback" and decision.outcome is Outcome.ALLOWED:
            label = "fallback"
        metrics = self.metrics
        requests = metrics.requests
        counted = requests.children.get((region, rule, kind, label))
        if counted is None:
            counted = requests.labels(region, rule, kind, label)
        counted.inc()
        for shadow_rule, shadow_kind in decision.shadow_exceeded:
            self._count(region, shadow_rule, shadow_kind, "shadow_limited")
            log.info("shadow rule %s would have limited this request", shadow_rule)
        if decision.near_limit:
            self.metrics.child(self.metrics.near_limit, region, rule).inc()
        record.rule = decision.rule_id
        record.decision = label
        if decision.identity_hash:
            record.identity = decision.logged_identity
        if record.consumer is not None or record.tier is not None:
            self._count_consumer(region, record, label)

    def _count_consumer(self, region: str, record: AccessRecord, label: str) -> None:
        # Consumers come from keys.yaml and tiers from it or the identity provider's
        # claim: labels the operator controls, never a client (unknown keys have none).
        metrics = self.metrics
        metrics.child(
            metrics.consumer_requests, region, record.consumer or "-", record.tier or "-", label
        ).inc()

    def _count(self, region: str, rule: str, kind: str, decision: str) -> None:
        self.metrics.child(self.metrics.requests, region, rule, kind, decision).inc()

    def finished(self, record: AccessRecord, started: float) -> None:
        """Metrics and the access-log line of a request that has ended."""
        # Whole microseconds: a float of few digits formats in under half the time of
        # one carrying the clock's full precision, and the line is shorter.
        record.duration_ms = int((_perf_counter() - started) * 1e6) / 1000
        if record.status:
            status_class = _STATUS_CLASSES.get(record.status // 100) or "other"
            self.metrics.child(self.metrics.responses, record.region, status_class).inc()
        self.access_log.emit(record)

    async def info_answer(self, req: Incoming) -> Answer:
        return Answer.json(200, _json(await self.info(full=False)), req.rate_headers)

    async def info(self, full: bool = True) -> dict[str, object]:
        """What the gateway runs. The public port's ``/info`` (``full=False``) tells
        which rule table is in force and whether the counters answer; where the counter
        stores, rule files and upstreams are, and the last reload error, are for the
        operator: the admin port's ``/info`` (hardening issue: /info exposure)."""
        table = self.rules.table
        regions = []
        for name, backend in self.backends.items():
            try:
                healthy = await asyncio.wait_for(backend.healthy(), 1.0)
            except (TimeoutError, OSError):
                healthy = False
            shown = backend.name if full else backend_kind(backend.name)
            regions.append({"name": name, "counter_backend": shown, "healthy": healthy})
        rules: dict[str, object] = {
            "hash": table.digest,
            "loaded_at": dt.datetime.fromtimestamp(table.loaded_at, dt.UTC).isoformat(),
            "count": len(table.rules),
        }
        info: dict[str, object] = {
            "version": __version__,
            "default_region": self.regions.default,
            "regions": regions,
            "rules": rules,
        }
        if full:
            rules["files"] = list(table.sources)
            rules["last_reload_error"] = self.rules.last_error
            info["upstreams"] = self.router.info()
        return info


def _identity_header(
    req: Incoming, name: str, raw: bytes, count: int, tokens: set[bytes] | None, is_key: bool
) -> Answer | None:
    """Take an identity header (``x-api-key``, ``x-user-id``) into ``req``, or the 400."""
    if count > 1:
        return Answer.error(400, f"send one {name} header, not {count}")
    if tokens and name.encode() in tokens:
        # Named in Connection it is hop-by-hop for this request: the upstream never sees
        # it, so it identifies nobody.
        return None
    try:
        value = valid_identity_header(raw)
    except ValueError as exc:
        return Answer.error(400, f"the {name} header {exc}")
    if is_key:  # (by role: the key's header may have another name, identity.api_key.header)
        req.api_key = value
    else:
        req.user_id = value
    return None


def _method_override(
    req: Incoming, overrides: list[tuple[bytes, bytes]], tokens: set[bytes] | None
) -> Answer | None:
    """Keep a method override (the keep_method_override setting): the rule is then
    chosen by the method the upstream will apply, decided from what the relay forwards.

    An override named in Connection is hop-by-hop: the relay drops it, so the upstream
    never sees it and it chooses nothing. On any method but POST none is kept (the relay
    drops it, ``req.keep_override`` staying False): the override middleware of Rack,
    express, ASP.NET Core, Symfony and Laravel honours one only on POST, so the upstream
    applies the request's own method, and by dropping it an upstream honouring one on
    every method does too."""
    if tokens:
        overrides = [(name, value) for name, value in overrides if name not in tokens]
        if not overrides:
            return None
    if req.method != "POST":
        return None
    if len(overrides) > 1:
        return Answer.error(400, "send one method override header, not several")
    raw = overrides[0][1]
    method = raw.decode("latin-1").upper()
    if method not in _OVERRIDABLE:
        shown = raw[:32].decode("latin-1")
        return Answer.error(400, f"the method override {repr(shown)} names no method accepted here")
    req.keep_override = True
    req.rule_method = method
    return None


# A key reads as '_method' once decoded only if its bytes spell "method", each letter as
# itself or as its percent escape ('+' decodes to a space, never to a letter). Found at C
# speed over the whole query, so only the parameters that could be an override cost
# Python work: a query of 30,000 '%;' pieces cost ~90 ms of the event loop a request
# when every piece was decoded (review, seventeenth session).
_COULD_SPELL_METHOD: Final = re.compile(
    rb"(?:m|%6[dD])(?:e|%65)(?:t|%74)(?:h|%68)(?:o|%6[fF])(?:d|%64)"
)
# More spellings than this in one query: refused (400), so what the check costs is bounded
# whatever the query holds (a real one has one or two: method=, payment_method=).
MAX_METHOD_SPELLINGS: Final = 64
_SEPARATOR: Final = re.compile(rb"[&;]")


def query_overrides(query: bytes) -> list[bytes] | None:
    """The values of the ``_method`` parameters of ``query`` (``?...``), its keys read as
    any framework reads them: split at '&' (and ';', as Rack 2 does), '+' a space,
    percent-decoded, then as PHP names ``$_GET``'s keys (Laravel, Symfony): leading
    spaces dropped, '.' and ' ' read as '_', cut at a NUL; a key ``_method[...]`` (PHP's
    arrays) counts too. None: more than MAX_METHOD_SPELLINGS spellings of "method"."""
    found: list[bytes] = []
    seen = 0
    end = 0  # where the last parameter looked at ends (its separator), or the '?'
    for match in _COULD_SPELL_METHOD.finditer(query):
        seen += 1
        if seen > MAX_METHOD_SPELLINGS:
            return None
        at = match.start()
        if at < end:
            continue  # (a second spelling in the same parameter)
        # Its bounds, searched only between the last parameter and the next separator:
        # the whole query is scanned about once, however many spellings it holds.
        start = max(query.rfind(b"&", end, at), query.rfind(b";", end, at), 0) + 1
        after = _SEPARATOR.search(query, at)
        end = len(query) if after is None else after.start()
        part = query[start:end]
        key, _, value = part.partition(b"=")
        if b"%" in key or b"+" in key:
            key = unquote_to_bytes(key.replace(b"+", b" "))
        if b"method" not in key:
            continue
        key = key.split(b"\0", 1)[0].lstrip(b" ").replace(b".", b"_").replace(b" ", b"_")
        if key == b"_method" or key.startswith(b"_method["):
            found.append(unquote_to_bytes(value.replace(b"+", b" ")))
    return found


def backend_kind(name: str) -> str:
    """A counter backend's kind without its address: ``memory``, or the counter URL's
    scheme (``redis``, ``rediss``, ``redis+cluster``, ``unix`` ...)."""
    scheme, sep, _ = name.partition("://")
    return scheme if sep else name.split(" ", 1)[0]


def _json(payload: object) -> bytes:
    return json.dumps(payload).encode()
