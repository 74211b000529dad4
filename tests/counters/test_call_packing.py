"""A request's EVALSHA is assembled from its checks' packed forms, each packed once per
check object (``redis_backend._Wire``): the bytes must be exactly what packing the whole
call from ``script_args`` gives, for any checks, however the kept forms were made, and
a check object that replaced another under the same key (a reloaded rule) is never sent
in its predecessor's form."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.counters.base import LimitCheck
from gateway.counters.factory import parse_counter_url, store_client
from gateway.counters.redis_backend import (
    MAX_CACHED_CHECKS,
    RedisBackend,
    batched,
    script_args,
)
from gateway.counters.resp import pack
from tests.counters.helpers import new_key
from tests.support.redis_servers import RedisServer

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
async def backend(redis_server: RedisServer) -> AsyncIterator[RedisBackend]:
    store = RedisBackend(store_client(parse_counter_url(redis_server.url)), name="redis")
    await store.load_script()
    yield store
    await store.close()


def whole(checks: list[LimitCheck]) -> bytes:
    """The call packed in one piece by hiredis, as the backend packed it before."""
    return pack(("EVALSHA", SHA, *script_args(checks)))


def bulk(value: bytes | str) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return b"$%d\r\n%s\r\n" % (len(raw), raw)


checks_strategy = st.builds(
    LimitCheck,
    key=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40),
    limit=st.integers(0, 10**9),
    window_ms=st.integers(1, 10**10),
    bucket_ms=st.integers(1, 10**8),
    enforce=st.booleans(),
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(pool=st.lists(checks_strategy, min_size=1, max_size=6), picks=st.data())
async def test_assembled_calls_are_the_calls_packed_whole(
    backend: RedisBackend, pool: list[LimitCheck], picks: st.DataObject
) -> None:
    # Requests drawn from a small pool of check objects, so kept forms are reused across
    # calls of other shapes (a rule's checks alone, then with one ceiling, then another).
    for _ in range(4):
        checks = picks.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))
        call = backend._call(checks)
        assert call.evalsha(SHA) == whole(checks)
        keys, values = call.parts()
        assert keys == b"".join(bulk(check.key) for check in checks)
        assert values == bulk(script_args(checks)[-1])  # type: ignore[arg-type]
        assert call.args == script_args(checks)


async def test_a_batched_call_is_its_requests_packed_in_order(backend: RedisBackend) -> None:
    rule = [
        LimitCheck(new_key(), 10, 60_000, 1_000),
        LimitCheck(new_key(3600), 100, 3_600_000, 60_000),
    ]
    ceilings = [LimitCheck(new_key(rule="ceiling"), 5, 10_000, 1_000) for _ in range(3)]
    requests = [[*rule, ceiling] for ceiling in ceilings] + [rule]
    calls = [backend._call(checks) for checks in requests]
    keys = [check.key for checks in requests for check in checks]
    argv = [script_args(checks)[-1] for checks in requests]
    count = len(keys)
    expected = pack(("EVALSHA", SHA, count, *keys, *argv))
    assert batched(SHA.encode(), calls) == expected


async def test_a_replaced_check_is_never_sent_in_its_old_form(backend: RedisBackend) -> None:
    key = new_key()
    old = LimitCheck(key, 2, 60_000, 1_000)
    ceiling = LimitCheck(new_key(rule="ceiling"), 9, 10_000, 1_000)
    assert backend._call([old, ceiling]).evalsha(SHA) == whole([old, ceiling])
    new = LimitCheck(key, 5, 60_000, 1_000)  # a reloaded rule: new object, same key
    assert backend._call([new, ceiling]).evalsha(SHA) == whole([new, ceiling])
    assert backend._call([new]).evalsha(SHA) == whole([new])
    # And what Redis applies is the new limit, shared by every pair the check is in.
    for other in range(5):
        pair = [new, LimitCheck(new_key(rule=f"ceiling{other}"), 9, 10_000, 1_000)]
        assert (await backend.hit(pair)).admitted
    refused = await backend.hit([new, LimitCheck(new_key(rule="ceiling"), 9, 10_000, 1_000)])
    assert not refused.admitted and refused.states[0].remaining == 0


async def test_the_kept_forms_start_over_when_full_and_stay_right(backend: RedisBackend) -> None:
    first = LimitCheck(new_key(), 3, 60_000, 1_000)
    backend._call([first])
    for i in range(MAX_CACHED_CHECKS + 10):
        backend._call([LimitCheck(f"k{i}", 1, 1_000, 100)])
    assert backend._call([first]).evalsha(SHA) == whole([first])
    again = LimitCheck(first.key, 7, 60_000, 1_000)
    assert backend._call([again]).evalsha(SHA) == whole([again])


async def test_a_key_that_cannot_be_encoded_is_a_value_error(backend: RedisBackend) -> None:
    with pytest.raises(ValueError):
        backend._call([LimitCheck("rl:{us:r:\udc80}:60s:v2", 1, 1_000, 100)])
    with pytest.raises(ValueError, match="window_ms"):
        backend._call([LimitCheck(new_key(), 1, 0, 100)])


async def test_a_pair_kept_by_the_limiter_is_packed_once_and_a_new_one_afresh(
    backend: RedisBackend,
) -> None:
    rule = LimitCheck(new_key(), 10, 60_000, 1_000)
    first = [rule, LimitCheck(new_key(rule="ceiling"), 5, 10_000, 1_000)]
    call = backend._call(first)
    assert backend._call(first) is call  # the same list: the kept call
    second = [rule, LimitCheck(new_key(rule="ceiling"), 6, 10_000, 1_000)]
    assert backend._call(second).evalsha(SHA) == whole(second)  # same first key, new pair
    equal = list(first)  # equal checks in another list: assembled again, the same bytes
    assert backend._call(equal) is not call
    assert backend._call(equal).evalsha(SHA) == whole(first)


async def test_the_kept_forms_are_bounded_whatever_the_identities(backend: RedisBackend) -> None:
    # Identities are the client's to choose: neither cache may grow past its bound.
    rule = LimitCheck(new_key(), 10, 60_000, 1_000)
    for i in range(MAX_CACHED_CHECKS + 100):
        backend._call([LimitCheck(f"one{i}", 1, 1_000, 100)])
        backend._call([LimitCheck(f"r{i}", 1, 1_000, 100), rule])
        assert len(backend._wires) <= MAX_CACHED_CHECKS
        assert len(backend._calls) <= MAX_CACHED_CHECKS
