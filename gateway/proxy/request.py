"""One request as the data plane holds it: raw bytes from llhttp, plus what was decided.

A plain slotted object instead of a framework request: the header list is the exact
``(name, value)`` byte pairs the client sent (after llhttp's strict parse), which is
also what the upstream receives, so identities are taken from those same bytes.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.policy.matcher import Selection
from gateway.proxy.access_log import AccessRecord
from gateway.ratelimit.decision import Decision


class Incoming:
    __slots__ = (
        "api_key",
        "body",
        "body_done",
        "body_size",
        "chunked",
        "client_ip",
        "connection_tokens",
        "content_length",
        "decision",
        "expect_continue",
        "forwarded_for",
        "forwarded_proto",
        "head_only",
        "headers",
        "host",
        "keep_alive",
        "method",
        "path",
        "query",
        "rate_headers",
        "record",
        "region",
        "request_id",
        "selection",
        "sink",
        "started",
        "target",
        "trusted_peer",
        "upgrade",
        "user_id",
        "version",
    )

    def __init__(self) -> None:
        self.method = ""
        self.target = b""
        self.version = "1.1"
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True
        self.head_only = False
        self.upgrade = False
        self.started = 0.0
        # framing, from the headers llhttp validated
        self.content_length: int | None = None
        self.chunked = False
        self.expect_continue = False
        # body: buffered until a sink (the upstream) takes it
        self.body: list[bytes] = []
        self.body_size = 0
        self.body_done = False
        self.sink: Callable[[bytes], None] | None = None
        # what the gateway read and decided
        self.path = ""
        self.query = b""  # "?..." exactly as sent, or empty
        self.host: bytes | None = None
        self.api_key: str | None = None
        self.user_id: str | None = None
        self.client_ip = "-"
        self.trusted_peer = False
        self.forwarded_for: list[bytes] = []
        self.forwarded_proto: bytes | None = None
        self.connection_tokens: frozenset[bytes] = frozenset()
        self.region = ""
        self.request_id = ""
        self.selection: Selection | None = None
        self.decision: Decision | None = None
        self.rate_headers: list[tuple[str, str]] = []
        self.record: AccessRecord | None = None
