"""The identity HMAC in C (gateway/ratelimit/_identity_hmac.c) against hmac.new and the
hashlib construction: the same 32 hex digits for any secret and value."""

from __future__ import annotations

import hashlib
import hmac
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.policy.model import IdentityKind
from gateway.ratelimit import identity
from gateway.ratelimit.identity import IdentityHasher

# The install builds it whenever it compiles (setup.py): without it these tests would
# only compare hashlib with itself.
BUILT = identity._C_HMAC is not None
if os.environ.get("GATEWAY_COMPILE", "1") != "0":
    assert BUILT, "the install compiles the identity HMAC (setup.py); it is missing"


def expected(secret: bytes, kind: IdentityKind, value: str) -> str:
    message = kind.value.encode() + b"\0" + value.encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()[:32]


def hashers(secret: bytes) -> list[IdentityHasher]:
    both = [IdentityHasher(secret, native=False)]
    if BUILT:
        both.append(IdentityHasher(secret))
        assert both[1].native and not both[0].native
    return both


@settings(max_examples=400, deadline=None)
@given(
    secret=st.binary(min_size=16, max_size=200),
    kind=st.sampled_from(list(IdentityKind)),
    value=st.text(max_size=300),
)
def test_every_digest_is_hmac_sha256_of_kind_and_value(
    secret: bytes, kind: IdentityKind, value: str
) -> None:
    for hasher in hashers(secret):
        assert hasher.digest(kind, value) == expected(secret, kind, value)


@pytest.mark.parametrize("size", [0, 1, 46, 47, 48, 54, 55, 56, 63, 64, 65, 110, 119, 120, 128])
def test_messages_at_every_padding_boundary(size: int) -> None:
    # "ip\0" + value: the message crosses SHA-256's block and length-field boundaries
    # (55/56 and 64 bytes after the 64-byte key block) at these value sizes.
    secret = bytes(range(32))
    value = "v" * size
    for hasher in hashers(secret):
        assert hasher.digest(IdentityKind.IP, value) == expected(secret, IdentityKind.IP, value)


def test_non_ascii_values_hash_their_utf8_bytes_and_lone_surrogates_are_refused() -> None:
    secret = b"s" * 40
    for value in ["ключ", "\0", "bob\x00198.51.100.7", "CN=Zoë,O=例"]:
        for hasher in hashers(secret):
            assert hasher.digest(IdentityKind.CLIENT_CERT, value) == expected(
                secret, IdentityKind.CLIENT_CERT, value
            )
    for hasher in hashers(secret):
        with pytest.raises(UnicodeEncodeError):
            hasher.digest(IdentityKind.API_KEY, "\ud800")


@pytest.mark.skipif(not BUILT, reason="the C HMAC is not built (GATEWAY_COMPILE=0)")
def test_the_c_functions_refuse_wrong_arguments() -> None:
    c_hmac = identity._C_HMAC
    assert c_hmac is not None
    states, hex32 = c_hmac
    with pytest.raises(ValueError, match="64-byte"):
        states(b"short")
    good = states(b"k" * 64)
    assert len(good) == 64
    for args in [(good[:63], b"", "x"), (good, "ip", "x"), (good, b"", b"x"), (good, b"")]:
        with pytest.raises(TypeError, match="hex32"):
            hex32(*args)


def _cpu_has_sha_ni() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = cpuinfo.read().splitlines()
    except OSError:
        return False
    return any(line.startswith("flags") and " sha_ni" in line for line in lines)


CHECK_BOTH = """
import hashlib, hmac, random, sys
from gateway.ratelimit import _identity_hmac as m
rng = random.Random(int(sys.argv[1]))
for n in range(300):
    secret = rng.randbytes(rng.choice([16, 32, 63, 64, 65, 200]))
    key = (hashlib.sha256(secret).digest() if len(secret) > 64 else secret).ljust(64, b"\\0")
    value = "".join(rng.choice("ab\\0\\u00e9\\u4e2d\\U0001f600") for _ in range(rng.randrange(300)))
    prefix = rng.choice([b"ip\\0", b"api_key\\0", b""])
    want = hmac.new(secret, prefix + value.encode(), hashlib.sha256).hexdigest()[:32]
    assert m.hex32(m.states(key), prefix, value) == want, (n, secret, prefix, value)
print(m.SHA_NI)
"""


@pytest.mark.skipif(not BUILT, reason="the C HMAC is not built (GATEWAY_COMPILE=0)")
@pytest.mark.parametrize("sha_ni", ["0", "1"])
def test_both_block_functions_give_hmac_sha256(sha_ni: str) -> None:
    """The portable block and the SHA-NI one (chosen at import: GATEWAY_SHA_NI=0 keeps the
    portable one), each against hmac.new; the SHA-NI one is chosen when the CPU has it."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", CHECK_BOTH, "7"],
        env={**os.environ, "GATEWAY_SHA_NI": sha_ni},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    chosen = done.stdout.strip()
    expected_choice = sha_ni == "1" and _cpu_has_sha_ni()
    assert chosen == ("1" if expected_choice else "0")
