"""Who a request is, for counting: the client address and the identity headers.

Raw API keys and user ids never leave this module: everything downstream (counter
keys, logs, metrics) sees a keyed hash (HMAC-SHA256 with a per-deployment secret).
"""

from __future__ import annotations

import hashlib
import importlib
import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from gateway.policy.model import IdentityKind

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_IDENTITY_HEADER_BYTES: Final = 256
MAX_FORWARDED_HOPS: Final = 32
MEMO_SIZE: Final = 8  # identity hashes remembered per connection
HASH_HEX_CHARS: Final = 32  # 128 bits of the HMAC: collisions are not a practical concern
_BLOCK: Final = 64  # SHA-256's block size, as HMAC pads the key to


def valid_identity_header(value: str | bytes | None) -> str | None:
    """The header value as an identity, or None when it forms none (absent, empty, over
    256 bytes). ``ValueError`` when it is not printable ASCII: such a request is refused,
    since no identity could be taken from exactly what the upstream would receive."""
    if isinstance(value, str):  # judged by the bytes a client sends, as the data plane is
        value = value.encode()
    if not value or len(value) > MAX_IDENTITY_HEADER_BYTES:
        return None
    text = value.decode("latin-1")
    if not text.isascii() or not text.isprintable():  # for ASCII: 0x20-0x7E
        raise ValueError("must be printable ASCII")
    return text


def _c_hmac() -> tuple[Callable[[bytes], bytes], Callable[[bytes, bytes, str], str]] | None:
    """The identity HMAC in C (``_identity_hmac.c``: ``states`` and ``hex32``), when the
    install built it (setup.py, as it compiles the data plane), else None: the hashlib
    construction below gives the same digests."""
    try:
        module = importlib.import_module("gateway.ratelimit._identity_hmac")
    except ImportError:
        return None
    states: Callable[[bytes], bytes] = module.states
    hex32: Callable[[bytes, bytes, str], str] = module.hex32
    return states, hex32


_C_HMAC: Final = _c_hmac()

# What each kind's hashed input starts with ("<kind>\0"), encoded once.
_KIND_PREFIXES: Final = {kind: kind.value.encode() + b"\0" for kind in IdentityKind}


class IdentityHasher:
    """Keyed hashing of identity values; the secret makes hashes useless to outsiders."""

    def __init__(self, secret: bytes, native: bool = True) -> None:
        """``native``: use the C HMAC when it is built (False: the hashlib one, for the
        tests that compare the two)."""
        if len(secret) < 16:
            raise ValueError("the identity secret must be at least 16 bytes")
        self._secret = secret
        # HMAC-SHA256 (RFC 2104) from its two keyed SHA-256 states, computed once; each
        # digest continues them. The same bytes as hmac.new(secret, msg, sha256)
        # (tests/unit/test_identity.py, tests/unit/test_identity_hmac.py). In C when
        # built: two SHA-256 blocks and one str a digest, 2.9x as fast as the hashlib
        # objects below with SHA-NI, 1.7x without (benchmarks/identity_hmac_bench.py).
        # The fallback stays on OpenSSL's SHA-256: CPython's own copies its state more
        # cheaply but hashes a block without SHA-NI, and was slower in time (1,387 against
        # 1,116 ns a digest) though callgrind, which hides SHA-NI, counted it cheaper.
        key = hashlib.sha256(secret).digest() if len(secret) > _BLOCK else secret
        key = key.ljust(_BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))
        c_hmac = _C_HMAC if native else None
        self._states = b"" if c_hmac is None else c_hmac[0](key)
        self._hex32 = None if c_hmac is None else c_hmac[1]

    @property
    def native(self) -> bool:
        """Whether digests are made in C (``_identity_hmac.c``)."""
        return self._hex32 is not None

    def digest(self, kind: IdentityKind, value: str) -> str:
        hex32 = self._hex32
        if hex32 is not None:
            return hex32(self._states, _KIND_PREFIXES[kind], value)
        inner = self._inner.copy()
        inner.update(_KIND_PREFIXES[kind] + value.encode())
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.hexdigest()[:HASH_HEX_CHARS]


