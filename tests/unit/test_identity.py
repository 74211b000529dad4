from __future__ import annotations

import hashlib
import hmac

import pytest

from gateway.policy.model import IdentityKind
from gateway.ratelimit.identity import (
    ClientAddressPolicy,
    IdentityHasher,
    RequestIdentity,
    valid_identity_header,
)

HASHER = IdentityHasher(b"0123456789abcdef0123")


def test_untrusted_peer_forwarding_header_is_ignored():
    policy = ClientAddressPolicy.parse([])
    assert policy.client_address("198.51.100.9", "1.2.3.4") == "198.51.100.9"
    policy = ClientAddressPolicy.parse(["10.0.0.0/8"])
    assert policy.client_address("198.51.100.9", "1.2.3.4") == "198.51.100.9"


def test_trusted_hops_are_walked_right_to_left():
    policy = ClientAddressPolicy.parse(["10.0.0.0/8", "192.168.0.0/16"])
    # client 203.0.113.5 -> proxy 192.168.1.1 -> proxy 10.0.0.2 -> gateway
    xff = "6.6.6.6, 203.0.113.5, 192.168.1.1"
    assert policy.client_address("10.0.0.2", xff) == "203.0.113.5"
    # every hop trusted: the leftmost one is the client
    assert policy.client_address("10.0.0.2", "10.1.1.1, 192.168.3.3") == "10.1.1.1"
    # garbage stops the walk at the last trusted hop: a client cannot pick its bucket
    assert policy.client_address("10.0.0.2", "1.1.1.1, bogus, 192.168.1.1") == "192.168.1.1"
    assert policy.client_address("10.0.0.2", "") == "10.0.0.2"


def test_ipv6_clients_are_grouped_by_prefix_and_mapped_v4_unwrapped():
    policy = ClientAddressPolicy.parse([])
    a = policy.client_address("2001:db8:1:2:aaaa::1", None)
    b = policy.client_address("2001:db8:1:2:bbbb::2", None)
    c = policy.client_address("2001:db8:1:3::1", None)
    assert a == b == "2001:db8:1:2::/64"
    assert c != a
    assert policy.client_address("::ffff:192.0.2.1", None) == "192.0.2.1"
    exact = ClientAddressPolicy.parse([], ipv6_prefix=128)
    assert exact.client_address("2001:db8::1", None) == "2001:db8::1"


@pytest.mark.parametrize("absent", ["", "x" * 257, b"", None])
def test_empty_or_long_identity_headers_form_no_identity(absent):
    assert valid_identity_header(absent) is None


@pytest.mark.parametrize("bad", ["caf\u00e9", "a\tb", "a\x00b", b"key\xff", b"a\x7fb"])
def test_identity_headers_that_are_not_printable_ascii_are_refused(bad):
    with pytest.raises(ValueError, match="printable ASCII"):
        valid_identity_header(bad)


def test_identity_header_bytes_become_the_same_text():
    assert valid_identity_header(b"key-1 x") == valid_identity_header("key-1 x") == "key-1 x"


def test_hash_is_keyed_and_never_contains_the_key():
    identity = RequestIdentity(HASHER, "192.0.2.1", "sk-live-abcdef", "user-1")
    key_hash = identity.key_for(IdentityKind.API_KEY)
    assert key_hash is not None and "sk-live" not in key_hash and len(key_hash) == 32
    other = IdentityHasher(b"another-secret-0123456789")
    assert other.digest(IdentityKind.API_KEY, "sk-live-abcdef") != key_hash
    # one user from two addresses: two identities
    there = RequestIdentity(HASHER, "192.0.2.2", None, "user-1")
    assert identity.key_for(IdentityKind.USER_IP) != there.key_for(IdentityKind.USER_IP)
    assert RequestIdentity(HASHER, "192.0.2.1", None, None).key_for(IdentityKind.API_KEY) is None


def test_bad_cidr_is_a_clear_error():
    with pytest.raises(ValueError, match="bad trusted-proxy CIDR 'ten'"):
        ClientAddressPolicy.parse(["ten"])


@pytest.mark.parametrize("secret_length", [16, 32, 63, 64, 65, 200])
def test_identity_hashes_are_hmac_sha256_of_kind_and_value(secret_length: int) -> None:
    secret = bytes(range(256))[:secret_length]
    hasher = IdentityHasher(secret)
    for kind in IdentityKind:
        for value in ["", "k", "sk-" + "x" * 300, "bob\0198.51.100.7", "ключ"]:
            expected = hmac.new(
                secret, kind.value.encode() + b"\0" + value.encode(), hashlib.sha256
            ).hexdigest()[:32]
            assert hasher.digest(kind, value) == expected
