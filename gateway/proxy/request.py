"""One request as the data plane holds it: raw bytes from llhttp, plus what was decided.

A plain object instead of a framework request: the header list is the exact
``(name, value)`` byte pairs the client sent (after llhttp's strict parse), which is
also what the upstream receives, so identities are taken from those same bytes.

Defaults live on the class, so a new request sets only its three lists (one is built
per request; setting ~30 slots in ``__init__`` cost more than the rest of the parse).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from gateway.identity.verified import Refusal
from gateway.policy.matcher import Selection
from gateway.policy.model import RuleTable
from gateway.proxy.access_log import AccessRecord
from gateway.ratelimit.decision import Decision


class Incoming:
    method = ""
    target = b""
    version = "1.1"
    keep_alive = True
    head_only = False
    upgrade = False
    # the Upgrade is passed on (its route takes upgrades): a tunnel slot is reserved for
    # it until the upstream's 101 joins the connections, or the request ends without one
    tunnel = False
    upgrade_value = b""  # the client's Upgrade header, as sent
    started = 0.0
    # bytes read while this request's head arrived (at least the head's size): when
    # under max_header_bytes, no single header can be over it
    head_size = 1 << 30
    # framing, from the headers llhttp validated
    content_length: int | None = None
    chunked = False
    expect_continue = False
    # Content on a method other than POST, PUT and PATCH: the upstream connection is
    # used for this request only (``bodiless_method_with_content``)
    close_upstream = False
    # answered before its body ended: the rest of the body is read and dropped
    answered_early = False
    # the client address whose upload slot this request holds (DataPlane.take_upload)
    upload_client: str | None = None
    # the client address whose download slot this request holds (DataPlane.take_download)
    download_client: str | None = None
    # counted in plane.exchanges (forwarded, not yet answered); its key there (None: a
    # trusted proxy's own request, counted in all only)
    exchange_counted = False
    exchange_client: str | None = None
    chunks = 0  # chunks of a chunked body so far
    framing = 0  # bytes of its body phase that were not body (chunk lines, trailers)
    framing_run = 0  # ... since its last body bytes
    # X-HTTP-Method-Override and its kin are passed on (the keep_method_override setting)
    keep_override = False
    rule_method = ""  # the overridden method, when it is kept: the rule is chosen by it
    # body: buffered until a sink (the upstream) takes it
    body_size = 0
    body_done = False
    sink: Callable[[bytes], None] | None = None
    # what the gateway read and decided
    path = ""
    query = b""  # "?..." exactly as sent, or empty
    host: bytes | None = None
    api_key: str | None = None
    user_id: str | None = None
    # verified identities (the config file's identity: section)
    token_header: bytes | None = None  # the bearer token's header value, as sent
    consumer: str | None = None  # the known key's consumer
    tier: str | None = None  # the consumer's or the token's tier
    refusal: Refusal | None = None  # answered 401 once its per-address count lets it through
    drop_user_header = False  # x-user-id from an untrusted peer, where only trusted ones count
    client_ip = "-"
    client_cert: str | None = None  # the TLS port's verified client certificate subject
    trusted_peer = False
    # False for a trusted proxy's own request (its X-Forwarded-For names no client behind
    # it): not capped per client address, since it is all the proxy's clients.
    names_client = True
    forwarded_proto: bytes | None = None
    connection_tokens: frozenset[bytes] = frozenset()
    region = ""
    request_id = ""
    table: RuleTable | None = None  # the rule table the request was matched against
    selection: Selection | None = None
    decision: Decision | None = None
    rate_headers: list[tuple[str, str]] = []
    rate_lines = b""  # rate_headers as header lines, for a forwarded request's response
    legacy_rate = False  # rate_headers hold X-RateLimit-* (the upstream's are dropped)
    record: AccessRecord | None = None
    upstream_head: bytes | None = None  # built once, kept for a retry
    given_request_id: str | None = None  # the client's X-Request-Id, when accepted
    # The gateway's KnownRefusal (gateway.proxy.handler) this request was answered from,
    # without counting: a byte-identical repeat on its connection may be answered from it
    # without being parsed again (ClientConnection._replay).
    known_refusal: object | None = None

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.forwarded_for: list[bytes] = []

    def again(self, started: float) -> Incoming:
        """A new request read from the same bytes as this one: what parsing them and
        ``Gateway.begin`` up to the rule's selection would set again, the same values
        (the lists are shared: nothing changes them once the head is read)."""
        req = Incoming()
        req.started = started
        req.method = self.method
        req.target = self.target
        req.version = self.version
        req.keep_alive = self.keep_alive
        req.head_only = self.head_only
        req.head_size = self.head_size
        req.headers = self.headers
        req.forwarded_for = self.forwarded_for
        req.body_done = True
        req.path = self.path
        req.query = self.query
        req.host = self.host
        req.api_key = self.api_key
        req.user_id = self.user_id
        req.client_ip = self.client_ip
        req.client_cert = self.client_cert
        req.trusted_peer = self.trusted_peer
        req.names_client = self.names_client
        req.forwarded_proto = self.forwarded_proto
        req.connection_tokens = self.connection_tokens
        req.region = self.region
        req.given_request_id = self.given_request_id
        req.table = self.table
        req.selection = self.selection
        return req


# Methods whose requests carry content by convention, which servers read: POST, PUT and
# PATCH. Servers that handle any other method without reading a body ("CL.0": Python's
# http.server, many hand-written handlers; GET, HEAD, DELETE, OPTIONS, and PURGE or
# UNLOCK alike) read its content, on a kept-alive connection, as the next request: one
# the gateway never counted, whose response a later client on the pooled connection
# would get.
CONTENT_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})


def bodiless_method_with_content(method: str, content_length: int | None, chunked: bool) -> bool:
    """Whether a request is one the upstream may not read the content of (content on a
    method other than POST, PUT and PATCH): it is then sent with ``Connection: close`` and
    its upstream connection is not used again."""
    return method not in CONTENT_METHODS and (chunked or (content_length or 0) > 0)
