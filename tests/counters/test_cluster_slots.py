"""``cluster.slot_of`` (compiled) against redis-py's ``key_slot``, which Redis Cluster
clients and this gateway's slot map agree on: the same slot for every key."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from gateway.counters.cluster import slot_of

# Keys built from the characters that matter (braces) and a few others, non-ASCII too.
pieces = st.text(alphabet=st.sampled_from("{}ab:é0"), max_size=12)


@given(st.lists(pieces, max_size=4).map("".join))
@settings(deadline=None)  # no per-example deadline: a slow, loaded CI machine stalls
def test_the_slot_is_redis_pys_for_any_key(key: str) -> None:
    assert slot_of(key) == key_slot(key.encode())


@given(st.text(max_size=40).filter(lambda k: not any(0xD800 <= ord(c) <= 0xDFFF for c in k)))
@settings(deadline=None)
def test_the_slot_is_redis_pys_for_any_text(key: str) -> None:
    assert slot_of(key) == key_slot(key.encode())


def test_hash_tags_as_the_cluster_spec_reads_them() -> None:
    # The first "{" and the first "}" after it; an empty tag hashes the whole key.
    assert slot_of("rl:{us:rule:abc}:10s:v2") == key_slot(b"us:rule:abc")
    assert slot_of("a{}b{c}") == key_slot(b"a{}b{c}")
    assert slot_of("{a}{b}") == key_slot(b"a")
    assert slot_of("no tag") == key_slot(b"no tag")
    assert slot_of("{user1000}.following") == 3443  # the spec's own example hashes "user1000"
