"""The key file's parsing and the key ring, from bytes (no files: see
tests/integration/test_keys_cli.py for the file edits and the hot reload)."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.identity.key_edit import KEY_PREFIX, key_digest, new_key, render
from gateway.identity.keys import (
    MAX_KEY_FILE_BYTES,
    Consumer,
    KeyEntry,
    KeyFileError,
    KeyRing,
    parse_entries,
    parse_key_file,
)
from tests.support.fuzz import fuzz

ACME_KEY = b"gk_acme-first-key"
ACME_KEY_2 = b"gk_acme-second-key"
BETA_KEY = b"gk_beta-key"


def sha(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()


GOOD = f"""
keys:
  - {{sha256: {sha(ACME_KEY)}, consumer: acme, tier: gold}}
  - sha256: {sha(ACME_KEY_2).upper()}
    consumer: acme
    tier: gold
  - {{sha256: {sha(BETA_KEY)}, consumer: beta}}
""".encode()


def refused(text: str | bytes) -> str:
    with pytest.raises(KeyFileError) as caught:
        parse_key_file(text.encode() if isinstance(text, str) else text, "keys.yaml")
    return str(caught.value)


def test_known_keys_map_to_their_consumer_and_tier():
    ring = parse_key_file(GOOD, "keys.yaml")
    assert len(ring) == 3
    assert ring.lookup(ACME_KEY) == Consumer("acme", "gold")
    assert ring.lookup(ACME_KEY_2) == Consumer("acme", "gold")  # upper-case hex is read
    assert ring.lookup(BETA_KEY) == Consumer("beta", None)
    assert ring.lookup(b"gk_unknown") is None
    assert ring.lookup(b"") is None
    # One consumer, one object: its keys share its counters.
    assert ring.lookup(ACME_KEY) is ring.lookup(ACME_KEY_2)
    assert sorted(ring.consumers) == ["acme", "beta"]
    assert ring.digest == hashlib.sha256(GOOD).hexdigest()
    assert ring.source == "keys.yaml"
    assert [e.sha256 for e in ring] == [sha(ACME_KEY), sha(ACME_KEY_2), sha(BETA_KEY)]


def test_an_empty_list_is_no_keys_but_an_empty_file_is_refused():
    assert len(parse_key_file(b"keys: []\n", "k")) == 0
    assert len(parse_key_file(b"keys:\n", "k")) == 0
    # A file caught half-written must not revoke every key.
    assert "expected a mapping with a 'keys' list" in refused("")
    assert "expected a mapping with a 'keys' list" in refused("# only a comment\n")
    assert len(KeyRing.empty()) == 0


def test_a_key_pasted_in_clear_is_refused_and_never_echoed():
    secret = "gk_this-is-a-real-key-pasted-by-mistake"
    message = refused(f"keys:\n  - {{sha256: {secret}, consumer: acme}}\n")
    assert "keys.yaml: entry #1, field 'sha256': expected the key's SHA-256" in message
    assert secret not in message
    message = refused(f"keys:\n  - {{key: {secret}, consumer: acme}}\n")
    assert "entry #1, field 'key': unknown field" in message and secret not in message
    # Nor does a YAML error show the line it happened on.
    message = refused(f"keys:\n  - {{sha256: {secret}, consumer: [acme}}\n")
    assert "not valid YAML: line 2" in message and secret not in message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keys: {}", "keys.yaml: 'keys' must be a list"),
        ("- a\n- b\n", "expected a mapping with a 'keys' list"),
        (f"keys: []\nversion: 1\nother: {sha(b'x')}", "unknown top-level key 'other'"),
        ("keys:\n  - just-a-string\n", "entry #1: expected a mapping"),
        (f"keys:\n  - {{sha256: {sha(b'x')[:63]}, consumer: a}}", "entry #1, field 'sha256'"),
        (f"keys:\n  - {{sha256: {sha(b'x')}0, consumer: a}}", "entry #1, field 'sha256'"),
        (f"keys:\n  - {{sha256: {'g' * 64}, consumer: a}}", "entry #1, field 'sha256'"),
        ("keys:\n  - {consumer: a}", "entry #1, field 'sha256'"),
        (f"keys:\n  - {{sha256: {sha(b'x')}}}", "entry #1, field 'consumer': missing"),
        (f"keys:\n  - {{sha256: {sha(b'x')}, consumer: 1234}}", "'consumer': expected a string"),
        (f"keys:\n  - {{sha256: {sha(b'x')}, consumer: ''}}", "'consumer': not a name"),
        (f"keys:\n  - {{sha256: {sha(b'x')}, consumer: 'a b'}}", "'consumer': not a name"),
        (f"keys:\n  - {{sha256: {sha(b'x')}, consumer: a, tier: [g]}}", "'tier': expected a str"),
        (
            f"keys:\n  - {{sha256: {sha(b'x')}, consumer: a}}\n"
            f"  - {{sha256: {sha(b'x').upper()}, consumer: b}}",
            "entry #2, field 'sha256': the same digest as entry #1",
        ),
        (
            f"keys:\n  - {{sha256: {sha(b'x')}, consumer: a, tier: gold}}\n"
            f"  - {{sha256: {sha(b'y')}, consumer: a}}",
            "entry #2, field 'tier': consumer 'a' has tier 'gold' in entry #1 and None here",
        ),
        ("keys: [\n", "not valid YAML: line 2"),
        ("a: &x [1]\nkeys: *x\n", "aliases (*name) are not allowed"),
        ("keys: " + "[" * 40 + "]" * 40, "nested deeper than 16 levels"),
        ("keys: !!python/object:os.system []", "not valid YAML"),
    ],
)
def test_a_bad_file_is_refused_whole_naming_entry_and_field(text, message):
    assert message in refused(text)


def test_an_oversized_file_is_refused_before_parsing():
    data = b"keys: []\n" + b"#" * MAX_KEY_FILE_BYTES
    assert f"keys.yaml: over {MAX_KEY_FILE_BYTES} bytes" in refused(data)


def test_generated_keys_are_strong_and_recognisable():
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100
    for key in keys:
        assert key.startswith(KEY_PREFIX) and len(key) == len(KEY_PREFIX) + 43
        assert key_digest(key) == sha(key.encode()) == key_digest(key.encode())


names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,20}", fullmatch=True)


@st.composite
def key_files(draw):
    """Distinct keys, each with a consumer; one tier per consumer."""
    keys = draw(st.lists(st.binary(min_size=1, max_size=40), unique=True, max_size=12))
    tiers = {}
    entries = []
    for key in keys:
        consumer = draw(names)
        tier = tiers.setdefault(consumer, draw(st.none() | names))
        entries.append((key, KeyEntry(sha(key), consumer, tier)))
    return entries


@fuzz(200)
@given(key_files(), st.binary(max_size=40))
def test_rendered_files_read_back_and_look_up_exactly_the_listed_keys(pairs, other):
    entries = tuple(entry for _, entry in pairs)
    data = render(entries).encode()
    assert parse_entries(data, "k") == entries
    ring = parse_key_file(data, "k")
    for key, entry in pairs:
        assert ring.lookup(key) == Consumer(entry.consumer, entry.tier)
    if all(other != key for key, _ in pairs):
        assert ring.lookup(other) is None