@dataclass(frozen=True, slots=True)
class ClientAddressPolicy:
    """How to find the client address behind trusted proxies, and how to group IPv6."""

    trusted: tuple[IPNetwork, ...] = ()
    ipv6_prefix: int = 64

    @classmethod
    def parse(cls, cidrs: Sequence[str], ipv6_prefix: int = 64) -> ClientAddressPolicy:
        networks = []
        for cidr in cidrs:
            try:
                networks.append(ipaddress.ip_network(cidr.strip(), strict=False))
            except ValueError as exc:
                raise ValueError(f"bad trusted-proxy CIDR {repr(cidr)}: {exc}") from exc
        if not 0 < ipv6_prefix <= 128:
            raise ValueError(f"ipv6 prefix must be 1..128, not {ipv6_prefix}")
        return cls(tuple(networks), ipv6_prefix)

    def is_trusted(self, address: IPAddress) -> bool:
        return any(address in network for network in self.trusted)

    def peer_trusted(self, peer: str | None) -> bool:
        """Whether the TCP peer is a trusted proxy (never, with none configured)."""
        if not self.trusted:
            return False
        address = _parse(peer)
        return address is not None and self.is_trusted(address)

    def client_address(self, peer: str | None, forwarded_for: str | None) -> str:
        """The client's address as a counting key (an IPv6 client grouped by prefix).

        Forwarding headers count only when the TCP peer is a trusted proxy; then
        ``X-Forwarded-For`` is walked right to left past trusted hops and the first
        untrusted address is the client. A malformed hop stops the walk at the last
        trusted hop, so a client cannot choose its own bucket by writing garbage.
        """
        return self.forwarded_client(peer, forwarded_for)[0]

    def forwarded_client(self, peer: str | None, forwarded_for: str | None) -> tuple[str, bool]:
        """``client_address``, and whether it names a client: False when the walk ended
        on a trusted address (a trusted proxy's own request, naming nobody behind it).
        Judged on the address itself, not its group: a client in a trusted proxy's IPv6
        prefix is a client all the same."""
        address = _parse(peer)
        if address is None:
            return peer or "unknown", True
        named = True
        if self.trusted and self.is_trusted(address):
            named = False
            hops = forwarded_for.split(",")[-MAX_FORWARDED_HOPS:] if forwarded_for else []
            for hop in reversed(hops):
                hop_address = _parse(hop.strip())
                if hop_address is None:
                    break
                address = hop_address
                if not self.is_trusted(hop_address):
                    named = True
                    break
        return self.group(address), named

    def group(self, address: IPAddress) -> str:
        if isinstance(address, ipaddress.IPv6Address) and self.ipv6_prefix < 128:
            network = ipaddress.IPv6Network((address, self.ipv6_prefix), strict=False)
            return str(network)
        return str(address)


def _parse(value: str | None) -> IPAddress | None:
    if not value:
        return None
    if value.startswith("[") and "]" in value:  # "[v6]:port" as some proxies write it
        value = value[1 : value.index("]")]
    try:
        address = ipaddress.ip_address(value.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@dataclass(slots=True)
class RequestIdentity:
    """The identity inputs of one request; hashes are computed once, when first needed."""

    hasher: IdentityHasher
    client_ip: str
    api_key: str | None
    user_id: str | None
    _cache: dict[IdentityKind, str | None] | None = None
    # Hashes already computed on the same connection (its caller's, kept small): a
    # client usually sends one key for a whole connection, so HMAC runs once per
    # connection, not per request.
    memo: dict[tuple[IdentityKind, str], str] | None = None
    client_cert: str | None = None  # a verified client certificate's subject (RFC 4514)

    # Written out: mypyc compiles this one, while the dataclass's own would run as Python
    # code on every construction (~3x slower; tests/unit/test_native.py checks it matches).
    def __init__(
        self,
        hasher: IdentityHasher,
        client_ip: str,
        api_key: str | None,
        user_id: str | None,
        _cache: dict[IdentityKind, str | None] | None = None,
        memo: dict[tuple[IdentityKind, str], str] | None = None,
        client_cert: str | None = None,
    ) -> None:
        self.hasher = hasher
        self.client_ip = client_ip
        self.api_key = api_key
        self.user_id = user_id
        self._cache = _cache
        self.memo = memo
        self.client_cert = client_cert

    def key_for(self, kind: IdentityKind) -> str | None:
        """The hashed identity for a rule of ``kind``, or None if it cannot be formed."""
        cache = self._cache
        if cache is None:
            cache = self._cache = {}
        elif kind in cache:
            return cache[kind]
        value: str | None
        if kind is IdentityKind.IP:
            value = self.client_ip
        elif kind is IdentityKind.API_KEY:
            value = self.api_key
        elif kind is IdentityKind.USER_IP:
            value = None if self.user_id is None else f"{self.user_id}\0{self.client_ip}"
        else:
            value = self.client_cert
        if value is None:
            result = None
        elif self.memo is None:
            result = self.hasher.digest(kind, value)
        else:
            result = self.memo.get((kind, value))
            if result is None:
                result = self.hasher.digest(kind, value)
                if len(self.memo) >= MEMO_SIZE:
                    self.memo.clear()
                self.memo[(kind, value)] = result
        cache[kind] = result
        return result
